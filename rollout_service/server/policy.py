"""The policy the replicas serve, and how a trainer changes it (POST /policy).

A version is a label the trainer gives an update. The service, not the trainer, records which
version generated each turn: a turn takes a lease on the version current when it is sent and
names that version's weights (a LoRA adapter has a name of its own per version, so a turn
already sent finishes on the adapter it named). A full-weight update changes the weights under
the turns in flight (vLLM pauses them and goes on after the reload), so such a turn records
both versions and is marked mixed.

No replica is ever routed while it may serve weights the service does not know it serves: one
that failed to take an update, stopped answering (it may have restarted on the base weights),
or lacks the current adapter is out of routing until the monitor has checked it and, where the
service can, brought it to the current version.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from inference.errors import InferenceError
from inference.replicas import Endpoint, ReplicaPool
from inference.weights import WeightsClient, WeightUpdateError

from ..protocol import PolicyState, PolicyUpdate, PolicyUpdateResult, ReplicaState, ReplicaUpdate
from .errors import BackendFailed, Conflict, Invalid, NotFound, StartupError, TooBusy
from .metrics import Metrics

log = logging.getLogger("rollout_service.policy")

VersionKind = Literal["base", "lora", "weights", "pushed"]
_DEFAULT_WEIGHTS = (None, "default")  # what /weight_info says of weights nobody has relabelled
# The label a replica carries while it reloads: one that still says so afterwards failed half-way
# (vLLM reloads in place, so its weights are gone) and must not serve until it is reloaded.
RELOADING = "reloading:"


@dataclass(frozen=True)
class PolicyVersion:
    label: str
    step: int  # successful updates before it: staleness is a difference of steps
    kind: VersionKind
    served_model: str  # the model name a turn is sent with
    path: str | None = None  # where its adapter or weights were loaded from (to restore a replica)
    weights: PolicyVersion | None = None  # under an adapter: the full-weight version beneath it

    @property
    def weights_label(self) -> str | None:
        """What /weight_info says on a replica that serves this version (None: the base checkpoint)."""
        under = self.weights if self.kind == "lora" else self
        return None if under is None or under.kind == "base" else under.label


@dataclass(frozen=True)
class TurnLease:
    version: PolicyVersion
    weights_epoch: int


class PolicyManager:
    """The current version, the replicas' state, and the updates (one at a time)."""

    def __init__(
        self,
        client: ReplicaPool,
        base_model: str,
        weights: WeightsClient,
        metrics: Metrics,
        checkpoint_root: str | None = None,
    ) -> None:
        self.client = client
        self.checkpoint_root = checkpoint_root
        self.base_model = base_model
        self.weights = weights
        self.metrics = metrics
        self.current = PolicyVersion("base", 0, "base", base_model)
        self._steps: dict[str, int] = {"base": 0}
        self.weights_epoch = 0  # bumped by every update that changes the base weights
        self.serving: dict[str, str | None] = {e.url: "base" for e in client.endpoints}
        self.paused = False  # held by the trainer (POST /policy/pause) until its POST /policy or the lease ends
        self.paused_since: float | None = None
        self._pause_deadline = 0.0  # monotonic: when the trainer's pause lease runs out
        self._lease: asyncio.Task | None = None
        self._paused_urls: list[str] = []  # the replicas that pause holds
        self._resume_failed: set[str] = set()  # paused by this service and still paused
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._lock = asyncio.Lock()
        self._in_flight: Counter[str] = Counter()  # served model name -> turns in flight on it
        # Evaluation on a pinned version: groups pinned to each served model (an adapter stays loaded while
        # pinned), the versions that can be named, and adapters already unloaded (no longer servable).
        self._pins: Counter[str] = Counter()
        self._known: dict[str, PolicyVersion] = {"base": self.current}
        self._unloaded: set[str] = set()
        self.max_loras = 4  # vLLM's --max-loras on the replicas (the service's --max-loras)
        self._restoring: set[str] = set()
        self._tasks: set[asyncio.Task] = set()
        self._closing = False
        self.history: deque[PolicyUpdateResult] = deque(maxlen=20)
        client.on_failure = self._on_failure

    # -- start -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Name the version the replicas serve now: the label a full-weight update left on them
        (`/weight_info`), else 'base'. Replicas that disagree cannot be one policy."""
        labels: dict[str, str | None] = {}
        for endpoint in self.client.endpoints:
            try:
                labels[endpoint.url] = await self.weights.version(endpoint.url)
            except WeightUpdateError:
                labels[endpoint.url] = None  # not in dev mode: nobody can have relabelled its weights
        for endpoint in self.client.endpoints:
            if await self._is_paused(endpoint.url):  # an earlier service stopped while holding it
                log.warning("policy replica %s was left paused: resuming it", endpoint.url)
                await self._resume([endpoint.url])
        broken = [url for url, label in labels.items() if label and label.startswith(RELOADING)]
        if broken:
            raise StartupError(f"policy replicas {broken} were left half-way through a reload: restart them")
        found = {label for label in labels.values() if label not in _DEFAULT_WEIGHTS}
        if len(found) > 1 or (found and any(label in _DEFAULT_WEIGHTS for label in labels.values())):
            raise StartupError(
                f"the policy replicas serve different weights ({labels}, from /weight_info): restart them "
                "on one checkpoint"
            )
        if found:
            label = found.pop()
            assert label is not None
            self.current = PolicyVersion(label, 0, "weights", self.base_model)
            self._steps = {label: 0}
            self._known = {label: self.current}
            self.serving = dict.fromkeys(self.serving, label)

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
                await self._resume(self._paused_urls)
        finally:
            self._lock.release()

    def begin_close(self) -> None:
        """Shutting down: no restore starts from now on (for a replica that joins or is probed), and the
        pause's lease ends with the service (close resumes what it holds)."""
        self._closing = True
        if self._lease is not None:
            self._lease.cancel()

    # -- turns -------------------------------------------------------------------------------

    async def lease(self, pin: str | None = None) -> TurnLease:
        """The version a turn about to be sent is generated with (the pinned one, for a group that
        names one); waits while the trainer holds the replicas paused (the turn would otherwise start
        on weights that are being replaced)."""
        while not self._unpaused.is_set():
            await self._unpaused.wait()
        version = self.servable(pin) if pin is not None else self.current
        lease = TurnLease(version, self.weights_epoch)
        self._in_flight[lease.version.served_model] += 1
        return lease

    def release(self, lease: TurnLease) -> str | None:
        """The turn is done. Returns the version it ended on when the weights changed under it."""
        name = lease.version.served_model
        self._in_flight[name] -= 1
        if self._in_flight[name] <= 0:
            del self._in_flight[name]
            if self._unused_adapter(lease.version):
                self._spawn(self._unload(name))
        if lease.weights_epoch != self.weights_epoch:
            return self.current.label
        return None

    def _unused_adapter(self, version: PolicyVersion) -> bool:
        """An adapter no turn in flight, no pin and not the current version uses: it may be unloaded."""
        name = version.served_model
        return (
            version.kind == "lora"
            and name != self.current.served_model
            and name not in self._in_flight
            and name not in self._pins
        )

    # -- evaluation on a pinned version --------------------------------------------------------

    def servable(self, label: str) -> PolicyVersion:
        """The version `label` names, if the replicas can still serve it; else NotFound or Conflict saying why.
        Full weights (base, a reload, a push) are servable while they are the replicas' weights; an
        adapter, while it is loaded over the weights it was trained on."""
        version = self._known.get(label)
        if version is None:
            raise NotFound(
                "unknown_version",
                f"no policy version {label!r} was served here (GET /policy names the current one)",
            )
        if version is self.current:
            return version
        if version.weights_label != self.current.weights_label:
            raise Conflict(
                "version_not_served",
                f"version {label!r} cannot be served: the replicas' full weights were replaced since "
                f"(they serve {self.current.weights_label or 'the base checkpoint'} now); a pin holds a LoRA "
                "version, or full weights still served",
            )
        if version.kind == "lora" and version.served_model in self._unloaded:
            raise Conflict(
                "version_not_served",
                f"version {label!r} cannot be served: its adapter was unloaded once nothing used it; pin a "
                "version while it is current (or while a group pinned to it runs) to keep it loaded",
            )
        return version

    def pin(self, label: str) -> PolicyVersion:
        """Hold `label`'s adapter loaded for a group pinned to it, until unpin()."""
        version = self.check_pin(label)
        self._pins[version.served_model] += 1
        return version

    def check_pin(self, label: str) -> PolicyVersion:
        """The version a group may pin, or a refusal: not servable, or one adapter past --max-loras (TooBusy)."""
        version = self.servable(label)
        name = version.served_model
        if version.kind == "lora" and name not in self._pins and name != self.current.served_model:
            kept = {n for n in self._pins if n != self.base_model}
            if self.current.kind == "lora":
                kept.add(self.current.served_model)
            if len(kept) + 1 > self.max_loras:
                raise TooBusy(
                    "too_many_pins",
                    f"pinning version {label!r} would keep {len(kept) + 1} adapters loaded (the current one and "
                    f"those pinned), over --max-loras={self.max_loras}: wait for pinned groups to finish",
                    headers={"Retry-After": "5"},
                )
        return version

    def unpin(self, version: PolicyVersion) -> None:
        name = version.served_model
        self._pins[name] -= 1
        if self._pins[name] <= 0:
            del self._pins[name]
            if self._unused_adapter(version):
                self._spawn(self._unload(name))

    def behind(self, label: str) -> int:
        """How many updates `label` is behind the current version."""
        return self.current.step - self._steps.get(label, 0)

    # -- updates -----------------------------------------------------------------------------

    async def pause(self, timeout_s: float) -> PolicyState:
        """Hold every replica paused for a weight transfer the trainer does itself, for `timeout_s`
        at most (a lease: asking again while paused renews it; see `_pause_ran_out`)."""
        async with self._lock:
            if self.paused:
                self._pause_deadline = time.monotonic() + timeout_s
                return self.state()
            # A replica out of routing serves no turn; it is checked before it is routed again.
            endpoints = self.client.routable() or self.client.endpoints
            outcomes = await asyncio.gather(*(self._timed(e.url, self.weights.pause(e.url)) for e in endpoints))
            failed = [o for o in outcomes if not o.ok]
            if failed:
                await self._resume([o.url for o in outcomes if o.ok])
                kind = Conflict if all(o.refused for o in failed) else BackendFailed
                raise kind("pause_failed", _describe(failed, "could not pause"))
            self.paused, self.paused_since = True, time.time()
            self._paused_urls = [e.url for e in endpoints]
            self._unpaused.clear()
            self._pause_deadline = time.monotonic() + timeout_s
            self._lease = asyncio.create_task(self._hold_lease(), name="pause-lease")
            return self.state()

    async def _hold_lease(self) -> None:
        """Wait out the pause's lease (renewals move its end), then end the pause if nothing else has:
        a trainer that died mid-push must not hold every replica, and with them every group, forever."""
        while True:
            await asyncio.sleep(max(0.0, self._pause_deadline - time.monotonic()))
            async with self._lock:
                if self._lease is not asyncio.current_task():
                    return  # the pause ended meanwhile (POST /policy, shutdown)
                if self._pause_deadline <= time.monotonic():
                    await self._pause_ran_out()
                    return

    async def _pause_ran_out(self) -> None:
        """Resume the replicas whose /weight_info still shows the weights from before the pause. Any
        other has had weights pushed that no POST /policy named: turns must not be sent there, so it
        stays paused and out of routing, the reason in /health/detail, until it is brought back to the
        current version (the monitor tries: a checkpoint the service knows is reloaded) or removed."""
        wanted = self.current.weights_label
        urls = list(dict.fromkeys(self._paused_urls))

        async def label(url: str) -> str | None | WeightUpdateError:
            try:
                return await self._label(url)
            except WeightUpdateError as exc:
                return exc

        labels = await asyncio.gather(*(label(url) for url in urls))
        resume = []
        for url, found in zip(urls, labels, strict=True):
            if not isinstance(found, WeightUpdateError) and _weights_match(found, wanted):
                resume.append(url)
                continue
            shown = f"could not be read ({found.detail})" if isinstance(found, WeightUpdateError) else repr(found)
            reason = (
                f"the pause lease ran out with /weight_info {shown}, not {wanted or 'the base checkpoint'!r} "
                f"as before the pause (weights pushed without a POST /policy): kept paused and out of routing "
                f"until it serves {self.current.label}"
            )
            log.warning("policy replica %s: %s", url, reason)
            self._resume_failed.add(url)  # still paused by this service: resumed before any restore
            self.serving[url] = None
            self.client.exclude(self._endpoint(url), reason)
        log.warning("the trainer's pause lease ran out without a POST /policy: resuming %d replica(s)", len(resume))
        await self._resume(resume)

    async def update(self, update: PolicyUpdate) -> PolicyUpdateResult:
        async with self._lock:
            if update.lora is None and update.weights is None and not self.paused:
                raise Conflict(
                    "not_paused",
                    "a version with neither lora nor weights finishes a weight transfer the trainer pushed "
                    "itself: POST /policy/pause first, push the weights, then POST /policy {version}",
                )
            if update.version in self._steps:
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
                outcomes = await self._load_adapter_everywhere(version)
                if self.paused and any(o.ok for o in outcomes):
                    await self._resume(self._paused_urls)  # the trainer's pause ends with its update
            elif update.weights is not None:
                path = await asyncio.to_thread(check_checkpoint, update.weights.path, "weights", self.checkpoint_root)
                version = PolicyVersion(update.version, step, "weights", self.base_model, path)
                outcomes = await self._reload_everywhere(version)
            else:
                version = PolicyVersion(update.version, step, "pushed", self.base_model)
                outcomes = await self._finish_push(version)
            took = [o for o in outcomes if o.ok and o.url not in self._resume_failed]
            if version.kind == "weights":
                # A failed reload may have left a replica without weights: out of routing until the
                # monitor has read its label (see RELOADING) and, if need be, reloaded it.
                for outcome in outcomes:
                    if not outcome.ok and not outcome.unchanged:
                        self.client.exclude(self._endpoint(outcome.url), f"reload failed: {outcome.error}")
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
                    f"{previous.label!r}. " + _describe(outcomes, "failed"),
                )
            self.current = version
            self._steps[version.label] = step
            self._known[version.label] = version
            for outcome in outcomes:
                endpoint = self._endpoint(outcome.url)
                if outcome.url in self._resume_failed:
                    continue  # still paused: the monitor resumes it before it is routed
                if outcome.ok:
                    self.serving[outcome.url] = version.label
                    self.client.exclude(endpoint, None)
                else:
                    self.client.exclude(endpoint, f"did not take version {version.label}: {outcome.error}")
            if self._unused_adapter(previous):
                self._spawn(self._unload(previous.served_model))
            result = PolicyUpdateResult(
                version=version.label,
                previous=previous.label,
                kind=version.kind,
                replicas=[ReplicaUpdate(url=o.url, ok=o.ok, seconds=o.seconds, error=o.error) for o in outcomes],
                seconds=round(time.monotonic() - started, 3),
                finished_at=round(time.time(), 3),
            )
            self.history.append(result)
            self.metrics.policy_update(result.kind, result.seconds)
            log.warning(
                "policy version %s (%s) served by %d of %d replicas",
                version.label,
                version.kind,
                len(took),
                len(outcomes),
            )
            return result

    async def _load_adapter_everywhere(self, version: PolicyVersion) -> list[_Outcome]:
        """The adapter on every replica, over the full weights it stands on. A replica out of routing or
        not yet checked (it joined or restarted, or a reload failed there) is brought there as a restore
        would, weights first. One in routing is checked: on other weights (it restarted, and nobody has
        noticed yet) it does not take the version, and the monitor restores it, rather than having its
        weights reloaded under the turns it runs."""
        assert version.path is not None
        return list(
            await asyncio.gather(
                *(
                    self._timed(e.url, self._bring_to(e.url, version))
                    if self.serving.get(e.url) is None or e.excluded is not None
                    else self._timed(e.url, self._load_over_checked_weights(e.url, version))
                    for e in self.client.endpoints
                )
            )
        )

    async def _load_over_checked_weights(self, url: str, version: PolicyVersion) -> None:
        label = await self._label(url)
        if not _weights_match(label, version.weights_label):
            raise WeightUpdateError(
                url,
                "load adapter",
                f"it serves weights labelled {label!r}, not {version.weights_label or 'the base checkpoint'} "
                "beneath the adapter (restarted?): out of routing until it is brought there",
            )
        await self._load_and_check(url, version)

    async def _load_and_check(self, url: str, version: PolicyVersion) -> None:
        assert version.path is not None
        await self.weights.load_adapter(url, version.served_model, version.path)
        models = await self.weights.models(url)
        if version.served_model not in models:
            raise WeightUpdateError(url, "load adapter", f"loaded, but /v1/models lists {models}")

    async def _reload_everywhere(self, version: PolicyVersion) -> list[_Outcome]:
        """Pause every replica, reload, check that the weights changed, label them, resume."""
        endpoints = self.client.endpoints
        before = await asyncio.gather(*(self._checksums(e.url) for e in endpoints))
        paused = await asyncio.gather(*(self._timed(e.url, self.weights.pause(e.url)) for e in endpoints))
        self._unpaused.clear()
        outcomes: list[_Outcome] = []
        try:
            jobs = []
            for endpoint, pause, sums in zip(endpoints, paused, before, strict=True):
                if pause.ok:
                    jobs.append(self._timed(endpoint.url, self._reload_one(endpoint.url, version, sums)))
                else:
                    jobs.append(_failed_outcome(pause))
            outcomes = list(await asyncio.gather(*jobs))
            if any(p.ok for p in paused):
                # Before resuming: the turns the pause froze end on other weights (or, after a
                # failed reload, perhaps on none), and say so.
                self.weights_epoch += 1
        finally:
            await self._resume([o.url for o in paused if o.ok] + (self._paused_urls if self.paused else []))
        return outcomes

    async def _reload_one(self, url: str, version: PolicyVersion, before: dict[str, str] | None) -> None:
        label_before = await self._label(url)
        await self._reload_labelled(url, version)
        if before is not None and await self._checksums(url) == before:
            await self.weights.set_version(url, label_before or "default")  # nothing changed: nor does its label
            raise _Unchanged(url, "reload weights", f"the weights at {version.path} are the ones already served")

    async def _reload_labelled(self, url: str, version: PolicyVersion) -> None:
        """Reload `version`'s checkpoint, labelled RELOADING until it is done: a reload that fails
        half-way leaves the replica saying so, and the monitor keeps it out of routing."""
        assert version.path is not None
        await self.weights.set_version(url, f"{RELOADING}{version.label}")
        await self.weights.reload_weights(url, version.path)
        await self.weights.reset_prefix_cache(url)
        await self.weights.set_version(url, version.label)

    async def _finish_push(self, version: PolicyVersion) -> list[_Outcome]:
        """The trainer pushed weights into the paused replicas: label them, then resume. A replica
        the pause did not hold (out of routing then) got nothing it can be trusted with."""
        held = set(self._paused_urls)
        outcomes = list(
            await asyncio.gather(
                *(
                    self._timed(e.url, self._label_pushed(e.url, version.label))
                    if e.url in held
                    else _failed_outcome(_Outcome(e.url, False, 0.0, "not paused with the others during the push"))
                    for e in self.client.endpoints
                )
            )
        )
        if any(o.ok for o in outcomes):
            self.weights_epoch += 1
        await self._resume(list(held))
        return outcomes

    async def _label_pushed(self, url: str, label: str) -> None:
        await self.weights.reset_prefix_cache(url)  # its cached KV came from the weights before the push
        await self.weights.set_version(url, label)

    async def _resume(self, urls: list[str]) -> None:
        """Resume the replicas this service paused, and let turns start again. One that does not
        resume stays out of routing (a turn sent there would hang) until the monitor resumes it."""
        results = await asyncio.gather(*(self._timed(url, self.weights.resume(url)) for url in dict.fromkeys(urls)))
        for outcome in results:
            if outcome.ok:
                self._resume_failed.discard(outcome.url)
            else:
                self._resume_failed.add(outcome.url)
                self.client.exclude(self._endpoint(outcome.url), f"could not be resumed: {outcome.error}")
        self.paused, self.paused_since, self._paused_urls = False, None, []
        if self._lease is not None and self._lease is not asyncio.current_task():
            self._lease.cancel()
        self._lease = None
        self._unpaused.set()

    async def _is_paused(self, url: str) -> bool:
        try:
            return await self.weights.is_paused(url)
        except WeightUpdateError:
            return False  # no dev mode: nothing can have paused it

    async def _checksums(self, url: str) -> dict[str, str] | None:
        """vLLM's weight checksums, or None where they cannot tell whether the weights changed: not
        served, or some of zero bytes. vLLM's CPU build repacks the linear layers into its kernels' own
        format on CPUs that have those kernels (seen on an AMD EPYC with AVX-512 BF16: 120 of 182
        tensors), leaving empty `weight` tensors behind, so a checkpoint that differs only there would
        look unchanged."""
        try:
            sums = await self.weights.checksums(url)
        except WeightUpdateError:
            return None
        return None if _EMPTY_DIGEST in sums.values() else sums

    async def _unload(self, name: str) -> None:
        self._unloaded.add(name)
        for endpoint in self.client.endpoints:
            try:
                await self.weights.unload_adapter(endpoint.url, name)
            except WeightUpdateError as exc:
                log.info("could not unload adapter %s: %s", name, exc)

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
        self.serving[endpoint.url] = None
        self.client.exclude(endpoint, f"{why}: routed again once it is checked to serve {self.current.label}")

    async def reconcile(self, endpoint: Endpoint, models: list[str]) -> None:
        """Called by the monitor for a replica that answered: is it on the current version? If not,
        take it out of routing and bring it there (in the background)."""
        if self._closing:
            return
        if self._lock.locked() or self.paused or endpoint.url in self._restoring:
            return  # an update, the trainer's pause or a restore is deciding for it
        if endpoint not in self.client.endpoints:
            return  # removed while it was probed
        current = self.current
        try:
            ok = await self._serves(endpoint.url, current, models)
            if not ok and current.kind == "lora":
                # The list may predate a restore that has just finished: ask again before acting.
                ok = await self._serves(endpoint.url, current, await self.weights.models(endpoint.url))
        except WeightUpdateError as exc:
            self.client.exclude(endpoint, f"cannot tell which weights it serves: {exc.detail}")
            return
        if (
            current is not self.current
            or self._lock.locked()
            or endpoint.url in self._restoring
            or endpoint not in self.client.endpoints
        ):
            return  # an update started or landed, or a restore began, meanwhile: the next probe looks again
        if ok:
            self.serving[endpoint.url] = current.label
            if endpoint.excluded is not None:
                self.client.exclude(endpoint, None)
            return
        self.serving[endpoint.url] = None
        self.client.exclude(endpoint, f"does not serve {current.label} (restarted?); bringing it there")
        self._restoring.add(endpoint.url)
        self._spawn(self._restore(endpoint, current))

    async def _label(self, url: str) -> str | None:
        """The replica's /weight_info label; None where the route is not served (no dev mode: then
        nobody can have reloaded or relabelled it)."""
        try:
            return await self.weights.version(url)
        except WeightUpdateError as exc:
            if exc.status == 404:
                return None
            raise

    async def _serves(self, url: str, version: PolicyVersion, models: list[str]) -> bool:
        if url in self._resume_failed:
            return False
        if version.kind == "lora" and version.served_model not in models:
            return False
        return _weights_match(await self._label(url), version.weights_label)

    async def _restore(self, endpoint: Endpoint, version: PolicyVersion) -> None:
        """Bring a replica to `version`: its full weights first where they differ, then its adapter."""
        url = endpoint.url
        try:
            async with self._lock:  # never alongside an update: one of the two would undo the other
                if version is self.current and not self.paused:
                    await self._bring_to(url, version)
                    self.serving[url] = version.label
                    self.client.exclude(endpoint, None)
                    log.info("replica %s brought back to version %s", url, version.label)
        except WeightUpdateError as exc:
            self.client.exclude(endpoint, f"could not be brought to version {version.label}: {exc.detail}")
        finally:
            self._restoring.discard(url)

    async def _bring_to(self, url: str, version: PolicyVersion) -> None:
        """Full weights first where they differ from those `version` stands on, then its adapter."""
        if url in self._resume_failed:
            await self.weights.resume(url)
            self._resume_failed.discard(url)
        beneath = version.weights if version.kind == "lora" else version
        label = await self._label(url)
        wanted = version.weights_label
        if not _weights_match(label, wanted):
            if beneath is None or beneath.kind == "base" or beneath.path is None:
                raise WeightUpdateError(
                    url,
                    "restore",
                    f"it serves weights labelled {label!r}, and the service cannot restore "
                    f"{wanted or 'the base checkpoint'} (weights the trainer pushed, or those it started "
                    "with): restart it on them, or update the policy",
                )
            await self._reload_labelled(url, beneath)
        if version.kind == "lora":
            await self._load_and_check(url, version)

    # -- membership ----------------------------------------------------------------------------

    async def join(self, endpoint: Endpoint, models: list[str], timeout_s: float) -> bool:
        """A new replica: out of routing until it is checked to serve the current version, and
        brought there (an adapter loaded, full weights reloaded) if it does not. False, and not
        added, when an update or a restore still holds the replica list after `timeout_s`."""
        try:
            async with asyncio.timeout(max(0.0, timeout_s)):
                await self._lock.acquire()  # a cancelled acquire leaves the lock free (asyncio.Lock)
        except TimeoutError:
            return False
        try:
            self.serving[endpoint.url] = None
            self.client.add(endpoint, f"joining: routed once it serves version {self.current.label}")
        finally:
            self._lock.release()
        await self.reconcile(endpoint, models)
        return True

    async def leave(self, endpoint: Endpoint) -> None:
        """Forget a drained replica (its turns are over), between updates."""
        async with self._lock:
            if endpoint not in self.client.endpoints:  # a second removal waited for the lock too
                return
            self.client.remove(endpoint)
            self.serving.pop(endpoint.url, None)
            self._resume_failed.discard(endpoint.url)

    # -- reading -----------------------------------------------------------------------------

    def state(self) -> PolicyState:
        return PolicyState(
            version=self.current.label,
            kind=self.current.kind,
            updates=self.current.step,
            paused=self.paused,
            pause_expires_in=round(max(0.0, self._pause_deadline - time.monotonic()), 1) if self.paused else None,
            served_model=self.current.served_model,
            replicas=[replica_state(e, self.serving.get(e.url)) for e in self.client.endpoints],
            recent_updates=list(self.history),
        )

    def _endpoint(self, url: str) -> Endpoint:
        return next(e for e in self.client.endpoints if e.url == url)

    def _spawn(self, coro) -> None:
        if self._closing:
            coro.close()
            return
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _timed(self, url: str, call) -> _Outcome:
        started = time.monotonic()
        try:
            await call
            return _Outcome(url, True, round(time.monotonic() - started, 3))
        except WeightUpdateError as exc:
            outcome = _Outcome(url, False, round(time.monotonic() - started, 3), exc.detail, exc.refused)
            outcome.unchanged = isinstance(exc, _Unchanged)
            return outcome
        except Exception as exc:  # a closed client, an answer that is not JSON: this replica's failure
            return _Outcome(url, False, round(time.monotonic() - started, 3), f"{type(exc).__name__}: {exc}"[:500])


def _weights_match(label: str | None, wanted: str | None) -> bool:
    """A replica labelled `label` serves the full weights labelled `wanted` (None: the base checkpoint,
    which a restarted replica serves too)."""
    return label == wanted or (wanted is None and label in _DEFAULT_WEIGHTS)


@dataclass
class _Outcome:
    url: str
    ok: bool
    seconds: float
    error: str | None = None
    refused: bool = False
    unchanged: bool = False  # it failed, but is known to serve what it served before


_EMPTY_DIGEST = hashlib.sha256(b"").hexdigest()


class _Unchanged(WeightUpdateError):
    """The reload worked, and the weights are the ones already served."""


def replica_state(endpoint: Endpoint, version: str | None) -> ReplicaState:
    return ReplicaState(
        url=endpoint.url,
        version=version,
        routed=endpoint.excluded is None,
        reason=endpoint.excluded,
        draining=endpoint.draining,
    )


async def _failed_outcome(outcome: _Outcome) -> _Outcome:
    return outcome


# What a folder must hold to be loaded: vLLM's full checkpoint, or a PEFT adapter.
CHECKPOINT_CONFIG = {"weights": "config.json", "lora": "adapter_config.json"}


def check_checkpoint(path: str, kind: Literal["weights", "lora"], root: str | None = None) -> str:
    """The folder, its links resolved (what the replicas are told to load), or Invalid for a folder
    vLLM could not load, before any replica is paused. vLLM 0.32 reloads in place, and a reload that
    fails (a missing folder, no weights in it) leaves the replica broken until it restarts; so the
    folder must be visible to the service too (the same machine or shared storage) and hold its
    config and safetensors weights. With `root` (--checkpoint-root), the folder and every entry in it,
    at any depth (whatever the engine reads: weights in any format, configs, tokenizer files), must be
    under it once symlinks are resolved.

    One answer for every refusal: which folders exist on this host is none of the caller's business."""
    real = _readable_checkpoint(path, CHECKPOINT_CONFIG[kind], root)
    if real is None:
        under = " under the checkpoint root" if root else ""
        raise Invalid(
            "checkpoint_refused",
            f"{path[:200]!r} is not a readable checkpoint{under}: give the absolute path of a folder the service "
            f"and the model servers both read, holding {CHECKPOINT_CONFIG[kind]} and *.safetensors weights",
        )
    return str(real)


# A checkpoint folder holds a config, weights (sharded: a few hundred files) and tokenizer files; a
# folder with more entries than this is not walked (the check runs on every update) but refused.
_MAX_CHECKPOINT_ENTRIES = 10_000


def _readable_checkpoint(path: str, config_name: str, root: str | None) -> Path | None:
    try:
        folder = Path(path)
        if not folder.is_absolute():  # the model servers would resolve it against their own directory
            return None
        real = folder.resolve(strict=True)
        bound = Path(root).resolve(strict=True) if root else None

        def inside(target: Path) -> bool:
            resolved = target.resolve(strict=True)
            return bound is None or resolved == bound or resolved.is_relative_to(bound)

        def readable(target: Path, mode: int) -> bool:
            return inside(target) and os.access(target.resolve(strict=True), mode)

        if not real.is_dir() or not readable(real, os.R_OK | os.X_OK):
            return None
        config = real / config_name
        if not config.is_file() or not readable(config, os.R_OK):
            return None
        weights = [f for f in real.glob("*.safetensors") if f.is_file()]
        if not weights or not all(readable(f, os.R_OK) for f in weights):
            return None
        if bound is not None and not _entries_inside(real, inside):
            return None
        return real
    except (OSError, ValueError, RuntimeError):  # missing, a loop of links, a name the file system refuses
        return None


def _entries_inside(folder: Path, inside: Callable[[Path], bool]) -> bool:
    """Every entry under `folder`, at any depth, resolves inside the root: a link anywhere in it that
    leaves the root (a *.bin, a tokenizer file, a linked sub-folder) refuses the folder. Linked
    folders are checked, not walked into."""
    seen = 0
    for top, folders, files in os.walk(folder, followlinks=False, onerror=_raise):
        for name in (*folders, *files):
            seen += 1
            if seen > _MAX_CHECKPOINT_ENTRIES or not inside(Path(top) / name):
                return False
    return True


def _raise(error: OSError) -> None:
    raise error


def _describe(outcomes: list[_Outcome], verb: str) -> str:
    return "; ".join(f"{o.url} {verb}: {o.error}" for o in outcomes if not o.ok)
