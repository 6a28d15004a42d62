"""Tail control: a group that says `deadline_s` or `min_graded` closes once that many of its attempts
are graded or its deadline passes, and the attempts still running are cut.

A cut attempt is cancelled like any other: its try ends its episode through the endings (attempt.py),
so its world goes back; it is told first that it is being cut, so it ends as `group_closed` (status
`cut`, no reward) rather than `cancelled`. Without tail control this is `asyncio.gather` over the
attempts: the group waits for every one.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from typing import Any, Literal

from ...protocol import GRADED_STATUSES, Attempt, GroupRequest
from .attempt import AttemptRun

ClosedBy = Literal["min_graded", "deadline"]


def graded(attempts: list[Attempt | None]) -> int:
    return sum(a is not None and a.status in GRADED_STATUSES for a in attempts)


async def run_until_closed(
    request: GroupRequest,
    runs: list[AttemptRun],
    jobs: dict[int, Coroutine[Any, Any, Attempt]],
    attempts: list[Attempt | None],
    closes_at: float | None,
) -> ClosedBy | None:
    """Run `jobs` (attempt index -> its run) into `attempts` until each has ended or the group closes;
    returns what closed it, or None when every job ended first."""
    tasks = {asyncio.ensure_future(job): i for i, job in jobs.items()}
    try:
        closed: ClosedBy | None = None
        while tasks:
            if request.min_graded is not None and graded(attempts) >= request.min_graded:
                closed = "min_graded"
                break
            timeout = None if closes_at is None else closes_at - time.monotonic()
            if timeout is not None and timeout <= 0:
                closed = "deadline"
                break
            done, _ = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                attempts[tasks.pop(task)] = task.result()
        if closed is None:
            return None
        reason = (
            f"min_graded={request.min_graded} attempts were graded"
            if closed == "min_graded"
            else f"deadline_s={request.deadline_s:g} passed"
        )
        for task, i in tasks.items():
            runs[i].cut_reason = reason
            task.cancel()
        # Each cut try ends its episode before it returns: the group answers with its worlds given back.
        await asyncio.wait(tasks)
        for task, i in tasks.items():
            ended_first = not task.cancelled() and task.exception() is None  # ended as it was being cut
            attempts[i] = task.result() if ended_first else runs[i].cut(reason)
        tasks.clear()
        return closed
    finally:
        # The group itself was cancelled (or an attempt raised): its attempts go with it, as gather's do.
        # A second cancellation while they end leaves each ending its episode on its own.
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)
