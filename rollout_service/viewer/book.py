"""What the viewer knows of a run, whichever way it learns it (a live service, a run log): one summary
per group for the list, totals for the overview charts, and the filters and pages of the group list.

Typed answers at the boundary: these models are what the viewer's JSON endpoints send.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pydantic import BaseModel, Field

from ..protocol import GroupResult
from ..server.sampler.task_stats import graded_rewards, has_signal

MAX_PAGE = 100  # groups per page of the list: never a page that loads every group


class GroupSummary(BaseModel):
    """One row of the group list; `seq` names the group in the viewer (group ids are the caller's and
    may repeat)."""

    seq: int
    group_id: str
    task_id: str
    slug: str
    family: str | None
    version: str | None = Field(description="the policy version of the group's newest turn")
    n: int
    rewards: list[float | None]
    mean: float | None
    pass_rate: float | None
    signal: bool = Field(description="two graded rewards at least, not all equal")
    statuses: list[str]
    failed: int
    completion_tokens: int
    wall_s: float
    diagnosis: str | None


class GroupPage(BaseModel):
    total: int = Field(description="groups matching the filters among those the viewer holds")
    held: int = Field(description="groups the viewer holds (live: the newest ones, up to a bound)")
    offset: int
    groups: list[GroupSummary]


class VersionSignal(BaseModel):
    version: str
    groups: int
    signal: int


class FailureCount(BaseModel):
    kind: str
    attribution: str
    count: int


class RunLogChanged(Exception):
    """A group's line is no longer what the index read there: the run log changed under the viewer."""


@dataclass(frozen=True)
class GroupQuery:
    """The list's filters; None: not filtered on."""

    task: str | None = None
    family: str | None = None
    version: str | None = None
    status: str | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    signal: bool | None = None
    offset: int = 0
    limit: int = 50

    def matches(self, g: GroupSummary) -> bool:
        if self.task is not None and self.task not in (g.task_id, g.slug):
            return False
        if self.family is not None and g.family != self.family:
            return False
        if self.version is not None and (g.version or "") != self.version:
            return False
        if self.status is not None and self.status not in g.statuses:
            return False
        if self.min_reward is not None and (g.mean is None or g.mean < self.min_reward):
            return False
        if self.max_reward is not None and (g.mean is None or g.mean > self.max_reward):
            return False
        return self.signal is None or g.signal == self.signal


def summarize(seq: int, result: GroupResult, family: str | None) -> GroupSummary:
    return GroupSummary(
        seq=seq,
        group_id=result.group_id,
        task_id=result.task_id,
        slug=result.slug,
        family=family,
        version=result.newest_policy_version,
        n=result.n,
        rewards=result.rewards,
        mean=result.mean,
        pass_rate=result.pass_rate,
        signal=has_signal(graded_rewards(result)),
        statuses=sorted(result.counts.by_status),
        failed=result.counts.failed,
        completion_tokens=result.completion_tokens,
        wall_s=result.wall_s,
        diagnosis=result.diagnosis,
    )


class RunTally:
    """Totals over every group seen (not only those still held): signal per version, failures by kind.
    Bounded by the versions and the failure kinds there are."""

    def __init__(self) -> None:
        self.groups = 0
        self.by_version: dict[str, list[int]] = {}  # version -> [groups, with signal]
        self.failures: Counter[tuple[str, str]] = Counter()

    def add(self, summary: GroupSummary, result: GroupResult) -> None:
        self.groups += 1
        tally = self.by_version.setdefault(summary.version or "(none)", [0, 0])
        tally[0] += 1
        tally[1] += summary.signal
        for attempt in result.attempts:
            if attempt.failure is not None:
                self.failures[(attempt.failure.kind, attempt.failure.attribution)] += 1

    def signal_by_version(self) -> list[VersionSignal]:
        return [VersionSignal(version=v, groups=g, signal=s) for v, (g, s) in self.by_version.items()]

    def failures_by_kind(self) -> list[FailureCount]:
        return [
            FailureCount(kind=kind, attribution=who, count=count) for (kind, who), count in self.failures.most_common()
        ]


def page(summaries: list[GroupSummary], query: GroupQuery) -> GroupPage:
    """Newest first, filtered, one page of at most MAX_PAGE."""
    matching = [g for g in reversed(summaries) if query.matches(g)]
    limit = max(1, min(query.limit, MAX_PAGE))
    return GroupPage(
        total=len(matching),
        held=len(summaries),
        offset=query.offset,
        groups=matching[query.offset : query.offset + limit],
    )
