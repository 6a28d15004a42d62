"""The wire protocol: what a trainer sends to the service and gets back.

Shared by the server and the trainer side, so it imports nothing but pydantic (and httpx's URL
parser, which the trainer's client has anyway).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, get_args

import httpx
from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

# The last segments of what the service itself asks a backend (an env's /health, /tasks, /step,
# /step/reset; a model server's /v1/models, /v1/completions, /v1/chat/completions, /tokenize): a URL
# ending in one names an endpoint, not a server.
_SERVICE_ENDPOINTS = frozenset({"health", "tasks", "step", "reset", "models", "completions", "chat", "tokenize"})
_SEGMENT = re.compile(r"[A-Za-z0-9._~-]+")


def http_url(url: str) -> str:
    """`url`, normalised, if it is the address of a server: http(s)://HOST[:PORT] with an optional base
    path the service extends itself (an env's /health, a model server's /v1/models). A query, a
    fragment, credentials, an encoded or dot segment or a path ending in an endpoint the service asks
    would make the service ask something else than the server's contract (a URL ending in `#` or
    `?x=` swallows the /health appended to it): each is refused, naming what to change."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme.lower() not in ("http", "https") or not rest.split("/", 1)[0]:
        raise ValueError(f"{url!r} is not an http:// or https:// URL with a host")
    if "@" in rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0]:
        # Before any message quotes the URL. A URL is shown in /envs, /health/detail, logs and metrics
        # labels; a model server's key goes in api-key-env.
        raise ValueError("a URL with credentials (user:password@) would show them wherever it is shown: leave them out")
    if "?" in url or "#" in url:
        raise ValueError(
            f"{url!r}: a backend is an address, http(s)://HOST:PORT[/BASE]; leave out the query or fragment "
            "(the service appends the contract's paths itself)"
        )
    try:
        parsed = httpx.URL(url)
        port = parsed.port
    except (httpx.InvalidURL, ValueError) as exc:
        raise ValueError(f"{url!r} is not a valid URL: {exc}") from None
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"{url!r} is not a valid URL: port {port} is out of range")
    _check_base_path(url, rest.partition("/")[2])
    return str(parsed)  # one spelling per server (scheme and host in lower case)


def _check_base_path(url: str, path: str) -> None:
    segments = path.rstrip("/").split("/") if path.rstrip("/") else []
    for segment in segments:
        if not _SEGMENT.fullmatch(segment) or segment in (".", ".."):
            raise ValueError(
                f"{url!r}: the base path may hold letters, digits and . _ ~ - only, in segments other "
                f"than . and .. ({segment!r} is not one)"
            )
    if segments and segments[-1].lower() in _SERVICE_ENDPOINTS:
        raise ValueError(
            f"{url!r} ends in /{segments[-1]}, an endpoint the service asks itself: give the server's "
            "address (http(s)://HOST:PORT, or its base path)"
        )


def short_text(text: str, limit: int) -> str:
    """`text`, cut to about `limit` characters where longer (saying how long it was)."""
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} characters)"


def describe_errors(errors: Sequence[Mapping[str, Any]]) -> str:
    """Validation errors as one line, `field.path: what is wrong` each: the service's 422 and the
    trainer client's own check word them alike."""
    parts = []
    for e in errors[:5]:
        # A dict's key is part of the path: cut each part short, or a huge key would come back whole.
        loc = ".".join(short_text(str(p), 40) for p in e.get("loc", ()) if p != "body") or "body"
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


def _not_text_or_bool(kind: str) -> BeforeValidator:
    def check(value: Any) -> Any:
        # pydantic's lax mode would read `"n": true` as n=1 and `"n": "8"` as 8: a sender's mistake run
        # as if meant. Numbers only (numpy's included, which a trainer may compute its seeds with).
        if isinstance(value, bool | str | bytes | bytearray):
            sent = "a boolean" if isinstance(value, bool) else "a string"
            raise PydanticCustomError(f"{kind}_type", f"Input should be a valid {kind}, not {sent}")
        return value

    return BeforeValidator(check)


def _true_or_false(value: Any) -> Any:
    # Not pydantic's Strict(), which refuses numpy's bool (`allow_greedy=temps[i] == 0` in a trainer).
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    raise PydanticCustomError("bool_type", "Input should be a valid boolean, true or false")


# A request's numbers and switches as JSON has them: a float field takes an integer (JSON has one number
# type: `"temperature": 1` is meant), nothing takes a string, and a switch is true or false, not "yes" or 1.
# (The null-able ones are their own aliases: `WireInt | None` would put a field's bounds in its JSON
# schema as pydantic's `ge`/`le`, not JSON Schema's `minimum`/`maximum`, and the OpenAPI docs lose them.)
WireInt = Annotated[int, _not_text_or_bool("integer")]
WireIntOrNull = Annotated[int | None, _not_text_or_bool("integer")]
WireFloat = Annotated[float, _not_text_or_bool("number")]
WireFloatOrNull = Annotated[float | None, _not_text_or_bool("number")]
WireBool = Annotated[bool, BeforeValidator(_true_or_false)]

# Control characters (C0, DEL, C1) and the Unicode line and paragraph separators: in a name that is
# logged, one would start a line of its own in a text log, forged by whoever sent the name. And lone
# surrogates, which no UTF-8 (a log line, the group's JSON) can hold.
UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def _printable(value: str) -> str:
    found = UNPRINTABLE.search(value)
    if found is not None:
        raise PydanticCustomError(
            "control_character",
            "must not hold control characters, line breaks or lone surrogates (found U+{code} at {at})",
            {"code": f"{ord(found.group()):04X}", "at": found.start()},
        )
    return value


# A name the service logs (ids, task ids, versions, families): printable text only.
LoggedName = Annotated[str, AfterValidator(_printable)]


REWARD_PROFILES = ("rl", "benchmark")  # the env contract's two profiles

AttemptStatus = Literal[
    "scored", "policy_failure", "env_failure", "inference_failure", "stale", "cancelled", "cut", "internal_error"
]
# The statuses that carry a reward and enter the group's advantages: the env graded the attempt, or
# the policy failed it (earning policy_failure_reward). Every other status is infrastructure's doing.
GRADED_STATUSES: frozenset[str] = frozenset({"scored", "policy_failure"})

# Every reason an attempt can end without the env's grade. A closed set: docs/concepts.md lists each.
FailureKind = Literal[
    # The policy's own doing: it counts as not passed, and earns the request's policy_failure_reward.
    "max_turns",  # the episode asked for more than max_turns completions
    "deadline",  # the try did not finish within timeout_s
    "context_overflow",  # the conversation outgrew the model's context window
    # The environment's side (infrastructure): excluded from rewards, retried up to `retries`.
    "env_unreachable",  # no answer from the env (connection refused, reset, transport timeout)
    "env_gone",  # 410: the episode ended, was abandoned or reclaimed while idle
    "env_episode_failed",  # 500: the episode's preparation or grading failed
    "env_no_world",  # 503, or none started within timeout_s, or every env of its task was removed: no world
    "env_episode_timeout",  # 504: the episode neither asked nor finished in time
    "env_rejected",  # 400/405/409: the env refused what the service sent (a bug somewhere)
    "env_bad_answer",  # the env answered with something the contract does not allow
    "env_answer_too_large",  # the env's answer was longer than the service's --max-answer-bytes
    "transport_error",  # the env finished the episode with failure_category transport_error
    "environment_failure",  # the env finished the episode with failure_category environment_failure
    "env_abandoned",  # the env reported the episode abandoned
    # The model server's side (infrastructure): excluded from rewards.
    "inference_unreachable",
    "inference_timeout",  # no completion within --inference-timeout
    "inference_server_error",  # 5xx
    "inference_rejected",  # 4xx other than a context overflow
    "bad_response",  # a completion the service cannot use (no choices, wrong shape)
    "inference_answer_too_large",  # the model server's answer was longer than --max-answer-bytes
    "policy_paused",  # timeout_s ran out while the policy replicas were paused for a weight update
    # The policy moved on: the attempt fell further behind than max_staleness too many times.
    "stale",
    # The request's own tail control (deadline_s, min_graded) closed the group before this attempt ended.
    "group_closed",
    # Neither.
    "cancelled",  # the trainer went away, or the service shut down
    "internal_error",  # a bug in the service; the detail says what
]
FAILURE_KINDS: tuple[str, ...] = get_args(FailureKind)
POLICY_FAILURE_KINDS = frozenset({"max_turns", "deadline", "context_overflow"})
# Cut by the request's own choice: neither the policy's doing nor the infrastructure's.
REQUEST_FAILURE_KINDS = frozenset({"group_closed"})
Attribution = Literal["policy", "infrastructure", "request"]


def attribution_of(kind: str) -> Attribution:
    if kind in POLICY_FAILURE_KINDS:
        return "policy"
    return "request" if kind in REQUEST_FAILURE_KINDS else "infrastructure"


# A stop string is sent with every turn of every attempt and kept in the run log: an honest one is a few
# characters (an end tag), so a cap far above that costs nobody and bounds what one request multiplies.
StopString = Annotated[str, Field(min_length=1, max_length=200)]


class SamplingParams(BaseModel):
    """Sampling as sent to the model server."""

    model_config = ConfigDict(extra="forbid")
    temperature: WireFloat = Field(1.0, ge=0.0, le=2.0)
    top_p: WireFloat = Field(1.0, gt=0.0, le=1.0)
    max_tokens: WireInt = Field(256, ge=1, le=32768)
    seed: WireIntOrNull = Field(None, ge=0, le=2**31 - 1)
    stop: list[StopString] | None = Field(None, max_length=8, description="at most 8, each at most 200 characters")


class GroupRequest(BaseModel):
    """One group: `n` attempts at one task."""

    model_config = ConfigDict(extra="forbid")

    task_id: LoggedName | None = Field(None, min_length=1, max_length=200, description="the env's task id")
    slug: LoggedName | None = Field(None, min_length=1, max_length=300, description="or the task's slug")
    n: WireInt = Field(8, ge=1, description="attempts in the group (at most the service's --max-n)")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    model: LoggedName | None = Field(None, max_length=200, description="model name; default: the service's policy")
    reward_profile: Literal["rl", "benchmark"] | None = Field(None, description="default: the env's own")
    advantage: Literal["mean", "zscore"] = Field(
        "mean", description="mean: reward - group mean; zscore: also divided by the group's std"
    )
    max_turns: WireInt = Field(32, ge=1, le=1000, description="model calls per episode before it is abandoned")
    timeout_s: WireFloat = Field(600.0, gt=0, le=86400, description="deadline of one episode try")
    max_tokens_total: WireIntOrNull = Field(
        None,
        ge=1,
        le=10_000_000,
        description="agent servers: tokens an attempt may sample across its turns; default max_turns * max_tokens",
    )
    retries: WireInt = Field(1, ge=0, le=10, description="re-runs of an attempt that failed on the env's side")
    policy_failure_reward: WireFloatOrNull = Field(
        0.0,
        ge=-1e6,
        le=1e6,
        description="the reward an attempt earns when the policy itself failed it (max_turns, deadline, "
        "context overflow); it enters rewards and advantages, flagged. null: exclude such attempts",
    )
    allow_greedy: WireBool = Field(False, description="accept temperature 0 with n > 1")
    allow_eval_side: WireBool = Field(False, description="accept a task served only by an eval-side env")
    max_staleness: WireIntOrNull = Field(
        None,
        ge=0,
        le=1_000_000,
        description="policy updates an attempt's oldest turn may be behind the current version; an attempt "
        "further behind is re-run from reset. Default: the service's --max-staleness (unbounded unless set)",
    )
    tokens: Literal["exact", "chat"] | None = Field(
        None,
        description="exact: each turn is sent as token ids that continue the attempt's trajectory, so nothing "
        "sampled is tokenized again (vLLM); chat: messages to /v1/chat/completions, for servers without token "
        "prompts. Default: exact where the model server accepts token prompts",
    )
    constrained: WireBool = Field(
        True,
        description="send the env's response_format to the model server as a structured-output constraint. "
        "Constrained logprobs are taken after the grammar mask (renormalised over the allowed tokens), so they "
        "are not the policy's own; false samples freely and returns the policy's logprobs",
    )
    deadline_s: WireFloatOrNull = Field(
        None,
        gt=0,
        le=86400,
        description="tail control: seconds from admission after which the group closes; its attempts still "
        "running are cut (status cut, kind group_closed, no reward) and their worlds given back. Default: none",
    )
    min_graded: WireIntOrNull = Field(
        None,
        ge=1,
        description="tail control: the group closes once this many attempts are graded (scored or failed by the "
        "policy), at most n; the rest are cut as with deadline_s, and the baseline is over the graded ones",
    )
    policy_version: Any = Field(
        None, description="no longer accepted: the service records the version of every turn itself", exclude=True
    )
    group_id: LoggedName | None = Field(None, max_length=200, description="echoed back; default: generated")
    pin_version: LoggedName | None = Field(
        None,
        max_length=100,
        description="evaluation on a pinned version: every policy turn runs on this version (one the service "
        "still serves: the current one, or an adapter kept loaded while pinned) whatever updates land meanwhile; "
        "max_staleness does not apply. 404 unknown_version, 409 version_not_served (its weights were replaced)",
    )

    @model_validator(mode="after")
    def _check(self) -> GroupRequest:
        if self.policy_version is not None:
            raise ValueError(
                "policy_version is not a request field: the service records the version that generated each "
                "turn (turns[].policy_version, oldest_/newest_policy_version); set versions with POST /policy"
            )
        if (self.task_id is None) == (self.slug is None):
            raise ValueError("give exactly one of task_id or slug")
        if self.min_graded is not None and self.min_graded > self.n:
            raise ValueError(f"min_graded={self.min_graded} is more than the group's n={self.n} attempts")
        if self.sampling.temperature == 0 and self.n > 1 and not self.allow_greedy:
            raise ValueError(
                "temperature 0 with n > 1 samples the same completion n times: a greedy group has no "
                "signal. Set sampling.temperature > 0 (e.g. 0.8), or allow_greedy: true if you mean it"
            )
        return self


class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    groups: list[GroupRequest] = Field(min_length=1, description="at most the service's --max-batch")


class Turn(BaseModel):
    """One model call of an episode."""

    index: int
    stage: str
    trainable: bool
    model: str
    endpoint: str
    messages: list[dict[str, Any]]
    response_format: Any = None
    completion: str
    # Exactly what the model server generated from and produced; None where it did not return them.
    prompt_token_ids: list[int] | None = Field(
        None,
        description="the ids the turn was generated from; null on the policy's exact turns (those with a "
        "`segment`), where they are that segment up to the turn's span (Attempt.turn_prompt_ids): repeated in "
        "each such turn, they were most of a group's JSON",
    )
    completion_token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    token_source: Literal["server", "absent"]
    finish_reason: str | None = None
    prompt_tokens: int
    completion_tokens: int
    seed: int | None = None
    policy_version: str | None = Field(
        None, description="the policy version whose weights generated this turn; null for a non-policy model"
    )
    mixed_version: bool = Field(
        False,
        description="the turn was being generated across a full-weight update: its tokens come from "
        "policy_version and policy_version_end, and nothing can tell which from which",
    )
    policy_version_end: str | None = Field(None, description="with mixed_version: the version it ended on")
    constrained: bool = Field(
        False,
        description="sampled under the env's response_format as a grammar constraint: its logprobs are over "
        "the tokens the grammar allowed, not the policy's whole vocabulary",
    )
    segment: int | None = Field(None, description="exact mode: the trajectory segment this turn's tokens are in")


CutReason = Literal["history_rewritten", "template_changed", "stop_string"]


class TurnSpan(BaseModel):
    """Where one sampled completion sits in its segment's token_ids: [start, end)."""

    turn: int = Field(description="index into the attempt's turns")
    start: int
    end: int
    trainable: bool
    policy_version: str | None = None
    policy_version_end: str | None = Field(None, description="set when the turn ran across a full-weight update")


class Segment(BaseModel):
    """One exact token sequence of an attempt: the first prompt as the chat template renders it, then
    each sampled completion's own ids and the tokens of what the env added in between."""

    token_ids: list[int]
    loss_mask: list[int] = Field(
        description="1 on tokens the policy sampled at a trainable stage; 0 on prompt, env and other tokens"
    )
    logprobs: list[float | None] = Field(description="the sampled token's logprob where loss_mask is 1, else null")
    prompt_tokens: int = Field(description="tokens before the first sampled one")
    turns: list[TurnSpan] = Field(default_factory=list)
    cut: CutReason | None = Field(
        None,
        description="why the previous segment ended here (null for the first): the env rewrote history, "
        "the chat template rendered the conversation so far differently and its render of the new messages "
        "could not be read apart, or the last turn ended on a stop string",
    )
    cut_detail: str | None = None
    prompts: Literal["rendered", "appended"] = Field(
        "rendered",
        description="rendered: every prompt in the segment is the chat template's own render of the conversation "
        "so far (a fresh render gives the same ids); appended: the template renders the conversation so far "
        "otherwise once more follows (a reasoning template that drops earlier reasoning from history), so the "
        "later prompts keep every token as sampled and append the template's render of the env's new messages: "
        "the ids are what the model saw, not what a fresh render of the messages would give",
    )


class Failure(BaseModel):
    kind: FailureKind
    attribution: Attribution
    detail: str = ""

    @classmethod
    def of(cls, kind: FailureKind, detail: str = "") -> Failure:
        """A failure with the attribution its kind implies."""
        return cls(kind=kind, attribution=attribution_of(kind), detail=detail[:500])


class AttemptTimings(BaseModel):
    queued_s: float = 0.0
    inference_s: float = 0.0
    env_s: float = 0.0
    total_s: float = 0.0


class AgentRecord(BaseModel):
    """What an attempt on an agent server did on its model endpoint (docs/agents.md)."""

    calls: int = Field(0, description="chat completion calls that became turns")
    refused: int = Field(0, description="calls refused (over the group's sampling, over a limit, malformed)")
    refusals: list[str] = Field(default_factory=list, description="why, the first 16 of them")
    adjusted: list[str] = Field(
        default_factory=list,
        description="sampling the agent asked for that the group's replaced (temperature, top_p, stop), once each",
    )
    tool_calls: int = Field(0, description="tool calls read from the sampled text and returned as tool_calls")
    tool_calls_unparsed: int = Field(0, description="<tool_call> blocks that could not be read: returned as text")


class Attempt(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    index: int
    status: AttemptStatus
    reward: float | None = Field(None, description="the env's grade, or policy_failure_reward for a policy failure")
    advantage: float | None = None
    pass_: bool | None = Field(None, alias="pass", serialization_alias="pass")
    answer: Any = None
    score: dict[str, Any] | None = None
    episode_id: str | None = None
    env: str | None = None
    failure: Failure | None = None
    tries: int = 1
    earlier_failures: list[Failure] = Field(default_factory=list)
    timings: AttemptTimings = Field(default_factory=AttemptTimings)
    oldest_policy_version: str | None = None
    newest_policy_version: str | None = Field(None, description="with a mixed turn: the version after it")
    tokens: Literal["exact", "chat"] = Field("chat", description="how the turns were sent (see GroupRequest.tokens)")
    trajectory: list[Segment] | None = Field(
        None, description="exact mode: the attempt's token sequence, one segment per stretch the env did not rewrite"
    )
    turns: list[Turn] = Field(default_factory=list)
    agent: AgentRecord | None = Field(None, description="on an agent server: its calls on the model endpoint")

    def turn_prompt_ids(self, turn: int) -> list[int] | None:
        """The ids turn `turn` (an index into `turns`) was generated from: in exact mode its segment up to
        its span; else the turn's own `prompt_token_ids` (None where the server returned none)."""
        record = self.turns[turn]
        if record.prompt_token_ids is not None or record.segment is None or self.trajectory is None:
            return record.prompt_token_ids
        segment = self.trajectory[record.segment]
        span = next((s for s in segment.turns if s.turn == record.index), None)
        if span is None:
            raise ValueError(f"turn {record.index} has no span in segment {record.segment} of attempt {self.index}")
        return segment.token_ids[: span.start]


class EnvContract(BaseModel):
    """What makes two rewards comparable, as the env reported it."""

    urls: list[str]
    catalog_hash: str
    data_anchor: str | None = None
    reward_version: str
    reward_profile: str
    side: str | None = None


class Counts(BaseModel):
    """scheduled = scored + failed; failed = policy_failed + unscorable."""

    scheduled: int
    scored: int = Field(description="graded by the environment")
    failed: int = Field(description="not graded: policy failures and unscorable attempts")
    policy_failed: int = Field(description="failed by the policy itself (max_turns, deadline, context overflow)")
    unscorable: int = Field(
        description="failed on the infrastructure's side, cancelled or cut: no reward, no advantage"
    )
    cut: int = Field(0, description="of the unscorable, those cut when tail control closed the group")
    rewarded: int = Field(description="attempts that carry a reward: the denominator of mean, std and advantages")
    by_status: dict[str, int]


class Baseline(BaseModel):
    """How a group closed by tail control formed its advantage baseline: over the graded attempts only."""

    over: int = Field(description="attempts the mean (and std) were taken over: those that carry a reward")
    cut: int = Field(description="attempts cut when the group closed: no reward, outside the baseline")
    closed_by: Literal["min_graded", "deadline", "all_ended"] = Field(
        description="what closed the group: enough graded attempts, the deadline, or every attempt ended first"
    )
    cut_attempts: list[int] = Field(default_factory=list, description="the indices of the attempts cut")


class GroupResult(BaseModel):
    group_id: str
    task_id: str
    slug: str
    oldest_policy_version: str | None = Field(None, description="the oldest version any turn of the group came from")
    newest_policy_version: str | None = None
    model: str
    sampling: dict[str, Any] = Field(description="as sent; attempt i's seed is in its turns")
    n: int
    advantage_kind: str
    policy_failure_reward: float | None = None
    env: EnvContract
    counts: Counts
    rewards: list[float | None]
    advantages: list[float | None]
    mean: float | None
    std: float | None
    pass_rate: float | None = Field(description="passes over the scored and policy-failed attempts")
    all_equal: bool = Field(description="every reward is the same (or fewer than two): no gradient")
    diagnosis: str | None = None
    baseline: Baseline | None = Field(
        None, description="with tail control (deadline_s, min_graded): what the advantages' baseline was formed over"
    )
    attempts: list[Attempt]
    wall_s: float
    completion_tokens: int
    run_id: str | None = None


_VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$"


class PathSource(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(min_length=1, max_length=4096, description="a folder as the model servers see it")


class PolicyUpdate(BaseModel):
    """POST /policy: what the policy replicas serve from now on."""

    model_config = ConfigDict(extra="forbid")
    version: str = Field(pattern=_VERSION_PATTERN, description="a new label: letters, digits, '.', '_', '-'")
    lora: PathSource | None = Field(None, description="a PEFT LoRA adapter folder, loaded next to the base model")
    weights: PathSource | None = Field(
        None, description="a full checkpoint folder: replicas pause, reload from it and resume (vLLM dev mode)"
    )

    @model_validator(mode="after")
    def _one_source(self) -> PolicyUpdate:
        if self.lora is not None and self.weights is not None:
            raise ValueError("give lora or weights, not both")
        return self


class PauseRequest(BaseModel):
    """POST /policy/pause: how long the pause may hold the replicas (a lease; asking again renews it)."""

    model_config = ConfigDict(extra="forbid")
    timeout_s: WireFloatOrNull = Field(
        None,
        gt=0,
        le=86400,
        description="when it runs out without a POST /policy, the service resumes the replicas whose "
        "/weight_info still shows the version from before the pause and keeps the others out of routing. "
        "Default: the service's --pause-timeout; at most its --max-pause-timeout",
    )


class ReplicaUpdate(BaseModel):
    url: str
    ok: bool
    seconds: float
    error: str | None = None


class PolicyUpdateResult(BaseModel):
    version: str
    previous: str
    kind: Literal["lora", "weights", "pushed"]
    replicas: list[ReplicaUpdate] = Field(description="each policy replica, and whether it took the update")
    seconds: float
    finished_at: float


class ReplicaState(BaseModel):
    url: str
    version: str | None = Field(description="the version it serves; null while the service brings it up to date")
    state: Literal["joining", "serving", "restoring", "paused", "excluded", "draining"] = Field(
        "serving",
        description="where it stands: routed only while serving (docs/architecture.md, the replica states)",
    )
    routed: bool
    reason: str | None = None
    draining: bool = Field(False, description="being taken out: no new turn goes to it")


class PolicyState(BaseModel):
    """GET /policy."""

    version: str
    kind: Literal["base", "lora", "weights", "pushed"]
    updates: int = Field(description="successful updates since the service started (staleness counts these)")
    paused: bool = Field(
        description="held paused by POST /policy/pause until the next POST /policy, or until its lease runs out"
    )
    pause_expires_in: float | None = Field(None, description="seconds left of the pause's lease, while paused")
    served_model: str = Field(description="the model name turns are sent with (an adapter's own name for LoRA)")
    replicas: list[ReplicaState]
    recent_updates: list[PolicyUpdateResult]


class ErrorBody(BaseModel):
    error: str
    message: str


# -- membership: envs added, drained and removed at runtime -----------------------------------


class _ByUrl(BaseModel):
    model_config = ConfigDict(extra="forbid")
    url: str = Field(max_length=2048)

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        return http_url(value).rstrip("/")


class EnvRef(_ByUrl):
    """POST /envs/drain: an env the service schedules on, by the URL it was added with."""


class EnvAdd(EnvRef):
    """POST /envs: schedule on one more env server."""

    timeout_s: WireFloat = Field(
        60.0, gt=0, le=3600, description="how long to wait for it to answer /health ready and /tasks"
    )


class EnvRemove(EnvRef):
    """POST /envs/remove: drain the env, wait for its episodes to finish, then forget it."""

    timeout_s: WireFloat = Field(
        300.0, ge=0, le=86400, description="how long to wait for the episodes on it to finish (0: do not wait)"
    )


class EnvState(BaseModel):
    url: str
    pool: int = Field(description="worlds it holds at once: the service never has more episodes on it")
    held: int = Field(description="worlds the service holds on it now")
    draining: bool = Field(description="taking no new episode: the ones on it finish, then it can be removed")
    side: str | None = None
    catalog_hash: str
    reward_version: str
    tasks: int = Field(description="tasks it serves")


class EnvRemoved(BaseModel):
    url: str
    tasks_no_longer_served: list[str] = Field(description="tasks no env serves any more: new groups for them get 404")


class ReplicaRef(_ByUrl):
    """POST /replicas/drain: a model server replica, by role and URL."""

    role: Literal["policy", "support"] = Field("policy", description="the route it serves: the policy or support")


class ReplicaAdd(ReplicaRef):
    """POST /replicas: route to one more replica of the policy (or support) model."""

    timeout_s: WireFloat = Field(
        300.0,
        gt=0,
        le=3600,
        description="how long to wait for it to list the model and (policy) be brought to the current version",
    )
    # A variable's name, never the key: a request body is logged and shown where a key must not be.
    api_key_env: str | None = Field(
        None,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,127}$",
        description="the variable in the service's environment holding the key this replica requires (vLLM's "
        "--api-key); default: the route's, --vllm-api-key-env",
    )


class ReplicaRemove(ReplicaRef):
    """POST /replicas/remove: drain the replica, wait for its turns in flight, then forget it."""

    timeout_s: WireFloat = Field(300.0, ge=0, le=86400, description="how long to wait for its turns in flight to end")
