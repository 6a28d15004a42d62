"""Attempts' exact trajectories in the shapes trainers take.

- `trl_rollout`: the dict TRL's `GRPOTrainer(rollout_func=...)` must return: `prompt_ids`,
  `completion_ids`, `logprobs` (0.0 where the env wrote) and `env_mask` (1 on the policy's tokens),
  one entry per attempt, the way TRL's own tool loop masks tool output.
- `token_batch`: padded `input_ids` / `attention_mask` / `loss_mask` / `old_logprobs` / `advantages`,
  one row per segment, as numpy arrays or torch tensors, for a plain PyTorch loss.

Only attempts that carry an advantage (scored or failed by the policy) are trained on; the others
are skipped, since their reward says nothing about the policy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import numpy as np

from ..protocol import Attempt


class NoTrajectory(ValueError):
    """An attempt without the trajectory this shape needs (it ran with tokens: chat)."""


def trainable(attempts: Iterable[Attempt]) -> list[Attempt]:
    """The attempts a gradient step uses: those with an advantage."""
    return [a for a in attempts if a.advantage is not None]


def _require_exact(attempts: list[Attempt]) -> list[Attempt]:
    for attempt in attempts:
        if attempt.tokens != "exact":
            raise NoTrajectory(
                f"attempt {attempt.index} ran with tokens={attempt.tokens}: it has no trajectory; request tokens: "
                "exact from a vLLM policy server"
            )
    return attempts


def trl_rollout(attempts: Iterable[Attempt], *, eos_token_id: int) -> dict[str, list]:
    """TRL's rollout_func output for these attempts: one entry per attempt, in order (TRL expects
    `num_generations` completions per prompt), plus each one's `advantage` and `reward` (extra fields
    TRL forwards to reward functions). An attempt without an advantage (the infrastructure failed it)
    or without a sampled token gets a placeholder that trains nothing: `[eos_token_id]` with
    `env_mask` 0. An attempt of several segments (its env rewrote its history) has no single
    sequence: use `token_batch`, which trains each segment as its own row."""
    out: dict[str, list] = {
        "prompt_ids": [],
        "completion_ids": [],
        "logprobs": [],
        "env_mask": [],
        "advantage": [],
        "reward": [],
    }
    for attempt in _require_exact(list(attempts)):
        segments = attempt.trajectory or []
        if len(segments) > 1:
            raise NoTrajectory(
                f"attempt {attempt.index} has {len(segments)} segments (cut: {segments[1].cut}): use token_batch, "
                "which trains each segment as its own row"
            )
        segment = segments[0] if segments else None
        cut = segment.prompt_tokens if segment is not None else 0
        if attempt.advantage is None or segment is None or len(segment.token_ids) == cut:
            prompt = segment.token_ids[:cut] if segment is not None else []
            completion, logprobs, mask = [eos_token_id], [0.0], [0]
        else:
            prompt = segment.token_ids[:cut]
            completion = segment.token_ids[cut:]
            logprobs = [lp if lp is not None else 0.0 for lp in segment.logprobs[cut:]]
            mask = segment.loss_mask[cut:]
        out["prompt_ids"].append(prompt)
        out["completion_ids"].append(completion)
        out["logprobs"].append(logprobs)
        out["env_mask"].append(mask)
        out["advantage"].append(attempt.advantage)
        out["reward"].append(attempt.reward)
    return out


def token_batch(
    attempts: Iterable[Attempt], *, pad_token_id: int = 0, tensors: Literal["np", "pt"] = "np"
) -> dict[str, Any]:
    """One right-padded row per segment of every attempt with an advantage; segments without a
    trainable token (and attempts that failed before their first turn) are left out. `old_logprobs`
    is 0 where `loss_mask` is 0; `advantages` is the attempt's, per row. Token t's mask and logprob
    belong to the logits at position t - 1."""
    rows = [(a, s) for a in _require_exact(trainable(attempts)) for s in (a.trajectory or []) if any(s.loss_mask)]
    width = max((len(s.token_ids) for _, s in rows), default=0)
    input_ids = np.full((len(rows), width), pad_token_id, dtype=np.int64)
    attention = np.zeros((len(rows), width), dtype=np.int64)
    loss_mask = np.zeros((len(rows), width), dtype=np.int64)
    old_logprobs = np.zeros((len(rows), width), dtype=np.float32)
    advantages = np.zeros((len(rows),), dtype=np.float32)
    for i, (attempt, segment) in enumerate(rows):
        n = len(segment.token_ids)
        input_ids[i, :n] = segment.token_ids
        attention[i, :n] = 1
        loss_mask[i, :n] = segment.loss_mask
        old_logprobs[i, :n] = [lp if lp is not None else 0.0 for lp in segment.logprobs]
        advantages[i] = attempt.advantage or 0.0
    batch = {
        "input_ids": input_ids,
        "attention_mask": attention,
        "loss_mask": loss_mask,
        "old_logprobs": old_logprobs,
        "advantages": advantages,
    }
    if tensors == "pt":
        import torch  # only a trainer that asks for tensors needs torch

        return {k: torch.from_numpy(v) for k, v in batch.items()}
    return batch
