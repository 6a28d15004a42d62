"""How long does cancelling queued attempts stall the event loop? (issue #11 item 4)

    .venv/bin/python bench/scheduler_cancel.py [--sizes 4000 65536] [--repeat 3]

For each size n: one env with its single slot held, n attempts of one request queued, then n of
another request queued behind them; the n behind are cancelled at once (a trainer gone with its
batch). Prints the longest gap a 1 ms heartbeat task saw (the loop stall), the same for 2n bare
asyncio tasks awaiting plain futures with the last n cancelled (the floor: asyncio's own cost of
cancelling n tasks), and the difference, the scheduler's part. Best of --repeat runs. Pure asyncio, no servers.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rollout_service.server.membership.world_scheduler import EnvSlots, WorldScheduler


async def stall_of(cancel_all) -> float:
    """Longest gap between heartbeats while `cancel_all()` runs and the cancelled tasks unwind."""
    gaps: list[float] = []
    stop = False

    async def heartbeat():
        last = time.perf_counter()
        while not stop:
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    beat = asyncio.create_task(heartbeat())
    await asyncio.sleep(0.01)
    await cancel_all()
    await asyncio.sleep(0.01)
    stop = True
    await beat
    return max(gaps) - 0.001


async def scheduler_run(n: int) -> float:
    sched = WorldScheduler([EnvSlots("env", 1)])
    held = await sched.acquire(["env"], (0, 0))
    front = [asyncio.create_task(sched.acquire(["env"], (1, i), "front")) for i in range(n)]
    back = [asyncio.create_task(sched.acquire(["env"], (2, i), "back")) for i in range(n)]
    await asyncio.sleep(0)
    assert sched.waiting == 2 * n

    async def cancel_all():
        for task in back:
            task.cancel()
        await asyncio.gather(*back, return_exceptions=True)

    stall = await stall_of(cancel_all)
    assert sched.waiting == n
    sched.release(held)
    slot = await front[0]
    for task in front[1:]:
        task.cancel()
    await asyncio.gather(*front[1:], return_exceptions=True)
    sched.release(slot)
    return stall


async def bare_run(n: int) -> float:
    """The same tasks without the scheduler: 2n awaiting plain futures, the last n cancelled."""
    loop = asyncio.get_running_loop()
    front = [asyncio.create_task(_await(loop.create_future())) for _ in range(n)]
    back = [asyncio.create_task(_await(loop.create_future())) for _ in range(n)]
    await asyncio.sleep(0)

    async def cancel_all():
        for task in back:
            task.cancel()
        await asyncio.gather(*back, return_exceptions=True)

    stall = await stall_of(cancel_all)
    for task in front:
        task.cancel()
    await asyncio.gather(*front, return_exceptions=True)
    return stall


async def _await(future: asyncio.Future) -> None:
    await future


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4000, 65536])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]}; cancelling n attempts queued behind n others on one env")
    print(f"{'n':>7} {'stall ms':>9} {'bare asyncio ms':>16} {'scheduler ms':>13}")
    for n in args.sizes:
        runs, bares = [], []
        for _ in range(args.repeat):
            gc.collect()
            runs.append(asyncio.run(scheduler_run(n)))
            gc.collect()
            bares.append(asyncio.run(bare_run(n)))
        stall, bare = min(runs), min(bares)
        print(f"{n:>7} {stall * 1e3:>9.1f} {bare * 1e3:>16.1f} {(stall - bare) * 1e3:>13.1f}")


if __name__ == "__main__":
    main()
