"""The classify table (server/groups/failures.py): every failure kind the protocol names can come out of it.

The oracle is the protocol's closed set (protocol.FAILURE_KINDS), not the table: the samples below
are every exception class the runner can meet (each EnvError and InferenceError subclass, found by
walking the hierarchy), the runner's own reasons, a timeout in each state a try can be in, and each
final answer the env can give that it could not grade (through outcome.score itself)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from rollout_service.backends.env_client import EnvError, StepAnswer
from rollout_service.backends.errors import InferenceError
from rollout_service.protocol import FAILURE_KINDS, Attempt
from rollout_service.server.groups.failures import Stale, TooManyTurns, TryState, Unscorable, classify
from rollout_service.server.groups.outcome import score, status_of
from rollout_service.server.membership.world_scheduler import NoEnvLeft


def _subclasses(base: type) -> list[type]:
    found = [base]
    for sub in base.__subclasses__():
        found += _subclasses(sub)
    return found


def _unscorable(answer: StepAnswer) -> Unscorable:
    with pytest.raises(Unscorable) as raised:
        score(Attempt(index=0, status="cancelled"), answer)
    return raised.value


def _samples() -> list[tuple[BaseException, TryState]]:
    plain = TryState(task_id="t001", timeout_s=5.0, episode_started=True)
    samples: list[tuple[BaseException, TryState]] = []
    samples += [(cls(503, "some_error", "words"), plain) for cls in _subclasses(EnvError)]
    samples += [(cls("words", 500), plain) for cls in _subclasses(InferenceError)]
    samples += [
        (TimeoutError(), TryState(task_id="t001", timeout_s=5.0, episode_started=False)),
        (TimeoutError(), plain),
        (TimeoutError(), TryState(task_id="t001", timeout_s=5.0, episode_started=True, waiting_for_policy=True)),
        (Stale("behind"), plain),
        (TooManyTurns("too many"), plain),
        (NoEnvLeft("every env drained"), plain),
        (asyncio.CancelledError(), plain),
        (RuntimeError("a bug"), plain),
    ]
    finals = [
        {"episode_id": "e1", "done": True, "status": "completed", "score": {"failure_category": category}}
        for category in ("transport_error", "environment_failure")
    ] + [{"episode_id": "e1", "done": True, "status": "abandoned"}]
    samples += [(_unscorable(msgspec.convert(final, StepAnswer)), plain) for final in finals]
    return samples


def test_every_failure_kind_of_the_protocol_comes_out_of_the_table():
    kinds = {classify(exc, state).failure.kind for exc, state in _samples()}
    assert kinds == set(FAILURE_KINDS), (
        f"unreachable: {set(FAILURE_KINDS) - kinds}; unknown: {kinds - set(FAILURE_KINDS)}"
    )


def test_no_known_way_to_fail_is_classified_as_a_bug():
    """Each row matters even where its kind is reachable another way (env_no_world is): without it,
    its exceptions would fall through to the last row and read as internal errors."""
    bugs = [exc for exc, state in _samples() if classify(exc, state).failure.kind == "internal_error"]
    assert [type(exc) for exc in bugs] == [RuntimeError]


def test_what_a_try_knew_decides_a_timeout_and_env_side_failures_may_run_again():
    def verdict(**state):
        return classify(TimeoutError(), TryState(task_id="t001", timeout_s=5.0, **state))

    no_world = verdict(episode_started=False)
    assert (no_world.failure.kind, no_world.retryable) == ("env_no_world", True)
    assert status_of(no_world.failure) == "env_failure"
    deadline = verdict(episode_started=True)
    assert (deadline.failure.kind, deadline.retryable) == ("deadline", False)
    assert status_of(deadline.failure) == "policy_failure"  # the policy's doing: it earns policy_failure_reward
    paused = verdict(episode_started=True, waiting_for_policy=True)
    assert (paused.failure.kind, paused.retryable) == ("policy_paused", False)
    assert status_of(paused.failure) == "inference_failure"


def test_a_keyboard_interrupt_is_no_attempts_failure():
    with pytest.raises(KeyboardInterrupt):
        classify(KeyboardInterrupt(), TryState(task_id="t001", timeout_s=5.0))
