"""Waiting between tries: one backoff for every loop that asks again (start-up probes, abandoning
an episode, a trainer waiting for the service). Standard library only: the trainer side imports it."""

from __future__ import annotations

import asyncio


class Backoff:
    """Delays from `first`, multiplied by `factor` after each, never over `cap` (first == cap: a
    steady poll)."""

    def __init__(self, first: float, cap: float, factor: float = 2.0) -> None:
        self.current, self.cap, self.factor = first, cap, factor

    def take(self) -> float:
        """The delay to wait now; the next one grows."""
        delay = self.current
        self.current = min(self.current * self.factor, self.cap)
        return delay

    async def sleep(self) -> None:
        await asyncio.sleep(self.take())
