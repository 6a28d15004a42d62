"""The service's state: the envs and models found at start, how a request maps onto them, and
which groups are running (so that shutdown can abandon them)."""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx

from inference.client import ChatClient, Endpoint, InferenceError, InferenceUnreachable
from inference.weights import WeightsClient

from ..protocol import (
    EnvAdd,
    EnvContract,
    EnvRef,
    EnvRemove,
    EnvRemoved,
    EnvState,
    GroupRequest,
    ReplicaAdd,
    ReplicaRef,
    ReplicaRemove,
    ReplicaState,
)
from .config import ServiceConfig
from .env_client import EnvClient, EnvError, EnvHealth, EnvTask, EnvUnreachable
from .errors import IncomparableEnv, RequestRefused, StartupError, shutting_down
from .health import BackendMonitor
from .metrics import Metrics
from .policy import PolicyManager, replica_state
from .result_json import group_json
from .runlog import RunLog
from .runner import EnvHandle, GroupRunner, ModelRoute, RunnerConfig, TaskTarget
from .scheduler import EnvSlots, WorldScheduler

log = logging.getLogger("rollout_service.service")


T = TypeVar("T")
# One start-up question to one backend: 10 s, doubled after each that times out (a slow /tasks of a
# large catalog on a starved host still gets through), up to 60 s.
_ASK_TIMEOUT_S, _ASK_TIMEOUT_MAX_S = 10.0, 60.0


class _NotYet(Exception):
    """A backend that does not answer yet (or says it is not ready): ask it again."""


@dataclass
class _Discovered:
    url: str
    health: EnvHealth
    tasks: list[EnvTask]


def _chat_client(urls: list[str], config: ServiceConfig, **kwargs: Any) -> ChatClient:
    return ChatClient(
        urls, timeout_s=config.inference_timeout, max_requests_per_second=config.max_requests_per_second, **kwargs
    )


class RolloutService:
    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.run_id = config.run_id or f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        self.policy = ModelRoute(config.model, _chat_client(config.vllm, config))
        self.versions = PolicyManager(
            self.policy.client, self.policy.request_model, WeightsClient(timeout_s=config.update_timeout), self.metrics
        )
        self.support: ModelRoute | None = None
        if config.support_model:
            self.support = ModelRoute(config.support_model, _chat_client(config.support_vllm or config.vllm, config))
        self.named: dict[str, ModelRoute] = {
            spec.name: ModelRoute(
                spec.name,
                _chat_client([spec.url], config, api_key=spec.api_key(), token_ids=spec.token_ids),
                served_model=spec.model,
            )
            for spec in config.model_endpoint
        }
        self.envs: dict[str, EnvHandle] = {}
        self.targets: dict[str, TaskTarget] = {}
        self.by_slug: dict[str, str] = {}
        self.task_info: dict[str, EnvTask] = {}
        self.run_log = RunLog(Path(config.runs_dir), self.run_id, config.max_run_log_queue) if config.runs_dir else None
        self.scheduler: WorldScheduler | None = None
        self.runner: GroupRunner | None = None
        self.monitor: BackendMonitor | None = None
        self.started_at = time.time()
        self.queued_attempts = 0  # attempts accepted and not finished, across all requests
        self._running: set[asyncio.Task] = set()
        self.closing = False
        self._cancellers: set[asyncio.Task] = set()
        # Backends not answering yet at start (name -> why), for /health/detail and the start-up log.
        self.waiting_for: dict[str, str] = {}
        # Why start() gave up, once it has: /health says `failed` rather than `starting` forever.
        self.startup_failure: str | None = None
        self.started_waiting_reported = False
        self._adding: set[str] = set()  # envs being added (POST /envs), not yet scheduled
        # Where each env's URL connects (see _server_addresses): one server under two names would
        # be scheduled as two pools, holding twice its worlds.
        self._env_addresses: dict[str, frozenset[tuple[str, int, str]]] = {}

    # -- start and stop ---------------------------------------------------------------------

    async def start(self, say: Callable[[str], None] = log.warning) -> None:
        """Wait for every env and model server to answer, then check that they fit together.

        Pieces come up in any order (compose, Kubernetes, Ray): an env or model server that does not
        answer yet, answers 5xx or says it is not ready is asked again with backoff, up to
        --startup-timeout, and `say` is told every few seconds what is still awaited. What waiting
        cannot fix (a wrong model name, an env that does not speak the step contract, datasets that
        disagree) is refused at once."""
        clients = {url: EnvClient(url) for url in self.config.env}
        self.waiting_for = {f"env {url}": "not asked yet" for url in clients}
        for role, route in self.model_routes():
            for endpoint in route.client.endpoints:
                self.waiting_for[f"model server {endpoint.url} ({role})"] = "not asked yet"
        reporter = asyncio.ensure_future(self._report_waiting(say))
        try:
            await asyncio.wait_for(
                _all_or_none([self._check_models(), *(self._discover(url, c) for url, c in clients.items())]),
                self.config.startup_timeout,
            )
        except BaseException as exc:
            for c in clients.values():
                await c.aclose()
            if isinstance(exc, TimeoutError):
                raise StartupError(
                    f"still waiting after {self.config.startup_timeout:g}s (--startup-timeout) for {self._awaited()}"
                ) from None
            raise
        finally:
            reporter.cancel()
        if self.started_waiting_reported:
            say(f"every env and model server answered after {time.time() - self.started_at:.0f}s")
        # Found in the order they answered; kept in the order they were given.
        order = {url: i for i, url in enumerate(self.config.env)}
        self.envs = dict(sorted(self.envs.items(), key=lambda item: order[item[0]]))
        for target in self.targets.values():
            target.envs.sort(key=lambda env: order[env.url])
            target.contract = target.envs[0].contract
        slots = [env.slots for env in self.envs.values()]
        await self._probe_token_prompts()
        await self.versions.start()
        if self.run_log is not None:
            self.run_log.start()
        self.scheduler = WorldScheduler(slots)
        self.runner = GroupRunner(
            self.scheduler,
            self.policy,
            self.support,
            self.metrics,
            RunnerConfig(policy_stages=frozenset(self.config.policy_stage), max_staleness=self.config.max_staleness),
            self.versions,
        )
        self.monitor = BackendMonitor(self.envs, self.model_routes(), self.versions)
        self.monitor.start()

    async def _report_waiting(self, say: Callable[[str], None], every_s: float = 10.0) -> None:
        """Say what is still awaited: first after a few seconds (a quick start says nothing), then
        every `every_s`."""
        await asyncio.sleep(3.0)
        while self.waiting_for:
            self.started_waiting_reported = True
            waited = time.time() - self.started_at
            say(f"waiting for {self._awaited()} ({waited:.0f}s of {self.config.startup_timeout:g}s, --startup-timeout)")
            await asyncio.sleep(every_s)

    async def _until_ready(self, name: str, probe: Callable[[], Awaitable[T]]) -> T:
        """`_ask_until_ready`, saying in `waiting_for` why `name` is still awaited."""
        answer = await _ask_until_ready(probe, functools.partial(self.waiting_for.__setitem__, name))
        self.waiting_for.pop(name, None)
        return answer

    def cancel_in_background(self, groups: dict[asyncio.Future, int]) -> None:
        """Cancel these groups (task -> its attempts) in slices, as a task of the service's own that
        nothing outside can interrupt."""
        if not groups:
            return
        task = asyncio.ensure_future(cancel_in_slices(groups))
        self._cancellers.add(task)
        task.add_done_callback(self._cancellers.discard)

    def cancel_running(self) -> None:
        """Shutting down: refuse new groups, cancel every running one; their episodes are abandoned on
        the way out."""
        self.closing = True
        self.versions.begin_close()  # a replica that joins from now on gets no restore started
        for task in list(self._running):
            task.cancel()

    async def close(self) -> None:
        self.cancel_running()
        if self._running:
            await asyncio.wait(set(self._running), timeout=30)
        if self.runner is not None:
            await self.runner.drain(timeout_s=30)  # abandons still on their way to the envs
        if self.monitor is not None:
            await self.monitor.stop()
        await self.versions.close()
        await self.versions.weights.aclose()
        if self.run_log is not None:
            await self.run_log.close()
        for _, route in self.model_routes():
            await route.client.aclose()
        for env in list(self.envs.values()):  # a removal finishing meanwhile changes the dict
            await env.client.aclose()

    def model_routes(self) -> list[tuple[str, ModelRoute]]:
        """Every model the service may ask, with the role /health names it by."""
        routes = [("policy", self.policy)]
        if self.support is not None:
            routes.append(("support", self.support))
        return routes + [(f"named:{name}", route) for name, route in self.named.items()]

    async def _discover(self, url: str, client: EnvClient) -> None:
        """Wait for the env at `url`, check it, and add it with its tasks (refusing at once an env
        whose rewards are not comparable with an env found before it, whatever else is awaited)."""
        found = await self._until_ready(f"env {url}", functools.partial(_ask_env, url, client))
        addresses = await _server_addresses(url)
        env = _checked_env(found, client)
        self._refuse_incomparable(env, found.tasks)
        if other := self._same_server(url, addresses):
            raise StartupError(f"{other}: give each env once")
        self._env_addresses[url] = addresses
        self.envs[url] = env
        self._index_tasks(env, found.tasks)

    def _same_server(self, url: str, addresses: frozenset[tuple[str, int, str]]) -> str | None:
        """Why `url` is an env scheduled already under another name, or None."""
        for other, known in self._env_addresses.items():
            if other != url and (shared := addresses & known):
                host, port, path = min(shared)
                return f"env {url} is env {other} under another name (both reach {host}:{port}{path})"
        return None

    def _refuse_incomparable(self, env: EnvHandle, tasks: list[EnvTask]) -> None:
        """IncomparableEnv if a task of `env` is served already with another dataset or reward version,
        or its slug names another task already."""
        for task in tasks:
            named = self.by_slug.get(task.slug) if task.slug else None
            if named is not None and named != task.task_id:
                raise IncomparableEnv(
                    f"env {env.url} names task {task.task_id} {task.slug!r}, the slug of task {named} served "
                    f"by {', '.join(e.url for e in self.targets[named].envs)}: a slug must name one task"
                )
            target = self.targets.get(task.task_id)
            if target is None:
                continue
            first = target.contract
            if (first.catalog_hash, first.reward_version) != (env.contract.catalog_hash, env.contract.reward_version):
                raise IncomparableEnv(
                    f"task {task.task_id} is served by {target.envs[0].url if target.envs else first.urls[0]} "
                    f"(dataset {first.catalog_hash}, reward {first.reward_version}) and by {env.url} "
                    f"(dataset {env.contract.catalog_hash}, reward {env.contract.reward_version}): their rewards "
                    "are not comparable; serve one dataset and reward version per service"
                )

    def _index_tasks(self, env: EnvHandle, tasks: list[EnvTask]) -> None:
        for task in tasks:
            target = self.targets.get(task.task_id)
            self.task_info.setdefault(task.task_id, task)
            if target is None:
                self.targets[task.task_id] = TaskTarget(task.task_id, task.slug, [env])
                if task.slug:
                    self.by_slug[task.slug] = task.task_id
            elif env not in target.envs:  # a task listed twice is served once
                target.envs.append(env)

    # -- membership: envs added, drained and removed while groups run ---------------------------

    async def add_env(self, body: EnvAdd) -> EnvState:
        """Schedule on one more env: it must answer ready within `timeout_s`, speak the step
        contract and, for every task it shares with the envs present, have their dataset and reward
        version. Queued attempts of its tasks may take its worlds at once."""
        self.refuse_unless_ready()
        assert self.scheduler is not None
        url = body.url
        if url in self.envs or url in self._adding:
            draining = url in self.envs and self.envs[url].slots.draining
            state = "is draining: remove it first" if draining else "is scheduled already (or being added)"
            raise RequestRefused(409, "env_present", f"env {url} {state}")
        self._adding.add(url)
        client = EnvClient(url)
        try:
            try:
                found = await asyncio.wait_for(
                    _ask_until_ready(functools.partial(_ask_env, url, client)), body.timeout_s
                )
                addresses = await _server_addresses(url)
                # No await from here to its scheduling: the checks hold against envs added meanwhile.
                env = _checked_env(found, client)
                self._refuse_incomparable(env, found.tasks)
            except TimeoutError:
                raise RequestRefused(
                    504, "env_not_ready", f"env {url} did not answer ready within timeout_s={body.timeout_s:g}"
                ) from None
            except IncomparableEnv as exc:
                raise RequestRefused(409, "env_incomparable", str(exc)) from None
            except StartupError as exc:
                raise RequestRefused(422, "env_refused", str(exc)) from None
            if self.closing:
                raise shutting_down()
            if other := self._same_server(url, addresses):
                raise RequestRefused(409, "env_present", f"{other}: its pool would be held twice")
        except BaseException:
            self._adding.discard(url)
            await client.aclose()
            raise
        self._adding.discard(url)
        self._env_addresses[url] = addresses
        self.envs[url] = env
        self._index_tasks(env, found.tasks)
        serves = {(t.task_id, True) for t in found.tasks}
        if env.contract.side != "eval":
            serves |= {(t.task_id, False) for t in found.tasks}
        self.scheduler.add_env(env.slots, serves)
        if self.monitor is not None:
            self.monitor.watch_env(url)
        log.warning("env %s added: pool %d, %d tasks", url, env.slots.pool, len(found.tasks))
        return self.env_state(env)

    def drain_env(self, body: EnvRef) -> EnvState:
        """No new episode on this env; the ones on it finish. Attempts queued for it alone wait for
        another env of their task (added later) or fail as env_no_world when it is removed."""
        env = self._present_env(body.url)
        assert self.scheduler is not None
        self.scheduler.drain_env(env.url)
        return self.env_state(env)

    async def remove_env(self, body: EnvRemove) -> EnvRemoved:
        """Drain the env, wait (up to `timeout_s`) until no episode holds a world on it, then forget
        it. Episodes are never cut short: if some still run at the deadline the env stays draining
        and the answer is 409 env_busy with how many."""
        env = self._present_env(body.url)
        assert self.scheduler is not None
        slots = self.scheduler.drain_env(env.url)
        assert slots.emptied is not None
        if slots.held:
            try:
                await asyncio.wait_for(slots.emptied.wait(), body.timeout_s)
            except TimeoutError:
                raise RequestRefused(
                    409,
                    "env_busy",
                    f"{slots.held} episodes still run on env {env.url} after timeout_s={body.timeout_s:g}; it stays "
                    "draining (no new episode starts on it): remove it again later",
                ) from None
        if self.envs.get(env.url) is not env:  # removed by a concurrent call meanwhile
            raise RequestRefused(404, "unknown_env", f"env {env.url} was removed meanwhile")
        self.scheduler.remove_env(env.url)
        del self.envs[env.url]
        self._env_addresses.pop(env.url, None)
        self.metrics.forget_env(env.url)
        gone = []
        for task_id, target in list(self.targets.items()):
            if env in target.envs:
                target.envs.remove(env)
                if not target.envs:
                    gone.append(task_id)
                    del self.targets[task_id]
                    self.task_info.pop(task_id, None)
                    if self.by_slug.get(target.slug) == task_id:
                        del self.by_slug[target.slug]
        if self.monitor is not None:
            self.monitor.forget_env(env.url)
        await env.client.aclose()
        log.warning("env %s removed; tasks no longer served: %d", env.url, len(gone))
        return EnvRemoved(url=env.url, tasks_no_longer_served=gone)

    def _present_env(self, url: str) -> EnvHandle:
        self.refuse_unless_ready()
        env = self.envs.get(url)
        if env is None:
            known = ", ".join(self.envs) or "none"
            raise RequestRefused(404, "unknown_env", f"no env {url} is scheduled here; present: {known}")
        return env

    def env_state(self, env: EnvHandle) -> EnvState:
        return EnvState(
            url=env.url,
            pool=env.slots.pool,
            held=env.slots.held,
            draining=env.slots.draining,
            side=env.contract.side,
            catalog_hash=env.contract.catalog_hash,
            reward_version=env.contract.reward_version,
            tasks=sum(env in t.envs for t in self.targets.values()),
        )

    async def _check_models(self) -> None:
        await _all_or_none(
            [
                self._until_ready(
                    f"model server {endpoint.url} ({role})", functools.partial(_ask_model, route, endpoint)
                )
                for role, route in self.model_routes()
                for endpoint in route.client.endpoints
            ]
        )

    # -- membership: model server replicas added, drained and removed while groups run ----------

    async def add_replica(self, body: ReplicaAdd) -> ReplicaState:
        """Route to one more replica of the policy (or support) model. It must list the model
        within `timeout_s`; a policy replica is routed to only once it serves the current version
        (brought there like a restarted one: adapter loaded, full weights reloaded)."""
        self.refuse_unless_ready()
        route = self._route(body.role)
        endpoint = route.client.new_endpoint(body.url)
        if any(e.url == endpoint.url for e in route.client.endpoints) or endpoint.url in self._adding:
            raise RequestRefused(409, "replica_present", f"{endpoint.url} is a {body.role} replica already")
        self._adding.add(endpoint.url)
        started = time.monotonic()
        try:
            models = await asyncio.wait_for(
                _ask_until_ready(functools.partial(_ask_model, route, endpoint)), body.timeout_s
            )
            if self.closing:
                raise shutting_down()
            if body.role == "policy":
                if not await self.versions.join(endpoint, models, body.timeout_s - (time.monotonic() - started)):
                    raise RequestRefused(
                        409,
                        "policy_busy",
                        f"{body.url} answers, but a policy update (or a restarted replica's restore) still held "
                        f"the replica list at timeout_s={body.timeout_s:g}; a replica joins between them: add it "
                        "again",
                    )
                if self.closing:  # the join waited for the update lock while a stop was asked for
                    raise shutting_down()
            else:
                route.client.add(endpoint)
        except TimeoutError:
            raise RequestRefused(
                504, "replica_not_ready", f"{body.url} did not list a model within timeout_s={body.timeout_s:g}"
            ) from None
        except StartupError as exc:
            raise RequestRefused(422, "replica_refused", str(exc)) from None
        finally:
            self._adding.discard(endpoint.url)
        if self.monitor is not None:
            self.monitor.watch_model(body.role, endpoint.url)
        log.warning("%s replica %s added", body.role, endpoint.url)
        # Bringing a policy replica to the current version runs in the background: answer once it
        # is routed, or at the deadline with the reason it is not (yet).
        await route.client.until(
            endpoint,
            lambda: endpoint.excluded is None or endpoint not in route.client.endpoints,
            body.timeout_s - (time.monotonic() - started),
        )
        return self._replica_state(body.role, endpoint)

    def drain_replica(self, body: ReplicaRef) -> ReplicaState:
        """No new turn to this replica: groups pinned there move at their next turn."""
        route, endpoint = self._present_replica(body)
        others = [e for e in route.client.endpoints if e is not endpoint and e.excluded is None]
        if not others:
            raise RequestRefused(
                409,
                "last_replica",
                f"{endpoint.url} is the last {body.role} replica in routing: add one (and let it be routed) first",
            )
        route.client.drain(endpoint, "draining: no new turn goes to it")
        return self._replica_state(body.role, endpoint)

    async def remove_replica(self, body: ReplicaRemove) -> ReplicaState:
        """Drain the replica, wait (up to `timeout_s`) for its turns in flight to end, forget it."""
        route, endpoint = self._present_replica(body)
        if body.role == "policy" and self.versions.paused:
            raise RequestRefused(
                409, "policy_paused", "the policy replicas are paused for a weight push: POST /policy first"
            )
        if not endpoint.draining:
            self.drain_replica(body)
        if not await route.client.until(endpoint, lambda: not endpoint.outstanding, body.timeout_s):
            raise RequestRefused(
                409,
                "replica_busy",
                f"{endpoint.outstanding} requests still run on {endpoint.url} after timeout_s={body.timeout_s:g}; "
                "it stays draining: remove it again later",
            )
        if endpoint not in route.client.endpoints:
            raise RequestRefused(404, "unknown_replica", f"{endpoint.url} was removed meanwhile")
        state = self._replica_state(body.role, endpoint)
        if body.role == "policy":
            await self.versions.leave(endpoint)
        else:
            route.client.remove(endpoint)
        if self.monitor is not None:
            self.monitor.forget_model(body.role, endpoint.url)
        log.warning("%s replica %s removed", body.role, endpoint.url)
        return state

    def _route(self, role: str) -> ModelRoute:
        if role == "support":
            if self.support is None:
                raise RequestRefused(422, "no_support_model", "this service has no support model (--support-model)")
            return self.support
        return self.policy

    def _present_replica(self, body: ReplicaRef) -> tuple[ModelRoute, Endpoint]:
        self.refuse_unless_ready()
        route = self._route(body.role)
        url = route.client.new_endpoint(body.url).url  # as the client spells it (no /v1)
        endpoint = next((e for e in route.client.endpoints if e.url == url), None)
        if endpoint is None:
            known = ", ".join(e.url for e in route.client.endpoints)
            raise RequestRefused(404, "unknown_replica", f"no {body.role} replica {body.url} here; present: {known}")
        return route, endpoint

    def _replica_state(self, role: str, endpoint: Endpoint) -> ReplicaState:
        return replica_state(endpoint, self.versions.serving.get(endpoint.url) if role == "policy" else None)

    async def _probe_token_prompts(self) -> None:
        for _, route in self.model_routes():
            if route.renderer is not None and route is not self.support:  # support turns always go as chat
                try:  # learn now whether it takes token prompts; a failure here is probed again later
                    await asyncio.wait_for(route.renderer.supported(), 30)
                except (InferenceError, TimeoutError):
                    pass

    # -- requests ---------------------------------------------------------------------------

    def resolve(self, request: GroupRequest) -> tuple[TaskTarget, ModelRoute]:
        """The task's envs and the model route for a request, or RequestRefused saying why not."""
        if request.n > self.config.max_n:
            raise RequestRefused(
                422, "n_too_large", f"n={request.n} is over this service's maximum of {self.config.max_n} (--max-n)"
            )
        task_id = request.task_id or self.by_slug.get(request.slug or "")
        target = self.targets.get(task_id or "")
        if target is None:
            name = f"task_id {request.task_id!r}" if request.task_id else f"slug {request.slug!r}"
            raise RequestRefused(
                404, "unknown_task", f"no environment serves a task with {name}; GET /tasks lists the served tasks"
            )
        if not request.allow_eval_side and all(e.contract.side == "eval" for e in target.envs):
            raise RequestRefused(
                409,
                "eval_side",
                f"task {target.task_id} is served only by an eval-side env "
                f"({', '.join(e.url for e in target.envs)}): training on it leaks the held-out "
                "set. Set allow_eval_side: true if you mean to",
            )
        if target.drained(request.allow_eval_side):
            candidates = target.candidates(request.allow_eval_side)
            raise RequestRefused(
                503,
                "envs_draining",
                f"every env serving task {target.task_id} is draining ({', '.join(candidates)}): add one "
                "(POST /envs) or send it again later",
                headers={"Retry-After": "5"},
            )
        route = self.policy
        if request.model and request.model != self.policy.model:
            named = self.named.get(request.model)
            if named is None:
                known = ", ".join([self.policy.model, *self.named])
                raise RequestRefused(
                    422,
                    "unknown_model",
                    f"model {request.model!r} is not served here; known: {known} (--model, --model-endpoint)",
                )
            route = named
        if request.tokens == "exact" and (route.renderer is None or route.renderer.unsupported):
            why = route.renderer.unsupported if route.renderer else "it was configured with token-ids=false"
            raise RequestRefused(
                422,
                "token_prompts_unsupported",
                f"tokens=exact, but {route.model}'s server cannot take token prompts ({why}): send tokens: chat",
            )
        return target, route

    def admit(self, requests: list[GroupRequest]) -> list[tuple[TaskTarget, ModelRoute]]:
        """Check every request before any work starts, and the cap on queued attempts."""
        self.refuse_unless_ready()
        resolved = []
        for i, request in enumerate(requests):
            try:
                resolved.append(self.resolve(request))
            except RequestRefused as exc:
                if len(requests) > 1:
                    exc.message = f"groups[{i}]: {exc.message}"
                raise
        attempts = sum(r.n for r in requests)
        if attempts > self.config.max_queued_attempts:
            raise RequestRefused(
                422,
                "too_many_attempts",
                f"this request holds {attempts} attempts, more than this service ever "
                f"queues ({self.config.max_queued_attempts}, --max-queued-attempts): split it",
            )
        if self.queued_attempts + attempts > self.config.max_queued_attempts:
            raise RequestRefused(
                429,
                "too_many_queued_attempts",
                f"{self.queued_attempts} attempts are queued or running and this request adds {attempts}: over "
                f"this service's cap of {self.config.max_queued_attempts} (--max-queued-attempts). Send it again "
                "when earlier groups have finished",
                headers={"Retry-After": "5"},
            )
        return resolved

    def start_groups(self, requests: list[GroupRequest]) -> list[asyncio.Task[bytes]]:
        """Admit and start groups; each is a task the service can cancel at shutdown. One share per
        call: concurrent calls get fair shares of the pools, earlier groups of one call go first."""
        resolved = self.admit(requests)
        assert self.runner is not None
        share = object()
        tasks = []
        for request, (target, route) in zip(requests, resolved, strict=True):
            sequence = self.runner.next_sequence()
            task = self._track(self._run(request, target, route, sequence, share))
            # Counted from admission (not from when the task first runs), so two requests admitted in
            # one loop iteration cannot both pass the cap; uncounted when done, however it ends.
            self.queued_attempts += request.n
            task.add_done_callback(functools.partial(self._uncount, request.n))
            tasks.append(task)
        return tasks

    async def _run(
        self, request: GroupRequest, target: TaskTarget, route: ModelRoute, sequence: int, share: object
    ) -> bytes:
        """One group, as the JSON every consumer gets: serialised once, recorded in the run log here
        (whether or not its trainer is still there to read it)."""
        assert self.runner is not None
        self.metrics.groups_in_flight.inc()
        try:
            result = await self.runner.run_group(request, target, route, sequence, self.run_id, share)
        finally:
            self.metrics.groups_in_flight.dec()
        body = group_json(result)
        if self.run_log is not None:
            self.run_log.append(body)
        return body

    def _uncount(self, attempts: int, _: asyncio.Future) -> None:
        self.queued_attempts -= attempts

    def _track(self, coro: Coroutine[Any, Any, bytes]) -> asyncio.Task[bytes]:
        task = asyncio.ensure_future(coro)
        self._running.add(task)
        task.add_done_callback(self._running.discard)
        return task

    def task_list(self) -> list[dict]:
        return [{"task_id": t.task_id, "slug": t.slug, "envs": [e.url for e in t.envs]} for t in self.targets.values()]

    # -- health -----------------------------------------------------------------------------

    def status(self) -> str:
        """ok, or degraded: from the last probes and the run log, without asking anyone now."""
        if self.monitor is None:
            return "failed" if self.startup_failure else "starting"
        ok = self.monitor.all_ok() and (self.run_log is None or self.run_log.error is None)
        routed = all(e.excluded is None or e.draining for e in self.policy.client.endpoints)
        ok = ok and routed and not self.versions.paused and not self._unserved(first_only=True)
        return "ok" if ok else "degraded"

    def _unserved(self, first_only: bool = False) -> list[str]:
        """What the envs present cannot serve: nothing at all, or tasks whose every env drains, or every
        training-side one (their queued attempts wait for an env added for them, or end when the
        drained one is removed). `first_only`: stop at the first such task (status() asks often)."""
        if not self.envs:
            return ["no env: every env was removed (POST /envs adds one)"]
        if not any(env.slots.draining for env in self.envs.values()):
            return []
        stranded = []
        for target in self.targets.values():
            # As resolve() refuses groups: with eval-side envs, or (a task some training env serves)
            # without them.
            if target.drained(include_eval=True) or (target.candidates(False) and target.drained(False)):
                stranded.append(target.task_id)
                if first_only:
                    break
        if not stranded:
            return []
        named = ", ".join(stranded[:5]) + (f" and {len(stranded) - 5} more" if len(stranded) > 5 else "")
        return [
            f"tasks served only by draining envs (all, or all on the training side): {named}. Their queued "
            "attempts wait until an env serving them is added (POST /envs) or end as env_no_world when the "
            "drained env is removed; new groups for them get 503 envs_draining"
        ]

    @property
    def ready(self) -> bool:
        return self.monitor is not None

    def refuse_unless_ready(self) -> None:
        if self.closing:
            raise shutting_down()
        if self.startup_failure:
            # Embedded without the CLI (which exits on this), the app stays up: say why it cannot serve.
            raise RequestRefused(503, "start_failed", f"the service could not start: {self.startup_failure}")
        if not self.ready:
            raise RequestRefused(
                503,
                "starting",
                f"the service is starting: {self.starting_summary()}",
                headers={"Retry-After": "5"},
            )

    def starting_summary(self) -> str:
        if self.startup_failure:
            return f"could not start: {self.startup_failure}"
        if not self.waiting_for:
            return "every backend answered; finishing its start-up checks"
        return f"waiting for {self._awaited()}"

    def _awaited(self) -> str:
        """What start-up still waits for, and why: for its log, its timeout and /health/detail."""
        return "; ".join(f"{name}: {why}" for name, why in self.waiting_for.items())

    def health_detail(self) -> dict:
        if self.scheduler is None or self.monitor is None:
            return {
                "status": self.status(),
                "reasons": [self.starting_summary()],
                "waiting_for": dict(self.waiting_for),
                "startup_timeout_s": self.config.startup_timeout,
                "run_id": self.run_id,
                "uptime_s": round(time.time() - self.started_at, 1),
            }
        envs = []
        for env in self.envs.values():
            state = {
                "url": env.url,
                "pool": env.slots.pool,
                "held": env.slots.held,
                "max_held": env.slots.max_held,
                "draining": env.slots.draining,
                "side": env.contract.side,
                "busy_world_seconds": round(env.slots.busy_seconds, 3),
            }
            state.update(self.monitor.env_state(env.url))
            envs.append(state)
        models = []
        for role, route in self.model_routes():
            for endpoint in route.client.endpoints:
                state = {
                    "url": endpoint.url,
                    "role": role,
                    "model": route.model,
                    "outstanding": endpoint.outstanding,
                    "token_prompts": "no: support turns go as chat" if role == "support" else _token_prompts(route),
                }
                if endpoint.excluded:
                    state["out_of_routing"] = endpoint.excluded
                state.update(self.monitor.model_state(role, endpoint.url))
                if endpoint.last_error:
                    state["last_error"] = endpoint.last_error[:300]
                models.append(state)
        run_log = None
        if self.run_log is not None:
            run_log = {
                "path": str(self.run_log.path),
                "groups_written": self.run_log.groups_written,
                "groups_lost": self.run_log.groups_lost,
                "error": self.run_log.error,
            }
        reasons = [f"env {e['url']}: {e.get('error')}" for e in envs if not e.get("ok")]
        reasons += [f"model server {m['url']}: {m.get('error')}" for m in models if not m.get("ok")]
        reasons += [f"model server {m['url']}: {m['out_of_routing']}" for m in models if m.get("out_of_routing")]
        if self.versions.paused_since is not None:
            held = time.time() - self.versions.paused_since
            reasons.append(f"policy replicas held paused by POST /policy/pause for {held:.0f}s: no turn starts")
        if run_log and run_log["error"]:
            reasons.append(f"run log: {run_log['error']}")
        reasons += self._unserved()
        return {
            "status": self.status(),
            "reasons": reasons,
            "run_id": self.run_id,
            "run_log": run_log,
            "uptime_s": round(time.time() - self.started_at, 1),
            "groups_in_flight": len(self._running),
            "attempts_queued": self.queued_attempts,
            "attempts_waiting_for_a_world": self.scheduler.waiting,
            "episodes_ending": self.runner.episodes_ending if self.runner else 0,
            "envs": envs,
            "models": models,
            "policy": self.versions.state().model_dump(),
        }


async def _ask_model(route: ModelRoute, endpoint: Endpoint) -> list[str]:
    """The models a replica lists (at least one), or _NotYet while it is not up; StartupError for
    what waiting cannot fix (not OpenAI-compatible, a key wanted, another model served)."""
    try:
        models = await route.client.list_models(endpoint)
    except InferenceUnreachable as exc:
        raise _NotYet(f"unreachable ({exc.detail})") from None
    except InferenceError as exc:
        status = exc.status or 0
        if status >= 500 or status in (408, 429):  # starting, overloaded, rate-limited
            raise _NotYet(f"GET /v1/models answered {status}") from None
        if status in (401, 403):
            raise StartupError(
                f"model server {endpoint.url} answers GET /v1/models with {status}: it wants an API "
                "key (api-key-env=VAR of --model-endpoint, with VAR set in the service's environment)"
            ) from None
        raise StartupError(
            f"model server {endpoint.url} answers GET /v1/models with {status}: is it an OpenAI-compatible server?"
        ) from None
    except ValueError as exc:  # not JSON, or not the list's shape
        raise StartupError(f"model server {endpoint.url}: {exc}") from None
    if not models:  # a router in front of replicas that have not registered yet
        raise _NotYet("GET /v1/models lists no model yet")
    if route.request_model not in models:
        raise StartupError(
            f"model server {endpoint.url} serves {models}, not {route.request_model!r}: "
            "pass --model (or --support-model, or model= of --model-endpoint) with one of those names"
        )
    return models


async def _ask_env(url: str, client: EnvClient) -> _Discovered:
    """The env's health and tasks, or _NotYet while it is not up (or not ready) yet."""
    try:
        # One question at a time: wait_for cancels the one in flight, so nothing is left asking a
        # slow env behind the next try.
        health = await client.health()
        if health.status != "ready":
            raise _NotYet(f"status {health.status!r}, not 'ready'")
        tasks = await client.tasks()
    except EnvError as exc:
        if isinstance(exc, EnvUnreachable):
            raise _NotYet(f"unreachable ({exc.message or exc})") from None
        if (exc.status or 0) >= 500:
            raise _NotYet(str(exc)) from None
        raise StartupError(f"env {url} does not speak the step contract: {exc}") from None
    return _Discovered(url, health, tasks)


async def _ask_until_ready(probe: Callable[[], Awaitable[T]], waiting: Callable[[str], Any] | None = None) -> T:
    """Ask `probe` until it answers, telling `waiting` why not yet. `_NotYet` means ask again later
    (backoff 0.25 s to 5 s); each question is bounded (10 s, doubled after each that times out, up to
    60 s): a backend that takes the connection and never answers is asked again. The caller bounds
    the whole wait (--startup-timeout at start, timeout_s for one added at runtime)."""
    delay, bound = 0.25, _ASK_TIMEOUT_S
    while True:
        try:
            return await asyncio.wait_for(probe(), bound)
        except TimeoutError:
            if waiting is not None:
                waiting(f"asked, no answer within {bound:g}s")
            bound = min(bound * 2, _ASK_TIMEOUT_MAX_S)
        except _NotYet as exc:
            if waiting is not None:
                waiting(str(exc))
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)


async def _server_addresses(url: str, timeout_s: float = 10.0) -> frozenset[tuple[str, int, str]]:
    """What identifies the server `url` reaches, as (host, port, path) keys: two URLs that share a key
    are one server. An IP address (however spelled: 127.1, 0x7f.0.0.1) or a name of this host's
    loopback (localhost) is keyed by the addresses it resolves to, so localhost and 127.0.0.1 share
    one. Any other name is keyed by itself: two names on one address may be two servers behind one
    proxy (virtual hosts, an ingress). Where the host does not resolve in time, by itself too."""
    parsed = httpx.URL(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    path = parsed.path.rstrip("/")
    by_name = frozenset({(parsed.host.lower(), port, path)})
    loop = asyncio.get_running_loop()
    try:
        found = await asyncio.wait_for(loop.getaddrinfo(parsed.host, port, type=socket.SOCK_STREAM), timeout_s)
    except (OSError, UnicodeError, TimeoutError):
        return by_name
    # A client connecting to the unspecified address reaches this host's loopback.
    unspecified = {"0.0.0.0": "127.0.0.1", "::": "::1"}
    addresses = {unspecified.get(str(info[4][0]), str(info[4][0])) for info in found}
    loopback = all(ipaddress.ip_address(a.split("%", 1)[0]).is_loopback for a in addresses)
    if not (loopback or _ip_literal(parsed.host)):
        return by_name
    return frozenset((address, port, path) for address in addresses)


def _ip_literal(host: str) -> bool:
    """An IP address, in any spelling the resolver takes (IPv6, 127.1, 0x7f.0.0.1, 2130706433)."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    try:
        socket.inet_aton(host)
        return True
    except OSError:
        return False


def _checked_env(found: _Discovered, client: EnvClient) -> EnvHandle:
    """The env as the scheduler and runner see it, or StartupError if it cannot serve episodes."""
    drive_modes = found.health.capabilities.get("drive_modes")
    if drive_modes is not None and "step" not in drive_modes:
        raise StartupError(
            f"env {found.url} does not serve step mode (drive_modes={drive_modes}): start it with --step"
        )
    if not found.tasks:
        raise StartupError(f"env {found.url} serves no task")
    contract = EnvContract(
        urls=[found.url],
        catalog_hash=found.health.catalog_hash,
        data_anchor=found.health.dataset.get("data_anchor"),
        reward_version=found.health.reward_version,
        reward_profile=found.health.reward_profile,
        side=found.health.side,
    )
    return EnvHandle(found.url, client, EnvSlots(found.url, found.health.pool), contract)


async def _all_or_none(coros: list[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Their results in order; at the first failure (or if cancelled) the others are cancelled,
    waited for, and the failure raised: nothing keeps probing after start-up has given up."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    if not tasks:
        return []
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.wait(tasks)
    for task in done:
        failure = None if task.cancelled() else task.exception()
        if failure is not None:
            raise failure
    return [task.result() for task in tasks]


async def cancel_in_slices(tasks: dict[asyncio.Future, int], attempts_per_slice: int = 256) -> None:
    """Cancel groups (task -> its attempts) a slice at a time, yielding to the loop between slices:
    cancelling a full batch (65,536 queued attempts) at once would stall every other request for a
    second or more. Whatever interrupts this, every group still gets cancelled."""
    try:
        sliced = 0
        for task, attempts in tasks.items():
            task.cancel()
            sliced += attempts
            if sliced >= attempts_per_slice:
                sliced = 0
                await asyncio.sleep(0)
    finally:
        for task in tasks:
            task.cancel()
    if tasks:
        await asyncio.wait(list(tasks))


def _token_prompts(route: ModelRoute) -> str:
    """Whether turns to this route go out as token ids (exact trajectories), for /health/detail."""
    if route.renderer is None:
        return "no: token-ids=false"
    if route.renderer.unsupported:
        return f"no: {route.renderer.unsupported}"
    return "yes" if route.renderer.end_of_turn is not None else "not yet probed"
