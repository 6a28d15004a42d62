"""The replicas held paused: the trainer's pause (POST /policy/pause) as a lease that runs out, the
service's own pause around a reload, and resuming what either held.

While anything holds the replicas paused no turn starts (it would start on weights being replaced).
A replica that does not resume is held paused (replica_states.py): out of routing until the monitor
has resumed it.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ...backends.errors import WeightUpdateError
from ...backends.replica_pool import Endpoint, ReplicaPool, engine_of
from ..errors import BackendFailed, Conflict, Invalid
from .replica_calls import describe, read_label, timed
from .replica_states import ReplicaStates
from .versions import VersionBook, weights_match

log = logging.getLogger("rollout_service.policy")


class PauseLease:
    """Which replicas the trainer's pause holds, and until when (those this service could not resume
    are held paused in their standing: replica_states.py).

    `lock` is the policy manager's: a pause, its lease running out and an update never interleave."""

    def __init__(
        self,
        client: ReplicaPool,
        book: VersionBook,
        states: ReplicaStates,
        lock: asyncio.Lock,
        default_s: float | None = None,
        max_s: float | None = None,
    ) -> None:
        self.client = client
        self.book = book
        self.states = states
        self.lock = lock
        # The lease when the trainer names none, and the longest it may name (the service's
        # --pause-timeout and --max-pause-timeout); None: it must name one, and any is taken.
        self.default_s, self.max_s = default_s, max_s
        self.paused = False  # held by the trainer until its POST /policy or the lease ends
        self.paused_since: float | None = None
        self.deadline = 0.0  # monotonic: when the trainer's pause lease runs out
        self.task: asyncio.Task | None = None  # the lease's watch
        self.held: list[Endpoint] = []  # the replicas the trainer's pause holds
        self._unpaused = asyncio.Event()
        self._unpaused.set()

    @property
    def expires_in(self) -> float | None:
        return round(max(0.0, self.deadline - time.monotonic()), 1) if self.paused else None

    async def wait_unpaused(self) -> None:
        while not self._unpaused.is_set():
            await self._unpaused.wait()

    def stop_turns(self) -> None:
        """No turn starts until the next resume (a reload is under way)."""
        self._unpaused.clear()

    def lease_for(self, timeout_s: float | None) -> float:
        """The lease a pause asking for `timeout_s` (None: the default) gets, or Invalid."""
        if timeout_s is None:
            if self.default_s is None:  # a manager made without the service's settings: the caller's bug
                raise ValueError("this pause lease has no default: name timeout_s")
            timeout_s = self.default_s
        if self.max_s is not None and timeout_s > self.max_s:
            raise Invalid(
                "pause_too_long", f"timeout_s {timeout_s:g} is over this service's --max-pause-timeout {self.max_s:g}"
            )
        return timeout_s

    async def hold(self, timeout_s: float) -> None:
        """Hold every replica paused for a weight transfer the trainer does itself, for `timeout_s`
        at most (asking again while paused renews the lease). The caller holds `lock`."""
        if self.paused:
            self.deadline = time.monotonic() + timeout_s
            return
        # A replica out of routing serves no turn; it is checked before it is routed again.
        endpoints = self.client.routable() or self.client.endpoints
        outcomes = await asyncio.gather(*(timed(e, engine_of(e).pause()) for e in endpoints))
        failed = [o for o in outcomes if not o.ok]
        if failed:
            await self.resume([o.endpoint for o in outcomes if o.ok])
            kind = Conflict if all(o.refused for o in failed) else BackendFailed
            raise kind("pause_failed", describe(failed, "could not pause"))
        self.paused, self.paused_since = True, time.time()
        self.held = list(endpoints)
        self._unpaused.clear()
        self.deadline = time.monotonic() + timeout_s
        self.task = asyncio.create_task(self._watch(), name="pause-lease")
        log.info("policy pause taken: %d replica(s) paused for up to %gs", len(endpoints), timeout_s)

    def end(self) -> None:
        """The service stops: the lease ends with it (the manager's close resumes what it holds)."""
        if self.task is not None:
            self.task.cancel()

    async def _watch(self) -> None:
        """Wait out the pause's lease (renewals move its end), then end the pause if nothing else has:
        a trainer that died mid-push must not hold every replica, and with them every group, forever."""
        while True:
            await asyncio.sleep(max(0.0, self.deadline - time.monotonic()))
            async with self.lock:
                if self.task is not asyncio.current_task():
                    return  # the pause ended meanwhile (POST /policy, shutdown)
                if self.deadline <= time.monotonic():
                    await self._ran_out()
                    return

    async def _ran_out(self) -> None:
        """Resume the replicas whose /weight_info still shows the weights from before the pause. Any
        other has had weights pushed that no POST /policy named: turns must not be sent there, so it
        stays paused and out of routing, the reason in /health/detail, until it is brought back to the
        current version (the monitor tries: a checkpoint the service knows is reloaded) or removed."""
        wanted = self.book.current.weights_label
        endpoints = _distinct(self.held)

        async def label(endpoint: Endpoint) -> str | None | WeightUpdateError:
            try:
                return await read_label(engine_of(endpoint))
            except WeightUpdateError as exc:
                return exc

        labels = await asyncio.gather(*(label(e) for e in endpoints))
        resume = []
        for endpoint, found in zip(endpoints, labels, strict=True):
            if not isinstance(found, WeightUpdateError) and weights_match(found, wanted):
                resume.append(endpoint)
                continue
            shown = f"could not be read ({found.detail})" if isinstance(found, WeightUpdateError) else repr(found)
            reason = (
                f"the pause lease ran out with /weight_info {shown}, not {wanted or 'the base checkpoint'!r} "
                f"as before the pause (weights pushed without a POST /policy): kept paused and out of routing "
                f"until it serves {self.book.current.label}"
            )
            log.warning("policy replica %s: %s", endpoint.url, reason)
            self.states.hold_paused(endpoint, reason)  # resumed before any restore
        log.warning("the trainer's pause lease ran out without a POST /policy: resuming %d replica(s)", len(resume))
        await self.resume(resume)

    async def resume(self, endpoints: list[Endpoint]) -> None:
        """Resume the replicas this service paused, and let turns start again. One that does not
        resume stays out of routing (a turn sent there would hang) until the monitor resumes it."""
        results = await asyncio.gather(*(timed(e, engine_of(e).resume()) for e in _distinct(endpoints)))
        for outcome in results:
            if outcome.ok:
                self.states.resumed(outcome.endpoint)
            else:
                self.states.hold_paused(outcome.endpoint, f"could not be resumed: {outcome.error}")
        if self.paused:  # the trainer's pause ends here (its update, its lease running out, shutdown)
            resumed = {o.url for o in results if o.ok}
            # Not resumed: a lease run out keeps replicas with pushed weights paused, or a resume failed.
            kept = {e.url for e in self.held} - resumed
            log.info("policy pause released: %d replica(s) resumed, %d kept paused", len(resumed), len(kept))
        self.paused, self.paused_since, self.held = False, None, []
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()
        self.task = None
        self._unpaused.set()


def _distinct(endpoints: list[Endpoint]) -> list[Endpoint]:
    """Each replica once, in order (a replica held by the trainer's pause and paused for a reload too)."""
    first: dict[str, Endpoint] = {}
    for endpoint in endpoints:
        first.setdefault(endpoint.url, endpoint)
    return list(first.values())
