"""The deadlines of a transport's requests in flight, kept by one timer for them all."""

from __future__ import annotations

import asyncio
from typing import Any

# How often the requests in flight are checked against their deadlines: a deadline holds to within this.
SWEEP_S = 0.05


class DeadlineSweep:
    """The deadlines of one transport's requests in flight, kept by one timer for them all, at the price
    of a deadline held to within SWEEP_S rather than exactly: a timer per request costs more. Counted side
    by side through bench/transport_cost.py (bench/results/deadlines-2026-12-06.json), a request cost
    ~388,000 instructions with this sweep, ~21,000-23,000 more (5.5-5.9%) with `asyncio.timeout` around
    the exchange (a Timeout, its two coroutines and a timer armed and cancelled per request), ~25,000
    more (6.3-6.6%) with aiohttp's own total timeout (its timer and timer contexts). A request past its
    deadline has its task cancelled, as both of those do, and `_send` turns that cancellation (and only
    that) into TransportTimeout."""

    def __init__(self) -> None:
        self._due: dict[asyncio.Task[Any], float] = {}
        self.expired: set[asyncio.Task[Any]] = set()
        self._sweep: asyncio.TimerHandle | None = None

    def add(self, task: asyncio.Task[Any], deadline_s: float) -> None:
        loop = task.get_loop()
        self._due[task] = loop.time() + deadline_s
        if self._sweep is None:
            self._sweep = loop.call_later(SWEEP_S, self._expire, loop)

    def remove(self, task: asyncio.Task[Any]) -> bool:
        """Whether this task's request was cancelled for its deadline (the cancellation is then taken
        back: it is TransportTimeout's to report, not the caller's)."""
        del self._due[task]
        if task not in self.expired:
            return False
        self.expired.discard(task)
        task.uncancel()
        return True

    def _expire(self, loop: asyncio.AbstractEventLoop) -> None:
        self._sweep = None
        now = loop.time()
        for task, due in self._due.items():
            if due <= now and task not in self.expired:
                self.expired.add(task)
                task.cancel()
        if self._due:
            self._sweep = loop.call_later(SWEEP_S, self._expire, loop)

    def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
