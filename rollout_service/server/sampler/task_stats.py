"""How hard each task is for each policy version: what its groups scored (GET /tasks/stats, /metrics),
and the difficulty bounds the sampler skips tasks by.

A group counts under the version of its newest turn (the version it finished on). Graded attempts
are those the env scored or the policy failed (they carry the reward a trainer learns from);
unscorable ones count nowhere. Each task keeps its last `_VERSIONS_KEPT` versions: memory stays
bounded over a run of any length.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import Counter

from ...protocol import GRADED_STATUSES as GRADED
from ...sampler_protocol import DifficultyBounds, TaskStats, VersionStats

if TYPE_CHECKING:
    from ...protocol import GroupResult
    from ..metrics import Metrics
    from ..policy.manager import PolicyManager

_VERSIONS_KEPT = 16


@dataclass
class _Tally:
    groups: int = 0
    graded: int = 0
    reward_sum: float = 0.0
    passes: int = 0
    judged: int = 0  # graded attempts that say pass or not (a policy failure counts as not passed)
    signal: int = 0


def graded_rewards(result: GroupResult) -> list[float]:
    return [a.reward for a in result.attempts if a.status in GRADED and a.reward is not None]


def has_signal(rewards: list[float]) -> bool:
    """Whether a group teaches anything: two graded rewards at least, not all equal."""
    return len(rewards) >= 2 and any(r != rewards[0] for r in rewards)


class TaskStatsBook:
    def __init__(self, versions: PolicyManager, metrics: Metrics) -> None:
        self.versions = versions
        self._by_task: dict[str, OrderedDict[str, _Tally]] = {}
        r = metrics.registry
        # By version, not by task: tasks x versions would be a series per pair for ever.
        self._groups = Counter(
            "rollout_task_groups", "Groups finished, by the policy version they ended on", ["version"], registry=r
        )
        self._signal = Counter(
            "rollout_task_signal_groups",
            "Groups whose graded rewards differ, by policy version",
            ["version"],
            registry=r,
        )
        self._graded = Counter(
            "rollout_task_graded_attempts", "Graded attempts, by policy version", ["version"], registry=r
        )
        self._passes = Counter(
            "rollout_task_passes", "Graded attempts that passed, by policy version", ["version"], registry=r
        )
        self._reward = Counter(
            "rollout_task_reward_sum", "Sum of graded rewards, by policy version", ["version"], registry=r
        )

    def record(self, result: GroupResult) -> None:
        if result.newest_policy_version is None and any(a.turns for a in result.attempts):
            return  # a named model's group (a teacher): not the policy's difficulty
        version = result.newest_policy_version or self.versions.current.label
        rewards = graded_rewards(result)
        per_version = self._by_task.setdefault(result.task_id, OrderedDict())
        tally = per_version.get(version)
        if tally is None:
            tally = per_version[version] = _Tally()
            while len(per_version) > _VERSIONS_KEPT:
                per_version.popitem(last=False)
        tally.groups += 1
        tally.graded += len(rewards)
        tally.reward_sum += sum(rewards)
        signal = has_signal(rewards)
        tally.signal += signal
        for attempt in result.attempts:
            if attempt.status in GRADED and attempt.reward is not None:
                tally.judged += 1
                tally.passes += bool(attempt.pass_)  # a policy failure has none: not passed
        self._groups.labels(version=version).inc()
        self._signal.labels(version=version).inc(signal)
        self._graded.labels(version=version).inc(len(rewards))
        self._passes.labels(version=version).inc(sum(bool(a.pass_) for a in result.attempts if a.status in GRADED))
        self._reward.labels(version=version).inc(sum(rewards))

    def stats(self, task_ids: list[str] | None = None) -> list[TaskStats]:
        wanted = self._by_task.keys() if task_ids is None else [t for t in task_ids if t in self._by_task]
        return [TaskStats(task_id=t, versions=self._versions_of(t)) for t in wanted]

    def _versions_of(self, task_id: str) -> list[VersionStats]:
        out = []
        for label, tally in reversed(self._by_task[task_id].items()):
            out.append(
                VersionStats(
                    version=label,
                    behind=self.versions.behind(label),
                    groups=tally.groups,
                    attempts=tally.graded,
                    mean_reward=round(tally.reward_sum / tally.graded, 6) if tally.graded else None,
                    pass_rate=round(tally.passes / tally.judged, 6) if tally.judged else None,
                    signal_share=round(tally.signal / tally.groups, 6),
                )
            )
        return out

    def recent_pass_rate(self, task_id: str, bounds: DifficultyBounds) -> tuple[float, float] | None:
        """(weighted groups, pass rate) over the last `bounds.versions` versions, each older one weighted
        `bounds.decay` times the next newer; None when nothing was graded there."""
        per_version = self._by_task.get(task_id)
        if not per_version:
            return None
        groups = passes = judged = 0.0
        for label, tally in per_version.items():
            behind = self.versions.behind(label)
            if behind < 0 or behind >= bounds.versions:
                continue
            weight = bounds.decay**behind
            groups += weight * tally.groups
            passes += weight * tally.passes
            judged += weight * tally.judged
        if judged <= 0:
            return None
        return groups, passes / judged

    def skip_reason(self, task_id: str, bounds: DifficultyBounds | None) -> str | None:
        """'pass_rate_above' / 'pass_rate_below' when the bounds skip this task now, else None."""
        if bounds is None:
            return None
        recent = self.recent_pass_rate(task_id, bounds)
        if recent is None or recent[0] < bounds.after_groups:
            return None
        rate = recent[1]
        if bounds.skip_pass_rate_above is not None and rate > bounds.skip_pass_rate_above:
            return "pass_rate_above"
        if bounds.skip_pass_rate_below is not None and rate < bounds.skip_pass_rate_below:
            return "pass_rate_below"
        return None
