"""The service's own ceiling: turns/s, CPU per turn, latency it adds and RSS, against instant stand-ins.

    .venv/bin/python bench/ceiling.py                       # 64, 256, 1024 in flight; 128- and 1024-token turns
    .venv/bin/python bench/ceiling.py --in-flight 256 --completion-tokens 128 --seconds 10
    .venv/bin/python bench/ceiling.py --profile results/ceiling-profile   # py-spy flame graphs too

Everything runs on loopback in processes of its own: the instant model server and env of
bench/standins.py, the service (`rollout-service serve`, as a user runs it) and this driver, which
keeps the env's pool full through `POST /groups/batch` (groups of n=8) and counts lines without
parsing them. Each configuration warms up, then is measured over a window:

turns/s        env steps in the window / its length (the env's own count)
cpu ms/turn    the service process's CPU time in the window / env steps
added p50/p99  the env's turnaround: from its answer to the episode's next request. The model
               stand-in answers at once, so this is what the service adds per turn (queueing
               for its CPU included)
rss MiB        the service's peak resident memory in the window (sampled every 0.5 s)
max open       the most episodes the env held at once (must never exceed the pool)

The stand-ins' and the driver's CPU are shown next to the service's: where they are near a whole
core, they (not the service) are the limit and the row says so. Results go to results/ceiling.json;
`--record bench/results/NAME.json` also writes them as a record (bench/record.py: command, commit,
machine, date) for the benchmarks page.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import record
from standins import REPLIES  # bench/ is on the path when this runs as a script

from rollout_service.launch.stack import ManagedProcess, free_port, fresh_port_file

ROOT = Path(__file__).resolve().parents[1]
N = 8  # attempts per group
MAX_BATCH = 1024  # groups per POST /groups/batch (the service's --max-batch)


class Processes:
    """The stack of one configuration; stopped on exit whatever happened."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.running: dict[str, subprocess.Popen] = {}

    def start(
        self, name: str, argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> psutil.Process:
        self.logs.mkdir(parents=True, exist_ok=True)
        log = open(self.logs / f"{name}.log", "w")
        self.running[name] = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, cwd=cwd or ROOT, env={**os.environ, **(env or {})}
        )
        return psutil.Process(self.running[name].pid)

    def port_file(self, name: str) -> Path:
        """Where `name`, started with `--port-file` and port 0, is to write the port it binds."""
        return fresh_port_file(self.logs, name)

    def url(self, name: str, port_file: Path, timeout_s: float = 120.0) -> str:
        """The loopback URL of `name` once it wrote the port it bound to `port_file`."""
        proc = ManagedProcess(name, self.running[name].args, self.logs / f"{name}.log", proc=self.running[name])
        proc.wait_port(port_file, timeout_s)
        return proc.url

    def stop(self) -> None:
        for proc in self.running.values():
            proc.terminate()
        for proc in self.running.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.running.clear()

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _wait_up(url: str, proc: subprocess.Popen, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=2.0) as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{url}: the process exited ({proc.returncode}); see its log")
            try:
                if (await http.get(url)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError(f"{url} did not come up in {timeout_s:g}s")


def _profile(pid: int, stacks: Path, seconds: float) -> subprocess.Popen:
    """py-spy (pip install py-spy) sampling the service for the window, as collapsed stacks."""
    stacks.parent.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid), "--rate", "250",
         "--duration", str(int(seconds)), "--format", "raw", "--output", str(stacks), "--nonblocking"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )  # fmt: skip


async def _drive(
    service: str, args: argparse.Namespace, in_flight: int, max_tokens: int, stop: asyncio.Event, groups_done: list[int]
) -> None:
    """Keep `--queued` attempts (at least twice the pool's worth) asked for, in batches of at most
    one pool's worth (and the service's --max-batch), each batch resent as soon as it is done."""
    asked = max(2 * in_flight, args.queued)
    groups_per_batch = min(MAX_BATCH, max(1, in_flight // N))
    lanes = -(-asked // (groups_per_batch * N))
    group = {"task_id": "t1", "n": N, "sampling": {"max_tokens": max_tokens}, "tokens": args.tokens}
    body = json.dumps({"groups": [group] * groups_per_batch})

    async def one_batch(http: httpx.AsyncClient) -> None:
        async with http.stream(
            "POST", f"{service}/groups/batch", content=body, headers={"content-type": "application/json"}
        ) as response:
            if response.status_code != 200:
                raise RuntimeError(f"POST /groups/batch: {response.status_code} {(await response.aread())[:300]!r}")
            async for line in response.aiter_lines():
                if line.startswith('{"index"') and '"error":' in line[:40]:
                    raise RuntimeError(f"a group failed: {line[:300]}")
                groups_done[0] += 1

    async with httpx.AsyncClient(timeout=None) as http:

        async def lane() -> None:
            while not stop.is_set():
                await one_batch(http)

        running = [asyncio.ensure_future(lane()) for _ in range(lanes)]
        try:
            await stop.wait()
        finally:
            for lane_task in running:
                lane_task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
        for lane_task in running:
            if not lane_task.cancelled() and lane_task.exception() is not None:
                raise lane_task.exception()  # type: ignore[misc]


def _cpu(proc: psutil.Process) -> float:
    times = proc.cpu_times()
    return times.user + times.system


def _print_profile(stacks: Path, top: int = 25) -> None:
    """The frames the service spent its samples in: own time (the frame on top) and total."""
    own: dict[str, int] = {}
    total: dict[str, int] = {}
    samples = 0
    for line in stacks.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        n = int(count)
        samples += n
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for frame in set(frames):
            total[frame] = total.get(frame, 0) + n
    print(f"profile: {samples} samples in {stacks} (collapsed stacks; flamegraph.pl or speedscope read it)")
    for title, table in (("own", own), ("total", total)):
        print(f"  top by {title} time:")
        for frame, n in sorted(table.items(), key=lambda kv: -kv[1])[:top]:
            print(f"    {100 * n / max(samples, 1):5.1f}%  {frame[:150]}")


async def measure(args: argparse.Namespace, in_flight: int, completion_tokens: int) -> dict:
    py = sys.executable
    # Absolute: a service run from another checkout (before=DIR) runs there, and writes its port file here.
    logs = (Path(args.out).parent / "logs" / "ceiling" / f"{in_flight}-{completion_tokens}").resolve()
    # Each server binds port 0 and writes the port it bound to a file read back here; a service run from
    # another checkout (bench/http_stacks.py's before=DIR) older than --port-file gets a free port instead.
    tree = getattr(args, "service_cwd", None)
    reports_port = tree is None or (Path(tree) / "rollout_service" / "listening.py").exists()
    with Processes(logs) as stack:
        port_files = {name: stack.port_file(name) for name in ("model", "env", "service")}
        model = stack.start(
            "model",
            [py, "bench/standins.py", "model", "--port", "0", "--port-file", str(port_files["model"]),
             "--completion-tokens", str(completion_tokens), "--replies", args.replies],
        )  # fmt: skip
        env = stack.start(
            "env",
            [py, "bench/standins.py", "env", "--port", "0", "--port-file", str(port_files["env"]),
             "--pool", str(in_flight), "--turns", str(args.turns), "--prompt-tokens", str(args.prompt_tokens)],
        )  # fmt: skip
        urls = {name: stack.url(name, port_files[name]) for name in ("model", "env")}
        listen = ["--listen", "127.0.0.1:0", "--port-file", str(port_files["service"])]
        if not reports_port:
            urls["service"] = f"http://127.0.0.1:{free_port()}"
            listen = ["--listen", urls["service"].removeprefix("http://")]
        service = stack.start(
            "service",
            [py, *getattr(args, "service_entry", ["-m", "rollout_service.tools.cli"]), "serve", "--env", urls["env"],
             "--vllm", urls["model"], "--model", "ceiling-model", *listen, "--max-n", str(N),
             "--max-batch", str(MAX_BATCH), "--max-queued-attempts", str(max(4 * in_flight, 2 * args.queued, 10_000))],
            env=getattr(args, "service_env", None),
            cwd=tree,
        )  # fmt: skip
        if reports_port:
            urls["service"] = stack.url("service", port_files["service"])
        await _wait_up(f"{urls['model']}/health", stack.running["model"])
        await _wait_up(f"{urls['env']}/health", stack.running["env"])
        await _wait_up(f"{urls['service']}/health", stack.running["service"])
        stop, groups = asyncio.Event(), [0]
        driver = asyncio.ensure_future(_drive(urls["service"], args, in_flight, completion_tokens, stop, groups))
        me = psutil.Process()
        async with httpx.AsyncClient(timeout=30.0) as http:
            try:
                await asyncio.wait({driver}, timeout=args.warmup)
                if driver.done():
                    driver.result()
                await http.post(f"{urls['env']}/stats")  # the window starts here
                watched = {"service": service, "model": model, "env": env, "driver": me}
                cpu0 = {name: _cpu(p) for name, p in watched.items()}
                t0, groups0 = time.monotonic(), groups[0]
                rss_start = service.memory_info().rss / 2**20
                profiler = None
                if args.profile:
                    stacks = Path(args.profile) / f"service-{in_flight}-{completion_tokens}-{args.tokens}.txt"
                    profiler = _profile(service.pid, stacks, args.seconds)
                peak_rss, rss_series = 0, []  # the series: (seconds into the window, MiB) every 5 s
                while (left := args.seconds - (time.monotonic() - t0)) > 0 and not driver.done():
                    now_rss = service.memory_info().rss
                    peak_rss = max(peak_rss, now_rss)
                    if not rss_series or time.monotonic() - t0 >= rss_series[-1][0] + 5:
                        rss_series.append((round(time.monotonic() - t0), round(now_rss / 2**20)))
                    await asyncio.wait({driver}, timeout=min(0.5, left))
                if driver.done():
                    driver.result()
                elapsed = time.monotonic() - t0
                stats = (await http.get(f"{urls['env']}/stats")).json()
                cpu = {name: _cpu(p) - cpu0[name] for name, p in watched.items()}
                rss = max(peak_rss, service.memory_info().rss) / 2**20
                if profiler is not None:
                    profiler.wait(timeout=args.seconds + 60)
                    _print_profile(stacks)
            finally:
                stop.set()
                await asyncio.gather(driver, return_exceptions=True)
    steps = stats["steps"] or 1
    row = {
        "in_flight": in_flight,
        "completion_tokens": completion_tokens,
        "tokens": args.tokens,
        "replies": args.replies,
        "attempts_asked": max(2 * in_flight, args.queued),
        "turns_per_s": round(stats["steps"] / elapsed, 1),
        "service_cpu_ms_per_turn": round(cpu["service"] * 1000 / steps, 3),
        "added_p50_ms": round(stats["turnaround_p50_ms"], 2),
        "added_p99_ms": round(stats["turnaround_p99_ms"], 2),
        "service_rss_mib": round(rss, 1),
        "service_rss_start_mib": round(rss_start, 1),
        "service_rss_series": rss_series,
        "max_open": stats["max_open"],
        "refused_resets": stats["refused"],  # resets the env refused, every world taken: must be 0
        "pool": stats["pool"],
        "groups_per_s": round((groups[0] - groups0) / elapsed, 2),
        "cpu_share": {name: round(c / elapsed, 2) for name, c in cpu.items()},  # cores used by each
        "window_s": round(elapsed, 1),
    }
    busy = [name for name in ("model", "env", "driver") if row["cpu_share"][name] > 0.8]
    row["limit"] = f"stand-in: {', '.join(busy)}" if busy else "service"
    if stats["max_open"] > in_flight:
        raise RuntimeError(f"the env held {stats['max_open']} episodes at once, over its pool of {in_flight}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--in-flight", type=int, nargs="+", default=[64, 256, 1024], help="the env's pool: episodes in flight"
    )
    parser.add_argument("--completion-tokens", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--turns", type=int, default=4, help="completions per episode")
    parser.add_argument(
        "--tokens",
        choices=["exact", "chat"],
        default="exact",
        help="the groups' `tokens`: exact (token prompts; a /tokenize of the conversation a turn) or chat (messages)",
    )
    parser.add_argument(
        "--replies",
        choices=REPLIES,
        default="as-sampled",
        help="exact mode: how the model's template tokenizes a reply, and so what a turn costs: as the ids sampled"
        " (nothing more), as the reply's text alone (a short /tokenize more) or otherwise (a second /tokenize of"
        " the conversation)",
    )
    parser.add_argument(
        "--queued", type=int, default=0, help="attempts to keep asked for (memory: e.g. 100000 with 1024 in flight)"
    )
    parser.add_argument("--prompt-tokens", type=int, default=2000, help="size of the first observation")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window per configuration")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--profile", metavar="DIR", help="record the service with py-spy into DIR (flame graphs)")
    parser.add_argument("--out", default="results/ceiling.json")
    parser.add_argument("--record", metavar="PATH", help="also write the rows as a benchmark record (bench/results/)")
    args = parser.parse_args()
    os.chdir(ROOT)
    rows = asyncio.run(run(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    report = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpus": os.cpu_count(), "rows": rows}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"written to {args.out}")
    if args.record:
        print(f"record written to {record.write(_record(args, rows), args.record)}")


def _record(args: argparse.Namespace, rows: list[dict]) -> dict:
    """The rows as a benchmark record, named as the benchmarks page's ceiling tables name them."""
    shown = [
        {
            "tokens": row["tokens"],
            "replies": row["replies"],
            "in flight": row["in_flight"],
            "completion tokens": row["completion_tokens"],
            "attempts asked": row["attempts_asked"],
            "turns/s": row["turns_per_s"],
            "CPU ms/turn": row["service_cpu_ms_per_turn"],
            "added p50 ms": row["added_p50_ms"],
            "added p99 ms": row["added_p99_ms"],
            "RSS MiB": row["service_rss_mib"],
            "groups/s": row["groups_per_s"],
            "limit": row["limit"],
        }
        for row in rows
    ]
    notes = (
        f"{args.seconds:g} s windows after {args.warmup:g} s of warm-up; {args.turns}-turn episodes from a"
        f" {args.prompt_tokens}-token first observation."
    )
    return record.make("ceiling", "The service's own ceiling", shown, notes=notes)


async def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    print(
        f"{'in flight':>9} {'tokens':>6} {'turns/s':>8} {'cpu ms/turn':>11} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'rss MiB':>8} {'max open':>8}  cores used (service model env driver)"
    )
    for completion_tokens in args.completion_tokens:
        for in_flight in args.in_flight:
            row = await measure(args, in_flight, completion_tokens)
            rows.append(row)
            share = row["cpu_share"]
            print(
                f"{in_flight:>9} {completion_tokens:>6} {row['turns_per_s']:>8} {row['service_cpu_ms_per_turn']:>11} "
                f"{row['added_p50_ms']:>7} {row['added_p99_ms']:>7} {row['service_rss_mib']:>8} "
                f"{row['max_open']:>8}  {share['service']} {share['model']} {share['env']} {share['driver']}"
                f"  limit: {row['limit']}",
                flush=True,
            )
    return rows


if __name__ == "__main__":
    main()
