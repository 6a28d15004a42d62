"""`rollout-service measure`: a checkpoint's pass rate on the held-out side, with its uncertainty."""

from __future__ import annotations

import asyncio
import json
import math
from collections import defaultdict

from ..protocol import GRADED_STATUSES, GroupRequest, GroupResult
from ..server.config import ServiceConfig
from ..server.service import RolloutService

Z95 = 1.959964


def wilson_interval(passes: int, trials: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95% by default)."""
    if trials == 0:
        return 0.0, 1.0
    p = passes / trials
    denom = 1 + z * z / trials
    centre = (p + z * z / (2 * trials)) / denom
    half = z * math.sqrt(p * (1 - p) / trials + z * z / (4 * trials * trials)) / denom
    # At p = 0 or 1 the bound at the observed rate is exact; rounding would otherwise exclude it.
    lo = 0.0 if passes == 0 else max(0.0, centre - half)
    hi = 1.0 if passes == trials else min(1.0, centre + half)
    return lo, hi


def mean_interval(values: list[float], z: float = Z95) -> tuple[float, float] | None:
    """The normal-approximation interval of a mean (95% by default): mean ± z·s/√n, with s the sample
    standard deviation. None for fewer than two values, or values all equal (no spread to go by: an
    interval of width 0 would claim certainty). Attempts at one task are taken as independent, as the
    pass rate's Wilson interval takes them."""
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))
    if sd == 0:
        return None
    half = z * sd / math.sqrt(len(values))
    return mean - half, mean + half


def resolution_floor(trials: int, z: float = Z95) -> float:
    """The smallest difference between two pass rates measured like this one that is not noise:
    the width of the 95% interval at p = 0.5 (its widest), for this many trials."""
    if trials == 0:
        return 1.0
    lo, hi = wilson_interval(trials // 2, trials, z)
    return hi - lo


async def run_measure(
    config: ServiceConfig,
    *,
    repeats: int,
    limit: int | None,
    temperature: float,
    max_tokens: int,
    model: str | None,
    progress=print,
    max_turns: int | None = None,
) -> dict:
    max_turns = max_turns or GroupRequest.model_fields["max_turns"].default
    service = RolloutService(config)
    try:
        await service.start(say=progress)
        targets = list(service.envs.targets.values())[: limit or None]
        if not targets:
            raise ValueError("the env serves no task")
        progress(f"measuring {len(targets)} task(s) x {repeats} repeat(s) on {', '.join(config.env)}")
        done = 0

        async def one(target) -> GroupResult:
            nonlocal done
            request = GroupRequest(
                task_id=target.task_id,
                n=repeats,
                allow_eval_side=True,
                allow_greedy=True,
                model=model,
                sampling={"temperature": temperature, "max_tokens": max_tokens},
                max_turns=max_turns,
            )
            # Admitted as any trainer's group is: the same checks, caps and run log.
            (task,) = service.admission.start_groups([request])
            result = (await task).result
            done += 1
            if done % max(1, len(targets) // 10) == 0 or done == len(targets):
                progress(f"  {done}/{len(targets)} tasks done")
            return result

        groups = await asyncio.gather(*(one(t) for t in targets))
    finally:
        await service.close()
    return summarize_measurement(groups, service, repeats, max_turns)


def summarize_measurement(groups: list[GroupResult], service: RolloutService, repeats: int, max_turns: int) -> dict:
    """Pass rate over the attempts the policy is accountable for: the env's grades and the policy's own
    failures (looping past max_turns, overflowing the context, the deadline), which count as not
    passed. Infrastructure failures are excluded and counted apart."""
    graded = [a for g in groups for a in g.attempts if a.status in GRADED_STATUSES]
    policy_failed = sum(a.status == "policy_failure" for a in graded)
    passes = sum(bool(a.pass_) for a in graded if a.status == "scored")
    lo, hi = wilson_interval(passes, len(graded))
    categories: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    category_of = {t.task_id: t.category or "uncategorized" for t in service.envs.task_info.values()}
    for g in groups:
        key = category_of.get(g.task_id, "all")
        for a in g.attempts:
            if a.status in GRADED_STATUSES:
                categories[key][0] += a.status == "scored" and bool(a.pass_)
                categories[key][1] += 1
    contract = groups[0].env if groups else None
    rewards = [a.reward for a in graded if a.reward is not None]
    return {
        "tasks": len(groups),
        "repeats": repeats,
        "max_turns": max_turns,
        "sampling": groups[0].sampling if groups else None,
        "scheduled": sum(g.counts.scheduled for g in groups),
        "graded": len(graded),
        "scored": len(graded) - policy_failed,
        "policy_failures": policy_failed,
        "unscorable": sum(g.counts.unscorable for g in groups),
        "passes": passes,
        "pass_rate": passes / len(graded) if graded else None,
        "wilson95": [lo, hi],
        "resolution_floor": resolution_floor(len(graded)),
        "mean_reward": sum(rewards) / len(rewards) if rewards else None,
        # Shaped rewards give partial credit: where few attempts pass, the mean reward moves before the
        # pass rate does, and its interval says whether it moved more than the noise.
        "mean_reward_ci95": mean_interval(rewards),
        "by_category": {k: {"passes": v[0], "scored": v[1]} for k, v in sorted(categories.items())},
        "model": groups[0].model if groups else None,
        "env": contract.model_dump() if contract else None,
    }


def format_measurement(m: dict) -> str:
    env = m["env"] or {}
    rate = "-" if m["pass_rate"] is None else f"{m['pass_rate']:.3f}"
    lines = [
        f"pass rate {rate}  (95% Wilson interval {m['wilson95'][0]:.3f} .. {m['wilson95'][1]:.3f})  "
        f"{m['passes']}/{m['graded']} attempts: {m['scored']} graded by the env, {m['policy_failures']} failed by "
        f"the policy itself (counted as not passed); {m['unscorable']} unscorable (infrastructure, excluded); "
        f"{m['scheduled']} scheduled",
        f"mean reward {'-' if m['mean_reward'] is None else format(m['mean_reward'], '.3f')}"
        + ("" if m["mean_reward_ci95"] is None else " (95% interval {:.3f} .. {:.3f})".format(*m["mean_reward_ci95"]))
        + "; "
        f"at most {m['max_turns']} model calls per episode; sampling {json.dumps(m['sampling'])}",
        f"resolution floor: with {m['graded']} attempts ({m['tasks']} tasks x {m['repeats']} repeats), "
        f"two checkpoints whose pass rates differ by less than {m['resolution_floor']:.3f} are not distinguishable",
        "by category: " + ", ".join(f"{k} {v['passes']}/{v['scored']}" for k, v in m["by_category"].items()),
        f"model {m['model']}; env dataset {env.get('catalog_hash')}, reward {env.get('reward_version')} "
        f"profile {env.get('reward_profile')}, side {env.get('side')}",
    ]
    return "\n".join(lines)
