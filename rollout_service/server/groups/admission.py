"""Admission: a request resolved to its task's envs and model route, the caps on queued attempts,
and the groups started (each a task the service can cancel at shutdown), whoever the caller."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import dataclass

from ...protocol import GroupRequest, GroupResult
from ..errors import Conflict, Invalid, NotFound, RequestRefused, TooBusy, Unavailable
from ..lifecycle import Lifecycle
from ..membership.envs import EnvRegistry
from ..membership.replicas import ReplicaRegistry
from ..membership.targets import ModelRoute, TaskTarget
from ..metrics import Metrics
from ..task_sets import cancel_in_slices
from .group_json import GroupOutcome
from .run_log import RunLog
from .runner import GroupRunner
from .window import AnswerWindow, window_size, worlds_serving


@dataclass(frozen=True)
class AdmissionLimits:
    """What one request and the service as a whole may hold (--max-n, --max-batch, --max-queued-attempts),
    and a batch's answer window at least (--answer-window)."""

    max_n: int
    max_batch: int
    max_queued_attempts: int
    answer_window: int = 16


class Admission:
    def __init__(
        self,
        limits: AdmissionLimits,
        lifecycle: Lifecycle,
        envs: EnvRegistry,
        replicas: ReplicaRegistry,
        runner: GroupRunner,
        metrics: Metrics,
        run_id: str,
        run_log: RunLog | None,
    ) -> None:
        self.limits = limits
        self.lifecycle = lifecycle
        self.envs = envs
        self.replicas = replicas
        self.runner = runner
        self.metrics = metrics
        self.run_id = run_id
        self.run_log = run_log
        self.queued_attempts = 0  # attempts accepted and not finished, across all requests
        self.running: set[asyncio.Task] = set()
        self.on_result: Callable[[GroupResult], None] | None = None  # every finished group (task stats)
        self._cancellers: set[asyncio.Task] = set()

    def resolve(self, request: GroupRequest) -> tuple[TaskTarget, ModelRoute]:
        """The task's envs and the model route for a request, or RequestRefused saying why not."""
        if request.n > self.limits.max_n:
            raise Invalid(
                "n_too_large", f"n={request.n} is over this service's maximum of {self.limits.max_n} (--max-n)"
            )
        task_id = request.task_id or self.envs.by_slug.get(request.slug or "")
        target = self.envs.targets.get(task_id or "")
        if target is None:
            name = f"task_id {request.task_id!r}" if request.task_id else f"slug {request.slug!r}"
            raise NotFound(
                "unknown_task", f"no environment serves a task with {name}; GET /tasks lists the served tasks"
            )
        if not request.allow_eval_side and all(e.contract.side == "eval" for e in target.envs):
            raise Conflict(
                "eval_side",
                f"task {target.task_id} is served only by an eval-side env "
                f"({', '.join(e.url for e in target.envs)}): training on it leaks the held-out "
                "set. Set allow_eval_side: true if you mean to",
            )
        if target.drained(request.allow_eval_side):
            candidates = target.candidates(request.allow_eval_side)
            raise Unavailable(
                "envs_draining",
                f"every env serving task {target.task_id} is draining ({', '.join(candidates)}): add one "
                "(POST /envs) or send it again later",
                retry_after_s=5,
            )
        policy = self.replicas.policy
        route = policy
        if request.model and request.model != policy.model:
            named = self.replicas.named.get(request.model)
            if named is None:
                known = ", ".join([policy.model, *self.replicas.named])
                raise Invalid(
                    "unknown_model",
                    f"model {request.model!r} is not served here; known: {known} (--model, --model-endpoint)",
                )
            route = named
        if request.pin_version is not None:  # evaluation on a pinned version (server/policy/manager.py)
            if route is not policy:
                raise Invalid("pin_not_policy", "pin_version names a policy version: leave model out")
            self.replicas.versions.check_pin(request.pin_version)
        if request.tokens == "exact" and (route.renderer is None or route.renderer.unsupported):
            why = route.renderer.unsupported if route.renderer else "it was configured with token-ids=false"
            raise Invalid(
                "token_prompts_unsupported",
                f"tokens=exact, but {route.model}'s server cannot take token prompts ({why}): send tokens: chat",
            )
        return target, route

    def admit(self, requests: list[GroupRequest]) -> list[tuple[TaskTarget, ModelRoute]]:
        """Check every request before any work starts, and the cap on queued attempts."""
        self.lifecycle.refuse_unless_ready()
        resolved = []
        for i, request in enumerate(requests):
            try:
                resolved.append(self.resolve(request))
            except RequestRefused as exc:
                if len(requests) > 1:
                    exc.message = f"groups[{i}]: {exc.message}"
                raise
        attempts = sum(r.n for r in requests)
        if attempts > self.limits.max_queued_attempts:
            raise Invalid(
                "too_many_attempts",
                f"this request holds {attempts} attempts, more than this service ever "
                f"queues ({self.limits.max_queued_attempts}, --max-queued-attempts): split it",
            )
        if self.queued_attempts + attempts > self.limits.max_queued_attempts:
            raise TooBusy(
                "too_many_queued_attempts",
                f"{self.queued_attempts} attempts are queued or running and this request adds {attempts}: over "
                f"this service's cap of {self.limits.max_queued_attempts} (--max-queued-attempts). Send it again "
                "when earlier groups have finished",
                retry_after_s=5,
            )
        return resolved

    def start_batch(self, requests: list[GroupRequest]) -> tuple[list[asyncio.Task[GroupOutcome]], AnswerWindow]:
        """A batch's groups (POST /groups/batch), at most --max-batch of them, admitted as one call; each
        starts when the answer's window has room (its line written frees a place: `AnswerWindow.leave`)."""
        if len(requests) > self.limits.max_batch:
            raise Invalid(
                "batch_too_large",
                f"{len(requests)} groups is over this service's maximum of "
                f"{self.limits.max_batch} per batch (--max-batch)",
            )
        task_ids = [r.task_id or self.envs.by_slug.get(r.slug or "", "") for r in requests]
        worlds = worlds_serving(self.envs, task_ids, any(r.allow_eval_side for r in requests))
        window = AnswerWindow(window_size(self.limits.answer_window, worlds, min(r.n for r in requests)))
        return self.start_groups(requests, window), window

    def count_held(self, attempts: int) -> None:
        """Attempts of finished groups that wait for their reader (`streaming.HeldResults`; negative
        when sent or dropped): they keep their room under --max-queued-attempts until then."""
        self.queued_attempts += attempts

    def start_groups(
        self, requests: list[GroupRequest], window: AnswerWindow | None = None
    ) -> list[asyncio.Task[GroupOutcome]]:
        """Admit and start groups; each is a task the service can cancel at shutdown. One share per
        call: concurrent calls get fair shares of the pools, earlier groups of one call go first. With a
        window, a group waits for its room before it runs (its attempts counted as queued meanwhile)."""
        resolved = self.admit(requests)
        share = object()
        tasks = []
        for request, (target, route) in zip(requests, resolved, strict=True):
            task = asyncio.ensure_future(self._run(request, target, route, self.runner.next_sequence(), share, window))
            self.running.add(task)
            task.add_done_callback(self.running.discard)
            # Counted from admission (not from when the task first runs), so two requests admitted in
            # one loop iteration cannot both pass the cap; uncounted when done, however it ends.
            self.queued_attempts += request.n
            task.add_done_callback(functools.partial(self._uncount, request.n))
            tasks.append(task)
        return tasks

    async def _run(
        self,
        request: GroupRequest,
        target: TaskTarget,
        route: ModelRoute,
        sequence: int,
        share: object,
        window: AnswerWindow | None = None,
    ) -> GroupOutcome:
        """One group, typed and as the JSON every consumer outside gets: serialised once, recorded in
        the run log here (whether or not its trainer is still there to read it)."""
        if window is not None:
            await window.enter()
        self.metrics.groups_in_flight.inc()
        try:
            result = await self.runner.run_group(
                request, target, route, sequence=sequence, run_id=self.run_id, share=share
            )
        finally:
            self.metrics.groups_in_flight.dec()
        if self.on_result is not None:
            self.on_result(result)
        outcome = GroupOutcome.of(result)
        if self.run_log is not None:
            self.run_log.append(outcome.body)
        return outcome

    def _uncount(self, attempts: int, _: asyncio.Future) -> None:
        self.queued_attempts -= attempts

    def cancel_in_background(self, groups: dict[asyncio.Future, int]) -> None:
        """Cancel these groups (task -> its attempts) in slices, as a task of the service's own that
        nothing outside can interrupt."""
        if not groups:
            return
        task = asyncio.ensure_future(cancel_in_slices(groups))
        self._cancellers.add(task)
        task.add_done_callback(self._cancellers.discard)

    def cancel_all(self) -> None:
        for task in list(self.running):
            task.cancel()
