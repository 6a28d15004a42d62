"""Running coroutines as tasks that end together."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


async def all_or_none(coros: list[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Their results in order; at the first failure (or if cancelled) the others are cancelled,
    waited for, and the failure raised: nothing keeps probing after start-up has given up."""
    try:
        async with asyncio.TaskGroup() as group:
            tasks = [group.create_task(c) for c in coros]
    except BaseExceptionGroup as failed:
        # The first failure, as the caller would have met it awaiting the coroutines one by one.
        raise failed.exceptions[0] from None
    return [task.result() for task in tasks]


async def cancel_in_slices(tasks: dict[asyncio.Future, int], attempts_per_slice: int = 256) -> None:
    """Cancel groups (task -> its attempts) a slice at a time, yielding to the loop between slices:
    cancelling a full batch (65,536 queued attempts) at once would stall every other request for a
    second or more. Whatever interrupts this, every group still gets cancelled."""
    try:
        sliced = 0
        for task, attempts in tasks.items():
            task.cancel()
            sliced += attempts
            if sliced >= attempts_per_slice:
                sliced = 0
                await asyncio.sleep(0)
    finally:
        for task in tasks:
            task.cancel()
    if tasks:
        await asyncio.wait(list(tasks))
