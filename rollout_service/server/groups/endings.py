"""Giving worlds back: every episode an attempt started is abandoned (unless the env ended it) and
its slot freed, in a task of its own that nothing that happens to the attempt can interrupt."""

from __future__ import annotations

import asyncio
import logging
import time

from ...backends.env_client import BadEnvAnswer, EnvError, StepAnswer
from ...retry import Backoff
from ..membership.targets import EnvHandle
from ..membership.world_scheduler import EnvSlots, WorldScheduler
from ..metrics import Metrics

log = logging.getLogger("rollout_service.runner")

# How long an ending keeps DELETEing an episode the env will not give back: the contract's idle
# reclaim (5 minutes by default) plus a margin; past it the env has ended the episode itself.
ABANDON_PATIENCE_S = 330.0


class EpisodeEndings:
    """The episodes being ended in the background; each holds its world's slot until done."""

    def __init__(self, scheduler: WorldScheduler, metrics: Metrics) -> None:
        self.scheduler = scheduler
        self.metrics = metrics
        self._running: set[asyncio.Task] = set()
        self._draining = False  # shutting down: endings stop retrying

    @property
    def running(self) -> int:
        return len(self._running)

    async def drain(self, timeout_s: float) -> None:
        """Wait (bounded) for the endings still running; from now on they try each DELETE once."""
        self._draining = True
        if self._running:
            await asyncio.wait(set(self._running), timeout=timeout_s)

    def end(
        self,
        env: EnvHandle,
        slot: EnvSlots,
        held_from: float,
        episode_id: str | None,
        reset: asyncio.Task[StepAnswer] | None,
    ) -> asyncio.Event | None:
        """Give the world back: abandon the episode if it is open (or if `reset`, a reset whose
        answer never reached the attempt, started one), then free the slot. Returns an event set
        once the first DELETE has been answered, or None when there was nothing to end."""
        if episode_id is None and reset is None:
            self.release(env, slot, held_from)
            return None
        first_delete = asyncio.Event()
        task = asyncio.ensure_future(self._abandon_then_release(env, slot, held_from, episode_id, reset, first_delete))
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return first_delete

    def release(self, env: EnvHandle, slot: EnvSlots, held_from: float) -> None:
        self.scheduler.release(slot, time.monotonic() - held_from)
        self.metrics.episodes_in_flight.labels(env=env.url).dec()

    async def _abandon_then_release(
        self,
        env: EnvHandle,
        slot: EnvSlots,
        held_from: float,
        episode_id: str | None,
        reset: asyncio.Task[StepAnswer] | None,
        first_delete: asyncio.Event,
    ) -> None:
        try:
            if reset is not None:
                try:
                    answer = await reset
                    if not answer.done:
                        episode_id = answer.episode_id
                except BadEnvAnswer as exc:
                    episode_id = exc.episode_id
                except (Exception, asyncio.CancelledError):
                    pass  # no episode was started (or none we can name)
            if episode_id is not None:
                await self._abandon_patiently(env, episode_id, first_delete)
        finally:
            first_delete.set()
            self.release(env, slot, held_from)

    async def _abandon_patiently(self, env: EnvHandle, episode_id: str, first_delete: asyncio.Event) -> None:
        """DELETE the episode until the env says it is gone. Until then the world is the env's and
        the slot stays held; a stopped or restarting env is retried with backoff, up to the contract's
        idle reclaim (by then the env has ended the episode itself)."""
        deadline = time.monotonic() + ABANDON_PATIENCE_S
        pause = Backoff(0.5, 10.0)
        while True:
            try:
                await env.client.abandon(episode_id)
                return
            except EnvError as exc:
                first_delete.set()
                if exc.episode_over:  # the env process is gone, and its worlds with it
                    return
                if self._draining or time.monotonic() + pause.current > deadline:
                    log.warning("gave up abandoning episode %s on %s: %s", episode_id, env.url, exc)
                    return
                log.warning(
                    "abandoning episode %s on %s failed (%s); again in %.1fs", episode_id, env.url, exc, pause.current
                )
            await pause.sleep()
