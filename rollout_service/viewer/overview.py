"""The overview's answer (GET /ui/api/overview): what each chart of the overview page draws."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from ..sampler_protocol import TaskStats
from .book import FailureCount, VersionSignal


class Sample(BaseModel):
    """The live service's counters at one moment (rates are the differences of two samples)."""

    t: float = Field(description="unix time")
    groups: int = Field(description="groups finished since the service started")
    completion_tokens: int = Field(description="completion tokens generated since the service started")
    pools: dict[str, float] = Field(description="env url -> share of its pool's worlds held")
    replicas: dict[str, int] = Field(description="policy replica url -> requests in flight on it")


class ReplicaNow(BaseModel):
    url: str
    version: str | None
    routed: bool
    outstanding: int


class LagBucket(BaseModel):
    le: str = Field(description="policy updates behind, at most (the histogram's bucket bound)")
    count: int


class RunPoint(BaseModel):
    """One group of a run log, in the order the log holds them (a run log keeps no clock time)."""

    seq: int
    mean: float | None
    completion_tokens: int


class Overview(BaseModel):
    mode: Literal["live", "runlog"]
    run_id: str
    status: str = Field(description="the service's status (live), or `finished` (a run log)")
    groups: int = Field(description="groups seen: since the service started, or in the run log")
    policy_version: str | None = None
    samples: list[Sample] = Field(default_factory=list, description="live only: the counters over time")
    replicas: list[ReplicaNow] = Field(default_factory=list, description="live only")
    lag: list[LagBucket] = Field(default_factory=list, description="live only: groups handed out by sampler streams")
    by_group: list[RunPoint] = Field(default_factory=list, description="run log only: the newest groups, in order")
    signal_by_version: list[VersionSignal]
    failures: list[FailureCount]


class TaskRow(TaskStats):
    family: str | None = None
