"""Replicas of one model server, as one: which replica a request goes to (groups pinned to one, so
that their shared prompt prefix is cached there; new groups to the one with the fewest episodes in
flight), how many turns at once each is sent (kv_admission.py), replicas added,
drained and removed at runtime, failover and exclusion, and an optional request rate cap. The calls
themselves are each replica's Engine's (rollout_service/backends/engine.py)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from .addresses import AddressPolicy
from .answers import Completion, TokenizeAnswer
from .engine import Engine, VllmServer
from .errors import BadInferenceResponse, InferenceError, InferenceServerError, InferenceTimeout, InferenceUnreachable
from .kv_admission import KvAdmission
from .transport import DEFAULT_MAX_ANSWER_BYTES, HttpTransport, make_transport

T = TypeVar("T")


@dataclass
class Endpoint:
    """One model server; `outstanding` counts requests in flight, `groups` the groups pinned to it."""

    url: str
    api_key: str | None = None
    outstanding: int = 0
    groups: int = 0
    failures: int = 0
    last_error: str | None = None
    last_ok: float = 0.0
    excluded: str | None = None  # why no turn is routed here now (e.g. it does not serve the current policy)
    draining: bool = False  # being taken out: it stays out of routing whatever a probe finds
    # Set at each change of `excluded`, and as a draining replica's requests end: see `until`.
    changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False, compare=False)
    engine: Engine | None = field(default=None, repr=False, compare=False)  # its calls; set by the pool


class ReplicaPool:
    """Completions, chat completions and renders over one or more replicas of the same model server.

    Requests of one affinity key (a group) stay on one replica while it answers, so the
    group's shared prompt prefix is cached there; new keys go to the least loaded replica.
    """

    def __init__(
        self,
        urls: list[str],
        *,
        api_key: str | None = None,
        timeout_s: float = 300.0,
        max_requests_per_second: float | None = None,
        token_ids: bool = True,
        max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
        update_timeout_s: float = 600.0,
        http: HttpTransport | None = None,
        engine: Callable[[str], Engine] | None = None,
        address_policy: AddressPolicy | None = None,
        kv: KvAdmission | None = None,
    ) -> None:
        """`http`: the client to call the servers with (a test's stand-in); otherwise the service's own
        stack, connecting where `address_policy` allows. `engine`: what speaks to the replica at a
        URL; vLLM's server (VllmServer) unless given. `update_timeout_s`: the deadline of an adapter load
        or weight reload (VllmServer). `kv`: the bound on each replica's turns in flight (none unless
        given)."""
        if not urls:
            raise ValueError("at least one model server URL is needed")
        self.api_key = api_key
        self.token_ids = token_ids
        self._http = http or make_transport(timeout_s, max_answer_bytes=max_answer_bytes, address_policy=address_policy)
        self._engine = engine
        self._update_timeout_s = update_timeout_s
        self.endpoints = [self.new_endpoint(u) for u in urls]
        self._pins: dict[str, Endpoint] = {}
        # Episodes in flight per affinity key (a group's attempts), as `episode` counts them; a key
        # pinned without any counted weighs one.
        self._episodes: dict[str, int] = {}
        self._turn = 0  # rotates the ties among equally loaded replicas
        self.kv = kv or KvAdmission(self.metrics_text, mode="off")
        self._deadline_s = timeout_s
        self._routable_again = asyncio.Event()
        # Told of every failure on a replica before the client retries elsewhere; may exclude it.
        self.on_failure: Callable[[Endpoint, InferenceError], None] | None = None
        self._throttle = None
        if max_requests_per_second:
            from asyncio_throttle import Throttler

            # Throttler counts requests per period; spread R/s as ceil(R) per ceil(R)/R seconds.
            rate = max(1, int(max_requests_per_second + 0.999))
            self._throttle = Throttler(rate_limit=rate, period=rate / max_requests_per_second)

    async def aclose(self) -> None:
        await self.kv.aclose()
        await self._http.aclose()

    async def metrics_text(self, url: str) -> str:
        """A replica's /metrics (Prometheus text); raises on no answer or one not 200."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        answer = await self._http.request("GET", f"{url}/metrics", headers=headers, timeout=5.0)
        if answer.status != 200:
            raise ValueError(f"HTTP {answer.status}")
        return answer.text

    # -- routing -------------------------------------------------------------------------------

    # Only the server's replica states (server/policy/replica_states.py) call these five: the pool
    # routes as they say, and never decides a replica's standing itself.

    def exclude(self, endpoint: Endpoint, reason: str) -> None:
        """Take a replica out of routing, saying why (a draining one stays as it is)."""
        if endpoint.draining:
            return
        endpoint.excluded = reason
        endpoint.changed.set()

    def readmit(self, endpoint: Endpoint) -> None:
        """Put a replica back in routing (not while it drains)."""
        if endpoint.draining:
            return
        endpoint.excluded = None
        endpoint.changed.set()
        self._routable_again.set()

    # -- membership: replicas added, drained and removed at runtime ----------------------------

    def new_endpoint(self, url: str, api_key: str | None = None) -> Endpoint:
        """An endpoint for `url` with `api_key`, else this client's key, not yet routed to (see `add`)."""
        base = _base(url)
        key = self.api_key if api_key is None else api_key
        engine = self._engine(base) if self._engine is not None else self._vllm(base, key)
        return Endpoint(base, key, engine=engine)

    def _vllm(self, url: str, api_key: str | None) -> Engine:
        return VllmServer(
            url, self._http, api_key=api_key, token_ids=self.token_ids, update_timeout_s=self._update_timeout_s
        )

    def add(self, endpoint: Endpoint, excluded: str | None = None) -> None:
        """Route to one more replica, at once or once `readmit(endpoint)` lets it in."""
        self.endpoints.append(endpoint)
        if excluded is None:
            self.readmit(endpoint)
        else:
            self.exclude(endpoint, excluded)

    def drain(self, endpoint: Endpoint, why: str) -> None:
        """No new turn goes to it; groups pinned there move at their next turn, turns in flight end."""
        endpoint.excluded = why
        endpoint.draining = True
        endpoint.changed.set()

    def remove(self, endpoint: Endpoint) -> None:
        self.endpoints.remove(endpoint)
        self.kv.forget(endpoint.url)
        for key in [k for k, e in self._pins.items() if e is endpoint]:
            self.unpin(key)
        endpoint.changed.set()

    @staticmethod
    async def until(endpoint: Endpoint, condition: Callable[[], bool], timeout_s: float) -> bool:
        """Wait until `condition()` holds (checked at each change of the endpoint), up to `timeout_s`;
        whether it holds."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            endpoint.changed.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(endpoint.changed.wait(), remaining)
            except TimeoutError:
                return condition()
        return True

    def routable(self) -> list[Endpoint]:
        return [e for e in self.endpoints if e.excluded is None]

    async def _wait_routable(self) -> list[Endpoint]:
        """The replicas in routing; while there is none (all restarting, or being brought up to the
        current policy), wait for one, up to the request deadline."""
        deadline = time.monotonic() + self._deadline_s
        while not (endpoints := self.routable()):
            self._routable_again.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                reasons = "; ".join(f"{e.url}: {e.excluded}" for e in self.endpoints)
                raise InferenceUnreachable(f"no replica is in routing: {reasons}")
            try:
                await asyncio.wait_for(self._routable_again.wait(), remaining)
            except TimeoutError:
                pass
        return endpoints

    def pin(self, key: str, endpoints: list[Endpoint] | None = None) -> Endpoint:
        endpoint = self._pins.get(key)
        if endpoint is not None and endpoint.excluded is not None:
            self.unpin(key)  # its replica left routing: the group moves
            endpoint = None
        if endpoint is None:
            endpoints = endpoints or self.routable() or [e for e in self.endpoints if not e.draining] or self.endpoints
            endpoint = self.least_loaded(endpoints)
            endpoint.groups += 1
            self._pins[key] = endpoint
        return endpoint

    def unpin(self, key: str) -> None:
        endpoint = self._pins.pop(key, None)
        if endpoint is not None:
            endpoint.groups -= 1

    def episodes_on(self) -> dict[str, int]:
        """Episodes in flight per replica URL: those of the groups pinned there."""
        counts = dict.fromkeys((e.url for e in self.endpoints), 0)
        for key, endpoint in self._pins.items():
            counts[endpoint.url] = counts.get(endpoint.url, 0) + self._episodes.get(key, 1)
        return counts

    def least_loaded(self, endpoints: list[Endpoint]) -> Endpoint:
        """The replica with the fewest episodes in flight (then fewest requests), one that failed last
        only if all did; equal ones take new work in turn, not always the first listed.

        Episodes, not groups: a group with one long attempt left weighs less than one just begun, and
        counting groups piles new ones onto the replica whose groups are all still at full width.
        Episodes, not tokens in flight: an episode between turns (its env stepping) holds no request
        but will send its next turn here, so a snapshot of requests undercounts the sticky load."""
        episodes = self.episodes_on()
        self._turn += 1
        order = {id(e): (i - self._turn) % len(endpoints) for i, e in enumerate(endpoints)}
        return min(endpoints, key=lambda e: (e.failures > 0, episodes.get(e.url, 0), e.outstanding, order[id(e)]))

    async def episode(self, key: str, run: Awaitable[T]) -> T:
        """Await `run`, one episode of affinity `key`, counted in its replica's load meanwhile."""
        self._episodes[key] = self._episodes.get(key, 0) + 1
        try:
            return await run
        finally:
            left = self._episodes[key] - 1
            if left:
                self._episodes[key] = left
            else:
                del self._episodes[key]

    # -- requests ------------------------------------------------------------------------------

    async def list_models(self, endpoint: Endpoint) -> list[str]:
        """The models a replica serves. Raises InferenceUnreachable (no answer), InferenceServerError
        (5xx), InferenceRejected (4xx; its `status` says which) or ValueError (not a model list)."""
        return await engine_of(endpoint).models()

    async def chat(
        self,
        *,
        model: str,
        messages: list[dict],
        sampling: Mapping[str, Any],
        n: int = 1,
        response_format: Any = None,
        affinity: str | None = None,
    ) -> Completion:
        """One chat completion; `sampling` holds temperature, top_p, max_tokens, seed, stop (None = unset).
        The server renders `messages` with its chat template and tokenizes them."""
        return await self._with_failover(
            affinity,
            lambda e: self._call(
                e,
                lambda engine: engine.chat(
                    model=model, messages=messages, sampling=sampling, n=n, response_format=response_format
                ),
                throttled=True,
            ),
        )

    async def complete(
        self,
        *,
        model: str,
        prompt_token_ids: list[int],
        sampling: Mapping[str, Any],
        response_format: Any = None,
        affinity: str | None = None,
    ) -> Completion:
        """One completion of a prompt given as token ids: nothing the model sampled earlier is tokenized
        again."""
        return await self._with_failover(
            affinity,
            lambda e: self._call(
                e,
                lambda engine: engine.complete(
                    model=model, prompt_token_ids=prompt_token_ids, sampling=sampling, response_format=response_format
                ),
                throttled=True,
            ),
        )

    async def tokenize(
        self,
        *,
        model: str,
        messages: list[dict] | None = None,
        text: str | None = None,
        add_generation_prompt: bool = True,
        affinity: str | None = None,
    ) -> TokenizeAnswer:
        """`messages` as the server's chat template renders them (vLLM's /tokenize), or plain `text`
        without special tokens: the answer, unread. A server without /tokenize answers
        InferenceRejected(404)."""

        def send(endpoint: Endpoint) -> Awaitable[TokenizeAnswer]:
            return self._call(
                endpoint,
                lambda engine: engine.tokenize(
                    model=model, messages=messages, text=text, add_generation_prompt=add_generation_prompt
                ),
            )

        # Not reported to on_failure: a tokenizer answer says nothing about which weights a replica serves.
        return await self._with_failover(affinity, send, report=False)

    async def _with_failover(
        self, affinity: str | None, send: Callable[[Endpoint], Awaitable[T]], report: bool = True
    ) -> T:
        endpoint = await self._choose(affinity)
        try:
            return await send(endpoint)
        except InferenceError as exc:
            if report and self.on_failure is not None:
                self.on_failure(endpoint, exc)
            if endpoint.excluded is None and not (exc.replica_down and len(self.routable()) > 1):
                raise
            # The replica is down, or was just taken out of routing (it may have restarted on other
            # weights): try once more on one in routing, waiting for one if there is none now.
            if affinity:
                self.unpin(affinity)
            if endpoint.excluded is None:  # down, but still routed: prefer any other replica
                others = [e for e in self.routable() if e is not endpoint]
                other = self.pin(affinity, others) if affinity else self.least_loaded(others)
            else:
                other = await self._choose(affinity)
            return await send(other)

    async def _choose(self, affinity: str | None) -> Endpoint:
        endpoints = self.routable()
        if not endpoints:
            endpoints = await self._wait_routable()
        if affinity:
            return self.pin(affinity, endpoints)
        return self.least_loaded(endpoints)

    async def _call(self, endpoint: Endpoint, call: Callable[[Engine], Awaitable[T]], throttled: bool = False) -> T:
        """`call` on one replica, counted in its load while it runs (and while it waits for the rate cap
        or the replica's KV bound: a removal waits for it), its failures kept on the endpoint."""
        endpoint.outstanding += 1
        try:
            if throttled and self._throttle is not None:
                async with self._throttle:
                    pass
            # Only turns (throttled calls) take a place under the replica's KV bound.
            async with self.kv.slot(endpoint.url) if throttled else contextlib.nullcontext():
                result = await call(engine_of(endpoint))
        except (InferenceTimeout, InferenceUnreachable, InferenceServerError) as exc:
            endpoint.failures += 1
            endpoint.last_error = f"{exc.status}: {exc.detail}" if exc.status else f"{exc.kind}: {exc.detail}"
            raise
        except BadInferenceResponse:
            _answered(endpoint)  # it answered: a shape this client cannot use is not the replica down
            raise
        finally:
            endpoint.outstanding -= 1
            if endpoint.draining:
                endpoint.changed.set()
        _answered(endpoint)
        return result


def _answered(endpoint: Endpoint) -> None:
    endpoint.failures, endpoint.last_error, endpoint.last_ok = 0, None, time.time()


def engine_of(endpoint: Endpoint) -> Engine:
    """The calls of the replica at `endpoint` (set when its pool made it)."""
    assert endpoint.engine is not None, "endpoints are made by their pool's new_endpoint"
    return endpoint.engine


def _base(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")
