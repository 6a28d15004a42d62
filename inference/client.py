"""Async client for OpenAI-compatible model servers (vLLM first), spread over replicas.

Two ways to ask for a completion: `chat` sends messages (the server renders and tokenizes them),
`complete` sends the prompt as token ids (vLLM's /v1/completions), with `tokenize` to render
messages through the server's own chat template. With vLLM both return the exact completion token
ids and one logprob per completion token, and the prompt's ids: the server's render of the messages
(`chat`; a server that does not return ids, another OpenAI-compatible one, yields `None` there), or
the ids sent, once the server's count of them agrees (`complete`, which refuses an answer whose
count differs or whose tokens are not ids).
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, ClassVar, TypeVar

import httpx
from pydantic import StrictInt, TypeAdapter

from .transport import HttpAnswer, HttpTransport, TransportError, TransportTimeout, loads, make_transport

MAX_DETAIL_CHARS = 500
T = TypeVar("T")
# Token ids and logprobs come by the thousand per answer: checked in pydantic-core, not element by
# element in Python. Ids must be ints as sent (a float or a string is a server's bug); logprobs
# may be any JSON number.
_TOKEN_IDS = TypeAdapter(list[StrictInt])
_LOGPROBS = TypeAdapter(list[float])


class InferenceError(Exception):
    """A completion could not be had. Subclasses say why; `kind` names it in results, `detail` is
    the server's words (bounded), `status` its HTTP status where it answered."""

    kind: ClassVar[str] = "inference_server_error"
    # A failure of this server, not of the request: another replica may succeed.
    replica_down: ClassVar[bool] = False

    def __init__(self, detail: str = "", status: int | None = None) -> None:
        self.detail, self.status = detail[:MAX_DETAIL_CHARS], status
        super().__init__(f"{self.kind}: {self.detail}" if detail else self.kind)


class InferenceTimeout(InferenceError):
    """No answer within the client's deadline (--inference-timeout)."""

    kind = "inference_timeout"


class InferenceUnreachable(InferenceError):
    """The server could not be reached, or dropped the connection."""

    kind = "inference_unreachable"
    replica_down = True


class InferenceServerError(InferenceError):
    """The server answered 5xx."""

    kind = "inference_server_error"
    replica_down = True


class InferenceRejected(InferenceError):
    """The server refused the request (4xx)."""

    kind = "inference_rejected"


class ContextOverflow(InferenceRejected):
    """The prompt (plus max_tokens) does not fit the model's context window: the conversation the
    policy produced outgrew it."""

    kind = "context_overflow"


class BadInferenceResponse(InferenceError):
    """A 2xx answer the client cannot use: no choices, wrong shape."""

    kind = "bad_response"


_CONTEXT_OVERFLOW = re.compile(r"maximum context length|context length|context window|too many tokens", re.I)


@dataclass
class Choice:
    text: str
    finish_reason: str | None
    completion_token_ids: list[int] | None
    logprobs: list[float] | None
    completion_tokens: int  # the ids' length, else the server's usage count
    stop_reason: str | int | None = None  # vLLM: the stop string or token id that ended it


@dataclass
class ChatResult:
    endpoint: str
    model: str
    # With a token prompt, the very list the caller sent (not a copy): an exact turn's is its trajectory's,
    # which grows after the turn, so read it before then.
    prompt_token_ids: list[int] | None
    prompt_tokens: int
    choices: list[Choice]
    latency_s: float


_TOKENS_KEY = b'"tokens":['
_MARK = f"rollout-service:{secrets.token_hex(8)}"  # TokenizeAnswer.array
_MARK_JSON = f'"{_MARK}"'.encode()


@dataclass
class TokenizeAnswer:
    """A /tokenize answer's body. A conversation's render is thousands of ids, and a turn mostly needs
    only those after the render it had before: `after` finds them by comparing bytes, never turning
    the known ids into Python objects (a decode, a validation and a list comparison of each)."""

    body: bytes

    def ids(self) -> list[int]:
        try:
            tokens = loads(self.body)["tokens"]
        except (ValueError, KeyError, TypeError) as exc:
            raise BadInferenceResponse(f"unexpected /tokenize answer: {type(exc).__name__}: {exc}") from None
        try:
            return _TOKEN_IDS.validate_python(tokens)
        except ValueError:
            raise BadInferenceResponse("unexpected /tokenize answer: tokens is not a list of ints") from None

    @cached_property
    def array(self) -> bytes | None:
        """The ids as the JSON array the answer holds (b"[1,2,3]"), where it is a compact array of the
        answer's own "tokens" and as long as its "count" says; else None. JSON writes an int one way
        only, so arrays with equal bytes hold equal ids."""
        body = self.body
        at = body.find(_TOKENS_KEY)
        if at < 0:
            return None
        start = at + len(_TOKENS_KEY) - 1
        close = body.find(b"]", start)  # ints only: the first "]" closes the array
        if close < 0:
            return None
        # The answer with the array taken out must be an object whose "tokens" is where the array was
        # (a mark no server writes: not a 0 or a false it may have had under a second "tokens").
        skeleton = body[:start] + _MARK_JSON + body[close + 1 :]
        try:
            shape = loads(skeleton)
        except ValueError:
            return None
        array = body[start : close + 1]
        length = array.count(b",") + 1 if close > start + 1 else 0
        if not isinstance(shape, dict) or shape.get("tokens") != _MARK:
            return None
        count = shape.get("count")
        if type(count) is not int or count != length:
            return None
        return array

    def after(self, known: bytes) -> list[int] | None:
        """The ids after those of `known` (a JSON array as `array` gives) when this answer's begin with
        them and at least one follows; None where the bytes cannot say so for sure (other ids, another
        shape): `ids()` then reads it in whole."""
        array = self.array
        if array is None or len(known) < 3:  # "[]": nothing known
            return None
        prefix = known[:-1] + b","  # "[1,2,3," : the array up to what follows them
        if not array.startswith(prefix):
            return None
        try:
            rest = _TOKEN_IDS.validate_python(loads(b"[" + array[len(prefix) :]))
        except ValueError:
            return None
        return rest or None  # "[1,2, ]" is not JSON: nothing can follow a comma


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

    @property
    def load(self) -> tuple[int, int]:
        return (self.groups, self.outstanding)


def structured_output(response_format: Any) -> dict | None:
    """The env's `response_format` as vLLM's `structured_outputs` for /v1/completions."""
    rf = normalize_response_format(response_format)
    if rf is None or rf["type"] == "text":
        return None
    spec = rf.get("json_schema")
    schema = spec.get("schema") if isinstance(spec, dict) else None
    # Anything but a schema object (a malformed one from the env) constrains to JSON only.
    return {"json": schema} if isinstance(schema, dict) else {"json_object": True}


def normalize_response_format(response_format: Any) -> dict | None:
    """The env's `response_format` as OpenAI's: pass an OpenAI-shaped one through, wrap a bare schema."""
    if not response_format:
        return None
    if isinstance(response_format, dict) and response_format.get("type") in ("json_schema", "json_object", "text"):
        return response_format
    if isinstance(response_format, dict):
        return {"type": "json_schema", "json_schema": {"name": "response", "schema": response_format}}
    return None


class ChatClient:
    """Chat completions over one or more replicas of the same model server.

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
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """`transport`: an httpx transport standing in for the servers (tests); otherwise aiohttp."""
        if not urls:
            raise ValueError("at least one model server URL is needed")
        self.api_key = api_key
        self.endpoints = [Endpoint(_base(u), api_key) for u in urls]
        self.token_ids = token_ids
        self._http: HttpTransport = make_transport(timeout_s, transport)
        self._pins: dict[str, Endpoint] = {}
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
        await self._http.aclose()

    # -- routing -------------------------------------------------------------------------------

    def exclude(self, endpoint: Endpoint, reason: str | None) -> None:
        """Take a replica out of routing (reason) or put it back (None; not while it drains)."""
        if endpoint.draining:
            return
        endpoint.excluded = reason
        endpoint.changed.set()
        if reason is None:
            self._routable_again.set()

    # -- membership: replicas added, drained and removed at runtime ----------------------------

    def new_endpoint(self, url: str) -> Endpoint:
        """An endpoint for `url` with this client's key, not yet routed to (see `add`)."""
        return Endpoint(_base(url), self.api_key)

    def add(self, endpoint: Endpoint, excluded: str | None = None) -> None:
        """Route to one more replica, at once or once `exclude(endpoint, None)` lets it in."""
        self.endpoints.append(endpoint)
        self.exclude(endpoint, excluded)

    def drain(self, endpoint: Endpoint, why: str) -> None:
        """No new turn goes to it; groups pinned there move at their next turn, turns in flight end."""
        endpoint.excluded = why
        endpoint.draining = True
        endpoint.changed.set()

    def remove(self, endpoint: Endpoint) -> None:
        self.endpoints.remove(endpoint)
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
            endpoint = min(endpoints, key=lambda e: (e.failures > 0, e.load))
            endpoint.groups += 1
            self._pins[key] = endpoint
        return endpoint

    def unpin(self, key: str) -> None:
        endpoint = self._pins.pop(key, None)
        if endpoint is not None:
            endpoint.groups -= 1

    # -- requests ------------------------------------------------------------------------------

    async def list_models(self, endpoint: Endpoint) -> list[str]:
        """The models a replica serves. Raises InferenceUnreachable (no answer), InferenceServerError
        (5xx), InferenceRejected (4xx; its `status` says which) or ValueError (not a model list)."""
        try:
            response = await self._http.request(
                "GET", f"{endpoint.url}/v1/models", headers=self._headers(endpoint), timeout=10.0
            )
        except TransportError as exc:
            raise InferenceUnreachable(f"{endpoint.url}: {exc}") from None
        if response.status >= 400:
            cls = InferenceServerError if response.status >= 500 else InferenceRejected
            raise cls(error_text(response), response.status)
        body = response.json()
        data = body.get("data") if isinstance(body, dict) else None
        if not isinstance(data, list) or not all(isinstance(m, dict) and isinstance(m.get("id"), str) for m in data):
            raise ValueError(f"GET /v1/models is not an OpenAI model list: {response.text[:200]!r}")
        return [m["id"] for m in data]

    async def chat(
        self,
        *,
        model: str,
        messages: list[dict],
        sampling: Mapping[str, Any],
        n: int = 1,
        response_format: Any = None,
        affinity: str | None = None,
    ) -> ChatResult:
        """One chat completion; `sampling` holds temperature, top_p, max_tokens, seed, stop (None = unset).
        The server renders `messages` with its chat template and tokenizes them."""
        body: dict[str, Any] = {
            "model": model,
            "messages": messages,
            "n": n,
            **{k: v for k, v in sampling.items() if v is not None},
        }
        if self.token_ids:
            body.update(logprobs=True, return_token_ids=True)
        rf = normalize_response_format(response_format)
        if rf is not None:
            body["response_format"] = rf
        return await self._with_failover(affinity, lambda e: self._generate(e, "/v1/chat/completions", body, model))

    async def complete(
        self,
        *,
        model: str,
        prompt_token_ids: list[int],
        sampling: Mapping[str, Any],
        response_format: Any = None,
        affinity: str | None = None,
    ) -> ChatResult:
        """One completion of a prompt given as token ids (vLLM's /v1/completions): nothing the model
        sampled earlier is tokenized again. The env's response_format becomes a structured-output
        constraint, as the chat endpoint would apply it."""
        body: dict[str, Any] = {
            "model": model,
            "prompt": prompt_token_ids,
            **{k: v for k, v in sampling.items() if v is not None},
            "logprobs": 0,  # the sampled token's own logprob only
            # Each sampled token as "token_id:<id>" beside its logprob. Not `return_token_ids`: that
            # echoes the prompt's ids too, thousands a turn that the service sent itself.
            "return_tokens_as_token_ids": True,
        }
        if sampling.get("stop"):
            # The ids include the tokens that formed a stop string; so must the text the env sees, or the
            # trajectory would hold tokens whose text the env never got.
            body["include_stop_str_in_output"] = True
        constraint = structured_output(response_format)
        if constraint is not None:
            body["structured_outputs"] = constraint
        return await self._with_failover(
            affinity, lambda e: self._generate(e, "/v1/completions", body, model, sent_prompt=prompt_token_ids)
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
        without special tokens: the answer, unread (its ids in whole, or only those after ids the
        caller knows). A server without /tokenize answers InferenceRejected(404)."""
        body: dict[str, Any] = {"model": model}
        if messages is not None:
            body.update(messages=messages, add_generation_prompt=add_generation_prompt)
        else:
            body.update(prompt=text or "", add_special_tokens=False)

        async def send(endpoint: Endpoint) -> TokenizeAnswer:
            response, _ = await self._post(endpoint, "/tokenize", body)
            return TokenizeAnswer(response.body)

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
                other = self.pin(affinity, others) if affinity else min(others, key=lambda e: e.outstanding)
            else:
                other = await self._choose(affinity)
            return await send(other)

    async def _choose(self, affinity: str | None) -> Endpoint:
        endpoints = self.routable()
        if not endpoints:
            endpoints = await self._wait_routable()
        if affinity:
            return self.pin(affinity, endpoints)
        return min(endpoints, key=lambda e: e.outstanding)

    async def _generate(
        self, endpoint: Endpoint, path: str, body: dict[str, Any], model: str, sent_prompt: list[int] | None = None
    ) -> ChatResult:
        if self._throttle is not None:
            endpoint.outstanding += 1  # bound for this replica already: a removal waits for it
            try:
                async with self._throttle:
                    pass
            finally:
                endpoint.outstanding -= 1  # _post counts it again before anything else can run
        response, latency = await self._post(endpoint, path, body)
        try:
            return _parse(response.json(), endpoint.url, model, latency, sent_prompt)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
            raise BadInferenceResponse(f"unexpected completion shape: {type(exc).__name__}: {exc}") from None

    async def _post(self, endpoint: Endpoint, path: str, body: dict[str, Any]) -> tuple[HttpAnswer, float]:
        """POST to one replica: a 2xx answer and its latency, or the InferenceError that says why not."""
        endpoint.outstanding += 1
        started = time.monotonic()
        try:
            response = await self._http.request(
                "POST", f"{endpoint.url}{path}", json=body, headers=self._headers(endpoint)
            )
        except TransportTimeout as exc:
            endpoint.failures += 1
            endpoint.last_error = f"timeout: {exc}"
            raise InferenceTimeout(f"{endpoint.url}: no answer in time") from None
        except TransportError as exc:
            endpoint.failures += 1
            endpoint.last_error = f"unreachable: {exc}"
            raise InferenceUnreachable(f"{endpoint.url}: {exc}") from None
        finally:
            endpoint.outstanding -= 1
            if endpoint.draining:
                endpoint.changed.set()
        latency = time.monotonic() - started
        if response.status >= 400:
            detail = error_text(response)
            if response.status >= 500:
                endpoint.failures += 1
                endpoint.last_error = f"{response.status}: {detail}"
                raise InferenceServerError(detail, response.status)
            if _CONTEXT_OVERFLOW.search(detail):
                raise ContextOverflow(detail, response.status)
            raise InferenceRejected(detail, response.status)
        endpoint.failures, endpoint.last_error, endpoint.last_ok = 0, None, time.time()
        return response, latency

    def _headers(self, endpoint: Endpoint) -> dict[str, str]:
        return {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}


def _base(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")


def error_text(response: HttpAnswer | httpx.Response) -> str:
    try:
        data = response.json()
        if isinstance(data, dict):
            err = data.get("error", data.get("detail", data))
            if isinstance(err, dict):
                return str(err.get("message", err))
            return str(err)
    except ValueError:
        pass
    return response.text


_TOKEN_ID_PREFIX = "token_id:"


def _ids_of_tokens(tokens: Any) -> list[int]:
    """The ids of a completion's logprobs tokens as vLLM writes them with `return_tokens_as_token_ids`
    ("token_id:42"). Read as one JSON array in C: a Python loop over a 1024-token turn took ~0.2 ms."""
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
        raise ValueError("logprobs.tokens is not a list of strings")
    joined = ",".join(tokens)
    if tokens and f",{joined}".count(f",{_TOKEN_ID_PREFIX}") != len(tokens):  # each one begins so
        raise ValueError('logprobs.tokens are not "token_id:<id>" (the server ignored return_tokens_as_token_ids)')
    # Only the prefix each token begins with goes: one inside a token is left to fail the decode.
    ids = _TOKEN_IDS.validate_python(loads(f"[{f',{joined}'.replace(f',{_TOKEN_ID_PREFIX}', ',')[1:]}]"))
    if len(ids) != len(tokens):
        raise ValueError("logprobs.tokens are not one id each")
    return ids


def _parse(data: dict, endpoint: str, model: str, latency: float, sent_prompt: list[int] | None = None) -> ChatResult:
    """The answer as a ChatResult; raises ValueError (or a lookup error) on any shape it cannot use.
    With `sent_prompt` (token ids sent), the result holds the very list sent: the server's count of
    the prompt's tokens must be its length, and prompt ids it echoes anyway must be those (an echo
    of the same numbers in another JSON form, 1.0 for 1, passes: the ids kept are the ones sent)."""
    raw_choices = data["choices"]
    if not isinstance(raw_choices, list) or not raw_choices:
        raise ValueError("the answer has no choices")
    usage = data.get("usage") or {}
    choices = []
    for raw in sorted(raw_choices, key=lambda c: c.get("index", 0)):
        logprobs = None
        raw_lp = raw.get("logprobs") or {}
        if raw_lp.get("content") is not None:  # chat: one entry per token
            logprobs = [float(t["logprob"]) for t in raw_lp["content"]]
        elif raw_lp.get("token_logprobs") is not None:  # completions
            logprobs = _LOGPROBS.validate_python(raw_lp["token_logprobs"])
        ids = raw.get("token_ids")
        if ids is not None:
            ids = _TOKEN_IDS.validate_python(ids)
        elif raw_lp.get("tokens") is not None and sent_prompt is not None:
            ids = _ids_of_tokens(raw_lp["tokens"])
        text = raw["message"].get("content") if "message" in raw else raw["text"]
        text = text or ""
        if not isinstance(text, str):
            raise ValueError("message.content is not text")
        if not isinstance(raw.get("finish_reason"), str | None):
            raise ValueError("finish_reason is not text")
        # Without ids (a non-vLLM server), the server's own count is what the env must be told.
        count = len(ids) if ids is not None else int(usage.get("completion_tokens") or 0) // len(raw_choices)
        choices.append(
            Choice(
                text=text,
                finish_reason=raw.get("finish_reason"),
                completion_token_ids=ids,
                logprobs=logprobs,
                completion_tokens=count,
                stop_reason=raw.get("stop_reason"),
            )
        )
    prompt_ids = data.get("prompt_token_ids")
    if prompt_ids is None and raw_choices[0].get("prompt_token_ids") is not None:  # completions: per choice
        prompt_ids = raw_choices[0]["prompt_token_ids"]
    if sent_prompt is not None:
        if prompt_ids is not None and prompt_ids != sent_prompt:
            raise ValueError("the prompt_token_ids echoed are not the prompt sent")
        # What says the server generated from these ids, now that they are not echoed: its own count.
        counted = usage.get("prompt_tokens")
        if counted != len(sent_prompt):
            raise ValueError(f"the server counted {counted} prompt tokens where {len(sent_prompt)} were sent")
        prompt_ids = sent_prompt
    elif prompt_ids is not None:
        prompt_ids = _TOKEN_IDS.validate_python(prompt_ids)
    return ChatResult(
        endpoint=endpoint,
        model=data.get("model", model),
        prompt_token_ids=prompt_ids,
        prompt_tokens=int(usage.get("prompt_tokens") or len(prompt_ids or ())),
        choices=choices,
        latency_s=latency,
    )
