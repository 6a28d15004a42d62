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

from ..protocol import Attempt, Segment


class NoTrajectory(ValueError):
    """An attempt without the trajectory this shape needs (it ran with tokens: chat)."""


def trainable(attempts: Iterable[Attempt]) -> list[Attempt]:
    """The attempts a gradient step uses: those with an advantage."""
    return [a for a in attempts if a.advantage is not None]


def _segments(attempt: Attempt) -> list[Segment]:
    if attempt.trajectory is None:
        raise NoTrajectory(
            f"attempt {attempt.index} has no trajectory (tokens={attempt.tokens}): request tokens: exact from a "
            "vLLM policy server"
        )
    return attempt.trajectory


def trl_rollout(attempts: Iterable[Attempt]) -> dict[str, list]:
    """TRL's rollout_func output for these attempts, in order, plus each one's `advantage` and `reward`
    (extra fields TRL forwards to reward functions). Each attempt must be a single segment: TRL trains
    one sequence per completion, and a rewritten history has no single sequence."""
    out: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "logprobs": [], "env_mask": [], "reward": []}
    for attempt in attempts:
        segments = _segments(attempt)
        if len(segments) != 1:
            raise NoTrajectory(
                f"attempt {attempt.index} has {len(segments)} segments (the env rewrote its history): use "
                "token_batch, which trains each segment as its own row"
            )
        segment = segments[0]
        cut = segment.prompt_tokens
        out["prompt_ids"].append(segment.token_ids[:cut])
        out["completion_ids"].append(segment.token_ids[cut:])
        out["logprobs"].append([lp if lp is not None else 0.0 for lp in segment.logprobs[cut:]])
        out["env_mask"].append(segment.loss_mask[cut:])
        out["reward"].append(attempt.reward)
    return out


def token_batch(
    attempts: Iterable[Attempt], *, pad_token_id: int = 0, tensors: Literal["np", "pt"] = "np"
) -> dict[str, Any]:
    """One right-padded row per segment of every attempt with an advantage; segments without a
    trainable token are left out. `old_logprobs` is 0 where `loss_mask` is 0; `advantages` is the
    attempt's, per row."""
    rows = [(a, s) for a in trainable(attempts) for s in _segments(a) if any(s.loss_mask)]
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
