"""Async client for OpenAI-compatible chat completions (vLLM first), spread over replicas.

Token-in/token-out: with vLLM the client asks for `return_token_ids` and `logprobs`, so every
choice carries the exact prompt and completion token ids and one logprob per completion token.
A server that does not return them (another OpenAI-compatible server) yields `None` there.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field

MAX_DETAIL_CHARS = 500


class SamplingParams(BaseModel):
    """Sampling as sent to the model server."""

    model_config = ConfigDict(extra="forbid")
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_tokens: int = Field(256, ge=1, le=32768)
    seed: int | None = Field(None, ge=0, le=2**31 - 1)
    stop: list[str] | None = Field(None, max_length=8)


class InferenceError(Exception):
    """A chat completion could not be had: `reason` is a short code, `detail` the server's words."""

    def __init__(self, reason: str, detail: str = "", status: int | None = None) -> None:
        self.reason, self.detail, self.status = reason, detail[:MAX_DETAIL_CHARS], status
        super().__init__(f"{reason}: {self.detail}" if detail else reason)


@dataclass
class Choice:
    text: str
    finish_reason: str | None
    completion_token_ids: list[int] | None
    logprobs: list[float] | None


@dataclass
class ChatResult:
    endpoint: str
    model: str
    prompt_token_ids: list[int] | None
    prompt_tokens: int
    choices: list[Choice]
    latency_s: float


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

    @property
    def load(self) -> tuple[int, int]:
        return (self.groups, self.outstanding)


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

    def __init__(self, urls: list[str], *, api_key: str | None = None, timeout_s: float = 300.0,
                 max_requests_per_second: float | None = None, token_ids: bool = True) -> None:
        if not urls:
            raise ValueError("at least one model server URL is needed")
        self.endpoints = [Endpoint(_base(u), api_key) for u in urls]
        self.token_ids = token_ids
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=1024)
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits)
        self._pins: dict[str, Endpoint] = {}
        self._throttle = None
        if max_requests_per_second:
            from asyncio_throttle import Throttler

            # Throttler counts requests per period; spread R/s as ceil(R) per ceil(R)/R seconds.
            rate = max(1, int(max_requests_per_second + 0.999))
            self._throttle = Throttler(rate_limit=rate, period=rate / max_requests_per_second)

    async def aclose(self) -> None:
        await self._http.aclose()

    # -- routing -------------------------------------------------------------------------------

    def pin(self, key: str) -> Endpoint:
        endpoint = self._pins.get(key)
        if endpoint is None:
            endpoint = min(self.endpoints, key=lambda e: (e.failures > 0, e.load))
            endpoint.groups += 1
            self._pins[key] = endpoint
        return endpoint

    def unpin(self, key: str) -> None:
        endpoint = self._pins.pop(key, None)
        if endpoint is not None:
            endpoint.groups -= 1

    # -- requests ------------------------------------------------------------------------------

    async def list_models(self, endpoint: Endpoint) -> list[str]:
        response = await self._http.get(f"{endpoint.url}/v1/models", headers=self._headers(endpoint), timeout=10.0)
        response.raise_for_status()
        return [m["id"] for m in response.json().get("data", [])]

    async def chat(self, *, model: str, messages: list[dict], sampling: SamplingParams, n: int = 1,
                   response_format: Any = None, affinity: str | None = None) -> ChatResult:
        endpoint = self.pin(affinity) if affinity else min(self.endpoints, key=lambda e: e.outstanding)
        try:
            return await self._chat_on(endpoint, model, messages, sampling, n, response_format)
        except InferenceError as exc:
            if exc.reason not in ("unreachable", "server_error") or len(self.endpoints) == 1:
                raise
            # The pinned replica is down: move the group to another one and try once there.
            if affinity:
                self.unpin(affinity)
                self._pins[affinity] = other = min((e for e in self.endpoints if e is not endpoint),
                                                   key=lambda e: e.load)
                other.groups += 1
            else:
                other = min((e for e in self.endpoints if e is not endpoint), key=lambda e: e.outstanding)
            return await self._chat_on(other, model, messages, sampling, n, response_format)

    async def _chat_on(self, endpoint: Endpoint, model: str, messages: list[dict], sampling: SamplingParams,
                       n: int, response_format: Any) -> ChatResult:
        body: dict[str, Any] = {"model": model, "messages": messages, "n": n,
                                **sampling.model_dump(exclude_none=True)}
        if self.token_ids:
            body.update(logprobs=True, return_token_ids=True)
        rf = normalize_response_format(response_format)
        if rf is not None:
            body["response_format"] = rf
        if self._throttle is not None:
            async with self._throttle:
                pass
        endpoint.outstanding += 1
        started = time.monotonic()
        try:
            response = await self._http.post(f"{endpoint.url}/v1/chat/completions", json=body,
                                             headers=self._headers(endpoint))
        except httpx.TimeoutException as exc:
            endpoint.failures += 1
            endpoint.last_error = f"timeout: {type(exc).__name__}"
            raise InferenceError("timeout", f"{endpoint.url}: no answer in time") from None
        except httpx.HTTPError as exc:
            endpoint.failures += 1
            endpoint.last_error = f"unreachable: {exc}"
            raise InferenceError("unreachable", f"{endpoint.url}: {type(exc).__name__}: {exc}") from None
        finally:
            endpoint.outstanding -= 1
        latency = time.monotonic() - started
        if response.status_code >= 400:
            detail = _error_text(response)
            if response.status_code >= 500:
                endpoint.failures += 1
                endpoint.last_error = f"{response.status_code}: {detail}"
                raise InferenceError("server_error", detail, response.status_code)
            raise InferenceError("rejected", detail, response.status_code)
        endpoint.failures, endpoint.last_error, endpoint.last_ok = 0, None, time.time()
        try:
            return _parse(response.json(), endpoint.url, model, latency)
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise InferenceError("bad_response", f"unexpected chat completion shape: {exc}") from None

    def _headers(self, endpoint: Endpoint) -> dict[str, str]:
        return {"Authorization": f"Bearer {endpoint.api_key}"} if endpoint.api_key else {}


def _base(url: str) -> str:
    return url.rstrip("/").removesuffix("/v1")


def _error_text(response: httpx.Response) -> str:
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


def _parse(data: dict, endpoint: str, model: str, latency: float) -> ChatResult:
    choices = []
    for raw in sorted(data["choices"], key=lambda c: c.get("index", 0)):
        logprobs = None
        content_lp = (raw.get("logprobs") or {}).get("content")
        if content_lp is not None:
            logprobs = [float(t["logprob"]) for t in content_lp]
        choices.append(Choice(text=raw["message"].get("content") or "", finish_reason=raw.get("finish_reason"),
                              completion_token_ids=raw.get("token_ids"), logprobs=logprobs))
    usage = data.get("usage") or {}
    prompt_ids = data.get("prompt_token_ids")
    return ChatResult(endpoint=endpoint, model=data.get("model", model), prompt_token_ids=prompt_ids,
                      prompt_tokens=int(usage.get("prompt_tokens") or len(prompt_ids or ())),
                      choices=choices, latency_s=latency)
