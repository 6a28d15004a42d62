"""Running groups: a group's attempts run side by side (each an `AttemptRun`, attempt.py), and the
group is returned only with attempts within its staleness bound.

Every episode an attempt starts is finished or abandoned and every world slot given back, on every
path (attempt.py); ending an episode is a task of its own (endings.py) that owns the slot until the
env has the world back, and `drain` waits for those still running at shutdown.
"""

from __future__ import annotations

import time
import uuid

from ...protocol import Attempt, GroupRequest, GroupResult
from ..membership.targets import GroupRun, ModelRoute, TaskTarget
from ..membership.world_scheduler import WorldScheduler
from ..metrics import Metrics
from ..policy.manager import PolicyManager
from .attempt import AgentLane, AttemptRun, RunnerConfig, RunnerParts
from .endings import EpisodeEndings
from .outcome import assemble
from .tail import run_until_closed


class GroupRunner:
    """Runs groups against the envs and models it was given; shares one scheduler across groups."""

    def __init__(
        self,
        scheduler: WorldScheduler,
        policy: ModelRoute,
        support: ModelRoute | None,
        metrics: Metrics,
        config: RunnerConfig | None = None,
        versions: PolicyManager | None = None,
        agents: AgentLane | None = None,
    ) -> None:
        self.endings = EpisodeEndings(scheduler, metrics)
        self.parts = RunnerParts(
            scheduler=scheduler,
            endings=self.endings,
            metrics=metrics,
            config=config or RunnerConfig(),
            policy=policy,
            support=support,
            versions=versions,
            agents=agents,
        )
        self._group_seq = 0

    @property
    def episodes_ending(self) -> int:
        """Episodes being abandoned in the background (their slots are still held until done)."""
        return self.endings.running

    def next_sequence(self) -> int:
        self._group_seq += 1
        return self._group_seq

    async def drain(self, timeout_s: float) -> None:
        """Wait (bounded) for episodes still being ended, e.g. before the env clients close."""
        await self.endings.drain(timeout_s)

    async def run_group(
        self,
        request: GroupRequest,
        target: TaskTarget,
        policy: ModelRoute,
        *,
        sequence: int | None = None,
        run_id: str | None = None,
        share: object = None,
    ) -> GroupResult:
        """Run one group. `share` names the request it came with: concurrent requests get fair
        shares of the pools; within one, earlier groups (lower `sequence`) get worlds first."""
        sequence = self.next_sequence() if sequence is None else sequence
        group_id = request.group_id or f"g-{uuid.uuid4().hex[:12]}"
        group = GroupRun(request, target, policy, group_id, sequence, share if share is not None else sequence)
        runs = [AttemptRun(self.parts, group, i) for i in range(request.n)]
        started = time.monotonic()
        # Evaluation on a pinned version: its adapter stays loaded while the group runs.
        versions = self.parts.versions
        pinned = versions.pin(request.pin_version) if request.pin_version and versions is not None else None
        closes_at = started + request.deadline_s if request.deadline_s is not None else None
        slots: list[Attempt | None] = [None] * request.n
        try:
            # Each attempt counted as an episode on its group's replica while it runs: routing by load.
            episode = policy.client.episode
            jobs = {i: episode(group_id, r.run()) for i, r in enumerate(runs)}
            closed = await run_until_closed(request, runs, jobs, slots, closes_at)
            attempts = [a for a in slots if a is not None]
            # An attempt within the bound when it ended may have fallen behind while its siblings
            # ran: the group returns only attempts within the bound now (re-run until it closes).
            while closed is None and (redo := [i for i, a in enumerate(attempts) if self.parts.went_stale(request, a)]):
                jobs = {i: episode(group_id, runs[i].run(attempts[i])) for i in redo}
                closed = await run_until_closed(request, runs, jobs, slots, closes_at)
                attempts = [a for a in slots if a is not None]
            if closed is not None:  # closed: one that fell behind since is stale, not run again
                for attempt in attempts:
                    self.parts.went_stale(request, attempt)
        finally:
            if pinned is not None and versions is not None:
                versions.unpin(pinned)
            policy.client.unpin(group_id)
            if policy.renderer is not None:
                policy.renderer.forget(group_id)
            if self.parts.support is not None:
                self.parts.support.client.unpin(group_id)
        tail = request.deadline_s is not None or request.min_graded is not None
        result = assemble(
            group,
            attempts,
            wall_s=time.monotonic() - started,
            run_id=run_id,
            versions=versions,
            closed_by=(closed or "all_ended") if tail else None,
        )
        self.parts.metrics.group_done(result)
        return result
