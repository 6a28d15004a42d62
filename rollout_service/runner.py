"""Running groups: attempts as episodes, each turn's completion from the model, nothing leaked.

Every episode this module starts is finished or abandoned (DELETE) on every path: a final
answer, env or inference errors, the per-try deadline, `max_turns`, and cancellation (a
trainer that went away, or shutdown). The DELETE is shielded from the cancellation that
triggers it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

from inference.client import ChatClient, InferenceError

from .advantages import group_advantages, summarize
from .env_client import EnvClient, EnvError, StepAnswer
from .metrics import Metrics
from .scheduler import EnvSlots, WorldScheduler
from .schemas import (Attempt, AttemptTimings, Counts, EnvContract, Failure, GroupRequest, GroupResult,
                      Turn)

UNSCORABLE_CATEGORIES = ("transport_error", "environment_failure")
_SEED_STRIDE = 7919  # attempt i samples with seed + i * stride + turn: different, reproducible


@dataclass
class Route:
    """Who answers a stage: a model (as results name it) on a chat client."""

    model: str
    client: ChatClient
    served_model: str | None = None  # the name the server knows it by, when it differs

    @property
    def request_model(self) -> str:
        return self.served_model or self.model


@dataclass
class EnvHandle:
    url: str
    client: EnvClient
    slots: EnvSlots
    contract: EnvContract


@dataclass
class TaskTarget:
    """A task and the envs that serve it (all with the same dataset fingerprint)."""

    task_id: str
    slug: str
    envs: list[EnvHandle]


@dataclass
class RunnerConfig:
    policy_stages: frozenset[str] = frozenset({"executor"})


@dataclass
class _Clock:
    queued: float = 0.0
    inference: float = 0.0
    env: float = 0.0
    started: float = field(default_factory=time.monotonic)


class GroupRunner:
    """Runs groups against the envs and models it was given; shares one scheduler across groups."""

    def __init__(self, scheduler: WorldScheduler, policy: Route, support: Route | None,
                 metrics: Metrics, config: RunnerConfig | None = None) -> None:
        self.scheduler = scheduler
        self.policy = policy
        self.support = support
        self.metrics = metrics
        self.config = config or RunnerConfig()
        self._group_seq = 0

    def next_sequence(self) -> int:
        self._group_seq += 1
        return self._group_seq

    async def run_group(self, request: GroupRequest, target: TaskTarget, policy: Route,
                        sequence: int | None = None, run_id: str | None = None) -> GroupResult:
        sequence = self.next_sequence() if sequence is None else sequence
        group_id = request.group_id or f"g-{uuid.uuid4().hex[:12]}"
        started = time.monotonic()
        try:
            attempts = await asyncio.gather(*(
                self._run_attempt(request, target, policy, group_id, (sequence, i), i)
                for i in range(request.n)))
        finally:
            policy.client.unpin(group_id)
            if self.support is not None:
                self.support.client.unpin(group_id)
        result = _assemble(request, target, policy, group_id, list(attempts), time.monotonic() - started, run_id)
        self.metrics.group_done(result)
        return result

    async def _run_attempt(self, request: GroupRequest, target: TaskTarget, policy: Route, group_id: str,
                           priority: tuple, index: int) -> Attempt:
        earlier: list[Failure] = []
        for try_number in range(1, request.retries + 2):
            attempt, retryable = await self._run_episode(request, target, policy, group_id, priority, index)
            attempt.tries, attempt.earlier_failures = try_number, list(earlier)
            self.metrics.attempt_done(attempt)
            if not retryable or try_number > request.retries:
                return attempt
            earlier.append(attempt.failure or Failure(kind="env_failure"))
        raise AssertionError("unreachable")

    async def _run_episode(self, request: GroupRequest, target: TaskTarget, policy: Route, group_id: str,
                           priority: tuple, index: int) -> tuple[Attempt, bool]:
        """One try: (the attempt, whether it failed on the env's side and may be run again)."""
        clock = _Clock()
        slot = await self.scheduler.acquire([e.url for e in target.envs], priority)
        clock.queued = time.monotonic() - clock.started
        env = next(e for e in target.envs if e.url == slot.url)
        held_from = time.monotonic()
        self.metrics.episodes_in_flight.labels(env=env.url).inc()
        attempt = Attempt(index=index, status="cancelled", env=env.url)
        finished = retryable = False
        try:
            async with asyncio.timeout(request.timeout_s):
                answer = await self._env_call(clock, env.client.reset(target.task_id, request.reward_profile))
                attempt.episode_id = answer.episode_id
                while not answer.done:
                    if len(attempt.turns) >= request.max_turns:
                        attempt.status = "timeout"
                        attempt.failure = Failure(kind="max_turns",
                                                  detail=f"the episode asked for more than max_turns="
                                                         f"{request.max_turns} completions")
                        break
                    turn = await self._complete(clock, request, policy, group_id, index, answer, len(attempt.turns))
                    attempt.turns.append(turn)
                    answer = await self._env_call(clock, env.client.step(
                        answer.episode_id, turn.completion, turn.prompt_tokens, turn.completion_tokens))
                else:
                    finished = True
                    _score(attempt, answer)
                    retryable = attempt.status == "env_failure"
        except TimeoutError:
            attempt.status = "timeout"
            attempt.failure = Failure(kind="deadline", detail=f"the try did not finish within timeout_s="
                                                              f"{request.timeout_s:g}")
        except EnvError as exc:
            finished = exc.status == 410  # the env already ended it; nothing to give back
            attempt.status = "env_failure"
            attempt.failure = Failure(kind=f"env_{exc.status or 'unreachable'}_{exc.error}", detail=exc.message)
            retryable = exc.retryable
        except InferenceError as exc:
            attempt.status = "inference_failure"
            attempt.failure = Failure(kind=exc.reason, detail=exc.detail)
        except asyncio.CancelledError:
            attempt.status = "cancelled"
            raise
        finally:
            if attempt.episode_id and not finished:
                await env.client.abandon_quietly(attempt.episode_id)
            self.scheduler.release(slot, time.monotonic() - held_from)
            self.metrics.episodes_in_flight.labels(env=env.url).dec()
            attempt.timings = AttemptTimings(queued_s=round(clock.queued, 4), inference_s=round(clock.inference, 4),
                                             env_s=round(clock.env, 4),
                                             total_s=round(time.monotonic() - clock.started, 4))
        return attempt, retryable

    async def _env_call(self, clock: _Clock, call) -> StepAnswer:
        started = time.monotonic()
        try:
            return await call
        finally:
            clock.env += time.monotonic() - started

    async def _complete(self, clock: _Clock, request: GroupRequest, policy: Route, group_id: str,
                        index: int, answer: StepAnswer, turn_index: int) -> Turn:
        observation = answer.observation
        if observation is None:
            raise EnvError(None, "invalid_answer", "the env answered done=false without an observation")
        trainable = observation.stage in self.config.policy_stages
        route = policy if trainable or self.support is None else self.support
        sampling = request.sampling
        seed = None
        if sampling.seed is not None:
            seed = (sampling.seed + index * _SEED_STRIDE + turn_index) % (2**31 - 1)
            sampling = sampling.model_copy(update={"seed": seed})
        started = time.monotonic()
        try:
            result = await route.client.chat(model=route.request_model, messages=observation.messages, sampling=sampling,
                                             response_format=observation.response_format, affinity=group_id)
        finally:
            clock.inference += time.monotonic() - started
        self.metrics.inference_latency.observe(time.monotonic() - started)
        choice = result.choices[0]
        has_ids = choice.completion_token_ids is not None and result.prompt_token_ids is not None
        completion_tokens = len(choice.completion_token_ids) if choice.completion_token_ids is not None else 0
        self.metrics.tokens.labels(kind="completion").inc(completion_tokens)
        self.metrics.tokens.labels(kind="prompt").inc(result.prompt_tokens)
        return Turn(
            index=turn_index, stage=observation.stage, trainable=trainable, model=route.model,
            endpoint=result.endpoint, messages=observation.messages, response_format=observation.response_format,
            completion=choice.text,
            prompt_token_ids=result.prompt_token_ids if has_ids else None,
            completion_token_ids=choice.completion_token_ids if has_ids else None,
            logprobs=choice.logprobs if has_ids else None,
            token_source="server" if has_ids else "absent", finish_reason=choice.finish_reason,
            prompt_tokens=result.prompt_tokens, completion_tokens=completion_tokens, seed=seed)


def _score(attempt: Attempt, answer: StepAnswer) -> None:
    """Classify a finished episode: scored, or unscorable with the env's reason."""
    attempt.score, attempt.answer = answer.score, answer.answer
    category = answer.failure_category
    if category in UNSCORABLE_CATEGORIES or answer.status == "abandoned":
        attempt.status = "env_failure"
        detail = (answer.score or {}).get("failure_detail") or f"the episode ended with failure_category={category}"
        attempt.failure = Failure(kind=category or "abandoned", detail=str(detail)[:500])
        return
    attempt.status = "scored"
    attempt.reward = float(answer.reward or 0.0)
    attempt.pass_ = bool(answer.pass_)
    if category:  # graded, with a policy-side failure (e.g. bad answer): a real zero
        attempt.failure = Failure(kind=category, detail="graded failure (counts as scored)")


def _assemble(request: GroupRequest, target: TaskTarget, policy: Route, group_id: str,
              attempts: list[Attempt], wall_s: float, run_id: str | None) -> GroupResult:
    rewards = [a.reward if a.status == "scored" else None for a in attempts]
    advantages = group_advantages(rewards, request.advantage)
    for attempt, advantage in zip(attempts, advantages):
        attempt.advantage = advantage
    mean, std, all_equal = summarize(rewards)
    scored = [a for a in attempts if a.status == "scored"]
    by_status: dict[str, int] = {}
    for a in attempts:
        by_status[a.status] = by_status.get(a.status, 0) + 1
    sampling = request.sampling.model_dump(exclude_none=True)
    diagnosis = None
    if all_equal:
        diagnosis = (f"all {len(scored)} scored rewards equal {mean}: this group carries no gradient. "
                     f"Sampling sent: temperature={request.sampling.temperature}, top_p={request.sampling.top_p}, "
                     f"max_tokens={request.sampling.max_tokens}, seed={request.sampling.seed}. Check the "
                     "temperature first; then whether the task is far too hard or too easy for this policy.")
    contract = target.envs[0].contract
    if request.reward_profile:
        contract = contract.model_copy(update={"reward_profile": request.reward_profile})
    contract = contract.model_copy(update={"urls": sorted({a.env for a in attempts if a.env})
                                           or [e.url for e in target.envs]})
    return GroupResult(
        group_id=group_id, task_id=target.task_id, slug=target.slug, policy_version=request.policy_version,
        model=policy.model, sampling=sampling, n=request.n, advantage_kind=request.advantage, env=contract,
        counts=Counts(scheduled=len(attempts), scored=len(scored), failed=len(attempts) - len(scored),
                      by_status=by_status),
        rewards=rewards, advantages=advantages, mean=mean, std=std,
        pass_rate=round(sum(bool(a.pass_) for a in scored) / len(scored), 6) if scored else None,
        all_equal=all_equal, diagnosis=diagnosis, attempts=attempts, wall_s=round(wall_s, 4),
        completion_tokens=sum(t.completion_tokens for a in attempts for t in a.turns), run_id=run_id)

