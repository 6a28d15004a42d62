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
    from .policy import PolicyManager
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
        self.envs = envs  # the service's own: envs added or removed at runtime are probed from then on
        self.versions = versions
        self.routes = routes
        self.interval_s = interval_s
        self._env_state: dict[str, dict[str, Any]] = {url: {"ok": True} for url in envs}
        self._model_state: dict[tuple[str, str], dict[str, Any]] = {
            (role, endpoint.url): {"ok": True} for role, route in routes for endpoint in route.client.endpoints
        }
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._probe_forever())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def all_ok(self) -> bool:
        return all(s["ok"] for s in self._env_state.values()) and all(s["ok"] for s in self._model_state.values())

    def env_state(self, url: str) -> dict[str, Any]:
        return dict(self._env_state.get(url, {"ok": False, "error": "unknown env"}))

    def watch_env(self, url: str) -> None:
        self._env_state[url] = {"ok": True}  # it answered ready just now; the next probe tells more

    def forget_env(self, url: str) -> None:
        self._env_state.pop(url, None)

    def watch_model(self, role: str, url: str) -> None:
        self._model_state[(role, url)] = {"ok": True}  # it listed the model just now

    def forget_model(self, role: str, url: str) -> None:
        self._model_state.pop((role, url), None)

    def model_state(self, role: str, url: str) -> dict[str, Any]:
        return dict(self._model_state.get((role, url), {"ok": False, "error": "unknown model server"}))

    async def probe(self) -> None:
        """Ask every backend now, concurrently."""
        probes = [self._probe_env(e) for e in list(self.envs.values())]
        probes += [
            self._probe_model(role, route, endpoint)
            for role, route in self.routes
            for endpoint in route.client.endpoints
        ]
        await asyncio.gather(*probes)

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
