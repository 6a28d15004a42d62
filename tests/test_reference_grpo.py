"""The reference trainer's GRPO update on the embedded model's real weights (transformers, float32),
in this process: which logprobs the importance ratio is taken against, and that the optimizer carries
its state from one GRPO step to the next. The batch is made here, in `token_batch`'s shape, with old
logprobs that no model could give (all 0: probability 1 for every token), so a ratio of exactly 1 can
only come from the trainer's own recomputation.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import reference_trainer  # noqa: E402

torch = pytest.importorskip("torch")


def _batch(rows: int = 4, length: int = 24) -> dict:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(100, 5000, (rows, length), generator=generator)
    attention = torch.ones(rows, length, dtype=torch.long)
    attention[1, length - 5 :] = 0  # a shorter row, padded
    loss_mask = torch.zeros(rows, length, dtype=torch.long)
    loss_mask[:, length // 2 :] = 1
    loss_mask *= attention
    return {
        "input_ids": ids,
        "attention_mask": attention,
        "loss_mask": loss_mask,
        "old_logprobs": torch.zeros(rows, length),
        "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5][:rows]),
    }


@pytest.fixture(scope="module")
def make_policy(tmp_path_factory):
    def make(**settings) -> reference_trainer.Policy:
        return reference_trainer.Policy(reference_trainer.Settings(out=tmp_path_factory.mktemp("grpo"), **settings))

    return make


def test_constrained_groups_take_the_ratio_against_the_trainers_own_logprobs(make_policy):
    # One minibatch: the ratio is measured before any update, so against the trainer's own logprobs
    # it is 1 however the batch was sampled; against the batch's (impossible) 0s it is p(token) < 1.
    constrained = make_policy(grpo_constrained=True, grpo_minibatches=1).grpo_update(_batch())
    assert constrained["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    free = make_policy(grpo_constrained=False, grpo_minibatches=1).grpo_update(_batch())
    assert free["ratio_mean"] < 0.5


def test_later_minibatches_see_the_step_move_the_policy_and_the_optimizer_carries_over_steps(make_policy):
    policy = make_policy(grpo_constrained=True, grpo_minibatches=2, grpo_lr=1e-3)
    first = policy.grpo_update(_batch())
    assert first["optimizer_steps"] == 2
    assert first["ratio_mean_last_minibatch"] != pytest.approx(1.0, abs=1e-4)  # the first minibatch's step moved it
    policy.grpo_update(_batch())
    optimizer = policy._grpo_optimizer
    steps = {int(state["step"]) for state in optimizer.state.values()}
    assert steps == {4}, f"Adam's step counts {steps}: the optimizer must live for the whole GRPO stage"
