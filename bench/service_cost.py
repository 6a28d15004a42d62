"""What a turn costs the service's process at the ceiling, in instructions: counted, not timed, so that
it holds on a machine shared with others' work (the ceiling's CPU per turn there moves by more than a
change to the hot path does; the count by well under 1%).

    .venv/bin/python bench/service_cost.py --trees /path/to/checkout-before . --record bench/results/NAME.json

Per tree (its `rollout_service` is the one imported) and completion length, bench/ceiling.py's load:
its instant stand-ins and driver (groups of 8 exact attempts through `POST /groups/batch`, the env's
pool kept full), the service (`rollout-service serve` run from the tree) under valgrind's callgrind
with its instrumentation off, so that it starts and warms up at a fraction of callgrind's cost. Then
the instrumentation goes on for a window, and at its end the count is dumped: the service's
instructions (user space, the kernel's work for the sockets left out) over the env steps in the
window. Everything is the service's: aiohttp, uvloop, the JSON libraries, the interpreter. Needs
valgrind.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx
import record
from ceiling import ROOT, N, Processes, _drive, _wait_up  # bench/ is on the path when this runs as a script
from standins import REPLIES

MAX_BATCH = 1024


async def _control(*args: str) -> None:
    proc = await asyncio.create_subprocess_exec(
        "callgrind_control", *args, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL
    )
    if await proc.wait() != 0:
        raise RuntimeError(f"callgrind_control {' '.join(args)} failed")


def _dumped(folder: Path) -> int:
    """The instructions in callgrind's last dump in `folder` (callgrind.out.1, .2, ...)."""
    dumps = [p for p in folder.iterdir() if p.name.startswith("callgrind.out.")]
    if not dumps:
        raise RuntimeError("callgrind wrote no dump")
    text = max(dumps, key=lambda p: int(p.name.rsplit(".", 1)[1])).read_text()
    summary = re.search(r"^(?:summary|totals):\s+(\d+)", text, re.MULTILINE)
    if summary is None:
        raise RuntimeError("no summary in callgrind's dump")
    return int(summary.group(1))


async def measure(args: argparse.Namespace, tree: Path, completion_tokens: int) -> dict:
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp, Processes(Path(tmp) / "logs") as stack:
        port_files = {name: stack.port_file(name) for name in ("model", "env", "service")}
        stack.start(
            "model",
            [py, "bench/standins.py", "model", "--port", "0", "--port-file", str(port_files["model"]),
             "--completion-tokens", str(completion_tokens), "--replies", args.replies],
        )  # fmt: skip
        stack.start(
            "env",
            [py, "bench/standins.py", "env", "--port", "0", "--port-file", str(port_files["env"]),
             "--pool", str(args.in_flight), "--turns", str(args.turns), "--prompt-tokens", str(args.prompt_tokens)],
        )  # fmt: skip
        urls = {name: stack.url(name, port_files[name]) for name in ("model", "env")}
        out = Path(tmp) / "callgrind.out"
        service = stack.start(
            "service",
            ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
             py, "-m", "rollout_service.tools.cli", "serve", "--env", urls["env"], "--vllm", urls["model"],
             "--model", "ceiling-model", "--listen", "127.0.0.1:0", "--port-file", str(port_files["service"]),
             "--max-n", str(N), "--max-batch", str(MAX_BATCH), "--max-queued-attempts", "10000"],
            env={"PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"},
            cwd=tree,
        )  # fmt: skip
        urls["service"] = stack.url("service", port_files["service"], timeout_s=600)
        await _wait_up(f"{urls['env']}/health", stack.running["env"])
        await _wait_up(f"{urls['service']}/health", stack.running["service"], timeout_s=600)
        stop, groups = asyncio.Event(), [0]
        drive_args = argparse.Namespace(queued=0, tokens="exact")
        driver = asyncio.ensure_future(
            _drive(urls["service"], drive_args, args.in_flight, completion_tokens, stop, groups)
        )
        async with httpx.AsyncClient(timeout=60.0) as http:
            try:
                await asyncio.wait({driver}, timeout=args.warmup)
                if driver.done():
                    driver.result()
                await _control("-i", "on", str(service.pid))
                await http.post(f"{urls['env']}/stats")  # the window starts here
                t0 = time.monotonic()
                await asyncio.wait({driver}, timeout=args.seconds)
                if driver.done():
                    driver.result()
                stats = (await http.get(f"{urls['env']}/stats")).json()
                await _control("-d", str(service.pid))
                elapsed = time.monotonic() - t0
            finally:
                stop.set()
                await asyncio.gather(driver, return_exceptions=True)
        instructions = _dumped(Path(tmp))
    steps = stats["steps"]
    if steps < 50:
        raise RuntimeError(f"only {steps} turns in the window: lengthen --seconds")
    return {
        "tree": tree.name,
        "completion tokens": completion_tokens,
        "turns counted": steps,
        "instructions a turn": round(instructions / steps),
        "window s": round(elapsed, 1),
    }


async def run(args: argparse.Namespace) -> list[dict]:
    rows = []
    for tokens in args.completion_tokens:
        base = None
        for tree in args.trees:
            row = await measure(args, tree, tokens)
            base = base or row["instructions a turn"]
            row["over the first tree"] = round(row["instructions a turn"] / base, 3)
            rows.append(row)
            print(row, flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", type=Path, nargs="+", default=[ROOT], help="checkouts, the first the baseline")
    parser.add_argument("--completion-tokens", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--in-flight", type=int, default=64, help="the env's pool: episodes in flight")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--replies", choices=REPLIES, default="as-sampled")
    parser.add_argument("--warmup", type=float, default=30.0, help="seconds driven before the count starts")
    parser.add_argument("--seconds", type=float, default=60.0, help="the counted window")
    parser.add_argument("--record", metavar="PATH", help="also write the rows as a benchmark record")
    args = parser.parse_args()
    args.trees = [tree.resolve() for tree in args.trees]
    os.chdir(ROOT)
    rows = asyncio.run(run(args))
    if args.record:
        notes = (
            f"bench/ceiling.py's load ({args.in_flight} exact episodes in flight, {args.turns} turns each, a"
            f" {args.prompt_tokens}-token first observation, groups of {N}) on the service run under callgrind,"
            f" its instrumentation on for a {args.seconds:g}-second window after {args.warmup:g} s of warm-up;"
            " a turn is one env step in the window. Trees: "
            + ", ".join(f"`{tree.name}` = `{tree}`" for tree in args.trees)
            + "."
        )
        made = record.make("service_cost", "The service's instructions per turn at the ceiling", rows, notes=notes)
        print(f"record written to {record.write(made, args.record)}")


if __name__ == "__main__":
    main()
