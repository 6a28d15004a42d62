"""Why a try ended: one table from what was raised to the attempt's failure (its kind, hence its
status) and whether the try may be run again.

Every way a try can end without the env's grade is raised as an exception and classified here,
the episode's own reasons included (it fell behind the policy, it asked for too many turns, the
env finished it but could not grade it). A row is a type and how to read it; the first row whose
type matches wins, so a subclass comes before its base.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from ...backends.env_client import EnvError
from ...backends.errors import InferenceError
from ...protocol import Failure, FailureKind
from ..membership.world_scheduler import NoEnvLeft


class Stale(Exception):
    """The attempt's oldest turn is further behind the current policy than the request allows."""


class TooManyTurns(Exception):
    """The episode asked for more completions than the request's max_turns."""


class GroupClosed(Exception):
    """The request's tail control (deadline_s, min_graded) closed the group while this try ran."""


class Unscorable(Exception):
    """The env finished the episode but could not grade it: infrastructure's doing, not a zero."""

    def __init__(self, kind: FailureKind, detail: str) -> None:
        self.kind, self.detail = kind, detail
        super().__init__(f"{kind}: {detail}")


@dataclass(frozen=True, slots=True)
class TryState:
    """What the try knew when it ended: the same exception means different things before the env
    gave a world and after, or while the policy was paused."""

    task_id: str
    timeout_s: float
    episode_started: bool = False
    waiting_for_policy: bool = False


@dataclass(frozen=True, slots=True)
class Classified:
    failure: Failure
    retryable: bool = False  # failed on the env's side, through no fault of the policy: may run again


def _as(kind: FailureKind, detail: str, retryable: bool = False) -> Classified:
    return Classified(Failure.of(kind, detail), retryable)


def _timed_out(_: TimeoutError, t: TryState) -> Classified:
    if t.waiting_for_policy:
        return _as(
            "policy_paused", f"timeout_s={t.timeout_s:g} ran out while the policy replicas were paused for an update"
        )
    if not t.episode_started:  # the env never gave a world: not the policy's doing
        return _as("env_no_world", f"the env started no episode within timeout_s={t.timeout_s:g}", retryable=True)
    return _as("deadline", f"the try did not finish within timeout_s={t.timeout_s:g}")


def _env_error(exc: EnvError, _: TryState) -> Classified:
    return _as(cast(FailureKind, exc.kind), f"{exc.status or 'no answer'} {exc.error}: {exc.message}", exc.retryable)


def bug(exc: BaseException) -> Classified:
    """A bug, or a malformed answer: the attempt fails as `internal_error` and is not run again. The
    table's last row, and what fails an attempt that raised outside its episode, whatever the type."""
    return _as("internal_error", f"{type(exc).__name__}: {exc}")


Row = tuple[type[BaseException], Callable[[Any, TryState], Classified]]

TABLE: tuple[Row, ...] = (
    (Stale, lambda exc, _: _as("stale", str(exc))),
    (GroupClosed, lambda exc, _: _as("group_closed", str(exc))),
    (TooManyTurns, lambda exc, _: _as("max_turns", str(exc))),
    (Unscorable, lambda exc, _: _as(exc.kind, exc.detail, retryable=True)),
    (NoEnvLeft, lambda exc, t: _as("env_no_world", f"task {t.task_id}: {exc}")),
    (TimeoutError, _timed_out),  # the try's own deadline (timeout_s)
    (EnvError, _env_error),  # each subclass names its kind (env_gone, env_rejected, ...)
    (InferenceError, lambda exc, _: _as(cast(FailureKind, exc.kind), exc.detail)),  # context_overflow too
    (asyncio.CancelledError, lambda _, __: _as("cancelled", "the group was cancelled (trainer gone or shutdown)")),
    (Exception, lambda exc, _: bug(exc)),  # a bug, or a malformed answer
)


def classify(exc: BaseException, state: TryState) -> Classified:
    """The failure `exc` gives the try, by the first row of `TABLE` that matches it."""
    for kind, read in TABLE:
        if isinstance(exc, kind):
            return read(exc, state)
    raise exc  # KeyboardInterrupt, SystemExit: not an attempt's failure
