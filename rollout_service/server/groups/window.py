"""A batch answer's window: at most `size` of its groups started and not yet written to the reader.

Without it a batch starts every group at once, and a reader that stops reading makes the service
hold every finished group's line (hundreds of MB for 512 groups of long replies) until the stall
timeout. With it, a group waits to start until a line of the answer has been written: a reader that
takes nothing holds at most `size` groups started, running or finished. The size never starves the
pools: it is at least what fills the worlds of the envs serving the batch.
"""

from __future__ import annotations

import asyncio
import math

from ..membership.envs import EnvRegistry


def worlds_serving(registry: EnvRegistry, task_ids: list[str], allow_eval: bool) -> int:
    """Worlds of the envs that serve these tasks, not draining (an env counted once)."""
    envs = {}
    for task_id in task_ids:
        target = registry.targets.get(task_id)
        for env in target.envs if target is not None else ():
            if (allow_eval or env.contract.side != "eval") and not env.slots.draining:
                envs[env.url] = env.slots.pool
    return sum(envs.values())


def window_size(least: int, worlds: int, smallest_n: int) -> int:
    """--answer-window, or the groups that fill `worlds` (and one more, ready as one ends) if more."""
    return max(least, math.ceil(worlds / max(1, smallest_n)) + 1)


class AnswerWindow:
    def __init__(self, size: int) -> None:
        self.size = size
        self._slots = asyncio.Semaphore(size)
        self._inside: set[asyncio.Future] = set()

    async def enter(self) -> None:
        """Wait for room, in the order the groups asked (the batch's earlier groups first)."""
        await self._slots.acquire()
        task = asyncio.current_task()
        assert task is not None
        self._inside.add(task)

    def leave(self, task: asyncio.Future) -> None:
        """`task`'s line was written (or will never be): its room goes to the next group. A group
        cancelled before it entered held none."""
        if task in self._inside:
            self._inside.discard(task)
            self._slots.release()

    @property
    def started_unsent(self) -> int:
        return len(self._inside)
