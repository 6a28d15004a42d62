"""Backend health, probed in the background so that GET /health costs nothing.

Every `interval_s` each env's /health and each model server's /v1/models are asked, all at once,
each bounded by a timeout; the last answer is kept. /health reads the cache: a trainer polling it
never makes the service call every backend in sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..policy.manager import PolicyManager
    from .targets import EnvHandle, ModelRoute

_PROBE_TIMEOUT_S = 3.0


class BackendMonitor:
    def __init__(
        self,
        envs: Mapping[str, EnvHandle],
        routes: list[tuple[str, ModelRoute]],
        versions: PolicyManager | None = None,
        interval_s: float = 2.0,
    ) -> None:
        # Both the registries' own, read at each probe: backends added or removed at runtime are
        # probed from then on, and forgotten when gone; one not probed yet is taken as it answered
        # when it joined (ready, or listing the model).
        self.envs = envs
        self.routes = routes
        self.versions = versions
        self.interval_s = interval_s
        self._env_state: dict[str, dict[str, Any]] = {}
        self._model_state: dict[tuple[str, str], dict[str, Any]] = {}
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._probe_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def all_ok(self) -> bool:
        """Every backend present now answered its last probe."""
        models = [(role, endpoint.url) for role, route in self.routes for endpoint in route.client.endpoints]
        return all(self.env_state(url)["ok"] for url in self.envs) and all(
            self.model_state(role, url)["ok"] for role, url in models
        )

    def env_state(self, url: str) -> dict[str, Any]:
        return dict(self._env_state.get(url, {"ok": True}))

    def model_state(self, role: str, url: str) -> dict[str, Any]:
        return dict(self._model_state.get((role, url), {"ok": True}))

    async def probe(self) -> None:
        """Ask every backend now, concurrently."""
        probes = [self._probe_env(e) for e in list(self.envs.values())]
        probes += [
            self._probe_model(role, route, endpoint)
            for role, route in self.routes
            for endpoint in route.client.endpoints
        ]
        await asyncio.gather(*probes)
        # Forget the backends removed meanwhile (their answers could not be read for a new one at the URL).
        for url in set(self._env_state) - set(self.envs):
            del self._env_state[url]
        current = {(role, endpoint.url) for role, route in self.routes for endpoint in route.client.endpoints}
        for key in set(self._model_state) - current:
            del self._model_state[key]

    async def _probe_forever(self) -> None:
        while True:
            await self.probe()
            await asyncio.sleep(self.interval_s)

    async def _probe_env(self, env: EnvHandle) -> None:
        state: dict[str, Any] = {"checked_at": round(time.time(), 3)}
        try:
            health = await asyncio.wait_for(env.client.health(), _PROBE_TIMEOUT_S)
            extra = health.model_extra or {}
            leased = extra.get("leased")  # an env's extra, not the contract's: kept only as a count
            if not isinstance(leased, int) or isinstance(leased, bool):
                leased = None
            state.update(ok=health.status == "ready", status=health.status, leased=leased)
            if health.status != "ready":
                state["error"] = f"status {health.status!r}"
        except Exception as exc:  # any failure to answer is "not ok", with its words
            state.update(ok=False, error=(str(exc) or type(exc).__name__)[:300])
        if env.url in self.envs:  # not removed while it was asked
            self._env_state[env.url] = state
            env.slots.down = not state["ok"]  # the scheduler prefers envs that answer

    async def _probe_model(self, role: str, route: ModelRoute, endpoint: Any) -> None:
        state: dict[str, Any] = {"checked_at": round(time.time(), 3)}
        try:
            models = await asyncio.wait_for(route.client.list_models(endpoint), _PROBE_TIMEOUT_S)
            if endpoint not in route.client.endpoints:
                return  # removed while it was asked
            state["ok"] = route.request_model in models
            if state["ok"]:
                # Back (a restarted replica): routing ranks it with the others again.
                endpoint.failures = 0
                if role == "policy" and self.versions is not None:
                    await self.versions.reconcile(endpoint, models)  # and on the current version
            if not state["ok"]:
                state["error"] = f"serves {models}, not {route.request_model}"
        except Exception as exc:  # any failure to answer is "not ok", with its words
            state.update(ok=False, error=f"unreachable: {type(exc).__name__}: {exc}"[:300])
            if role == "policy" and self.versions is not None:
                self.versions.replica_unreachable(endpoint, "unreachable at a probe")
        if endpoint in route.client.endpoints:  # not removed while it was asked
            self._model_state[(role, endpoint.url)] = state
