"""The policy the replicas serve, and how a trainer changes it (POST /policy): the policy manager,
which wires the version book (versions.py), each replica's standing (replica_states.py), the pause
(pause.py) and the updates applied to replicas (apply.py), one update at a time.

No replica is ever routed while it may serve weights the service does not know it serves: one
that failed to take an update, stopped answering (it may have restarted on the base weights),
or lacks the current adapter is out of routing until the monitor has checked it and, where the
service can, brought it to the current version.
"""

from __future__ import annotations

import asyncio
import logging
import time

from ...backends.errors import InferenceError, WeightUpdateError
from ...backends.replica_pool import Endpoint, ReplicaPool, engine_of
from ...protocol import PolicyState, PolicyUpdate, PolicyUpdateResult, ReplicaUpdate
from ..errors import BackendFailed, Conflict, Invalid, StartupError
from ..metrics import Metrics
from .apply import ReplicaUpdater
from .checkpoints import check_checkpoint
from .pause import PauseLease
from .replica_calls import describe, is_paused, listed_models, read_label
from .replica_states import Phase, ReplicaStates
from .versions import DEFAULT_WEIGHTS, RELOADING, PolicyVersion, TurnLease, VersionBook, weights_match

log = logging.getLogger("rollout_service.policy")


class PolicyManager:
    """The current version, the replicas' state, and the updates (one at a time)."""

    def __init__(
        self,
        client: ReplicaPool,
        base_model: str,
        metrics: Metrics,
        checkpoint_root: str | None = None,
        *,
        max_loras: int | None = None,
        pause_timeout_s: float | None = None,
        max_pause_timeout_s: float | None = None,
    ) -> None:
        self.client = client
        self.checkpoint_root = checkpoint_root
        self.base_model = base_model
        self.metrics = metrics
        self._lock = asyncio.Lock()
        self.book = VersionBook(base_model)
        if max_loras is not None:
            self.book.max_loras = max_loras  # how many pinned versions' adapters may stay loaded
        # Each replica's standing, and through it the pool's routing: the manager never routes itself.
        self.states = ReplicaStates(client, metrics, "policy", self.book.current.label)
        self.pause_lease = PauseLease(client, self.book, self.states, self._lock, pause_timeout_s, max_pause_timeout_s)
        self.updater = ReplicaUpdater(client, self.book, self.states, self.pause_lease)
        self._tasks: set[asyncio.Task] = set()
        self._closing = False
        client.on_failure = self._on_failure

    @property
    def current(self) -> PolicyVersion:
        return self.book.current

    @property
    def paused(self) -> bool:
        return self.pause_lease.paused

    @property
    def paused_since(self) -> float | None:
        return self.pause_lease.paused_since

    # -- start -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Name the version the replicas serve now: the label a full-weight update left on them
        (`/weight_info`), else 'base'. Replicas that disagree cannot be one policy."""
        labels: dict[str, str | None] = {}
        for endpoint in self.client.endpoints:
            try:
                labels[endpoint.url] = await engine_of(endpoint).weight_version()
            except WeightUpdateError:
                labels[endpoint.url] = None  # not in dev mode: nobody can have relabelled its weights
        for endpoint in self.client.endpoints:
            if await is_paused(engine_of(endpoint)):  # an earlier service stopped while holding it
                log.warning("policy replica %s was left paused: resuming it", endpoint.url)
                await self.pause_lease.resume([endpoint])
        broken = [url for url, label in labels.items() if label and label.startswith(RELOADING)]
        if broken:
            raise StartupError(f"policy replicas {broken} were left half-way through a reload: restart them")
        found = {label for label in labels.values() if label not in DEFAULT_WEIGHTS}
        if len(found) > 1 or (found and any(label in DEFAULT_WEIGHTS for label in labels.values())):
            raise StartupError(
                f"the policy replicas serve different weights ({labels}, from /weight_info): restart them "
                "on one checkpoint"
            )
        if found:
            label = found.pop()
            assert label is not None
            self.book.start_on(label)
            self.states.start_on(label)

    async def close(self) -> None:
        """Never leave a replica paused: wait (bounded) for an update under way, then resume what
        the trainer's pause still holds."""
        self.begin_close()
        if self._tasks:
            # A restore cancelled in the middle of a reload leaves its replica labelled as reloading (the
            # next start refuses it): let what runs end first, within bounds.
            await asyncio.wait(set(self._tasks), timeout=30)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=5)
        try:
            await asyncio.wait_for(self._lock.acquire(), 30)
        except TimeoutError:
            log.warning("a policy update was still running at shutdown; its replicas may stay paused")
            return
        try:
            if self.paused:
                await self.pause_lease.resume(self.pause_lease.held)
        finally:
            self._lock.release()

    def begin_close(self) -> None:
        """Shutting down: no restore starts from now on (for a replica that joins or is probed), and the
        pause's lease ends with the service (close resumes what it holds)."""
        self._closing = True
        self.pause_lease.end()

    # -- turns and pinned groups ---------------------------------------------------------------

    async def lease(self, pin: str | None = None) -> TurnLease:
        """The version a turn about to be sent is generated with (the pinned one, for a group that
        names one); waits while the trainer holds the replicas paused (the turn would otherwise start
        on weights that are being replaced)."""
        await self.pause_lease.wait_unpaused()
        return self.book.take(pin)

    def release(self, lease: TurnLease) -> str | None:
        """The turn is done. Returns the version it ended on when the weights changed under it."""
        if self.book.give_back(lease):
            self._spawn(self.updater.unload(lease.version.served_model))
        if lease.weights_epoch != self.book.weights_epoch:
            return self.current.label
        return None

    def check_pin(self, label: str) -> PolicyVersion:
        return self.book.check_pin(label)

    def pin(self, label: str) -> PolicyVersion:
        return self.book.pin(label)

    def unpin(self, version: PolicyVersion) -> None:
        if self.book.unpin(version):
            self._spawn(self.updater.unload(version.served_model))

    def behind(self, label: str) -> int:
        return self.book.behind(label)

    # -- updates -----------------------------------------------------------------------------

    async def pause(self, timeout_s: float | None = None) -> PolicyState:
        """Hold every replica paused for a weight transfer the trainer does itself, for `timeout_s`
        at most (a lease: asking again while paused renews it); None: the service's default lease."""
        timeout_s = self.pause_lease.lease_for(timeout_s)  # refused before any replica is paused
        async with self._lock:
            await self.pause_lease.hold(timeout_s)
            return self.state()

    async def update(self, update: PolicyUpdate) -> PolicyUpdateResult:
        async with self._lock:
            if update.lora is None and update.weights is None and not self.paused:
                raise Conflict(
                    "not_paused",
                    "a version with neither lora nor weights finishes a weight transfer the trainer pushed "
                    "itself: POST /policy/pause first, push the weights, then POST /policy {version}",
                )
            if update.version in self.book.steps:
                raise Conflict("version_exists", f"version {update.version!r} was already served")
            started = time.monotonic()
            previous = self.current
            step = previous.step + 1
            if update.lora is not None:
                # The folder as checked, links resolved, is what the replicas are told to load.
                path = await asyncio.to_thread(check_checkpoint, update.lora.path, "lora", self.checkpoint_root)
                beneath = previous.weights if previous.kind == "lora" else previous
                version = PolicyVersion(
                    update.version,
                    step,
                    "lora",
                    f"{self.base_model}@{update.version}",
                    path,
                    beneath if beneath is not None and beneath.kind != "base" else None,
                )
                outcomes = await self.updater.load_adapter_everywhere(version)
                if self.paused and any(o.ok for o in outcomes):
                    await self.pause_lease.resume(self.pause_lease.held)  # the trainer's pause ends with its update
            elif update.weights is not None:
                path = await asyncio.to_thread(check_checkpoint, update.weights.path, "weights", self.checkpoint_root)
                version = PolicyVersion(update.version, step, "weights", self.base_model, path)
                outcomes = await self.updater.reload_everywhere(version)
            else:
                version = PolicyVersion(update.version, step, "pushed", self.base_model)
                outcomes = await self.updater.finish_push(version)
            held_paused = self.states.held_paused
            took = [o for o in outcomes if o.ok and not held_paused(o.endpoint)]
            if version.kind == "weights":
                # A failed reload may have left a replica without weights: out of routing until the
                # monitor has read its label (see RELOADING) and, if need be, reloaded it.
                for outcome in outcomes:
                    if not outcome.ok and not outcome.unchanged:
                        self.states.exclude(outcome.endpoint, f"reload failed: {outcome.error}")
            if not took:
                refusal = Invalid if all(o.refused for o in outcomes) else BackendFailed
                kept = (
                    "every replica keeps"
                    if version.kind == "lora"
                    else "replicas whose reload failed stay out of routing until checked; the others keep"
                )
                raise refusal(
                    "update_failed",
                    f"no policy replica took version {update.version!r}; {kept} serving "
                    f"{previous.label!r}. " + describe(outcomes, "failed"),
                )
            self.book.adopt(version)
            for outcome in outcomes:
                if held_paused(outcome.endpoint):
                    continue  # still paused: the monitor resumes it before it is routed
                if outcome.ok:
                    self.states.serve(outcome.endpoint, version.label)
                else:
                    self.states.exclude(outcome.endpoint, f"did not take version {version.label}: {outcome.error}")
            if self.book.unused_adapter(previous):
                self._spawn(self.updater.unload(previous.served_model))
            result = PolicyUpdateResult(
                version=version.label,
                previous=previous.label,
                kind=version.kind,
                replicas=[ReplicaUpdate(url=o.url, ok=o.ok, seconds=o.seconds, error=o.error) for o in outcomes],
                seconds=round(time.monotonic() - started, 3),
                finished_at=round(time.time(), 3),
            )
            self.book.history.append(result)
            self.metrics.policy_update(result.kind, result.seconds)
            # A lifecycle event when every replica took it; a warning when some did not (they stay out
            # of routing until the monitor brings them to this version).
            log.log(
                logging.INFO if len(took) == len(outcomes) else logging.WARNING,
                "policy version %s (%s) served by %d of %d replicas",
                version.label,
                version.kind,
                len(took),
                len(outcomes),
            )
            return result

    # -- replicas that come and go -------------------------------------------------------------

    def _on_failure(self, endpoint: Endpoint, exc: InferenceError) -> None:
        """A turn failed on a replica. If it stopped answering it may have restarted on the base
        weights; if it does not know the current adapter it did. Either way: out of routing until
        the monitor has checked what it serves."""
        lost_adapter = exc.status == 404 and self.current.kind == "lora"
        if exc.replica_down or lost_adapter:
            self.replica_unreachable(endpoint, exc.kind)

    def replica_unreachable(self, endpoint: Endpoint, why: str) -> None:
        """A turn or a probe found the replica down: it may come back on its launch weights."""
        if self.current.kind == "base" or endpoint not in self.client.endpoints:
            return  # a restarted replica serves the base weights too; a removed one is nobody's concern
        self.states.exclude(endpoint, f"{why}: routed again once it is checked to serve {self.current.label}")

    async def reconcile(self, endpoint: Endpoint, models: list[str]) -> None:
        """Called by the monitor for a replica that answered: is it on the current version? If not,
        take it out of routing and bring it there (in the background)."""
        if self._closing:
            return
        if self._lock.locked() or self.paused or self.states.phase(endpoint) is Phase.RESTORING:
            return  # an update, the trainer's pause or a restore is deciding for it
        if self.states.phase(endpoint) is Phase.DRAINING:
            return await self._resume_draining(endpoint)  # it leaves: not restored, but never left paused
        if endpoint not in self.client.endpoints:
            return  # removed while it was probed
        current = self.current
        try:
            ok = await self._serves(endpoint, current, models)
            if not ok and current.kind == "lora":
                # The list may predate a restore that has just finished: ask again before acting.
                ok = await self._serves(endpoint, current, await listed_models(engine_of(endpoint)))
        except WeightUpdateError as exc:
            self.states.exclude(endpoint, f"cannot tell which weights it serves: {exc.detail}")
            return
        if (
            current is not self.current
            or self._lock.locked()
            or self.states.phase(endpoint) in (Phase.RESTORING, Phase.DRAINING)
            or (ok and self.states.held_paused(endpoint))
            or endpoint not in self.client.endpoints
        ):
            return  # an update started or landed, or a restore began, meanwhile: the next probe looks again
        if ok:
            self.states.serve(endpoint, current.label)
            return
        self.states.restore(endpoint, f"does not serve {current.label} (restarted?); bringing it there")
        self._spawn(self._restore(endpoint, current))

    async def _resume_draining(self, endpoint: Endpoint) -> None:
        """A draining replica this service left paused (its resume failed, or a pause lease ran out on
        it): the turns frozen there end, and it can be removed, only once it is resumed."""
        if not await is_paused(engine_of(endpoint)):  # asked before the lock: an update never waits on it
            return
        async with self._lock:  # outside an update and the trainer's pause, nothing else holds it paused
            if not self.paused and endpoint in self.client.endpoints:
                await self.pause_lease.resume([endpoint])

    async def _serves(self, endpoint: Endpoint, version: PolicyVersion, models: list[str]) -> bool:
        if self.states.held_paused(endpoint):
            return False
        if version.kind == "lora" and version.served_model not in models:
            return False
        return weights_match(await read_label(engine_of(endpoint)), version.weights_label)

    async def _restore(self, endpoint: Endpoint, version: PolicyVersion) -> None:
        """Bring a replica to `version`: its full weights first where they differ, then its adapter."""
        try:
            async with self._lock:  # never alongside an update: one of the two would undo the other
                if version is self.current and not self.paused and endpoint in self.client.endpoints:
                    await self.updater.bring_to(endpoint, version)
                    self.states.serve(endpoint, version.label)
                    log.info("replica %s brought back to version %s", endpoint.url, version.label)
        except WeightUpdateError as exc:
            self.states.exclude(endpoint, f"could not be brought to version {version.label}: {exc.detail}")
        finally:
            self.states.restore_ended(endpoint)  # out of routing, unless it was brought there

    # -- membership ----------------------------------------------------------------------------

    async def join(self, endpoint: Endpoint, models: list[str], timeout_s: float) -> bool:
        """A new replica: out of routing until it is checked to serve the current version, and
        brought there (an adapter loaded, full weights reloaded) if it does not. False, and not
        added, when an update or a restore still holds the replica list after `timeout_s`."""
        try:
            async with asyncio.timeout(max(0.0, timeout_s)):
                # Left paused (by a service that could not resume it, as at start): resumed before routed.
                paused = await is_paused(engine_of(endpoint))
                await self._lock.acquire()  # a cancelled acquire leaves the lock free (asyncio.Lock)
        except TimeoutError:
            return False
        try:
            self.states.join(endpoint, f"joining: routed once it serves version {self.current.label}")
            if paused:
                self.states.hold_paused(endpoint, "found paused when it joined: resumed before it is routed")
        finally:
            self._lock.release()
        await self.reconcile(endpoint, models)
        return True

    async def leave(self, endpoint: Endpoint) -> None:
        """Forget a drained replica (its turns are over), between updates."""
        async with self._lock:
            if endpoint not in self.client.endpoints:  # a second removal waited for the lock too
                return
            self.states.forget(endpoint)

    # -- reading -----------------------------------------------------------------------------

    def state(self) -> PolicyState:
        return PolicyState(
            version=self.current.label,
            kind=self.current.kind,
            updates=self.current.step,
            paused=self.paused,
            pause_expires_in=self.pause_lease.expires_in,
            served_model=self.current.served_model,
            replicas=[self.states.report(e) for e in self.client.endpoints],
            recent_updates=list(self.book.history),
        )

    def _spawn(self, coro) -> None:
        if self._closing:
            coro.close()
            return
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
