"""How many step-contract calls per second one refenv process sustains (latency 0).

    .venv/bin/python bench/refenv_throughput.py [--pool 16] [--seconds 20] [--drivers 32]

Starts `refenv serve --step --pool P` on a port it binds and reports, then `drivers` concurrent loops each run
whole episodes (reset, one SQL step, one answer step) for `seconds`, and prints calls/s
(resets + steps) and episodes/s. A driver holds at most one episode, so drivers > pool also
exercise the blocking reset. Loopback only; bounded in time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rollout_service.launch.stack import ManagedProcess, refenv_command, start_listening

SQL = json.dumps({"action": "sql", "input": "SELECT COUNT(*) FROM customers"})
ANSWER = json.dumps({"action": "answer", "input": "20"})


async def driver(client: httpx.AsyncClient, deadline: float, counts: dict) -> None:
    while time.monotonic() < deadline:
        answer = (await client.post("/step/reset", json={"task_id": "t005"})).json()
        counts["calls"] += 1
        for completion in (SQL, ANSWER):
            if answer["done"]:
                break
            answer = (
                await client.post(
                    "/step",
                    json={
                        "episode_id": answer["episode_id"],
                        "completion": completion,
                        "prompt_tokens": 300,
                        "completion_tokens": 20,
                    },
                )
            ).json()
            counts["calls"] += 1
        counts["episodes"] += 1


async def measure(url: str, drivers: int, seconds: float) -> dict:
    counts = {"calls": 0, "episodes": 0}
    limits = httpx.Limits(max_connections=drivers + 4)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=60) as client:
        started = time.monotonic()
        await asyncio.gather(*(driver(client, started + seconds, counts) for _ in range(drivers)))
        wall = time.monotonic() - started
    return {
        "calls_per_s": counts["calls"] / wall,
        "episodes_per_s": counts["episodes"] / wall,
        "wall_s": wall,
        **counts,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pool", type=int, default=16)
    parser.add_argument("--drivers", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    started: list[ManagedProcess] = []
    try:
        cmd = refenv_command(0, "--pool", str(args.pool))
        url = start_listening("bench-refenv", cmd, Path("results/logs"), started).url
        result = asyncio.run(measure(url, args.drivers, args.seconds))
        health = httpx.get(f"{url}/health").json()
    finally:
        for proc in started:
            proc.stop()
    print(
        f"refenv pool {args.pool}, {args.drivers} drivers, {result['wall_s']:.1f}s: "
        f"{result['calls_per_s']:.0f} calls/s ({result['episodes_per_s']:.0f} episodes/s); "
        f"max_leased {health['max_leased']}, leased at end {health['leased']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
