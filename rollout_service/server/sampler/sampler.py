"""The sampler: draws tasks, runs groups through the service's own admission (as POST /groups does),
keeps those that carry signal and refills, within a budget.

`Sampler` is the engine both the one-shot sample (POST /groups/sample) and the streams (POST
/samplers) drive: it keeps as many groups running as fill the pools of the envs it draws on (or as
the caller has room for), hands back each finished group as kept or dropped with the reason, and
cancels what still runs when it is closed (the runner abandons their episodes: worlds released).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Counter as PromCounter
from pydantic import ValidationError

from ...protocol import GRADED_STATUSES, describe_errors, short_text
from ...sampler_protocol import DroppedGroup, TaskDraw, _SamplerSettings, group_from_template
from ..errors import Conflict, Invalid, NotFound, RequestRefused
from ..groups.admission import Admission
from ..groups.group_json import GroupOutcome
from ..groups.streaming import HeldResults
from ..groups.window import worlds_serving
from ..membership.envs import EnvRegistry
from ..policy.manager import PolicyManager
from ..policy.versions import PolicyVersion
from .audit import Shape, shape_of
from .task_stats import TaskStatsBook

# Refusals after which the sampler stops: the service itself cannot run groups now.
_SERVICE_REFUSALS = frozenset({"shutting_down", "starting", "start_failed"})
# Refusals that concern one task (its env went, or drains): the sampler leaves that task out.
_TASK_REFUSALS = frozenset({"unknown_task", "envs_draining", "eval_side"})
_BUSY_RETRY_S = 1.0  # the queue was full: try again after this long, or when a group of ours finishes


@dataclass
class Finished:
    """A group of the sampler's that ended: `body` (its JSON) when kept, else `dropped` says why."""

    task_id: str
    attempts: int
    group_id: str | None = None
    body: bytes | None = None
    dropped: DroppedGroup | None = None
    oldest_version: str | None = None
    completion_tokens: int = 0  # what it cost: a kept group dropped later (stale) still counts it
    seq: int = 0  # the order it was started in
    shape: Shape | None = None  # its figures for the bias audit (None: no result came)


@dataclass(frozen=True)
class SamplerRooms:
    """What a sampler uses of the service: the envs it draws from, the admission its groups go through
    (as POST /groups's do), the policy's versions, the difficulty book, its kept and dropped counters."""

    envs: EnvRegistry
    admission: Admission
    versions: PolicyManager
    task_stats: TaskStatsBook
    kept: PromCounter
    dropped: PromCounter


@dataclass
class DropCounts:
    """Dropped groups counted: by reason, and what they cost."""

    dropped: Counter[str] = field(default_factory=Counter)
    attempts_dropped: int = 0
    completion_tokens_dropped: int = 0

    def count(self, dropped: DroppedGroup) -> None:
        self.dropped[dropped.reason] += 1
        self.attempts_dropped += dropped.attempts
        self.completion_tokens_dropped += dropped.completion_tokens


class TaskDeck:
    """Weighted buckets of task ids (families, envs, or one bucket); within a bucket each task is drawn
    once before any is drawn twice (a fresh shuffle per pass)."""

    def __init__(self, buckets: list[tuple[float, list[str]]], rng: random.Random) -> None:
        self.rng = rng
        self.buckets = [(w, list(dict.fromkeys(ids))) for w, ids in buckets if w > 0 and ids]
        self._order: list[list[str]] = [[] for _ in self.buckets]

    def remove(self, task_id: str) -> None:
        self.buckets = [(w, [t for t in ids if t != task_id]) for w, ids in self.buckets]
        self._order = [[t for t in order if t != task_id] for order in self._order]

    def draw(self, skip: Callable[[str], bool]) -> str | None:
        """A task that `skip` does not refuse, or None when it refuses every one."""
        live = [i for i, (_, ids) in enumerate(self.buckets) if ids]
        while live:
            (i,) = self.rng.choices(live, weights=[self.buckets[j][0] for j in live])
            ids = self.buckets[i][1]
            # Each task of the bucket asked once, across the end of a pass (a fresh shuffle may repeat
            # the tasks the old pass left).
            asked: set[str] = set()
            while len(asked) < len(ids):
                if not self._order[i]:
                    self._order[i] = self.rng.sample(ids, len(ids))
                task_id = self._order[i].pop()
                if task_id in asked:
                    continue
                asked.add(task_id)
                if not skip(task_id):
                    return task_id
            live.remove(i)
        return None


@dataclass
class Tally(DropCounts):
    """What a sampler has run, for its summary lines and its stream's state. Every group that finished
    is counted once: kept when it is handed to the caller, or dropped (a stream's buffered groups are
    neither yet)."""

    groups_run: int = 0
    kept: int = 0
    skipped: dict[str, set[str]] = field(default_factory=dict)

    def skipped_lists(self) -> dict[str, list[str]]:
        return {why: sorted(ids) for why, ids in self.skipped.items()}


def draw_buckets(rooms: SamplerRooms, draw: TaskDraw, template: dict) -> list[tuple[float, list[str]]]:
    """The buckets a request draws from, or RequestRefused (404/409/422) naming what does not exist
    or may not be drawn."""
    allow_eval = bool(template.get("allow_eval_side", False))

    def eligible(task_id: str) -> bool:
        target = rooms.envs.targets.get(task_id)
        return target is not None and bool(target.candidates(allow_eval))

    if draw.task_ids is not None:
        for task_id in dict.fromkeys(draw.task_ids):
            try:
                group = group_from_template(template, task_id)
            except ValidationError as exc:  # the request's mistake: a 422, not a 500
                raise Invalid("invalid_request", f"task_ids: {describe_errors(exc.errors())}") from None
            rooms.admission.resolve(group)  # 404 unknown, 409 eval side, 503 draining
        return [(1.0, list(draw.task_ids))]
    if draw.families is not None:
        by_family: dict[str, list[str]] = {}
        for task_id, info in rooms.envs.task_info.items():
            if info.family and eligible(task_id):
                by_family.setdefault(info.family, []).append(task_id)
        unknown = [f for f in draw.families if f not in by_family]
        eval_only = {
            info.family
            for task_id, info in rooms.envs.task_info.items()
            if info.family in unknown and task_id in rooms.envs.targets
        }
        if eval_only:  # it exists, on the held-out side only: the request's choice to make, not a typo
            names = ", ".join(short_text(f, 80) for f in sorted(eval_only)[:5])
            raise Conflict(
                "eval_side",
                f"family {names} is served only by eval-side envs: training on it leaks the held-out set. "
                "Set the template's allow_eval_side: true if you mean to",
            )
        if unknown:
            known = ", ".join(sorted(by_family)[:20]) or "none"
            side = "" if allow_eval else " on the training side"
            raise NotFound(
                "unknown_family",
                f"no served task{side} is of family {', '.join(short_text(f, 80) for f in unknown[:5])}; "
                f"known: {known}",
            )
        return [(w, by_family[f]) for f, w in draw.families.items()]
    if draw.envs is not None:
        buckets = []
        for url, weight in draw.envs.items():
            env = rooms.envs.envs.get(url.rstrip("/"))
            if env is None:
                known = ", ".join(rooms.envs.envs) or "none"
                raise NotFound("unknown_env", f"no env {short_text(url, 200)} is scheduled here; present: {known}")
            if env.contract.side == "eval" and not allow_eval:
                raise Conflict(
                    "eval_side",
                    f"env {short_text(url, 200)} serves the eval side: training on it leaks the held-out set. "
                    "Set the template's allow_eval_side: true if you mean to",
                )
            buckets.append((weight, [t for t, target in rooms.envs.targets.items() if env in target.envs]))
        return buckets
    every = [task_id for task_id in rooms.envs.targets if eligible(task_id)]
    if not every:
        raise Conflict("no_training_tasks", "no env serves a task on the training side (GET /envs)")
    return [(1.0, every)]


def pools_drawn_on(registry: EnvRegistry, buckets: list[tuple[float, list[str]]], allow_eval: bool) -> int:
    """Worlds of the envs that serve the drawn tasks (an env counted once)."""
    return worlds_serving(registry, [task_id for _, ids in buckets for task_id in ids], allow_eval)


class Sampler:
    def __init__(
        self,
        rooms: SamplerRooms,
        settings: _SamplerSettings,
        budget: int | None,
        room: Callable[[], int],
        held: HeldResults,
    ) -> None:
        """`room()`: how many more groups the caller can take now (running ones count as taken)."""
        self.rooms = rooms
        self.settings = settings
        self.template = settings.group
        self.n = group_from_template(self.template, "template").n
        self.budget = budget
        self.room = room
        self.held = held
        buckets = draw_buckets(rooms, settings.tasks, self.template)
        self.deck = TaskDeck(buckets, random.Random(settings.seed))
        allow_eval = bool(self.template.get("allow_eval_side", False))
        pool = pools_drawn_on(rooms.envs, buckets, allow_eval)
        self.at_once = settings.groups_at_once or max(1, math.ceil(pool / self.n) + 1)
        self.running: dict[asyncio.Task[GroupOutcome], str] = {}
        # A running group's start order, time, and the policy version current when it started.
        self.began: dict[asyncio.Future, tuple[int, float, str]] = {}
        self.cancelled_walls: list[float] = []  # seconds each group cancelled by close() had run
        self.started = 0
        self.tally = Tally()
        self.stopped: str | None = None
        self._wake = asyncio.Event()
        self._busy_until = 0.0
        self._pinned: PolicyVersion | None = None

    # -- starting groups ----------------------------------------------------------------------

    def check_first(self) -> None:
        """Refuse now (as an HTTP error, before any line) what would refuse every group: the template
        against the service's limits and the queue cap."""
        task_id = next((ids[0] for _, ids in self.deck.buckets if ids), None)  # a look, not a draw
        if task_id is None:
            raise Conflict("no_tasks", "the draw holds no task")
        self.rooms.admission.admit([group_from_template(self.template, task_id)])
        pin = self.template.get("pin_version")
        if pin is not None:
            # Held for the sampler's life, not only while one of its groups runs: between two groups
            # the version would otherwise be free to unload, or its room under --max-loras taken by
            # another pin, and the sample would stop half done.
            self._pinned = self.rooms.versions.pin(pin)

    def fill(self) -> None:
        """Start groups while there is room, budget and a task to draw."""
        while self.stopped is None and len(self.running) < self.at_once and self.room() > 0:
            if time.monotonic() < self._busy_until:
                return
            if self.budget is not None and self.started >= self.budget:
                return
            task_id = self.deck.draw(self._skipped)
            if task_id is None:
                if not self.running:
                    self.stopped = self._why_no_task()
                return
            request = group_from_template(self.template, task_id)
            try:
                (task,) = self.rooms.admission.start_groups([request])
            except RequestRefused as exc:
                if exc.error == "too_many_queued_attempts":
                    self._busy_until = time.monotonic() + _BUSY_RETRY_S
                    return
                if exc.error in _TASK_REFUSALS:
                    self.deck.remove(task_id)
                    self.tally.skipped.setdefault(exc.error, set()).add(task_id)
                    continue
                if exc.error in _SERVICE_REFUSALS:
                    self.stopped = f"the service refused more groups: {exc.message}"
                else:
                    self.stopped = f"the service refused a group ({exc.error}): {exc.message}"
                return
            self.held.hold_when_done(task, request.n)
            self.running[task] = task_id
            self.began[task] = (self.started, time.monotonic(), self.rooms.versions.current.label)
            self.started += 1

    def _skipped(self, task_id: str) -> bool:
        why = self.rooms.task_stats.skip_reason(task_id, self.settings.difficulty)
        if why is None:
            return False
        self.tally.skipped.setdefault(why, set()).add(task_id)
        return True

    def _why_no_task(self) -> str:
        if self.tally.skipped:
            counts = ", ".join(f"{len(ids)} {why}" for why, ids in sorted(self.tally.skipped.items()))
            return f"no task left to draw: every one was skipped ({counts})"
        return "no task left to draw"

    def running_behind(self, updates: int) -> int:
        """Running groups started `updates` or more policy updates ago."""
        return sum(self.rooms.versions.behind(label) >= updates for _, _, label in self.began.values())

    def wake(self) -> None:
        """The caller has room again."""
        self._wake.set()

    # -- groups finishing ---------------------------------------------------------------------

    async def next(self) -> Finished | None:
        """The next group of ours to finish, or None once nothing runs and nothing can start
        (`stopped` says why, unless the caller's room alone holds it back)."""
        while True:
            self.fill()
            if not self.running:
                if self.stopped is not None or (self.budget is not None and self.started >= self.budget):
                    return None
                # Waiting for room (a stream's buffer is full) or for the queue to make room.
                timeout = max(0.0, self._busy_until - time.monotonic()) or None
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout)
                except TimeoutError:
                    pass
                self._wake.clear()
                continue
            waiter = asyncio.ensure_future(self._wake.wait())
            try:
                timeout = max(0.0, self._busy_until - time.monotonic()) or None
                done, _ = await asyncio.wait([*self.running, waiter], timeout=timeout, return_when="FIRST_COMPLETED")
            finally:
                waiter.cancel()
            self._wake.clear()
            for task in self.running:
                if task in done:
                    return self._outcome(task, self.running.pop(task))

    def _outcome(self, task: asyncio.Task[GroupOutcome], task_id: str) -> Finished:
        seq = self.began.pop(task, (0, 0.0, ""))[0]
        finished = self._judge(task, task_id)
        finished.seq = seq
        return finished

    def _judge(self, task: asyncio.Task[GroupOutcome], task_id: str) -> Finished:
        if task.cancelled():
            # Only the service cancels a group of ours while we run: it is shutting down.
            self.stopped = "the service is shutting down: its groups were cancelled"
            return self._drop(task_id, self.n, "group_failed", "cancelled: the service is shutting down")
        exc = task.exception()
        if exc is not None:
            return self._drop(task_id, self.n, "group_failed", f"{type(exc).__name__}: {exc}")
        outcome = task.result()
        group = outcome.result
        self.tally.groups_run += 1
        graded = [a.reward for a in group.attempts if a.status in GRADED_STATUSES and a.reward is not None]
        oldest = group.oldest_policy_version
        reason = detail = None
        if self.settings.filter == "signal":
            if len(graded) < 2:
                statuses = Counter(a.status for a in group.attempts)
                reason = "too_few_graded"
                detail = f"{len(graded)} of {group.n} attempts graded ({dict(statuses)}): no comparison"
            elif all(r == graded[0] for r in graded):
                reason, detail = "no_signal", f"every graded reward is {graded[0]:g}"
        tokens = group.completion_tokens
        shape = shape_of(group)
        if reason is None:
            return Finished(
                task_id,
                group.n,
                group.group_id,
                body=outcome.body,
                oldest_version=oldest,
                completion_tokens=tokens,
                shape=shape,
            )
        assert detail is not None
        self.held.release(group.n)
        dropped = DroppedGroup(
            task_id=task_id,
            group_id=group.group_id,
            reason=reason,
            detail=detail,
            rewards=group.rewards,
            attempts=group.n,
            completion_tokens=tokens,
        )
        self.count_dropped(dropped)
        return Finished(task_id, group.n, dropped=dropped, oldest_version=oldest, completion_tokens=tokens, shape=shape)

    def _drop(self, task_id: str, attempts: int, reason: str, detail: str) -> Finished:
        if not self.stopped:  # a group cancelled by a shutdown did not run
            self.tally.groups_run += 1
        dropped = DroppedGroup(task_id=task_id, reason=reason, detail=detail[:500])
        self.count_dropped(dropped)
        return Finished(task_id, attempts, dropped=dropped)

    def count_kept(self) -> None:
        """A kept group is being handed to the caller (counted here alone, once)."""
        self.tally.kept += 1
        self.rooms.kept.inc()

    def count_dropped(self, dropped: DroppedGroup) -> None:
        self.tally.count(dropped)
        self.rooms.dropped.labels(reason=dropped.reason).inc()

    def close(self) -> int:
        """Cancel every group still running (their episodes are abandoned); how many there were."""
        self.stopped = self.stopped or "closed"
        running: dict[asyncio.Future, int] = {task: self.n for task in self.running}
        now = time.monotonic()
        self.cancelled_walls = [now - self.began.get(task, (0, now, ""))[1] for task in running]
        self.running.clear()
        self.began.clear()
        self.rooms.admission.cancel_in_background(running)
        if self._pinned is not None:  # its groups still running hold their own pins until they end
            self.rooms.versions.unpin(self._pinned)
            self._pinned = None
        return len(running)

    def budget_spent(self) -> bool:
        return self.budget is not None and self.started >= self.budget
