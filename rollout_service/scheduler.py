"""World slots: the service never holds more episodes on an env than its pool has worlds.

Attempts beyond the pools wait here, in the service, not in HTTP requests parked on the env
(a blocked /step/reset holds a connection and gives the env no way to prefer one group over
another). Waiters are served by priority (group order, then attempt index): earlier groups
finish first, and a later group becomes the earliest as soon as those before it finish.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
from dataclasses import dataclass, field
from typing import Sequence


@dataclass
class EnvSlots:
    """Slot accounting of one environment."""

    url: str
    capacity: int
    held: int = 0
    max_held: int = 0
    busy_seconds: float = 0.0  # world-seconds held, for utilisation

    @property
    def free(self) -> int:
        return self.capacity - self.held


@dataclass(order=True)
class _Waiter:
    priority: tuple
    seq: int
    future: asyncio.Future = field(compare=False)
    candidates: frozenset[str] = field(compare=False)


class WorldScheduler:
    """Grants env slots to attempts, at most `capacity` per env, best priority first."""

    def __init__(self, envs: Sequence[EnvSlots]) -> None:
        self.envs = {e.url: e for e in envs}
        self._waiters: list[_Waiter] = []
        self._seq = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for w in self._waiters if not w.future.done())

    async def acquire(self, candidates: Sequence[str], priority: tuple) -> EnvSlots:
        """Wait for a slot on one of `candidates` (env URLs); the least busy free one wins."""
        free = [self.envs[u] for u in candidates if self.envs[u].free > 0]
        if free and not self._has_earlier_waiter(candidates, priority):
            return self._grant(min(free, key=lambda e: e.held / e.capacity))
        waiter = _Waiter(priority, next(self._seq), asyncio.get_running_loop().create_future(),
                         frozenset(candidates))
        bisect.insort(self._waiters, waiter)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            if waiter.future.done() and not waiter.future.cancelled():
                self.release(waiter.future.result())  # granted just as we were cancelled
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def release(self, env: EnvSlots, held_seconds: float = 0.0) -> None:
        env.held -= 1
        env.busy_seconds += held_seconds
        for waiter in self._waiters:
            if not waiter.future.done() and env.url in waiter.candidates:
                waiter.future.set_result(self._grant(env))
                self._waiters.remove(waiter)
                return

    def _grant(self, env: EnvSlots) -> EnvSlots:
        env.held += 1
        env.max_held = max(env.max_held, env.held)
        assert env.held <= env.capacity, "a world slot was granted beyond the pool"
        return env

    def _has_earlier_waiter(self, candidates: Sequence[str], priority: tuple) -> bool:
        wanted = set(candidates)
        return any(not w.future.done() and w.priority < priority and w.candidates & wanted
                   for w in self._waiters)
