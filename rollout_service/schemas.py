"""The HTTP API's request and result models: what a trainer sends and gets back."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from inference.client import SamplingParams

AttemptStatus = Literal["scored", "env_failure", "inference_failure", "timeout", "cancelled"]
REWARD_PROFILES = ("rl", "benchmark")  # the contract's two profiles


class GroupRequest(BaseModel):
    """One group: `n` attempts at one task."""

    model_config = ConfigDict(extra="forbid")

    task_id: str | None = Field(None, min_length=1, max_length=200, description="the env's task id")
    slug: str | None = Field(None, min_length=1, max_length=300, description="or the task's slug")
    n: int = Field(8, ge=1, description="attempts in the group (at most the service's --max-n)")
    sampling: SamplingParams = Field(default_factory=SamplingParams)
    model: str | None = Field(None, max_length=200, description="model name; default: the service's policy")
    reward_profile: Literal["rl", "benchmark"] | None = Field(None, description="default: the env's own")
    advantage: Literal["mean", "zscore"] = Field(
        "mean", description="mean: reward - group mean; zscore: also divided by the group's std")
    max_turns: int = Field(32, ge=1, le=1000, description="model calls per episode before it is abandoned")
    timeout_s: float = Field(600.0, gt=0, le=86400, description="deadline of one episode try")
    retries: int = Field(1, ge=0, le=10, description="re-runs of an attempt that failed on the env's side")
    allow_greedy: bool = Field(False, description="accept temperature 0 with n > 1")
    allow_eval_side: bool = Field(False, description="accept a task served only by an eval-side env")
    policy_version: str | None = Field(None, max_length=200, description="echoed back")
    group_id: str | None = Field(None, max_length=200, description="echoed back; default: generated")

    @model_validator(mode="after")
    def _check(self) -> "GroupRequest":
        if (self.task_id is None) == (self.slug is None):
            raise ValueError("give exactly one of task_id or slug")
        if self.sampling.temperature == 0 and self.n > 1 and not self.allow_greedy:
            raise ValueError(
                "temperature 0 with n > 1 samples the same completion n times: a greedy group has no "
                "signal. Set sampling.temperature > 0 (e.g. 0.8), or allow_greedy: true if you mean it")
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
    # Exactly what the model server produced; None where it did not return them.
    prompt_token_ids: list[int] | None = None
    completion_token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    token_source: Literal["server", "absent"]
    finish_reason: str | None = None
    prompt_tokens: int
    completion_tokens: int
    seed: int | None = None


class Failure(BaseModel):
    kind: str
    detail: str = ""


class AttemptTimings(BaseModel):
    queued_s: float = 0.0
    inference_s: float = 0.0
    env_s: float = 0.0
    total_s: float = 0.0


class Attempt(BaseModel):
    index: int
    status: AttemptStatus
    reward: float | None = None
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
    turns: list[Turn] = Field(default_factory=list)

    model_config = ConfigDict(populate_by_name=True)


class EnvContract(BaseModel):
    """What makes two rewards comparable, as the env reported it."""

    urls: list[str]
    catalog_hash: str
    data_anchor: str | None = None
    reward_version: str
    reward_profile: str
    side: str | None = None


class Counts(BaseModel):
    scheduled: int
    scored: int
    failed: int
    by_status: dict[str, int]


class GroupResult(BaseModel):
    group_id: str
    task_id: str
    slug: str
    policy_version: str | None = None
    model: str
    sampling: dict[str, Any] = Field(description="as sent; attempt i's seed is in its turns")
    n: int
    advantage_kind: str
    env: EnvContract
    counts: Counts
    rewards: list[float | None]
    advantages: list[float | None]
    mean: float | None
    std: float | None
    pass_rate: float | None
    all_equal: bool
    diagnosis: str | None = None
    attempts: list[Attempt]
    wall_s: float
    completion_tokens: int
    run_id: str | None = None


class ErrorBody(BaseModel):
    error: str
    message: str
