"""Async client for an environment speaking GraphJin's `env serve --step` contract, with typed errors."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar
from urllib.parse import quote

import msgspec
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .addresses import AddressPolicy
from .transport import (
    DEFAULT_MAX_ANSWER_BYTES,
    AddressRefused,
    AnswerTooLarge,
    ConnectRefused,
    EncodedAnswer,
    HttpAnswer,
    HttpTransport,
    TransportError,
    TransportTimeout,
    make_transport,
)

if TYPE_CHECKING:
    pass

# An error text from the env is data for the trainer: keep it, but bounded.
MAX_DETAIL_CHARS = 500


class EnvError(Exception):
    """An environment answered with an error, or could not be reached.

    Subclasses say which; `kind` names it in results. `retryable`: the attempt failed through no
    fault of the policy and may be run again. `episode_over`: the env has already ended the
    episode and given its world back, so there is nothing to abandon.
    """

    kind: ClassVar[str] = "env_episode_failed"
    retryable: ClassVar[bool] = True
    episode_over: ClassVar[bool] = False

    def __init__(self, status: int | None, error: str, message: str = "") -> None:
        self.status, self.error, self.message = status, error, message[:MAX_DETAIL_CHARS]
        super().__init__(f"{status or 'no answer'} {error}: {self.message}".rstrip(": "))


class EnvUnreachable(EnvError):
    """No answer: connection refused or reset, or the transport timed out."""

    kind = "env_unreachable"


class EnvDown(EnvUnreachable):
    """Connection refused: no env process is listening. Its episodes went with it (a restarted env
    starts with every world free), so there is nothing to abandon."""

    episode_over = True


class EnvAddressRefused(EnvUnreachable):
    """The env's name resolves now to an address the service may not reach (--allow-backends): not
    connected to, nothing sent."""


class EnvAnswerTooLarge(EnvError):
    """An answer longer than --max-answer-bytes: cut off as it came. The env may have started or
    advanced the episode all the same, so it is abandoned."""

    kind = "env_answer_too_large"


class EnvRejected(EnvError):
    """400/405/409: the env refused what the service sent; a bug, never retried."""

    kind = "env_rejected"
    retryable = False


class UnknownTask(EnvRejected):
    """404 unknown_task."""


class EpisodeGone(EnvError):
    """410: ended, abandoned, or reclaimed after sitting idle."""

    kind = "env_gone"
    episode_over = True


class EpisodeFailed(EnvError):
    """500 episode_failed: preparation or grading failed."""

    kind = "env_episode_failed"


class NoWorldAvailable(EnvError):
    """503 no_world_available."""

    kind = "env_no_world"


class EpisodeTimeout(EnvError):
    """504 episode_timeout: the env reclaimed the world itself."""

    kind = "env_episode_timeout"
    episode_over = True


class BadEnvAnswer(EnvError):
    """A 2xx answer the contract does not allow (not JSON, wrong shape). `episode_id`: the episode
    the answer named, if it named one, so that it can still be abandoned."""

    kind = "env_bad_answer"
    episode_id: str | None = None


_BY_STATUS: dict[int, type[EnvError]] = {
    400: EnvRejected,
    404: UnknownTask,
    405: EnvRejected,
    409: EnvRejected,
    410: EpisodeGone,
    500: EpisodeFailed,
    503: NoWorldAvailable,
    504: EpisodeTimeout,
}


# An episode's answers come every turn: decoded by msgspec into the structs below in one pass (in C,
# fields the service does not read skipped), not parsed into dicts and then validated by pydantic.
# Lax as the pydantic model they replace was (strict=False): a number or a bool may come as its string
# ("1.5", "true"), but a number is not a string (an episode_id of 5 is refused).


class Observation(msgspec.Struct):
    stage: str = "unknown"
    messages: list[dict[str, Any]] = msgspec.field(default_factory=list)
    functions: Any = None
    response_format: Any = None


class StepAnswer(msgspec.Struct):
    """An answer of /step/reset or /step: an observation, or the final form (`done: true`)."""

    episode_id: str
    task_id: str | None = None
    slug: str | None = None
    done: bool = False
    observation: Observation | None = None
    # Final form; GraphJin omits these when empty or false.
    status: str | None = None
    answer: Any = None
    pass_: bool = msgspec.field(default=False, name="pass")
    reward: float = 0.0
    score: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not math.isfinite(self.reward):  # NaN would silently void every advantage
            raise ValueError("reward must be a finite number")

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

    @model_validator(mode="after")
    def _pool_is_a_count(self) -> EnvHealth:
        pool = self.capabilities.get("pool")
        if pool is not None and (not isinstance(pool, int) or isinstance(pool, bool) or pool < 1):
            # Its type, not its value: the value is the env's words, and this message reaches a 422.
            shown = pool if isinstance(pool, int) and not isinstance(pool, bool) else f"a {type(pool).__name__}"
            raise ValueError(f"capabilities.pool must be a whole number of worlds, at least 1, not {shown}")
        return self

    @property
    def pool(self) -> int:
        return int(self.capabilities.get("pool") or self.workers)

    @property
    def side(self) -> str | None:
        return self.capabilities.get("side")

    @property
    def catalog_hash(self) -> str:
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

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 330.0,
        max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
        http: HttpTransport | None = None,
        token: str | None = None,
        address_policy: AddressPolicy | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        # The env's own token (refenv --token): held back until `accept`, so that a URL that has not
        # shown it is an env (its /health read and checked) never sees it. /health never carries it
        # (the contract keeps it open). Envs that ask for no token ignore it.
        self._token_headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._headers: dict[str, str] = {}
        # An agent server (its /health lists the "agent" drive mode): episodes are runs, POST /run and
        # DELETE /run/{attempt_id} (docs/agents.md), not /step.
        self.agent = False
        # `http`: the client to call the env with (a test's stand-in); otherwise the service's own stack.
        # `address_policy`: where it may connect (see CheckedResolver).
        self._http = http or make_transport(timeout_s, max_answer_bytes=max_answer_bytes, address_policy=address_policy)

    async def aclose(self) -> None:
        await self._http.aclose()

    def accept(self) -> None:
        """Its /health was read and it speaks the step contract: every call but /health carries
        the token from now on."""
        self._headers = self._token_headers

    async def health(self) -> EnvHealth:
        return _validate(EnvHealth, _object(await self._call("GET", "/health", headers={}), "GET /health"))

    async def tasks(self) -> list[EnvTask]:
        data = _object(await self._call("GET", "/tasks"), "GET /tasks")
        tasks = data.get("tasks", [])
        if not isinstance(tasks, list):
            raise BadEnvAnswer(200, "invalid_answer", "GET /tasks: `tasks` is not a list")
        return [_validate(EnvTask, t) for t in tasks]

    async def reset(self, task_id: str, reward_profile: str | None = None) -> StepAnswer:
        """Start an episode. A caller that may be cancelled mid-call must keep this call running
        (shield it) and abandon the episode it starts: the env starts it either way."""
        body: dict[str, Any] = {"task_id": task_id}
        if reward_profile:
            body["reward_profile"] = reward_profile
        answer = await self._call("POST", "/step/reset", json=body)
        try:
            return _step_answer(answer, "POST /step/reset")
        except BadEnvAnswer as exc:
            # The env may have started the episode all the same: keep its id so it can be given back.
            try:
                data = answer.json()
            except ValueError:
                raise exc from None
            named = data.get("episode_id") if isinstance(data, dict) else None
            if isinstance(named, str) and not data.get("done"):
                exc.episode_id = named
            raise

    async def step(self, episode_id: str, completion: str, prompt_tokens: int, completion_tokens: int) -> StepAnswer:
        body = {
            "episode_id": episode_id,
            "completion": completion,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
        }
        return _step_answer(await self._call("POST", "/step", json=body), "POST /step")

    async def run(self, body: dict[str, Any], timeout_s: float) -> StepAnswer:
        """An agent server's episode, run whole: its final form (the step contract's), read as a step
        answer of the attempt's id. `timeout_s` bounds the call (the attempt's own deadline)."""
        answer = await self._call("POST", "/run", json=body, timeout=timeout_s)
        data = _object(answer, "POST /run")
        if data.get("done") is not True:
            raise BadEnvAnswer(answer.status, "invalid_answer", "POST /run: the answer is not a final form (done)")
        try:
            return msgspec.convert({**data, "episode_id": body["attempt_id"]}, StepAnswer, strict=False)
        except (msgspec.ValidationError, ValueError) as exc:
            raise BadEnvAnswer(answer.status, "invalid_answer", f"POST /run: {exc}") from None

    async def abandon(self, episode_id: str) -> None:
        """DELETE the episode (an agent server's run); 410 means its world is already back, which is
        what we want."""
        where = "/run" if self.agent else "/step"
        try:
            answer = await self._call("DELETE", f"{where}/{quote(episode_id, safe='')}", timeout=30.0)
            _object(answer, f"DELETE {where}")
        except EpisodeGone:
            pass

    async def _call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        timeout: float | None = None,  # noqa: ASYNC109 - a per-request deadline
        headers: dict[str, str] | None = None,
    ) -> HttpAnswer:
        """A 2xx answer, unread, or the EnvError that says why not."""
        try:
            response = await self._http.request(
                method,
                self.base_url + path,
                json=json,
                timeout=timeout,
                headers=self._headers if headers is None else headers,
            )
        except TransportTimeout as exc:
            raise EnvUnreachable(None, "transport_timeout", f"{method} {path}: {exc}") from None
        except AddressRefused as exc:
            raise EnvAddressRefused(None, "backend_not_allowed", f"{method} {path}: {exc}") from None
        except ConnectRefused as exc:
            raise EnvDown(None, "transport_error", f"{method} {path}: {exc}") from None
        except AnswerTooLarge as exc:
            raise EnvAnswerTooLarge(None, "answer_too_large", f"{method} {path}: {exc}") from None
        except EncodedAnswer as exc:
            raise BadEnvAnswer(None, "invalid_answer", f"{method} {path}: {exc}") from None
        except TransportError as exc:
            raise EnvUnreachable(None, "transport_error", f"{method} {path}: {exc}") from None
        if response.status >= 400:
            try:
                data = response.json()
            except ValueError:
                data = None
            error = data.get("error", "http_error") if isinstance(data, dict) else "http_error"
            message = data.get("message", "") if isinstance(data, dict) else response.text
            cls = _BY_STATUS.get(response.status, EpisodeFailed if response.status >= 500 else EnvRejected)
            raise cls(response.status, str(error), str(message))
        return response


def _object(answer: HttpAnswer, call: str) -> dict:
    """A 2xx answer's body as the JSON object the contract says it is, or BadEnvAnswer."""
    try:
        data = answer.json()
    except ValueError:
        data = None
    if not isinstance(data, dict):
        raise BadEnvAnswer(answer.status, "invalid_answer", f"{call}: the answer is not a JSON object")
    return data


_STEP_ANSWER = msgspec.json.Decoder(StepAnswer, strict=False)


def _step_answer(answer: HttpAnswer, call: str) -> StepAnswer:
    """An episode's answer as a StepAnswer, or BadEnvAnswer naming what does not fit the contract. A
    body msgspec refuses is read again as the transport reads JSON (which makes a lone surrogate
    escape encodable) and converted from that, or the error says why not."""
    try:
        return _STEP_ANSWER.decode(answer.body)
    except msgspec.DecodeError:
        pass
    data = _object(answer, call)
    try:
        return msgspec.convert(data, StepAnswer, strict=False)
    except msgspec.ValidationError as exc:
        raise BadEnvAnswer(answer.status, "invalid_answer", f"StepAnswer: {exc}") from None


_M = TypeVar("_M", bound=BaseModel)


def _validate(model: type[_M], data: Any) -> _M:
    """`data` as `model`, or BadEnvAnswer naming what does not fit the contract."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "answer"
        raise BadEnvAnswer(200, "invalid_answer", f"{model.__name__}: {where}: {first.get('msg')}") from None
