"""Memory while batch answers go unread: the service's RSS through three POST /groups/batch that
nobody reads, until the service cuts them off after --stream-stall-timeout.

    .venv/bin/python bench/unread_answers.py [--stall-timeout 20] [--answer-window 16] [--json PATH]

Instant stand-ins (bench/standins.py): a model that answers every completion with --reply-tokens
tokens (with logprobs) and an env of --pool worlds, one turn an episode. Three raw sockets (receive
buffer 4 KiB) each send POST /groups/batch of --groups groups x --n attempts and never read. The
service's RSS (/proc) is sampled every 0.25 s from before the batches until every connection has been
closed by the service (TCP_INFO: no longer established) and --after-s more. --stream-stall-timeout is
short here (the default is 120 s) so a run takes a minute; what it bounds is the same. --answer-window
100000 stands for the code before the window (every group of a batch started at once). Records the
RSS before, its largest growth and the growth at the end, when each connection was closed, and the
env's episodes started (the groups the window let start).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import record  # noqa: E402

from rollout_service.launch.stack import ManagedProcess, start_listening  # noqa: E402

ESTABLISHED = 1  # tcpi_state, the first byte of Linux's struct tcp_info


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def established(sock: socket.socket) -> bool:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == ESTABLISHED


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--groups", type=int, default=512)
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--reply-tokens", type=int, default=2048)
    p.add_argument("--pool", type=int, default=64)
    p.add_argument("--answers", type=int, default=3)
    p.add_argument("--stall-timeout", type=float, default=20.0)
    p.add_argument("--answer-window", type=int, default=16)
    p.add_argument("--after-s", type=float, default=5.0)
    p.add_argument("--deadline-s", type=float, default=300.0)
    p.add_argument("--logs", type=Path, default=ROOT / "results" / "logs" / "unread")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    py = sys.executable
    started: list[ManagedProcess] = []
    readers: list[socket.socket] = []
    try:
        model = start_listening(
            "unread-model",
            [py, "bench/standins.py", "model", "--port", "0", "--completion-tokens", str(args.reply_tokens)],
            args.logs,
            started,
            ready_path="/v1/models",
        )
        env = start_listening(
            "unread-env",
            [py, "bench/standins.py", "env", "--port", "0", "--pool", str(args.pool), "--turns", "1"],
            args.logs,
            started,
        )
        service = start_listening(
            "unread-service",
            [py, "-m", "rollout_service.tools.cli", "serve", "--env", env.url, "--vllm", model.url,
             "--model", "ceiling-model", "--listen", "127.0.0.1:0", "--stream-stall-timeout", str(args.stall_timeout),
             "--answer-window", str(args.answer_window)],
            args.logs,
            started,
        )  # fmt: skip
        assert service.proc is not None and service.port is not None
        pid = service.proc.pid
        rss0 = rss_mib(pid)
        group = {"task_id": "t1", "n": args.n, "sampling": {"max_tokens": args.reply_tokens}}
        payload = json.dumps({"groups": [group] * args.groups}).encode()
        t0 = time.monotonic()
        for _ in range(args.answers):
            reader = socket.socket()
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            reader.connect(("127.0.0.1", service.port))
            reader.sendall(
                b"POST /groups/batch HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
                b"content-length: %d\r\n\r\n%b" % (len(payload), payload)
            )
            readers.append(reader)
        samples: list[tuple[float, float]] = []
        closed_at: list[float | None] = [None] * len(readers)
        done_at = None
        while time.monotonic() - t0 < args.deadline_s:
            now = time.monotonic() - t0
            samples.append((round(now, 2), round(rss_mib(pid) - rss0, 1)))
            for i, reader in enumerate(readers):
                if closed_at[i] is None and not established(reader):
                    closed_at[i] = round(now, 2)
            if done_at is None and all(c is not None for c in closed_at):
                done_at = now
            if done_at is not None and now - done_at >= args.after_s:
                break
            time.sleep(0.25)
        detail = httpx.get(f"{service.url}/health/detail", timeout=10).json()
        stats = httpx.get(f"{env.url}/stats", timeout=10).json()
        peak = max(growth for _, growth in samples)
        row = {
            "answer window": args.answer_window,
            "RSS before MiB": round(rss0, 1),
            "RSS growth max MiB": peak,
            "RSS growth at end MiB": samples[-1][1],
            "closed by the service s": closed_at,
            "stall timeout s": args.stall_timeout,
            "episodes started": stats["resets"],
            "episodes abandoned": stats["abandoned"],
            "attempts queued at end": detail["attempts_queued"],
        }
        print(json.dumps(row))
        if args.json is not None:
            rec = record.make(
                "unread-answers",
                f"Service RSS through {args.answers} unread POST /groups/batch of {args.groups} groups x "
                f"{args.n} attempts, {args.reply_tokens}-token replies",
                [row],
                notes=f"Stand-in model and env (bench/standins.py, instant), env pool {args.pool}, one turn an "
                f"episode. --stream-stall-timeout {args.stall_timeout:g} s (short for the bench; default 120 s). "
                "RSS growth is over the service's RSS before the batches; closed = the reader's socket no longer "
                "established (TCP_INFO), in seconds from the sends.",
            )
            rec["figures"]["rss_samples"] = samples
            record.write(rec, args.json)
        return 0
    finally:
        for reader in readers:
            reader.close()
        for proc in reversed(started):
            proc.stop()


if __name__ == "__main__":
    sys.exit(main())
