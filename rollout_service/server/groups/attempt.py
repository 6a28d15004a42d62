"""One attempt of a group: its tries, each an episode against an env, turn by turn on the model.

An `AttemptRun` carries what the attempt needs (its group's request, target and model route, its
index) so that its steps are methods, not parameter lists. Every episode a try starts is finished
or abandoned on every path: a final answer, env or inference errors, a malformed answer, the per-try
deadline, `max_turns`, and cancellation (a trainer that went away, shutdown), a second cancellation
during cleanup included. Why a try failed is read from what it raised, in `failures.classify`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ...backends.answers import structured_output
from ...backends.env_client import BadEnvAnswer, EnvError, EnvUnreachable, StepAnswer
from ...backends.errors import BadInferenceResponse, InferenceError
from ...backends.json_body import JsonList
from ...backends.template_renderer import TokenPromptsUnsupported
from ...protocol import GRADED_STATUSES, Attempt, AttemptTimings, Failure, GroupRequest, Turn
from ..membership.targets import EnvHandle, GroupRun, ModelRoute
from ..membership.world_scheduler import NoEnvLeft, WorldScheduler
from ..metrics import Metrics
from ..policy.manager import PolicyManager
from .endings import EpisodeEndings
from .failures import GroupClosed, Stale, TooManyTurns, TryState, bug, classify
from .outcome import fail, fail_stale, failed, score
from .trajectory import TrajectoryBuilder

log = logging.getLogger("rollout_service.runner")

_SEED_STRIDE = 7919  # attempt i samples with seed + i * stride + turn: different, the same on a rerun
# Re-runs of an attempt that fell behind max_staleness, on top of `retries`: past them the policy
# moves faster than this task's episodes finish, and the attempt is returned as failed (stale).
MAX_STALE_RERUNS = 8


@dataclass
class RunnerConfig:
    policy_stages: frozenset[str] = frozenset({"executor"})
    max_staleness: int | None = None  # when a request says nothing


class AgentLane(Protocol):
    """Runs a try's episode on an agent server (server/agents/lane.py): the agent drives, its model
    calls come back as this attempt's turns."""

    async def episode(self, run: AttemptRun, t: _Try, attempt: Attempt, env: EnvHandle) -> None: ...


@dataclass(frozen=True)
class RunnerParts:
    """What every attempt of a runner shares: worlds, endings, metrics, and the models."""

    scheduler: WorldScheduler
    endings: EpisodeEndings
    metrics: Metrics
    config: RunnerConfig
    policy: ModelRoute  # the service's policy: its turns are served under a version lease
    support: ModelRoute | None  # answers the stages that are not the policy's, when set
    versions: PolicyManager | None  # the policy's versions; turns of other models carry none
    agents: AgentLane | None = None  # episodes on agent servers; None: agent servers are refused

    def stale_reason(self, request: GroupRequest, attempt: Attempt) -> str | None:
        """Why the attempt's oldest turn is further behind the current policy than the bound, or None."""
        bound = request.max_staleness if request.max_staleness is not None else self.config.max_staleness
        if bound is None or self.versions is None or request.pin_version is not None:  # a pin stays behind
            return None
        labels = [t.policy_version for t in attempt.turns if t.policy_version is not None]
        if not labels:
            return None
        behind = max(self.versions.behind(label) for label in labels)
        if behind <= bound:
            return None
        oldest = max(labels, key=self.versions.behind)
        return (
            f"its turns from version {oldest} are {behind} updates behind {self.versions.current.label} "
            f"(max_staleness={bound})"
        )

    def went_stale(self, request: GroupRequest, attempt: Attempt) -> bool:
        """Turn a graded attempt (scored, or failed by the policy) whose oldest turn is now further
        behind than the bound into a stale failure; True if it did."""
        if attempt.status not in GRADED_STATUSES:
            return False
        why = self.stale_reason(request, attempt)
        if why is None:
            return False
        fail_stale(attempt, why)
        return True


@dataclass
class _Try:
    """One try's bookkeeping: where its time went, and what its ending must know."""

    started: float = field(default_factory=time.monotonic)
    queued: float = 0.0
    inference: float = 0.0
    env: float = 0.0
    waiting_for_policy: bool = False  # held by a paused policy: not the policy's time
    reset: asyncio.Task[StepAnswer] | None = None  # the reset, a task of its own the ending can take over
    over: bool = False  # the env has ended the episode itself: nothing to abandon

    def timings(self) -> AttemptTimings:
        return AttemptTimings(
            queued_s=round(self.queued, 4),
            inference_s=round(self.inference, 4),
            env_s=round(self.env, 4),
            total_s=round(time.monotonic() - self.started, 4),
        )


class AttemptRun:
    """Attempt `index` of a group, run try after try until one counts."""

    def __init__(self, parts: RunnerParts, group: GroupRun, index: int) -> None:
        self.parts = parts
        self.group = group
        self.index = index
        self.priority = (group.sequence, index)
        # Set by the runner before it cancels this attempt because tail control closed the group:
        # the try then ends as `group_closed` (status cut), not `cancelled`.
        self.cut_reason: str | None = None
        self.current: Attempt | None = None  # the try in flight once it holds a world

    def cut(self, reason: str) -> Attempt:
        """What a cut attempt returns: its try in flight, or a fresh record if it held no world yet."""
        attempt = self.current if self.current is not None else Attempt(index=self.index, status="cut")
        if attempt.status != "cut":
            fail(attempt, classify(GroupClosed(reason), self._state(_Try(), attempt)).failure)
        attempt.reward = attempt.advantage = attempt.pass_ = None
        return attempt

    async def run(self, prior: Attempt | None = None) -> Attempt:
        """Run tries until one counts: env failures are re-run up to `retries`, stale attempts up to
        MAX_STALE_RERUNS more. `prior`: a finished try to go on from (one that went stale)."""
        request = self.group.request
        attempt, retryable = prior, False
        while True:
            earlier: list[Failure] = []
            if attempt is not None:
                failure = attempt.failure
                stale_reruns = sum(f.kind == "stale" for f in attempt.earlier_failures)
                if failure is not None and failure.kind == "stale":
                    if stale_reruns >= MAX_STALE_RERUNS:
                        return attempt
                elif not retryable or len(attempt.earlier_failures) - stale_reruns >= request.retries:
                    return attempt
                earlier = [*attempt.earlier_failures, failure or Failure.of("env_episode_failed")]
            try:
                result, retryable = await self._try()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug outside the episode loop: this attempt fails, its siblings go on
                log.exception("attempt %d of group %s failed unexpectedly", self.index, self.group.group_id)
                # Not `classify`: outside the episode, a TimeoutError or an EnvError is a bug all the same.
                verdict = bug(exc)
                result, retryable = failed(self.index, verdict.failure), verdict.retryable
            result.tries, result.earlier_failures = len(earlier) + 1, earlier
            self.parts.went_stale(request, result)
            self.parts.metrics.attempt_done(result)
            attempt = result

    def _state(self, t: _Try, attempt: Attempt | None) -> TryState:
        return TryState(
            task_id=self.group.target.task_id,
            timeout_s=self.group.request.timeout_s,
            episode_started=attempt is not None and attempt.episode_id is not None,
            waiting_for_policy=t.waiting_for_policy,
        )

    async def _try(self) -> tuple[Attempt, bool]:
        """One try: (the attempt, whether it failed on the env's side and may be run again)."""
        request, target, parts = self.group.request, self.group.target, self.parts
        t = _Try()
        self.current = None
        try:
            slot = await parts.scheduler.acquire(
                target.candidates(request.allow_eval_side),
                self.priority,
                self.group.share,
                task=(target.task_id, request.allow_eval_side),
            )
        except NoEnvLeft as exc:
            verdict = classify(exc, self._state(t, None))
            return failed(self.index, verdict.failure), verdict.retryable
        t.queued = time.monotonic() - t.started
        try:
            env = target.env(slot.url)
        except BaseException:  # no episode started yet: the slot alone goes back
            parts.scheduler.release(slot)
            raise
        held_from = time.monotonic()
        parts.metrics.episodes_in_flight.labels(env=env.url).inc()
        attempt = Attempt(
            index=self.index,
            status="cancelled",
            env=env.url,
            failure=Failure.of("cancelled", "the group was cancelled"),
        )
        self.current = attempt
        retryable = False
        try:
            async with asyncio.timeout(request.timeout_s):
                if env.client.agent:
                    if parts.agents is None:
                        raise RuntimeError(f"{env.url} is an agent server, and this runner runs no agents")
                    await parts.agents.episode(self, t, attempt, env)
                else:
                    await self._episode(t, attempt, env)
        except (Exception, asyncio.CancelledError) as exc:
            if isinstance(exc, BadEnvAnswer) and attempt.episode_id is None and exc.episode_id:
                attempt.episode_id = exc.episode_id  # a malformed reset answer that still names its episode
            if isinstance(exc, EnvError):
                t.over = exc.episode_over
            if isinstance(exc, EnvUnreachable):
                slot.down = True  # retries go elsewhere until the monitor's next probe finds it answering
            closed = isinstance(exc, asyncio.CancelledError) and self.cut_reason is not None
            verdict = classify(GroupClosed(self.cut_reason) if closed else exc, self._state(t, attempt))
            if verdict.failure.kind == "internal_error":  # a malformed answer or a bug: never the group's
                log.exception("episode of attempt %d of group %s failed unexpectedly", self.index, self.group.group_id)
            fail(attempt, verdict.failure)
            retryable = verdict.retryable
            if isinstance(exc, asyncio.CancelledError):
                raise
        finally:
            attempt.timings = t.timings()
            # A reset that never reached us may still have started an episode: the ending takes it over.
            unknown_reset = t.reset if attempt.episode_id is None else None
            episode_id = None if t.over else attempt.episode_id
            first_delete = parts.endings.end(env, slot, held_from, episode_id, unknown_reset)
            # Wait for the ending's first DELETE so the group answers after its worlds are back, but
            # never for a reset still in flight (timeout_s bounds the try) nor for the retries of an
            # env that refuses or is down (the ending keeps the slot and goes on by itself). A second
            # cancellation here leaves the ending running on its own; it still frees the slot.
            if first_delete is not None and (unknown_reset is None or unknown_reset.done()):
                await asyncio.shield(first_delete.wait())
        return attempt, retryable

    async def _episode(self, t: _Try, attempt: Attempt, env: EnvHandle) -> None:
        """Reset, then a completion and a step per turn until the env's final answer, which grades
        the attempt. Whatever ends it otherwise is raised."""
        request = self.group.request
        t.reset = asyncio.ensure_future(env.client.reset(self.group.target.task_id, request.reward_profile))
        answer = await self._timed_env(t, asyncio.shield(t.reset))
        attempt.episode_id = answer.episode_id
        trajectory = await self._trajectory(t)
        if trajectory is not None:
            attempt.tokens, attempt.trajectory = "exact", trajectory.segments
        while not answer.done:
            why = self.parts.stale_reason(request, attempt)
            if why is not None:
                raise Stale(why)
            if len(attempt.turns) >= request.max_turns:
                raise TooManyTurns(f"the episode asked for more than max_turns={request.max_turns} completions")
            turn = await self._turn(t, answer, len(attempt.turns), trajectory)
            attempt.turns.append(turn)
            step = env.client.step(answer.episode_id, turn.completion, turn.prompt_tokens, turn.completion_tokens)
            answer = await self._timed_env(t, step)
        t.over = True
        score(attempt, answer)

    async def _timed_env(self, t: _Try, call: Awaitable[StepAnswer]) -> StepAnswer:
        started = time.monotonic()
        try:
            return await call
        finally:
            t.env += time.monotonic() - started

    async def _trajectory(self, t: _Try) -> TrajectoryBuilder | None:
        """A trajectory for this try when its turns go out as token ids (exact mode), else None."""
        request, group_id = self.group.request, self.group.group_id
        renderer = self.group.route.renderer
        if request.tokens == "chat" or renderer is None:
            return None
        started = time.monotonic()
        try:
            supported = await renderer.supported(group_id)
        except InferenceError:
            if request.tokens == "exact":
                raise
            return None  # not known yet (the server did not answer the probe): this try goes as chat
        finally:
            t.inference += time.monotonic() - started
        if supported:
            return TrajectoryBuilder(renderer, group_id)
        if request.tokens == "exact":
            why = renderer.unsupported
            raise TokenPromptsUnsupported(f"tokens=exact, but the model server cannot take token prompts: {why}")
        return None

    async def _turn(
        self,
        t: _Try,
        answer: StepAnswer,
        turn_index: int,
        trajectory: TrajectoryBuilder | None,
        sampling_asked: dict[str, Any] | None = None,
    ) -> Turn:
        """The model's completion for the env's observation, as the turn's record. `sampling_asked`: the
        group's sampling as one call narrowed it (an agent's max_tokens); by default the group's."""
        request, group_id, parts = self.group.request, self.group.group_id, self.parts
        policy = self.group.route
        observation = answer.observation
        if observation is None:
            raise BadEnvAnswer(200, "invalid_answer", "the env answered done=false without an observation")
        trainable = observation.stage in parts.config.policy_stages
        route = policy if trainable or parts.support is None else parts.support
        sampling: dict[str, Any] = dict(sampling_asked) if sampling_asked else request.sampling.model_dump()
        seed = None
        if request.sampling.seed is not None:
            seed = (request.sampling.seed + self.index * _SEED_STRIDE + turn_index) % (2**31 - 1)
            sampling["seed"] = seed
        exact = trajectory is not None and route is policy
        prompt_ids = None
        if exact:
            assert trajectory is not None
            started = time.monotonic()
            try:
                prompt_ids = await trajectory.prompt(observation.messages)
            finally:
                t.inference += time.monotonic() - started
            if trajectory.continued is not None:
                parts.metrics.continued(trajectory.continued)
        versions = parts.versions
        lease = None
        if versions is not None and route is parts.policy:
            t.waiting_for_policy = True
            lease = await versions.lease(request.pin_version)
            t.waiting_for_policy = False
        ended_on = None
        started = time.monotonic()
        model = lease.version.served_model if lease is not None else route.request_model
        constraint = observation.response_format if request.constrained else None
        try:
            if prompt_ids is not None:
                result = await route.client.complete(
                    model=model,
                    prompt_token_ids=prompt_ids,
                    sampling=sampling,
                    response_format=constraint,
                    affinity=group_id,
                )
            else:
                result = await route.client.chat(
                    model=model,
                    messages=observation.messages,
                    sampling=sampling,
                    response_format=constraint,
                    affinity=group_id,
                )
        finally:
            t.inference += time.monotonic() - started
            if lease is not None and versions is not None:
                ended_on = versions.release(lease)
        if lease is not None:
            parts.metrics.turns.labels(version=lease.version.label).inc()
        choice = result.choices[0]
        # An exact turn's prompt ids are the very list the client sent (it refuses an answer whose count or
        # echo of the prompt differs): the trajectory's, which holds them for the turn's record too.
        has_ids = choice.completion_token_ids is not None and result.prompt_token_ids is not None
        if exact and (
            not has_ids or choice.logprobs is None or len(choice.logprobs) != len(choice.completion_token_ids or ())
        ):
            raise BadInferenceResponse("a token-prompt completion without its ids and logprobs")
        parts.metrics.completion_done(time.monotonic() - started, result.prompt_tokens, choice.completion_tokens)
        # Every value was validated where it came in (the server's and the env's answers): constructed
        # without checking thousands of ids again (~3% of the service's CPU at bench/ceiling.py's ceiling).
        completion_ids, logprobs = choice.completion_token_ids, choice.logprobs
        if exact and completion_ids is not None and logprobs is not None:
            # Written once, for the turn's record and its trajectory alike (transport.JsonList).
            completion_ids, logprobs = JsonList(completion_ids), JsonList(logprobs)
        turn = Turn.model_construct(
            index=turn_index,
            stage=observation.stage,
            trainable=trainable,
            model=route.model,
            endpoint=result.endpoint,
            messages=observation.messages,
            response_format=observation.response_format,
            completion=choice.text,
            prompt_token_ids=result.prompt_token_ids if has_ids and not exact else None,
            completion_token_ids=completion_ids if has_ids else None,
            logprobs=logprobs if has_ids else None,
            token_source="server" if has_ids else "absent",
            finish_reason=choice.finish_reason,
            prompt_tokens=result.prompt_tokens,
            completion_tokens=choice.completion_tokens,
            seed=seed,
            policy_version=lease.version.label if lease is not None else None,
            mixed_version=ended_on is not None,
            policy_version_end=ended_on,
            constrained=structured_output(constraint) is not None,
        )
        if exact:
            assert trajectory is not None
            trajectory.record(turn, stopped_on_string=isinstance(choice.stop_reason, str))
        return turn
