"""Running groups: attempts as episodes, each turn's completion from the model, nothing leaked.

Every episode this module starts is finished or abandoned (DELETE) on every path, and every
world slot it takes is given back: a final answer, env or inference errors, a malformed answer,
the per-try deadline, `max_turns`, and cancellation (a trainer that went away, shutdown), a
second cancellation during cleanup included. Ending an episode is a task of its own that owns
the slot until the env has the world back; nothing that happens to the attempt can interrupt it.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, cast

from inference.answers import structured_output
from inference.errors import BadInferenceResponse, ContextOverflow, InferenceError
from inference.json_body import JsonList

from ..protocol import (
    GRADED_STATUSES,
    Attempt,
    AttemptTimings,
    Failure,
    FailureKind,
    GroupRequest,
    GroupResult,
    Turn,
)
from ..retry import Backoff
from .env_client import BadEnvAnswer, EnvError, EnvUnreachable, StepAnswer
from .metrics import Metrics
from .outcome import assemble, fail, fail_stale, failed, score
from .policy import PolicyManager
from .scheduler import EnvSlots, NoEnvLeft, WorldScheduler
from .targets import EnvHandle, ModelRoute, TaskTarget
from .trajectory import TokenPromptsUnsupported, TrajectoryBuilder

__all__ = ["EnvHandle", "GroupRunner", "ModelRoute", "RunnerConfig", "TaskTarget"]

log = logging.getLogger("rollout_service.runner")

_SEED_STRIDE = 7919  # attempt i samples with seed + i * stride + turn: different, the same on a rerun
# How long an ending keeps DELETEing an episode the env will not give back: the contract's idle
# reclaim (5 minutes by default) plus a margin; past it the env has ended the episode itself.
ABANDON_PATIENCE_S = 330.0
# Re-runs of an attempt that fell behind max_staleness, on top of `retries`: past them the policy
# moves faster than this task's episodes finish, and the attempt is returned as failed (stale).
MAX_STALE_RERUNS = 8


@dataclass
class RunnerConfig:
    policy_stages: frozenset[str] = frozenset({"executor"})
    max_staleness: int | None = None  # when a request says nothing


class _Stale(Exception):
    """The attempt's oldest turn is further behind the current policy than the request allows."""


@dataclass
class _Clock:
    queued: float = 0.0
    inference: float = 0.0
    env: float = 0.0
    started: float = field(default_factory=time.monotonic)
    waiting_for_policy: bool = False  # held by a paused policy: not the policy's time


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
    ) -> None:
        self.scheduler = scheduler
        self.versions = versions  # the policy's versions; turns of other models carry none
        self.policy = policy
        self.support = support
        self.metrics = metrics
        self.config = config or RunnerConfig()
        self._group_seq = 0
        self._endings: set[asyncio.Task] = set()  # episodes being ended in the background
        self._draining = False  # shutting down: endings stop retrying

    @property
    def episodes_ending(self) -> int:
        """Episodes being abandoned in the background (their slots are still held until done)."""
        return len(self._endings)

    def next_sequence(self) -> int:
        self._group_seq += 1
        return self._group_seq

    async def drain(self, timeout_s: float) -> None:
        """Wait (bounded) for episodes still being ended, e.g. before the env clients close."""
        self._draining = True
        if self._endings:
            await asyncio.wait(set(self._endings), timeout=timeout_s)

    async def run_group(
        self,
        request: GroupRequest,
        target: TaskTarget,
        policy: ModelRoute,
        sequence: int | None = None,
        run_id: str | None = None,
        share: object = None,
    ) -> GroupResult:
        """Run one group. `share` names the request it came with: concurrent requests get fair
        shares of the pools; within one, earlier groups (lower `sequence`) get worlds first."""
        sequence = self.next_sequence() if sequence is None else sequence
        group_id_share = share if share is not None else sequence
        group_id = request.group_id or f"g-{uuid.uuid4().hex[:12]}"
        started = time.monotonic()
        try:
            attempts = list(
                await asyncio.gather(
                    *(
                        self._run_attempt(request, target, policy, group_id, (sequence, i), i, group_id_share)
                        for i in range(request.n)
                    )
                )
            )
            # An attempt within the bound when it ended may have fallen behind while its siblings
            # ran: the group returns only attempts within the bound now.
            while redo := [i for i, a in enumerate(attempts) if self._went_stale(request, a)]:
                again = await asyncio.gather(
                    *(
                        self._run_attempt(
                            request, target, policy, group_id, (sequence, i), i, group_id_share, attempts[i]
                        )
                        for i in redo
                    )
                )
                for i, attempt in zip(redo, again, strict=True):
                    attempts[i] = attempt
        finally:
            policy.client.unpin(group_id)
            if policy.renderer is not None:
                policy.renderer.forget(group_id)
            if self.support is not None:
                self.support.client.unpin(group_id)
        result = assemble(
            request, target, policy, group_id, list(attempts), time.monotonic() - started, run_id, self.versions
        )
        self.metrics.group_done(result)
        return result

    async def _run_attempt(
        self,
        request: GroupRequest,
        target: TaskTarget,
        policy: ModelRoute,
        group_id: str,
        priority: tuple,
        index: int,
        share: object,
        prior: Attempt | None = None,
    ) -> Attempt:
        """Run tries until one counts: env failures are re-run up to `retries`, stale attempts up to
        MAX_STALE_RERUNS more. `prior`: a finished try to go on from (one that went stale)."""
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
                result, retryable = await self._run_episode(request, target, policy, group_id, priority, index, share)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug outside the episode loop: this attempt fails, its siblings go on
                log.exception("attempt %d of group %s failed unexpectedly", index, group_id)
                result, retryable = failed(index, "internal_error", f"{type(exc).__name__}: {exc}"), False
            result.tries, result.earlier_failures = len(earlier) + 1, earlier
            self._went_stale(request, result)
            self.metrics.attempt_done(result)
            attempt = result

    def _went_stale(self, request: GroupRequest, attempt: Attempt) -> bool:
        """Turn a graded attempt (scored, or failed by the policy) whose oldest turn is now further
        behind than the bound into a stale failure; True if it did."""
        if attempt.status not in GRADED_STATUSES:
            return False
        why = self._stale_reason(request, attempt)
        if why is None:
            return False
        fail_stale(attempt, why)
        return True

    async def _run_episode(
        self,
        request: GroupRequest,
        target: TaskTarget,
        policy: ModelRoute,
        group_id: str,
        priority: tuple,
        index: int,
        share: object,
    ) -> tuple[Attempt, bool]:
        """One try: (the attempt, whether it failed on the env's side and may be run again)."""
        clock = _Clock()
        try:
            slot = await self.scheduler.acquire(
                target.candidates(request.allow_eval_side),
                priority,
                share,
                task=(target.task_id, request.allow_eval_side),
            )
        except NoEnvLeft as exc:
            return failed(index, "env_no_world", f"task {target.task_id}: {exc}"), False
        clock.queued = time.monotonic() - clock.started
        env = target.env(slot.url)
        held_from = time.monotonic()
        self.metrics.episodes_in_flight.labels(env=env.url).inc()
        attempt = Attempt(
            index=index, status="cancelled", env=env.url, failure=Failure.of("cancelled", "the group was cancelled")
        )
        reset: asyncio.Task[StepAnswer] | None = None
        over = retryable = False  # over: the env has ended the episode itself
        try:
            async with asyncio.timeout(request.timeout_s):
                # The reset runs as a task of its own: if this try is cancelled or times out while the
                # env is still starting the episode, the ending below takes it over.
                reset = asyncio.ensure_future(env.client.reset(target.task_id, request.reward_profile))
                answer = await self._env_call(clock, asyncio.shield(reset))
                attempt.episode_id = answer.episode_id
                trajectory = await self._trajectory(clock, request, policy, group_id)
                if trajectory is not None:
                    attempt.tokens, attempt.trajectory = "exact", trajectory.segments
                while not answer.done:
                    self._check_staleness(request, attempt)
                    if len(attempt.turns) >= request.max_turns:
                        fail(
                            attempt,
                            "max_turns",
                            f"the episode asked for more than max_turns={request.max_turns} completions",
                        )
                        break
                    turn = await self._complete(
                        clock, request, policy, group_id, index, answer, len(attempt.turns), trajectory
                    )
                    attempt.turns.append(turn)
                    answer = await self._env_call(
                        clock,
                        env.client.step(answer.episode_id, turn.completion, turn.prompt_tokens, turn.completion_tokens),
                    )
                else:
                    over = True
                    score(attempt, answer)
                    retryable = attempt.status == "env_failure"
        except _Stale as exc:
            fail_stale(attempt, str(exc))
        except TimeoutError:
            if clock.waiting_for_policy:
                fail(
                    attempt,
                    "policy_paused",
                    f"timeout_s={request.timeout_s:g} ran out while the policy replicas were paused for an update",
                )
            elif attempt.episode_id is None:  # the env never gave a world: not the policy's doing
                fail(attempt, "env_no_world", f"the env started no episode within timeout_s={request.timeout_s:g}")
                retryable = True
            else:
                fail(attempt, "deadline", f"the try did not finish within timeout_s={request.timeout_s:g}")
        except EnvError as exc:
            if isinstance(exc, BadEnvAnswer) and attempt.episode_id is None and exc.episode_id:
                attempt.episode_id = exc.episode_id  # a malformed reset answer that still names its episode
            over = exc.episode_over
            if isinstance(exc, EnvUnreachable):
                slot.down = True  # retries go elsewhere until the monitor's next probe finds it answering
            fail(attempt, cast(FailureKind, exc.kind), f"{exc.status or 'no answer'} {exc.error}: {exc.message}")
            retryable = exc.retryable
        except ContextOverflow as exc:
            fail(attempt, "context_overflow", exc.detail)
        except InferenceError as exc:
            fail(attempt, cast(FailureKind, exc.kind), exc.detail)
        except asyncio.CancelledError:
            fail(attempt, "cancelled", "the group was cancelled (trainer gone or shutdown)")
            raise
        except Exception as exc:  # a malformed answer or a bug: this attempt's failure, never the group's
            log.exception("episode of attempt %d of group %s failed unexpectedly", index, group_id)
            fail(attempt, "internal_error", f"{type(exc).__name__}: {exc}")
        finally:
            attempt.timings = AttemptTimings(
                queued_s=round(clock.queued, 4),
                inference_s=round(clock.inference, 4),
                env_s=round(clock.env, 4),
                total_s=round(time.monotonic() - clock.started, 4),
            )
            # A reset that never reached us may still have started an episode: the ending takes it over.
            unknown_reset = reset if attempt.episode_id is None else None
            first_delete = self._end_episode(env, slot, held_from, None if over else attempt.episode_id, unknown_reset)
            # Wait for the ending's first DELETE so the group answers after its worlds are back, but
            # never for a reset still in flight (timeout_s bounds the try) nor for the retries of an
            # env that refuses or is down (the ending keeps the slot and goes on by itself). A second
            # cancellation here leaves the ending running on its own; it still frees the slot.
            if first_delete is not None and (unknown_reset is None or unknown_reset.done()):
                await asyncio.shield(first_delete.wait())
        return attempt, retryable

    async def _trajectory(
        self, clock: _Clock, request: GroupRequest, policy: ModelRoute, group_id: str
    ) -> TrajectoryBuilder | None:
        """A trajectory for this try when its turns go out as token ids (exact mode), else None."""
        renderer = policy.renderer
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
            clock.inference += time.monotonic() - started
        if supported:
            return TrajectoryBuilder(renderer, group_id)
        if request.tokens == "exact":
            why = renderer.unsupported
            raise TokenPromptsUnsupported(f"tokens=exact, but the model server cannot take token prompts: {why}")
        return None

    def _check_staleness(self, request: GroupRequest, attempt: Attempt) -> None:
        """Before a turn: stop an episode that can no longer be returned within the bound."""
        why = self._stale_reason(request, attempt)
        if why is not None:
            raise _Stale(why)

    def _stale_reason(self, request: GroupRequest, attempt: Attempt) -> str | None:
        bound = request.max_staleness if request.max_staleness is not None else self.config.max_staleness
        if bound is None or self.versions is None:
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

    def _end_episode(
        self,
        env: EnvHandle,
        slot: EnvSlots,
        held_from: float,
        episode_id: str | None,
        reset: asyncio.Task[StepAnswer] | None,
    ) -> asyncio.Event | None:
        """Give the world back: abandon the episode if it is open, then free the slot. Anything to
        wait for runs as its own task (kept in `_endings`), so no cancellation can cut it short.
        Returns an event set once the first DELETE has been answered (or there was nothing to end)."""
        if episode_id is None and reset is None:
            self._release(env, slot, held_from)
            return None
        first_delete = asyncio.Event()
        task = asyncio.ensure_future(self._abandon_then_release(env, slot, held_from, episode_id, reset, first_delete))
        self._endings.add(task)
        task.add_done_callback(self._endings.discard)
        return first_delete

    async def _abandon_then_release(
        self,
        env: EnvHandle,
        slot: EnvSlots,
        held_from: float,
        episode_id: str | None,
        reset: asyncio.Task[StepAnswer] | None,
        first_delete: asyncio.Event,
    ) -> None:
        try:
            if reset is not None:
                try:
                    answer = await reset
                    if not answer.done:
                        episode_id = answer.episode_id
                except BadEnvAnswer as exc:
                    episode_id = exc.episode_id
                except (Exception, asyncio.CancelledError):
                    pass  # no episode was started (or none we can name)
            if episode_id is not None:
                await self._abandon_patiently(env, episode_id, first_delete)
        finally:
            first_delete.set()
            self._release(env, slot, held_from)

    async def _abandon_patiently(self, env: EnvHandle, episode_id: str, first_delete: asyncio.Event) -> None:
        """DELETE the episode until the env says it is gone. Until then the world is the env's and
        the slot stays held; a stopped or restarting env is retried with backoff, up to the contract's
        idle reclaim (by then the env has ended the episode itself)."""
        deadline = time.monotonic() + ABANDON_PATIENCE_S
        pause = Backoff(0.5, 10.0)
        while True:
            try:
                await env.client.abandon(episode_id)
                return
            except EnvError as exc:
                first_delete.set()
                if exc.episode_over:  # the env process is gone, and its worlds with it
                    return
                if self._draining or time.monotonic() + pause.current > deadline:
                    log.warning("gave up abandoning episode %s on %s: %s", episode_id, env.url, exc)
                    return
                log.warning(
                    "abandoning episode %s on %s failed (%s); again in %.1fs", episode_id, env.url, exc, pause.current
                )
            await pause.sleep()

    def _release(self, env: EnvHandle, slot: EnvSlots, held_from: float) -> None:
        self.scheduler.release(slot, time.monotonic() - held_from)
        self.metrics.episodes_in_flight.labels(env=env.url).dec()

    async def _env_call(self, clock: _Clock, call) -> StepAnswer:
        started = time.monotonic()
        try:
            return await call
        finally:
            clock.env += time.monotonic() - started

    async def _complete(
        self,
        clock: _Clock,
        request: GroupRequest,
        policy: ModelRoute,
        group_id: str,
        index: int,
        answer: StepAnswer,
        turn_index: int,
        trajectory: TrajectoryBuilder | None = None,
    ) -> Turn:
        observation = answer.observation
        if observation is None:
            raise BadEnvAnswer(200, "invalid_answer", "the env answered done=false without an observation")
        trainable = observation.stage in self.config.policy_stages
        route = policy if trainable or self.support is None else self.support
        sampling: dict[str, Any] = request.sampling.model_dump()
        seed = None
        if request.sampling.seed is not None:
            seed = (request.sampling.seed + index * _SEED_STRIDE + turn_index) % (2**31 - 1)
            sampling["seed"] = seed
        exact = trajectory is not None and route is policy
        prompt_ids = None
        if exact:
            assert trajectory is not None
            started = time.monotonic()
            try:
                prompt_ids = await trajectory.prompt(observation.messages)
            finally:
                clock.inference += time.monotonic() - started
            if trajectory.continued is not None:
                self.metrics.continued(trajectory.continued)
        lease = None
        if self.versions is not None and route is self.policy:
            clock.waiting_for_policy = True
            lease = await self.versions.lease()
            clock.waiting_for_policy = False
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
            clock.inference += time.monotonic() - started
            if lease is not None and self.versions is not None:
                ended_on = self.versions.release(lease)
        if lease is not None:
            self.metrics.turns.labels(version=lease.version.label).inc()
        choice = result.choices[0]
        # An exact turn's prompt ids are the very list the client sent (it refuses an answer whose count or
        # echo of the prompt differs): the trajectory's, which holds them for the turn's record too.
        has_ids = choice.completion_token_ids is not None and result.prompt_token_ids is not None
        if exact and (
            not has_ids or choice.logprobs is None or len(choice.logprobs) != len(choice.completion_token_ids or ())
        ):
            raise BadInferenceResponse("a token-prompt completion without its ids and logprobs")
        self.metrics.completion_done(time.monotonic() - started, result.prompt_tokens, choice.completion_tokens)
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
