"""The sampler's wire models: POST /groups/sample, the sampler streams (POST /samplers ...), and
GET /tasks/stats. Shared by the server and the trainer's client, so it imports only pydantic and
the group protocol."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .protocol import GroupRequest, LoggedName, WireFloat, WireInt, WireIntOrNull, describe_errors

# The fields of a group that the sampler fills in itself, per group.
_DRAWN_FIELDS = ("task_id", "slug", "group_id")


# As long as the group's own fields allow (GroupRequest.task_id, an env's URL in POST /envs).
# An abandoned stream holds its buffer's worth of queue and memory until it expires: an hour at most.
MAX_IDLE_TIMEOUT_S = 3_600

TaskId = Annotated[LoggedName, Field(min_length=1, max_length=200)]
Family = Annotated[LoggedName, Field(min_length=1, max_length=200)]
EnvUrl = Annotated[str, Field(min_length=1, max_length=2048)]


def group_from_template(template: dict[str, Any], task_id: str) -> GroupRequest:
    """The group the sampler runs for `task_id`: the template with the task filled in."""
    return GroupRequest.model_validate({**template, "task_id": task_id})


class TaskDraw(BaseModel):
    """Where the sampler draws tasks from: every training-side task (nothing given), a list of task
    ids, or task families or envs with weights (a weighted choice of family or env, then a task of it,
    each task of it once before any twice)."""

    model_config = ConfigDict(extra="forbid")
    task_ids: list[TaskId] | None = Field(None, min_length=1, max_length=100_000, description="draw from these tasks")
    families: dict[Family, WireFloat] | None = Field(
        None, min_length=1, max_length=10_000, description="task family -> weight (>= 0)"
    )
    envs: dict[EnvUrl, WireFloat] | None = Field(
        None, min_length=1, max_length=1_000, description="env URL (as GET /envs lists it) -> weight (>= 0)"
    )

    @model_validator(mode="after")
    def _one_way(self) -> TaskDraw:
        given = [name for name in ("task_ids", "families", "envs") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"give one of task_ids, families or envs, not {' and '.join(given)}")
        for name in ("families", "envs"):
            weights = getattr(self, name)
            if weights is not None:
                if any(w < 0 or w != w for w in weights.values()):
                    raise ValueError(f"{name}: weights are numbers >= 0")
                if not math.isfinite(sum(weights.values())):
                    raise ValueError(f"{name}: the weights' sum must be finite (they are relative: scale them down)")
                if not any(w > 0 for w in weights.values()):
                    raise ValueError(f"{name}: at least one weight must be above 0")
        return self


class DifficultyBounds(BaseModel):
    """Skip tasks the policy (nearly) always or never passes, from GET /tasks/stats as it stands
    when the task would be drawn. The pass rate counted is over the last `versions` policy versions,
    each older version's groups weighted `decay` times the next newer one's; a task is judged once
    those weighted groups reach `after_groups`."""

    model_config = ConfigDict(extra="forbid")
    skip_pass_rate_above: WireFloat | None = Field(None, ge=0, le=1, description="skip a task passed more often")
    skip_pass_rate_below: WireFloat | None = Field(None, ge=0, le=1, description="skip a task passed less often")
    after_groups: WireFloat = Field(2, gt=0, le=1_000_000, description="weighted groups before a task is judged")
    versions: WireInt = Field(1, ge=1, le=64, description="policy versions counted: 1 = the current one only")
    decay: WireFloat = Field(0.5, ge=0, le=1, description="weight of a version's groups relative to the next newer")

    @model_validator(mode="after")
    def _some_bound(self) -> DifficultyBounds:
        if self.skip_pass_rate_above is None and self.skip_pass_rate_below is None:
            raise ValueError("give skip_pass_rate_above, skip_pass_rate_below or both")
        return self


class _SamplerSettings(BaseModel):
    """What a one-shot sample and a stream share."""

    model_config = ConfigDict(extra="forbid")
    group: dict[str, Any] = Field(
        default_factory=dict,
        description="the group template: any field of POST /groups (n, sampling, max_turns, ...) but task_id, "
        "slug and group_id, which the sampler fills in",
    )
    tasks: TaskDraw = Field(default_factory=TaskDraw, description="default: every training-side task")
    filter: Literal["signal", "none"] = Field(
        "signal",
        description="signal: drop a group whose graded rewards (attempts scored or failed by the policy) are all "
        "equal, or that has fewer than two; none: keep every group that ran",
    )
    difficulty: DifficultyBounds | None = None
    groups_at_once: WireIntOrNull = Field(
        None, ge=1, le=100_000, description="groups run at once; default: enough to keep every pool drawn on full"
    )
    seed: WireIntOrNull = Field(None, ge=0, le=2**63 - 1, description="seeds the task draw (default: random)")

    @field_validator("group")
    @classmethod
    def _template(cls, value: dict[str, Any]) -> dict[str, Any]:
        named = [k for k in _DRAWN_FIELDS if k in value]
        if named:
            raise ValueError(f"the template may not set {', '.join(named)}: the sampler draws the task")
        try:
            group_from_template(value, "template")
        except ValidationError as exc:
            raise ValueError(describe_errors(exc.errors())) from None
        return value


class SampleRequest(_SamplerSettings):
    """POST /groups/sample: `count` groups with signal, drawn and refilled until found or the budget
    is spent."""

    count: WireInt = Field(ge=1, le=100_000, description="groups wanted (kept by the filter)")
    max_groups: WireIntOrNull = Field(
        None, ge=1, le=1_000_000, description="budget: groups run at most, kept or not (default 4 x count)"
    )

    @model_validator(mode="after")
    def _budget(self) -> SampleRequest:
        if self.max_groups is not None and self.max_groups < self.count:
            raise ValueError(f"max_groups={self.max_groups} is below count={self.count}: it could never be met")
        return self

    @property
    def budget(self) -> int:
        return self.max_groups if self.max_groups is not None else 4 * self.count


class StreamCreate(_SamplerSettings):
    """POST /samplers: a stream that keeps `buffer` groups ready while the trainer trains."""

    buffer: WireInt = Field(
        8, ge=1, le=10_000, description="groups buffered or running for the stream at most (its bound)"
    )
    max_staleness: WireIntOrNull = Field(
        None,
        ge=0,
        le=1_000_000,
        description="policy updates a handed-out group's oldest turn may be behind the current version; a buffered "
        "group further behind is dropped (counted) and replaced. Default: unbounded",
    )
    pacing: bool = Field(
        True,
        description="with max_staleness: start a group only while the groups running and buffered fit in what the "
        "trainer takes in max_staleness steps (so none waits long enough to go stale), and hand out the oldest "
        "first. false: keep `buffer` groups going and drop (and replace) those that went stale",
    )
    step_groups: WireIntOrNull = Field(
        None,
        ge=1,
        le=100_000,
        description="groups the trainer takes per policy update, for pacing. Default: the last pull's count "
        "(before the first pull, `buffer` alone bounds the stream)",
    )
    max_groups: WireIntOrNull = Field(None, ge=1, description="budget over the stream's life (default: none)")
    idle_timeout_s: WireFloat = Field(
        600,
        gt=0,
        le=MAX_IDLE_TIMEOUT_S,
        description="the stream is closed (its groups cancelled) after this long without a pull",
    )

    @field_validator("group")
    @classmethod
    def _follows_the_policy(cls, value: dict[str, Any]) -> dict[str, Any]:
        # A stream feeds training, which follows the current policy: its buffered groups are judged by
        # max_staleness, and a pin would neither hold the pinned adapter while they wait nor survive it.
        if value.get("pin_version") is not None:
            raise ValueError("a stream follows the current policy: pin_version is for POST /groups or /groups/sample")
        return value


class StreamPull(BaseModel):
    model_config = ConfigDict(extra="forbid")
    count: WireInt = Field(ge=1, le=100_000, description="groups to hand out")
    timeout_s: WireFloat = Field(
        3600, gt=0, le=86_400, description="give up waiting after this long (the summary says how many came)"
    )


class DroppedGroup(BaseModel):
    """A group the filter (or the staleness bound) did not keep: a line of its own."""

    task_id: str
    group_id: str | None = None
    reason: Literal["no_signal", "too_few_graded", "group_failed", "stale", "undelivered"]
    detail: str
    rewards: list[float | None] = Field(default_factory=list)
    attempts: int = 0
    completion_tokens: int = 0


class Spread(BaseModel):
    """A distribution in three figures; p50 and p90 by nearest rank (the smallest value with at least that
    share of the values at or below it)."""

    mean: float
    p50: float
    p90: float


class AuditPart(BaseModel):
    groups: int = Field(description="groups of this kind over the stream's life")
    completion_tokens: Spread | None = Field(None, description="completion tokens per attempt, per group")
    turns: Spread | None = Field(None, description="turns per attempt, per group")
    pass_rate: Spread | None = Field(None, description="the group's pass rate (groups with graded attempts)")
    wall_s: Spread | None = Field(None, description="seconds the group ran (a cancelled one: until it was cancelled)")


class BiasAudit(BaseModel):
    """Kept against dropped and cancelled groups: if the dropped ones are the long or hard ones, training
    sees a biased draw. Distributions over the last 10,000 groups of each kind; a cancelled group's
    result never came, so only its count and time are known."""

    kept: AuditPart
    dropped: AuditPart
    cancelled: AuditPart


class StreamState(BaseModel):
    """A stream's state (GET /samplers/{id}, and each pull's summary): every count is over the
    stream's life."""

    id: str
    buffer_bound: int
    buffered: int = Field(description="groups kept and waiting for a pull, now")
    running: int = Field(description="groups running for the stream, now")
    handed_out: int = Field(description="groups handed out by pulls")
    groups_run: int = Field(description="groups that finished: handed out, dropped, or buffered")
    dropped: dict[str, int] = Field(description="dropped groups by reason")
    attempts_dropped: int = Field(0, description="attempts spent on dropped groups")
    completion_tokens_dropped: int = Field(0, description="completion tokens spent on dropped groups")
    dropped_lines_lost: int = Field(
        0, description="dropped groups whose line was lost (over 256 waited for a pull, or a pull was cut off)"
    )
    skipped_tasks: dict[str, list[str]]
    lag_histogram: dict[str, int] = Field(description="lag -> groups handed out")
    max_staleness: int | None = None
    pacing: bool = True
    paced_ahead: int | None = Field(
        None,
        description="with pacing: the groups that may be running and buffered now (the pull's groups still due "
        "+ max_staleness x step_groups); null while unbounded",
    )
    audit: BiasAudit | None = Field(None, description="kept vs dropped vs cancelled groups' lengths, turns, pass rates")
    budget: int | None = None
    idle_timeout_s: float
    idle_s: float
    stopped: str | None = Field(None, description="why production stopped (budget spent, no task left), if it has")


class SampleSummary(BaseModel):
    """The last line of a sample, or of a pull. A sample's counts are the request's own. A pull's
    top-level counts are that pull's alone; `stream` holds the stream's totals over its life."""

    requested: int
    kept: int = Field(description="groups handed out in this answer")
    complete: bool = Field(description="as many groups were kept as were asked for")
    stopped: str = Field(description="why it ended, in words: the count reached, the budget spent, ...")
    groups_run: int = Field(
        description="sample: groups that finished (kept or dropped; cancelled ones are not counted). "
        "Pull: the groups this summary tells of (kept + dropped)"
    )
    groups_cancelled: int = Field(0, description="groups still running when it ended, cancelled (worlds released)")
    dropped: dict[str, int] = Field(
        default_factory=dict,
        description="dropped groups by reason. Pull: those dropped since the previous pull's summary",
    )
    attempts_dropped: int = Field(0, description="attempts spent on the groups counted in `dropped`")
    completion_tokens_dropped: int = Field(0, description="completion tokens spent on the groups counted in `dropped`")
    skipped_tasks: dict[str, list[str]] | None = Field(
        None, description="sample only: tasks the difficulty bounds skipped, by why (a stream's: stream.skipped_tasks)"
    )
    budget: int | None = Field(None, description="sample only (a stream's: stream.budget)")
    # Pulls only.
    dropped_lines_lost: int | None = Field(
        None,
        description="of the groups counted in `dropped`, those whose line this answer does not carry: more "
        "than 256 waited between pulls (the oldest lines went), or an earlier pull was cut off",
    )
    lags: list[int] | None = Field(None, description="each handed-out group's lag (updates behind), in order")
    policy_version: str | None = None
    stream: StreamState | None = Field(None, description="the stream's state and totals over its life")


class VersionStats(BaseModel):
    version: str
    behind: int = Field(description="policy updates this version is behind the current one")
    groups: int
    attempts: int = Field(description="graded attempts (scored or failed by the policy)")
    mean_reward: float | None
    pass_rate: float | None
    signal_share: float | None = Field(description="share of its groups whose graded rewards differ")


class TaskStats(BaseModel):
    task_id: str
    versions: list[VersionStats] = Field(description="newest first")
