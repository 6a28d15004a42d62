"""Async client for an environment speaking GraphJin's `env serve --step` contract, with typed errors."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
from pydantic import BaseModel, ConfigDict, Field

# An error text from the env is data for the trainer: keep it, but bounded.
MAX_DETAIL_CHARS = 500


class EnvError(Exception):
    """An environment answered with an error, or could not be reached.

    `retryable` is True for failures on the environment's side (410/500/503/504, transport):
    the attempt failed through no fault of the policy and may be run again.
    """

    retryable = False

    def __init__(self, status: int | None, error: str, message: str = "") -> None:
        self.status, self.error, self.message = status, error, message[:MAX_DETAIL_CHARS]
        super().__init__(f"{status or 'no answer'} {error}: {self.message}".rstrip(": "))


class EnvBadRequest(EnvError):
    """400/405/409: the driver sent something wrong; a bug, never retried."""


class UnknownTask(EnvError):
    """404 unknown_task."""


class EpisodeGone(EnvError):
    """410: ended, abandoned, or reclaimed after sitting idle."""

    retryable = True


class EnvFailure(EnvError):
    """500 episode_failed, 503 no_world_available, 504 episode_timeout, or the env unreachable."""

    retryable = True


_BY_STATUS: dict[int, type[EnvError]] = {400: EnvBadRequest, 404: UnknownTask, 405: EnvBadRequest,
                                         409: EnvBadRequest, 410: EpisodeGone, 500: EnvFailure,
                                         503: EnvFailure, 504: EnvFailure}


class Observation(BaseModel):
    model_config = ConfigDict(extra="allow")
    stage: str = "unknown"
    messages: list[dict[str, Any]] = Field(default_factory=list)
    functions: Any = None
    response_format: Any = None


class StepAnswer(BaseModel):
    """An answer of /step/reset or /step: an observation, or the final form (`done: true`)."""

    model_config = ConfigDict(extra="allow")
    episode_id: str
    task_id: str | None = None
    slug: str | None = None
    done: bool = False
    observation: Observation | None = None
    # Final form; GraphJin omits these when empty or false.
    status: str | None = None
    answer: Any = None
    pass_: bool = Field(False, alias="pass")
    reward: float = 0.0
    score: dict[str, Any] | None = None

    @property
    def failure_category(self) -> str | None:
        return (self.score or {}).get("failure_category") or None


class EnvHealth(BaseModel):
    model_config = ConfigDict(extra="allow")
    status: str
    workers: int = Field(ge=1)
    tasks: int = 0
    dataset: dict[str, Any] = Field(default_factory=dict)
    reward_version: str = ""
    reward_profile: str = ""
    suite: dict[str, Any] = Field(default_factory=dict)
    capabilities: dict[str, Any] = Field(default_factory=dict)

    @property
    def pool(self) -> int:
        return int(self.capabilities.get("pool") or self.workers)

    @property
    def side(self) -> str | None:
        return self.capabilities.get("side")

    @property
    def fingerprint(self) -> str:
        return str(self.dataset.get("catalog_hash", ""))


class EnvTask(BaseModel):
    model_config = ConfigDict(extra="allow")
    task_id: str
    slug: str = ""
    prompt: str = ""
    category: str = ""
    difficulty: str = ""
    writes: bool = False
    family: str | None = None


class EnvClient:
    """One environment server. `timeout_s` bounds a single reset/step call on our side."""

    def __init__(self, base_url: str, *, timeout_s: float = 330.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=512)
        self._http = httpx.AsyncClient(base_url=self.base_url, timeout=httpx.Timeout(timeout_s, connect=10.0),
                                       limits=limits, transport=transport)

    async def aclose(self) -> None:
        await self._http.aclose()

    async def health(self) -> EnvHealth:
        return EnvHealth.model_validate(await self._call("GET", "/health"))

    async def tasks(self) -> list[EnvTask]:
        data = await self._call("GET", "/tasks")
        return [EnvTask.model_validate(t) for t in data.get("tasks", [])]

    async def reset(self, task_id: str, reward_profile: str | None = None) -> StepAnswer:
        """Start an episode. If the caller is cancelled meanwhile, the reset still completes and
        its episode is abandoned: the env starts it either way, and only its id can give it back."""
        body: dict[str, Any] = {"task_id": task_id}
        if reward_profile:
            body["reward_profile"] = reward_profile
        call = asyncio.ensure_future(self._call("POST", "/step/reset", json=body))
        try:
            data = await asyncio.shield(call)
        except asyncio.CancelledError:
            await asyncio.wait([call])
            if not call.cancelled() and call.exception() is None:
                started = call.result()
                if started.get("episode_id") and not started.get("done"):
                    await self.abandon_quietly(str(started["episode_id"]))
            raise
        return StepAnswer.model_validate(data)

    async def step(self, episode_id: str, completion: str, prompt_tokens: int,
                   completion_tokens: int) -> StepAnswer:
        body = {"episode_id": episode_id, "completion": completion,
                "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
        return StepAnswer.model_validate(await self._call("POST", "/step", json=body))

    async def abandon(self, episode_id: str) -> None:
        """DELETE the episode; 410 means its world is already back, which is what we want."""
        try:
            await self._call("DELETE", f"/step/{episode_id}", timeout=30.0)
        except EpisodeGone:
            pass

    async def abandon_quietly(self, episode_id: str) -> bool:
        """Abandon from a cleanup path: never raises, never cancelled half-way. True if it went through."""
        task = asyncio.ensure_future(self.abandon(episode_id))
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            # Our caller is being cancelled, but the world must still go back: finish first.
            await asyncio.wait([task])
            raise
        except Exception:
            return False
        return True

    async def _call(self, method: str, path: str, *, json: Any = None, timeout: float | None = None) -> dict:
        kwargs: dict[str, Any] = {}
        if json is not None:
            kwargs["json"] = json
        if timeout is not None:
            kwargs["timeout"] = timeout
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.TimeoutException as exc:
            raise EnvFailure(None, "transport_timeout", f"{method} {path}: {type(exc).__name__}") from None
        except httpx.HTTPError as exc:
            raise EnvFailure(None, "transport_error", f"{method} {path}: {type(exc).__name__}: {exc}") from None
        try:
            data = response.json()
        except ValueError:
            data = {}
        if response.status_code >= 400:
            error = data.get("error", "http_error") if isinstance(data, dict) else "http_error"
            message = data.get("message", "") if isinstance(data, dict) else response.text
            cls = _BY_STATUS.get(response.status_code, EnvFailure if response.status_code >= 500 else EnvBadRequest)
            raise cls(response.status_code, str(error), str(message))
        if not isinstance(data, dict):
            raise EnvFailure(response.status_code, "invalid_answer", "the environment answered with non-object JSON")
        return data
