"""An attempt's outcome and its group's result: which status a failure gives, an episode's grade,
and the group assembled with its rewards, advantages and counts."""

from __future__ import annotations

from typing import Literal, cast

from ...advantages import group_advantages, summarize
from ...backends.env_client import StepAnswer
from ...protocol import (
    GRADED_STATUSES,
    Attempt,
    AttemptStatus,
    Baseline,
    Counts,
    Failure,
    FailureKind,
    GroupResult,
    Turn,
)
from ..membership.targets import GroupRun
from ..policy.manager import PolicyManager
from .failures import Unscorable

# The env finished the episode but says it could not grade it: infrastructure, not a zero.
UNSCORABLE_CATEGORIES = ("transport_error", "environment_failure")


def status_of(failure: Failure) -> AttemptStatus:
    if failure.attribution == "policy":
        return "policy_failure"
    if failure.kind == "cancelled":
        return "cancelled"
    if failure.kind == "group_closed":
        return "cut"
    if failure.kind == "internal_error":
        return "internal_error"
    if failure.kind == "stale":
        return "stale"
    if failure.kind in ("transport_error", "environment_failure") or failure.kind.startswith("env_"):
        return "env_failure"
    return "inference_failure"


def fail(attempt: Attempt, failure: Failure) -> None:
    attempt.failure, attempt.status = failure, status_of(failure)


def fail_stale(attempt: Attempt, why: str) -> None:
    """The attempt fell further behind the policy than its request allows: whatever grade it had is
    dropped (a stale grade must not reach the trainer) and it fails as stale."""
    attempt.reward = attempt.pass_ = attempt.score = attempt.answer = None
    fail(attempt, Failure.of("stale", why))


def failed(index: int, failure: Failure) -> Attempt:
    attempt = Attempt(index=index, status="internal_error")
    fail(attempt, failure)
    return attempt


def score(attempt: Attempt, answer: StepAnswer) -> None:
    """Grade a finished episode; raises `Unscorable` with the env's reason when the env could not."""
    attempt.score, attempt.answer = answer.score, answer.answer
    category = answer.failure_category
    if category in UNSCORABLE_CATEGORIES or answer.status == "abandoned":
        detail = (answer.score or {}).get("failure_detail") or f"the episode ended with failure_category={category}"
        kind = cast(FailureKind, category) if category in UNSCORABLE_CATEGORIES else "env_abandoned"
        raise Unscorable(kind, str(detail))
    # Graded, perhaps with a policy-side failure category (a wrong answer): a real grade.
    attempt.status, attempt.failure = "scored", None
    attempt.reward = float(answer.reward or 0.0)
    attempt.pass_ = bool(answer.pass_)


def version_span(turns: list[Turn], versions: PolicyManager | None) -> tuple[str | None, str | None]:
    """The oldest and the newest policy version in these turns (a mixed turn counts with both)."""
    labels = [t.policy_version for t in turns if t.policy_version is not None]
    labels += [t.policy_version_end for t in turns if t.policy_version_end is not None]
    if not labels or versions is None:
        return None, None
    return max(labels, key=versions.behind), min(labels, key=versions.behind)


def assemble(
    group: GroupRun,
    attempts: list[Attempt],
    *,
    wall_s: float,
    run_id: str | None,
    versions: PolicyManager | None = None,
    closed_by: Literal["min_graded", "deadline", "all_ended"] | None = None,
) -> GroupResult:
    """The group's result: policy failures earn `policy_failure_reward` (flagged by their status),
    unscorable attempts carry no reward; advantages are over the attempts that carry one. `closed_by`:
    how a group with tail control closed (its result then says what its baseline was formed over)."""
    request, target = group.request, group.target
    for a in attempts:
        if a.status == "policy_failure":
            a.reward, a.pass_ = request.policy_failure_reward, False
        a.oldest_policy_version, a.newest_policy_version = version_span(a.turns, versions)
    rewards = [a.reward if a.status in GRADED_STATUSES else None for a in attempts]
    advantages = group_advantages(rewards, request.advantage)
    for attempt, advantage in zip(attempts, advantages, strict=True):
        attempt.advantage = advantage
    mean, std, all_equal = summarize(rewards)
    rewarded = sum(r is not None for r in rewards)
    by_status: dict[str, int] = {}
    for a in attempts:
        by_status[a.status] = by_status.get(a.status, 0) + 1
    scored = by_status.get("scored", 0)
    policy_failed = by_status.get("policy_failure", 0)
    cut = [a.index for a in attempts if a.status == "cut"]
    baseline = None
    if closed_by is not None:
        baseline = Baseline(over=rewarded, cut=len(cut), closed_by=closed_by, cut_attempts=cut)
    graded = [a for a in attempts if a.status in GRADED_STATUSES]
    s = request.sampling
    diagnosis = None
    if all_equal:
        if rewarded == 0:
            why = "no attempt carries a reward (none was scored)"
        elif rewarded == 1:
            why = "only one attempt carries a reward, so there is nothing to compare it with"
        else:
            why = f"all {rewarded} rewards equal {mean}"
        diagnosis = (
            f"{why}: this group carries no gradient. Sampling sent: temperature={s.temperature}, "
            f"top_p={s.top_p}, max_tokens={s.max_tokens}, seed={s.seed}. Check the temperature first; "
            "then whether the task is far too hard or too easy for this policy."
        )
    oldest, newest = version_span([t for a in attempts for t in a.turns], versions)
    # The first env the request could use reports the contract (its side included).
    candidates = target.candidates(request.allow_eval_side)
    contract = next((e.contract for e in target.envs if e.url in candidates), target.contract)
    if request.reward_profile:
        contract = contract.model_copy(update={"reward_profile": request.reward_profile})
    contract = contract.model_copy(
        update={"urls": sorted({a.env for a in attempts if a.env}) or [e.url for e in target.envs]}
    )
    return GroupResult(
        group_id=group.group_id,
        task_id=target.task_id,
        slug=target.slug,
        oldest_policy_version=oldest,
        newest_policy_version=newest,
        model=group.route.model,
        sampling=s.model_dump(exclude_none=True),
        n=request.n,
        advantage_kind=request.advantage,
        policy_failure_reward=request.policy_failure_reward,
        env=contract,
        counts=Counts(
            scheduled=len(attempts),
            scored=scored,
            failed=len(attempts) - scored,
            policy_failed=policy_failed,
            unscorable=len(attempts) - scored - policy_failed,
            rewarded=rewarded,
            cut=len(cut),
            by_status=by_status,
        ),
        rewards=rewards,
        advantages=advantages,
        mean=mean,
        std=std,
        pass_rate=round(sum(bool(a.pass_) for a in graded) / len(graded), 6) if graded else None,
        all_equal=all_equal,
        diagnosis=diagnosis,
        baseline=baseline,
        attempts=attempts,
        wall_s=round(wall_s, 4),
        completion_tokens=sum(t.completion_tokens for a in attempts for t in a.turns),
        run_id=run_id,
    )
