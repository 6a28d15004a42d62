"""The service's phase (starting, ready, failed, closing), and asking backends until they answer.

Pieces come up in any order (compose, Kubernetes, Ray): a backend that does not answer yet, answers
5xx or says it is not ready is asked again with backoff; what waiting cannot fix is refused at once.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from ..retry import Backoff
from .errors import Unavailable, shutting_down

T = TypeVar("T")
# One start-up question to one backend: 10 s, doubled after each that times out (a slow /tasks of a
# large catalog on a starved host still gets through), up to 60 s.
ASK_TIMEOUT_S, ASK_TIMEOUT_MAX_S = 10.0, 60.0


class NotYet(Exception):
    """A backend that does not answer yet (or says it is not ready): ask it again."""


class Lifecycle:
    """Where the service is in its life (starting, ready, failed, closing): every room asks it
    whether a request may be served now. The rooms themselves are made once, with the service."""

    def __init__(self, startup_timeout_s: float) -> None:
        self.startup_timeout_s = startup_timeout_s
        self.started_at = time.time()
        self.closing = False
        # Backends not answering yet at start (name -> why), for /health/detail and the start-up log.
        self.waiting_for: dict[str, str] = {}
        # Why start() gave up, once it has: /health says `failed` rather than `starting` forever.
        self.startup_failure: str | None = None
        self.waiting_reported = False
        self.ready = False  # set once, when start-up has checked every backend and started every room

    def refuse_unless_ready(self) -> None:
        if self.closing:
            raise shutting_down()
        if self.startup_failure:
            # Embedded without the CLI (which exits on this), the app stays up: say why it cannot serve.
            raise Unavailable("start_failed", f"the service could not start: {self.startup_failure}")
        if not self.ready:
            raise Unavailable(
                "starting",
                f"the service is starting: {self.starting_summary()}",
                retry_after_s=5,
            )

    def starting_summary(self) -> str:
        if self.startup_failure:
            return f"could not start: {self.startup_failure}"
        if not self.waiting_for:
            return "every backend answered; finishing its start-up checks"
        return f"waiting for {self.awaited()}"

    def awaited(self) -> str:
        """What start-up still waits for, and why: for its log, its timeout and /health/detail."""
        return "; ".join(f"{name}: {why}" for name, why in self.waiting_for.items())

    async def until_ready(self, name: str, probe: Callable[[], Awaitable[T]]) -> T:
        """`ask_until_ready`, saying in `waiting_for` why `name` is still awaited."""
        answer = await ask_until_ready(probe, functools.partial(self.waiting_for.__setitem__, name))
        self.waiting_for.pop(name, None)
        return answer

    async def report_waiting(self, say: Callable[[str], None], every_s: float = 10.0) -> None:
        """Say what is still awaited: first after a few seconds (a quick start says nothing), then
        every `every_s`."""
        await asyncio.sleep(3.0)
        while self.waiting_for:
            self.waiting_reported = True
            waited = time.time() - self.started_at
            say(f"waiting for {self.awaited()} ({waited:.0f}s of {self.startup_timeout_s:g}s, --startup-timeout)")
            await asyncio.sleep(every_s)


async def ask_until_ready(probe: Callable[[], Awaitable[T]], waiting: Callable[[str], Any] | None = None) -> T:
    """Ask `probe` until it answers, telling `waiting` why not yet. `NotYet` means ask again later
    (backoff 0.25 s to 5 s); each question is bounded (10 s, doubled after each that times out, up to
    60 s): a backend that takes the connection and never answers is asked again. The caller bounds
    the whole wait (--startup-timeout at start, timeout_s for one added at runtime)."""
    pause, bound = Backoff(0.25, 5.0), Backoff(ASK_TIMEOUT_S, ASK_TIMEOUT_MAX_S)
    while True:
        try:
            return await asyncio.wait_for(probe(), bound.current)
        except TimeoutError:
            if waiting is not None:
                waiting(f"asked, no answer within {bound.take():g}s")
        except NotYet as exc:
            if waiting is not None:
                waiting(str(exc))
            await pause.sleep()
