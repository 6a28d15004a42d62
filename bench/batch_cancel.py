"""How long does the service's event loop stall when a trainer with a full batch queued disconnects?
(issue: "Cancelling 65,536 queued attempts (a full batch) must stall the loop < 100 ms")

    .venv/bin/python bench/batch_cancel.py [--groups 1024] [--n 64] [--py-spy] [--json results/batch_cancel.json]

End to end, on this machine: the scripted model (tests/scripted_model.py, answers at once), refenv
with a pool of 2 and 600 s per step (the two attempts that get worlds never finish, every other one
stays queued) and the service. One raw-socket trainer sends POST /groups/batch with --groups groups
of --n attempts and waits until /health/detail shows them queued. A sampler thread then calls
GET /health in a tight loop (one keep-alive client) and records each answer's send and receive
times; after ~1 s the trainer's socket is closed. Sampling goes on until /health/detail shows
groups_in_flight == 0 and attempts_queued == 0, plus 1 s.

Prints one line per number and writes --json: /health latency before the disconnect (p50, p99,
max), during the cancellation (max latency, largest gap between consecutive answers), how long
until everything was cancelled, and refenv's leased/episodes at the end (the two running episodes
must have been abandoned: leased 0). --py-spy also records the service with py-spy (raw collapsed
stacks, from just before the disconnect) and prints the functions it saw most.
Every process started here is stopped in a `finally`.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from rollout_service.launch.stack import (  # noqa: E402
    ManagedProcess,
    refenv_command,
    service_command,
    start_listening,
)

SCRIPTED_MODEL = ROOT / "tests" / "scripted_model.py"


class Sampler(threading.Thread):
    """GET /health in a tight loop; (send, receive, status) wall-clock times of every answer."""

    def __init__(self, url: str) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.samples: list[tuple[float, float, int]] = []
        self.errors: list[str] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        with httpx.Client(timeout=30.0) as client:
            while not self.stopping.is_set():
                sent = time.time()
                try:
                    status = client.get(self.url).status_code
                except httpx.HTTPError as exc:
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                    status = -1
                self.samples.append((sent, time.time(), status))


def start(name: str, cmd: list[str], ready_path: str, logs: Path, started: list[ManagedProcess]) -> ManagedProcess:
    return start_listening(f"batch_cancel-{name}", cmd, logs, started, ready_path=ready_path)


def http_request(method: str, port: int, path: str, body: bytes) -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: keep-alive\r\n\r\n"
    ).encode() + body


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def top_frames(raw_path: Path, limit: int = 12) -> list[tuple[str, int, int]]:
    """From py-spy's raw (collapsed) output: (function, samples as leaf, samples anywhere on stack)."""
    leaf: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    for line in raw_path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]  # one entry per function
        leaf[frames[-1]] += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)
    return [(f, leaf[f], inclusive[f]) for f, _ in inclusive.most_common(limit)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=1024)
    p.add_argument("--n", type=int, default=64)
    p.add_argument("--baseline-s", type=float, default=1.0, help="sampling before the disconnect (default 1)")
    p.add_argument("--deadline-s", type=float, default=90.0, help="most seconds to wait for each phase")
    p.add_argument("--logs", type=Path, default=ROOT / "results" / "logs")
    p.add_argument("--json", type=Path, default=ROOT / "results" / "batch_cancel.json")
    p.add_argument("--py-spy", action="store_true", help="record the service with py-spy during the cancellation")
    args = p.parse_args()
    attempts = args.groups * args.n

    started: list[ManagedProcess] = []
    sock: socket.socket | None = None
    sampler: Sampler | None = None
    spy: subprocess.Popen | None = None
    try:
        t = time.monotonic()
        model_cmd = [sys.executable, str(SCRIPTED_MODEL), "--port", "0", "--script", "answer"]
        model_url = start("model", model_cmd, "/v1/models", args.logs, started).url
        refenv = refenv_command(0, "--pool", "2", "--latency-ms", "600000")
        env_url = start("refenv", refenv, "/health", args.logs, started).url
        service_cmd = service_command(
            0,
            [env_url],
            model_url,
            "--max-queued-attempts",
            str(max(70000, attempts + 1000)),
            model="scripted",
        )
        service = start("service", service_cmd, "/health", args.logs, started)
        assert service.proc is not None and service.port is not None
        service_url, service_port = service.url, service.port
        print(f"stack up in {time.monotonic() - t:.1f}s (service pid {service.proc.pid}; logs in {args.logs})")

        detail_client = httpx.Client(timeout=30.0)

        def detail() -> dict:
            return detail_client.get(f"{service_url}/health/detail").json()

        # 2. The trainer: one raw socket, a full batch.
        task = detail_client.get(f"{service_url}/tasks").json()["tasks"][0]["task_id"]  # any task it serves
        group = {"task_id": task, "n": args.n, "sampling": {"temperature": 0.8, "max_tokens": 8}}
        body = json.dumps({"groups": [group] * args.groups}).encode()
        sock = socket.create_connection(("127.0.0.1", service_port))
        t_sent = time.monotonic()
        sock.sendall(http_request("POST", service_port, "/groups/batch", body))
        sock.settimeout(args.deadline_s)
        head = sock.recv(65536)
        status_line = head.split(b"\r\n", 1)[0].decode(errors="replace")
        print(
            f"batch: {args.groups} groups x n={args.n} = {attempts} attempts, {len(body)} bytes; answer: {status_line}"
        )
        if b" 200 " not in head.split(b"\r\n", 1)[0]:
            print(head.decode(errors="replace")[:2000])
            return 1
        deadline = time.monotonic() + args.deadline_s
        queued = detail()["attempts_queued"]
        last_change, last = time.monotonic(), queued
        while queued < attempts and time.monotonic() < deadline and time.monotonic() - last_change < 10:
            time.sleep(0.2)
            queued = detail()["attempts_queued"]
            if queued != last:
                last_change, last = time.monotonic(), queued
        state = detail()
        t_queued = time.monotonic() - t_sent
        print(
            f"attempts_queued: {state['attempts_queued']} (of {attempts}), "
            f"waiting_for_a_world: {state['attempts_waiting_for_a_world']}, groups_in_flight: "
            f"{state['groups_in_flight']}, {t_queued:.2f}s after the send"
        )
        env_before = httpx.get(f"{env_url}/health", timeout=10).json()
        print(f"env before: leased {env_before['leased']}, episodes {env_before['episodes']}")

        # 3. Sample /health; the trainer disconnects after --baseline-s.
        sampler = Sampler(f"{service_url}/health")
        sampler.start()
        if args.py_spy:
            spy_raw = args.json.with_suffix(".pyspy.txt")
            spy_raw.parent.mkdir(parents=True, exist_ok=True)
            spy = subprocess.Popen(
                [
                    str(Path(sys.executable).parent / "py-spy"),
                    "record",
                    "--pid",
                    str(service.proc.pid),
                    "--rate",
                    "200",
                    "--format",
                    "raw",
                    "--output",
                    str(spy_raw),
                    "--duration",
                    "8",
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        time.sleep(args.baseline_s)
        t_close = time.time()
        sock.close()
        sock = None

        deadline = time.monotonic() + args.deadline_s
        t_done_sent = t_done = None
        polls = 0
        while time.monotonic() < deadline:
            sent = time.time()
            state = detail()
            polls += 1
            if state["groups_in_flight"] == 0 and state["attempts_queued"] == 0:
                t_done_sent, t_done = sent, time.time()
                break
            time.sleep(0.05)
        time.sleep(1.0)
        sampler.stopping.set()
        sampler.join(35)
        end_state = detail()
        env_deadline = time.monotonic() + 30
        env_after = httpx.get(f"{env_url}/health", timeout=10).json()
        while env_after["leased"] and time.monotonic() < env_deadline:
            time.sleep(0.2)
            env_after = httpx.get(f"{env_url}/health", timeout=10).json()
        t_env_free = time.time() - t_close
        detail_client.close()

        # 4. The numbers.
        samples = sampler.samples
        before = [(s, r) for s, r, _ in samples if r < t_close]
        base_lat = [(r - s) * 1000 for s, r in before]
        end = t_done if t_done is not None else samples[-1][1]
        during = [(s, r) for s, r, _ in samples if r >= t_close and s <= end]
        during_lat = [(r - s) * 1000 for s, r in during]
        answers = [r for s, r, _ in samples if t_close - 1e-9 <= r <= end + 1.0]
        last_before = max((r for s, r in before), default=t_close)
        stamps = [last_before, *answers]
        gaps = [(b - a) * 1000 for a, b in itertools.pairwise(stamps)]
        max_gap = max(gaps, default=float("nan"))
        gap_at = stamps[gaps.index(max_gap)] - t_close if gaps else float("nan")
        worst = max(during, key=lambda sr: sr[1] - sr[0], default=None)
        result = {
            "groups": args.groups,
            "n": args.n,
            "attempts_queued_before": queued,
            "baseline_samples": len(base_lat),
            "baseline_p50_ms": round(statistics.median(base_lat), 2) if base_lat else None,
            "baseline_p99_ms": round(pct(base_lat, 0.99), 2),
            "baseline_max_ms": round(max(base_lat, default=float("nan")), 2),
            "during_samples": len(during_lat),
            "during_p50_ms": round(statistics.median(during_lat), 2) if during_lat else None,
            "during_max_ms": round(max(during_lat, default=float("nan")), 2),
            "during_max_at_s": round(worst[0] - t_close, 3) if worst else None,
            "during_max_gap_ms": round(max_gap, 2),
            "during_max_gap_ends_at_s": round(gap_at + max_gap / 1000, 3) if gaps else None,
            "during_over_100ms": sum(1 for x in during_lat if x > 100),
            "cancelled_within_s": round(t_done - t_close, 3) if t_done else None,
            "cancelled_after_s_lower_bound": round(t_done_sent - t_close, 3) if t_done_sent else None,
            "detail_polls": polls,
            "end_groups_in_flight": end_state["groups_in_flight"],
            "end_attempts_queued": end_state["attempts_queued"],
            "end_attempts_waiting_for_a_world": end_state["attempts_waiting_for_a_world"],
            "end_episodes_ending": end_state["episodes_ending"],
            "env_leased_end": env_after["leased"],
            "env_leased_zero_after_s": round(t_env_free, 3),
            "env_episodes_end": env_after["episodes"],
            "sampler_errors": sampler.errors[:5],
            "non_200": sum(1 for _, _, st in samples if st != 200),
        }
        for key, value in result.items():
            print(f"{key}: {value}")
        # Every answer from 0.2 s before the disconnect to the end: [sent, received] in s after it.
        result["timeline"] = [
            [round(s - t_close, 4), round(r - t_close, 4)]
            for s, r, _ in samples
            if r >= t_close - 0.2 and s <= end + 1.0
        ]
        slow = [(a, b) for a, b in result["timeline"] if b - a > 0.1]
        print(f"answers slower than 100 ms (sent, received; s after the disconnect): {slow}")
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")
        if spy is not None:
            try:
                spy.wait(15)
            except subprocess.TimeoutExpired:
                spy.terminate()
            spy_raw = args.json.with_suffix(".pyspy.txt")
            if spy_raw.exists():
                print(f"py-spy (raw stacks in {spy_raw}); samples as leaf / on stack, function")
                leaves = collections.Counter()
                for line in spy_raw.read_text(errors="replace").splitlines():
                    stack, _, count = line.rpartition(" ")
                    if count.isdigit():
                        leaves[re.sub(r":\d+\)$", ")", stack.split(";")[-1])] += int(count)
                print("  top leaves: " + "; ".join(f"{n} {f}" for f, n in leaves.most_common(12)))
                for frame, own, total in top_frames(spy_raw, 40):
                    print(f"  {own:6d} {total:6d}  {frame}")
        return 0
    finally:
        if sampler is not None:
            sampler.stopping.set()
        if sock is not None:
            sock.close()
        if spy is not None and spy.poll() is None:
            spy.terminate()
            spy.wait(10)
        for proc in reversed(started):  # the service first, so it abandons its episodes while the env is up
            proc.stop()


if __name__ == "__main__":
    raise SystemExit(main())
