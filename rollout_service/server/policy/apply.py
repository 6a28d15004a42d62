"""Bringing the policy replicas to a version: an adapter loaded over the weights it stands on, a
full-weight checkpoint reloaded (checked to have changed, labelled as it goes), a trainer's own
push labelled, an adapter nothing uses unloaded.

Each `*_everywhere` call answers one outcome per replica and raises nothing a replica did; the
policy manager (manager.py) decides from the outcomes what is served and routed.
"""

from __future__ import annotations

import asyncio
import logging

from ...backends.engine import Engine
from ...backends.errors import WeightUpdateError
from ...backends.replica_pool import Endpoint, ReplicaPool, engine_of
from .pause import PauseLease
from .replica_calls import Outcome, Unchanged, failed, listed_models, read_checksums, read_label, timed
from .replica_states import Phase, ReplicaStates
from .versions import RELOADING, PolicyVersion, VersionBook, weights_match

log = logging.getLogger("rollout_service.policy")


class ReplicaUpdater:
    """Each call asks the replicas' engines (rollout_service/backends/engine.py), never a server's URL."""

    def __init__(self, client: ReplicaPool, book: VersionBook, states: ReplicaStates, pause: PauseLease) -> None:
        self.client = client
        self.book = book
        self.states = states
        self.pause = pause

    async def load_adapter_everywhere(self, version: PolicyVersion) -> list[Outcome]:
        """The adapter on every replica, over the full weights it stands on. A replica out of routing or
        not yet checked (it joined or restarted, or a reload failed there) is brought there as a restore
        would, weights first. One in routing is checked: on other weights (it restarted, and nobody has
        noticed yet) it does not take the version, and the monitor restores it, rather than having its
        weights reloaded under the turns it runs."""
        assert version.path is not None
        return list(
            await asyncio.gather(
                *(
                    timed(e, self.bring_to(e, version))
                    if self.states.phase(e) is not Phase.SERVING
                    else timed(e, self._load_over_checked_weights(engine_of(e), version))
                    for e in self.client.endpoints
                )
            )
        )

    async def reload_everywhere(self, version: PolicyVersion) -> list[Outcome]:
        """Pause every replica, reload, check that the weights changed, label them, resume."""
        endpoints = self.client.endpoints
        before = await asyncio.gather(*(read_checksums(engine_of(e)) for e in endpoints))
        paused = await asyncio.gather(*(timed(e, engine_of(e).pause()) for e in endpoints))
        self.pause.stop_turns()
        outcomes: list[Outcome] = []
        try:
            jobs = []
            for endpoint, pause, sums in zip(endpoints, paused, before, strict=True):
                if pause.ok:
                    jobs.append(timed(endpoint, self._reload_one(engine_of(endpoint), version, sums)))
                else:
                    jobs.append(failed(pause))
            outcomes = list(await asyncio.gather(*jobs))
            if any(p.ok for p in paused):
                # Before resuming: the turns the pause froze end on other weights (or, after a
                # failed reload, perhaps on none), and say so.
                self.book.weights_epoch += 1
        finally:
            await self.pause.resume(
                [o.endpoint for o in paused if o.ok] + (self.pause.held if self.pause.paused else [])
            )
        return outcomes

    async def finish_push(self, version: PolicyVersion) -> list[Outcome]:
        """The trainer pushed weights into the paused replicas: label them, then resume. A replica
        the pause did not hold (out of routing then) got nothing it can be trusted with."""
        held = list(self.pause.held)
        held_urls = {e.url for e in held}
        outcomes = list(
            await asyncio.gather(
                *(
                    timed(e, self._label_pushed(engine_of(e), version.label))
                    if e.url in held_urls
                    else failed(Outcome(e, False, 0.0, "not paused with the others during the push"))
                    for e in self.client.endpoints
                )
            )
        )
        if any(o.ok for o in outcomes):
            self.book.weights_epoch += 1
        await self.pause.resume(held)
        return outcomes

    async def bring_to(self, endpoint: Endpoint, version: PolicyVersion) -> None:
        """Full weights first where they differ from those `version` stands on, then its adapter."""
        engine = engine_of(endpoint)
        if self.states.held_paused(endpoint):
            await engine.resume()
            self.states.resumed(endpoint)
        beneath = version.weights if version.kind == "lora" else version
        label = await read_label(engine)
        wanted = version.weights_label
        if not weights_match(label, wanted):
            if beneath is None or beneath.kind == "base" or beneath.path is None:
                raise WeightUpdateError(
                    endpoint.url,
                    "restore",
                    f"it serves weights labelled {label!r}, and the service cannot restore "
                    f"{wanted or 'the base checkpoint'} (weights the trainer pushed, or those it started "
                    "with): restart it on them, or update the policy",
                )
            await self._reload_labelled(engine, beneath)
        if version.kind == "lora":
            await self._load_and_check(engine, version)

    async def unload(self, name: str) -> None:
        self.book.unloaded.add(name)
        for endpoint in self.client.endpoints:
            try:
                await engine_of(endpoint).unload_adapter(name)
            except WeightUpdateError as exc:
                log.info("could not unload adapter %s: %s", name, exc)

    async def _load_over_checked_weights(self, engine: Engine, version: PolicyVersion) -> None:
        label = await read_label(engine)
        if not weights_match(label, version.weights_label):
            raise WeightUpdateError(
                engine.url,
                "load adapter",
                f"it serves weights labelled {label!r}, not {version.weights_label or 'the base checkpoint'} "
                "beneath the adapter (restarted?): out of routing until it is brought there",
            )
        await self._load_and_check(engine, version)

    async def _load_and_check(self, engine: Engine, version: PolicyVersion) -> None:
        assert version.path is not None
        await engine.load_adapter(version.served_model, version.path)
        models = await listed_models(engine)
        if version.served_model not in models:
            raise WeightUpdateError(engine.url, "load adapter", f"loaded, but /v1/models lists {models}")

    async def _reload_one(self, engine: Engine, version: PolicyVersion, before: dict[str, str] | None) -> None:
        label_before = await read_label(engine)
        await self._reload_labelled(engine, version)
        if before is not None and await read_checksums(engine) == before:
            await engine.set_weight_version(label_before or "default")  # nothing changed: nor does its label
            raise Unchanged(engine.url, "reload weights", f"the weights at {version.path} are the ones already served")

    async def _reload_labelled(self, engine: Engine, version: PolicyVersion) -> None:
        """Reload `version`'s checkpoint, labelled RELOADING until it is done: a reload that fails
        half-way leaves the replica saying so, and the monitor keeps it out of routing."""
        assert version.path is not None
        await engine.set_weight_version(f"{RELOADING}{version.label}")
        await engine.reload_weights(version.path)
        await engine.reset_prefix_cache()
        await engine.set_weight_version(version.label)

    async def _label_pushed(self, engine: Engine, label: str) -> None:
        await engine.reset_prefix_cache()  # its cached KV came from the weights before the push
        await engine.set_weight_version(label)
