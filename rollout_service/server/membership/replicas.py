"""The model routes (policy, support, named) and their replicas' membership while groups run."""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from typing import Any

from ...backends.errors import AddressNotAllowed, InferenceAnswerTooLarge, InferenceError, InferenceUnreachable
from ...backends.kv_admission import KvAdmission
from ...backends.replica_pool import Endpoint, ReplicaPool
from ...protocol import ReplicaAdd, ReplicaRef, ReplicaRemove, ReplicaState
from ..config import ServiceConfig
from ..errors import BackendTimedOut, Conflict, Invalid, NotFound, StartupError, shutting_down
from ..lifecycle import Lifecycle, NotYet, ask_until_ready
from ..metrics import Metrics
from ..policy.manager import PolicyManager
from ..policy.replica_states import Phase, ReplicaStates
from ..task_sets import all_or_none
from .allowed_backends import AllowedBackends
from .targets import ModelRoute

log = logging.getLogger("rollout_service.replicas")


def _replica_pool(urls: list[str], config: ServiceConfig, allowed: AllowedBackends, **kwargs: Any) -> ReplicaPool:
    pool = ReplicaPool(
        urls,
        timeout_s=config.inference_timeout,
        max_requests_per_second=config.max_requests_per_second,
        max_answer_bytes=config.max_answer_bytes,
        address_policy=allowed,
        update_timeout_s=config.update_timeout,
        **kwargs,
    )
    pool.kv = KvAdmission(
        pool.metrics_text, mode=config.kv_admission, fixed_cap=config.kv_max_turns, interval_s=config.kv_poll_interval
    )
    return pool


class ReplicaRegistry:
    def __init__(self, config: ServiceConfig, lifecycle: Lifecycle, metrics: Metrics, allowed: AllowedBackends) -> None:
        self.lifecycle = lifecycle
        self.allowed = allowed  # what POST /replicas may reach
        key = config.vllm_api_key()
        self.policy = ModelRoute(config.model, _replica_pool(config.vllm, config, allowed, api_key=key))
        self.versions = PolicyManager(
            self.policy.client,
            self.policy.request_model,
            metrics,
            config.checkpoint_root,
            max_loras=config.max_loras,
            pause_timeout_s=config.pause_timeout,
            max_pause_timeout_s=config.max_pause_timeout,
        )
        self.support: ModelRoute | None = None
        if config.support_model:
            self.support = ModelRoute(
                config.support_model, _replica_pool(config.support_vllm or config.vllm, config, allowed, api_key=key)
            )
        self.named: dict[str, ModelRoute] = {
            spec.name: ModelRoute(
                spec.name,
                _replica_pool([spec.url], config, allowed, api_key=spec.api_key(), token_ids=spec.token_ids),
                served_model=spec.model,
            )
            for spec in config.model_endpoint
        }
        # Each route's replicas' standing, the one writer of its routing: the policy's is the manager's.
        self.states: dict[str, ReplicaStates] = {
            role: self.versions.states if role == "policy" else ReplicaStates(route.client, metrics, role)
            for role, route in self.model_routes()
        }
        self.adding: set[str] = set()  # replicas being added, not yet routed
        # The service's own secrets: a replica added by URL may not be sent one of them as its key.
        self._own_secrets = {v for v in (config.api_key_env, config.admin_key_env, config.env_token_env) if v}
        # What it may be sent: only variables the operator listed at start (--replica-key-envs).
        self._replica_keys = {*config.replica_key_envs, *([config.vllm_api_key_env] if config.vllm_api_key_env else [])}

    def load_rows(self) -> list[tuple[str, str, int, int | None]]:
        """Per replica: role, URL, episodes in flight there, the bound on its turns (None: none)."""
        rows = []
        for role, route in self.model_routes():
            episodes = route.client.episodes_on()
            for endpoint in route.client.endpoints:
                cap = route.client.kv.gate(endpoint.url).cap
                rows.append((role, endpoint.url, episodes.get(endpoint.url, 0), cap))
        return rows

    def model_routes(self) -> list[tuple[str, ModelRoute]]:
        """Every model the service may ask, with the role /health names it by."""
        routes = [("policy", self.policy)]
        if self.support is not None:
            routes.append(("support", self.support))
        return routes + [(f"named:{name}", route) for name, route in self.named.items()]

    # -- start and stop ---------------------------------------------------------------------

    def await_all(self) -> None:
        """Name every replica in the start-up's waiting list."""
        for role, route in self.model_routes():
            for endpoint in route.client.endpoints:
                self.lifecycle.waiting_for[f"model server {endpoint.url} ({role})"] = "not asked yet"

    async def check(self) -> None:
        """Wait until every replica lists its model (StartupError for one serving another)."""
        await all_or_none(
            [
                self.lifecycle.until_ready(
                    f"model server {endpoint.url} ({role})", functools.partial(ask_model, route, endpoint)
                )
                for role, route in self.model_routes()
                for endpoint in route.client.endpoints
            ]
        )

    async def probe_token_prompts(self) -> None:
        for _, route in self.model_routes():
            if route.renderer is not None and route is not self.support:  # support turns always go as chat
                try:  # learn now whether it takes token prompts; a failure here is probed again later
                    await asyncio.wait_for(route.renderer.supported(), 30)
                except (InferenceError, TimeoutError):
                    pass

    async def aclose(self) -> None:
        await self.versions.close()
        for _, route in self.model_routes():
            await route.client.aclose()

    # -- membership ---------------------------------------------------------------------------

    def _replica_key(self, body: ReplicaAdd) -> str | None:
        """The key a replica being added is sent: its `api_key_env`'s value, else the route's (None)."""
        if body.api_key_env is None:
            return None
        if body.api_key_env in self._own_secrets:
            raise Invalid(
                "replica_key_refused",
                f"api_key_env {body.api_key_env} holds one of the service's own keys: name the replica's key",
            )
        if body.api_key_env not in self._replica_keys:
            listed = ", ".join(sorted(self._replica_keys)) or "none"
            raise Invalid(
                "replica_key_not_allowed",
                f"api_key_env {body.api_key_env} is not a variable this service may send to a replica (listed "
                f"at start with --replica-key-envs or --vllm-api-key-env: {listed})",
            )
        key = os.environ.get(body.api_key_env)
        if not key:
            raise Invalid(
                "replica_key_missing", f"api_key_env {body.api_key_env}: not set in the service's environment"
            )
        return key

    async def add(self, body: ReplicaAdd) -> ReplicaState:
        """Route to one more replica of the policy (or support) model. It must list the model
        within `timeout_s`; a policy replica is routed to only once it serves the current version
        (brought there like a restarted one: adapter loaded, full weights reloaded)."""
        self.lifecycle.refuse_unless_ready()
        route = self.route(body.role)
        await self.allowed.check(body.url, f"{body.role} replica")  # before anything is asked of it
        endpoint = route.client.new_endpoint(body.url, api_key=self._replica_key(body))
        if any(e.url == endpoint.url for e in route.client.endpoints) or endpoint.url in self.adding:
            raise Conflict("replica_present", f"{endpoint.url} is a {body.role} replica already")
        self.adding.add(endpoint.url)
        started = time.monotonic()
        try:
            models = await asyncio.wait_for(
                ask_until_ready(functools.partial(ask_model, route, endpoint)), body.timeout_s
            )
            if self.lifecycle.closing:
                raise shutting_down()
            if body.role == "policy":
                if not await self.versions.join(endpoint, models, body.timeout_s - (time.monotonic() - started)):
                    raise Conflict(
                        "policy_busy",
                        f"{body.url} answers, but a policy update (or a restarted replica's restore) still held "
                        f"the replica list at timeout_s={body.timeout_s:g}; a replica joins between them: add it "
                        "again",
                    )
                if self.lifecycle.closing:  # the join waited for the update lock while a stop was asked for
                    raise shutting_down()
            else:
                self.states[body.role].admit(endpoint)
        except TimeoutError:
            raise BackendTimedOut(
                "replica_not_ready", f"{body.url} did not list a model within timeout_s={body.timeout_s:g}"
            ) from None
        except StartupError as exc:
            raise Invalid("replica_refused", str(exc)) from None
        finally:
            self.adding.discard(endpoint.url)
        log.info("%s replica %s added", body.role, endpoint.url)
        # Bringing a policy replica to the current version runs in the background: answer once it
        # is routed, or at the deadline with the reason it is not (yet).
        await route.client.until(
            endpoint,
            lambda: endpoint.excluded is None or endpoint not in route.client.endpoints,
            body.timeout_s - (time.monotonic() - started),
        )
        return self.state(body.role, endpoint)

    def drain(self, body: ReplicaRef) -> ReplicaState:
        """No new turn to this replica: groups pinned there move at their next turn."""
        route, endpoint = self._present(body)
        states = self.states[body.role]
        if states.phase(endpoint) is Phase.DRAINING:
            return self.state(body.role, endpoint)  # asked again (a retry): it drains already
        others = [e for e in route.client.endpoints if e is not endpoint and states.phase(e) is Phase.SERVING]
        if not others:
            raise Conflict(
                "last_replica",
                f"{endpoint.url} is the last {body.role} replica in routing: add one (and let it be routed) first",
            )
        states.drain(endpoint, "draining: no new turn goes to it")
        log.info("%s replica %s draining: no new turn goes to it", body.role, endpoint.url)
        return self.state(body.role, endpoint)

    async def remove(self, body: ReplicaRemove) -> ReplicaState:
        """Drain the replica, wait (up to `timeout_s`) for its turns in flight to end, forget it."""
        route, endpoint = self._present(body)
        if body.role == "policy" and self.versions.paused:
            raise Conflict("policy_paused", "the policy replicas are paused for a weight push: POST /policy first")
        if self.states[body.role].phase(endpoint) is not Phase.DRAINING:
            self.drain(body)
        if not await route.client.until(endpoint, lambda: not endpoint.outstanding, body.timeout_s):
            raise Conflict(
                "replica_busy",
                f"{endpoint.outstanding} requests still run on {endpoint.url} after timeout_s={body.timeout_s:g}; "
                "it stays draining: remove it again later",
            )
        if endpoint not in route.client.endpoints:
            raise NotFound("unknown_replica", f"{endpoint.url} was removed meanwhile")
        state = self.state(body.role, endpoint)
        if body.role == "policy":
            await self.versions.leave(endpoint)
        else:
            self.states[body.role].forget(endpoint)
        log.info("%s replica %s removed", body.role, endpoint.url)
        return state

    def route(self, role: str) -> ModelRoute:
        if role == "support":
            if self.support is None:
                raise Invalid("no_support_model", "this service has no support model (--support-model)")
            return self.support
        return self.policy

    def _present(self, body: ReplicaRef) -> tuple[ModelRoute, Endpoint]:
        self.lifecycle.refuse_unless_ready()
        route = self.route(body.role)
        url = route.client.new_endpoint(body.url).url  # as the client spells it (no /v1)
        endpoint = next((e for e in route.client.endpoints if e.url == url), None)
        if endpoint is None:
            known = ", ".join(e.url for e in route.client.endpoints)
            raise NotFound("unknown_replica", f"no {body.role} replica {body.url} here; present: {known}")
        return route, endpoint

    def state(self, role: str, endpoint: Endpoint) -> ReplicaState:
        return self.states[role].report(endpoint)


def token_prompts(route: ModelRoute) -> str:
    """Whether turns to this route go out as token ids (exact trajectories), for /health/detail."""
    if route.renderer is None:
        return "no: token-ids=false"
    if route.renderer.unsupported:
        return f"no: {route.renderer.unsupported}"
    if route.renderer.end_of_turn is not None:
        return "yes"
    if route.renderer.appends:  # a reasoning template: every segment goes on by appending
        return "yes: the chat template renders history otherwise, so segments keep their tokens (appended)"
    return "not yet probed"


async def ask_model(route: ModelRoute, endpoint: Endpoint) -> list[str]:
    """The models a replica lists (at least one), or NotYet while it is not up; StartupError for
    what waiting cannot fix (not OpenAI-compatible, a key wanted, another model served)."""
    try:
        models = await route.client.list_models(endpoint)
    except InferenceAnswerTooLarge:  # asking again would only read another one: refused at once
        raise StartupError(
            f"model server {endpoint.url}: its answer to GET /v1/models is longer than --max-answer-bytes: "
            "is it an OpenAI-compatible server?"
        ) from None
    except AddressNotAllowed as exc:  # waiting would not change where its name points now
        raise StartupError(f"model server {endpoint.url}: {exc.detail}") from None
    except InferenceUnreachable as exc:
        raise NotYet(f"unreachable ({exc.detail})") from None
    except InferenceError as exc:
        status = exc.status or 0
        if status >= 500 or status in (408, 429):  # starting, overloaded, rate-limited
            raise NotYet(f"GET /v1/models answered {status}") from None
        if status in (401, 403):
            raise StartupError(
                f"model server {endpoint.url} answers GET /v1/models with {status}: it wants an API "
                "key (api-key-env=VAR of --model-endpoint, with VAR set in the service's environment)"
            ) from None
        raise StartupError(
            f"model server {endpoint.url} answers GET /v1/models with {status}: is it an OpenAI-compatible server?"
        ) from None
    except ValueError:  # not JSON, or not the list's shape; what it said is not repeated (see ask_env)
        raise StartupError(
            f"model server {endpoint.url}: GET /v1/models is not an OpenAI model list: "
            "is it an OpenAI-compatible server?"
        ) from None
    if not models:  # a router in front of replicas that have not registered yet
        raise NotYet("GET /v1/models lists no model yet")
    if route.request_model not in models:
        # How many, not which: the names are the backend's words, and a refusal never repeats them.
        raise StartupError(
            f"model server {endpoint.url} does not serve {route.request_model!r} (it lists {len(models)} "
            "other model(s); GET /v1/models on it names them): pass --model (or --support-model, or model= "
            "of --model-endpoint) with one of those names"
        )
    return models
