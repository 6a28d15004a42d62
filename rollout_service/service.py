"""The service's state: the envs and models found at start, and how a request maps onto them."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx

from inference.client import ChatClient

from .config import ServiceConfig
from .env_client import EnvClient, EnvError, EnvHealth, EnvTask
from .metrics import Metrics
from .runner import EnvHandle, GroupRunner, Route, RunnerConfig, TaskTarget
from .scheduler import EnvSlots, WorldScheduler
from .runlog import RunLog
from .schemas import EnvContract, GroupRequest, GroupResult


class StartupError(Exception):
    """The service cannot start as configured; the message says what to fix."""


class RequestError(Exception):
    """A trainer's request cannot be served as sent: HTTP status, code and what to change."""

    def __init__(self, status: int, error: str, message: str) -> None:
        super().__init__(message)
        self.status, self.error, self.message = status, error, message


@dataclass
class _Discovered:
    url: str
    health: EnvHealth
    tasks: list[EnvTask]


class RolloutService:
    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.run_id = config.run_id or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        self.policy = Route(config.model, ChatClient(
            config.vllm, timeout_s=config.inference_timeout_s,
            max_requests_per_second=config.max_requests_per_second))
        self.support: Route | None = None
        if config.support_model:
            self.support = Route(config.support_model, ChatClient(
                config.support_vllm or config.vllm, timeout_s=config.inference_timeout_s,
                max_requests_per_second=config.max_requests_per_second))
        self.envs: dict[str, EnvHandle] = {}
        self.targets: dict[str, TaskTarget] = {}
        self.by_slug: dict[str, str] = {}
        self.task_info: dict[str, EnvTask] = {}
        self.named: dict[str, Route] = {
            name: Route(name, ChatClient([spec.url], api_key=spec.api_key(), timeout_s=config.inference_timeout_s,
                                         max_requests_per_second=config.max_requests_per_second,
                                         token_ids=spec.token_ids),
                        served_model=spec.model)
            for name, spec in config.model_endpoints.items()}
        self.run_log = RunLog(Path(config.runs_dir), self.run_id) if config.runs_dir else None
        self.scheduler: WorldScheduler | None = None
        self.runner: GroupRunner | None = None
        self.started_at = time.time()

    # -- start and stop ---------------------------------------------------------------------

    async def start(self) -> None:
        """Read every env's /health and /tasks and every model server's /v1/models, or refuse."""
        clients = {url.rstrip("/"): EnvClient(url) for url in self.config.envs}
        if len(clients) != len(self.config.envs):
            raise StartupError("the same --env URL is given twice")
        try:
            discovered = await asyncio.wait_for(
                asyncio.gather(*(self._discover(url, c) for url, c in clients.items())),
                self.config.startup_timeout_s)
        except asyncio.TimeoutError:
            raise StartupError(f"the envs did not answer /health and /tasks within "
                               f"{self.config.startup_timeout_s:g}s") from None
        except StartupError:
            for c in clients.values():
                await c.aclose()
            raise
        slots = []
        for found in discovered:
            contract = EnvContract(urls=[found.url], catalog_hash=found.health.fingerprint,
                                   data_anchor=found.health.dataset.get("data_anchor"),
                                   reward_version=found.health.reward_version,
                                   reward_profile=found.health.reward_profile, side=found.health.side)
            slot = EnvSlots(found.url, found.health.pool)
            slots.append(slot)
            self.envs[found.url] = EnvHandle(found.url, clients[found.url], slot, contract)
        self._index_tasks(discovered)
        await self._check_models()
        if self.run_log is not None:
            self.run_log.start()
        self.scheduler = WorldScheduler(slots)
        self.runner = GroupRunner(self.scheduler, self.policy, self.support, self.metrics,
                                  RunnerConfig(policy_stages=frozenset(self.config.policy_stages)))

    async def close(self) -> None:
        if self.run_log is not None:
            await self.run_log.close()
        for _, route in self.model_routes():
            await route.client.aclose()
        for env in self.envs.values():
            await env.client.aclose()

    def model_routes(self) -> list[tuple[str, Route]]:
        """Every model the service may ask, with the role /health names it by."""
        routes = [("policy", self.policy)]
        if self.support is not None:
            routes.append(("support", self.support))
        return routes + [(f"named:{name}", route) for name, route in self.named.items()]

    async def _discover(self, url: str, client: EnvClient) -> _Discovered:
        try:
            health, tasks = await asyncio.gather(client.health(), client.tasks())
        except EnvError as exc:
            raise StartupError(f"env {url} is unreachable or unhealthy: {exc}") from None
        except ValueError as exc:  # pydantic: not a contract-shaped answer
            raise StartupError(f"env {url} does not speak the step contract: {exc}") from None
        if health.status != "ready":
            raise StartupError(f"env {url} reports status {health.status!r}, not 'ready'")
        drive_modes = health.capabilities.get("drive_modes")
        if drive_modes is not None and "step" not in drive_modes:
            raise StartupError(f"env {url} does not serve step mode (drive_modes={drive_modes}): "
                               "start it with --step")
        if not tasks:
            raise StartupError(f"env {url} serves no task")
        return _Discovered(url, health, tasks)

    def _index_tasks(self, discovered: list[_Discovered]) -> None:
        for found in discovered:
            env = self.envs[found.url]
            for task in found.tasks:
                target = self.targets.get(task.task_id)
                self.task_info.setdefault(task.task_id, task)
                if target is None:
                    self.targets[task.task_id] = TaskTarget(task.task_id, task.slug, [env])
                    if task.slug:
                        self.by_slug[task.slug] = task.task_id
                    continue
                first = target.envs[0].contract
                if (first.catalog_hash, first.reward_version) != (env.contract.catalog_hash,
                                                                  env.contract.reward_version):
                    raise StartupError(
                        f"task {task.task_id} is served by {first.urls[0]} (dataset {first.catalog_hash}, "
                        f"reward {first.reward_version}) and by {env.url} (dataset {env.contract.catalog_hash}, "
                        f"reward {env.contract.reward_version}): their rewards are not comparable; serve one "
                        "dataset and reward version per service")
                target.envs.append(env)

    def record(self, group: GroupResult) -> None:
        """Append a finished group to the run log, if there is one."""
        if self.run_log is not None:
            self.run_log.append(group)

    async def _check_models(self) -> None:
        for _, route in self.model_routes():
            for endpoint in route.client.endpoints:
                try:
                    models = await route.client.list_models(endpoint)
                except (httpx.HTTPError, ValueError, KeyError) as exc:
                    raise StartupError(f"model server {endpoint.url} is unreachable: "
                                       f"{type(exc).__name__}: {exc}") from None
                if route.request_model not in models:
                    raise StartupError(f"model server {endpoint.url} serves {models}, not {route.request_model!r}: "
                                       "pass --model (or --support-model, or model= of --model-endpoint) "
                                       "with one of those names")

    # -- requests ---------------------------------------------------------------------------

    def resolve(self, request: GroupRequest) -> tuple[TaskTarget, Route]:
        """The task's envs and the policy route for a request, or a RequestError saying why not."""
        if request.n > self.config.max_n:
            raise RequestError(422, "n_too_large", f"n={request.n} is over this service's maximum of "
                               f"{self.config.max_n} (--max-n)")
        task_id = request.task_id or self.by_slug.get(request.slug or "")
        target = self.targets.get(task_id or "")
        if target is None:
            name = f"task_id {request.task_id!r}" if request.task_id else f"slug {request.slug!r}"
            raise RequestError(404, "unknown_task", f"no environment serves a task with {name}; "
                               "GET /tasks lists the served tasks")
        envs = target.envs
        if not request.allow_eval_side and all(e.contract.side == "eval" for e in envs):
            raise RequestError(409, "eval_side", f"task {target.task_id} is served only by an eval-side env "
                               f"({', '.join(e.url for e in envs)}): training on it leaks the held-out "
                               "set. Set allow_eval_side: true if you mean to")
        if not request.allow_eval_side:
            envs = [e for e in envs if e.contract.side != "eval"]
        route = self.policy
        if request.model and request.model != self.policy.model:
            route = self.named.get(request.model)
            if route is None:
                known = ", ".join([self.policy.model, *self.named])
                raise RequestError(422, "unknown_model", f"model {request.model!r} is not served here; "
                                   f"known: {known} (--model, --model-endpoint)")
        return TaskTarget(target.task_id, target.slug, envs), route

    def task_list(self) -> list[dict]:
        return [{"task_id": t.task_id, "slug": t.slug, "envs": [e.url for e in t.envs]}
                for t in self.targets.values()]

    async def health(self) -> dict:
        """The service and each env and model server it uses, asked now."""
        async def env_state(env: EnvHandle) -> dict:
            state = {"url": env.url, "pool": env.slots.capacity, "held_by_service": env.slots.held,
                     "max_held_by_service": env.slots.max_held, "side": env.contract.side,
                     "busy_world_seconds": round(env.slots.busy_seconds, 3)}
            try:
                health = await asyncio.wait_for(env.client.health(), 3.0)
                state.update(ok=True, status=health.status,
                             leased=(health.model_extra or {}).get("leased"))
            except (EnvError, asyncio.TimeoutError, ValueError) as exc:
                state.update(ok=False, error=str(exc)[:300] or type(exc).__name__)
            return state

        async def model_state(route: Route, role: str) -> list[dict]:
            out = []
            for endpoint in route.client.endpoints:
                state = {"url": endpoint.url, "role": role, "model": route.model,
                         "outstanding": endpoint.outstanding}
                try:
                    models = await asyncio.wait_for(route.client.list_models(endpoint), 3.0)
                    state.update(ok=route.request_model in models)
                    if route.request_model not in models:
                        state["error"] = f"serves {models}, not {route.request_model}"
                except (httpx.HTTPError, asyncio.TimeoutError, ValueError, KeyError) as exc:
                    state.update(ok=False, error=f"unreachable: {type(exc).__name__}: {exc}"[:300])
                if endpoint.last_error:
                    state["last_error"] = endpoint.last_error[:300]
                out.append(state)
            return out

        envs = await asyncio.gather(*(env_state(e) for e in self.envs.values()))
        models = [state for role, route in self.model_routes() for state in await model_state(route, role)]
        ok = all(e["ok"] for e in envs) and all(m["ok"] for m in models)
        return {"status": "ok" if ok else "degraded", "run_id": self.run_id,
                "run_log": str(self.run_log.path) if self.run_log else None,
                "uptime_s": round(time.time() - self.started_at, 1),
                "groups_in_flight": int(self.metrics.groups_in_flight._value.get()),
                "attempts_waiting_for_a_world": self.scheduler.waiting if self.scheduler else 0,
                "envs": list(envs), "models": models}
