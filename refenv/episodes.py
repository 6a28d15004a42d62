"""Step-mode episodes: each one runs as a task that parks every model call for the driver."""

from __future__ import annotations

import asyncio
import random
import secrets
import time
from dataclasses import dataclass, field

from refenv.agent import AgentOptions, Ask, InjectedFault, Reply, run_agent
from refenv.grading import EpisodeRecord, failure_score, grade
from refenv.tasks import Task
from refenv.world import World, WorldPool


class ContractError(Exception):
    """An error answer of the contract: HTTP status, `error` code and message."""

    def __init__(self, status: int, error: str, message: str = "") -> None:
        super().__init__(message or error)
        self.status, self.error, self.message = status, error, message


@dataclass
class Counters:
    """Each started episode ends one way, counted once its world is back in the pool: then
    started == finished + abandoned + reclaimed + failed + timed_out + live episodes."""

    started: int = 0
    finished: int = 0
    abandoned: int = 0
    reclaimed: int = 0
    failed: int = 0
    timed_out: int = 0
    steps: int = 0


@dataclass
class Episode:
    episode_id: str
    task: Task
    world: World
    profile: str
    record: EpisodeRecord = field(default_factory=EpisodeRecord)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    awaiting: bool = False
    deadline: float = 0.0
    runner: asyncio.Task | None = None
    _completion: asyncio.Future | None = None

    async def park(self, observation: dict) -> Reply:
        """The step-mode `Ask`: hand the observation to the driver and wait for /step."""
        self._completion = asyncio.get_running_loop().create_future()
        self.awaiting = True
        self.events.put_nowait(("observation", observation))
        return await self._completion

    def deliver(self, reply: Reply) -> None:
        self.awaiting = False
        assert self._completion is not None
        self._completion.set_result(reply)


class EpisodeTable:
    """The live episodes of a step server, the pool behind them, and the reaper."""

    def __init__(
        self,
        pool: WorldPool,
        pristine_rows: dict,
        *,
        step_timeout: float,
        latency_s: float,
        fail_rate: float,
        seed: int,
        responder: bool,
        support_ask: Ask | None,
    ) -> None:
        self.pool = pool
        self.pristine_rows = pristine_rows
        self.step_timeout = step_timeout
        self.latency_s = latency_s
        self.fail_rate = fail_rate
        self.responder = responder
        self.support_ask = support_ask
        self.counters = Counters()
        self._live: dict[str, Episode] = {}
        self._faults = random.Random(f"refenv-faults:{seed}")

    # -- lifecycle ---------------------------------------------------------------------------

    async def reset(self, task: Task, profile: str) -> dict:
        world = await self.pool.acquire()  # blocks while every world is held, like GraphJin
        # Unguessable: whoever knows an id can drive or end that episode, and the ids of others'
        # episodes must not follow from one's own (nor from /health's counters).
        episode = Episode(f"step-{secrets.token_urlsafe(16)}", task, world, profile)
        self._live[episode.episode_id] = episode
        self.counters.started += 1
        opts = AgentOptions(latency_s=self.latency_s, responder=self.responder)
        if self.fail_rate and self._faults.random() < self.fail_rate:
            opts.fault = self._faults.choice(["transport_error", "environment_failure", "http_500"])
            opts.fault_turn = self._faults.randint(1, task.turn_budget)
        episode.runner = asyncio.create_task(self._run(episode, opts), name=episode.episode_id)
        self._touch(episode)
        try:
            return await self._next_answer(episode)
        except asyncio.CancelledError:
            # The driver gave up on this reset before it had the episode's id: no one else can end it.
            if await asyncio.shield(self._end(episode)):
                self.counters.abandoned += 1
            raise

    async def step(self, episode_id: str, reply: Reply) -> dict:
        episode = self._live.get(episode_id)
        if episode is None:
            raise ContractError(410, "episode_gone", f"episode {episode_id!r} has ended or was reclaimed")
        if not episode.awaiting:
            raise ContractError(409, "nothing_awaiting", f"episode {episode_id!r} is not waiting for a completion")
        self.counters.steps += 1
        self._touch(episode)
        episode.deliver(reply)
        return await self._next_answer(episode)

    async def abandon(self, episode_id: str) -> dict:
        episode = self._live.get(episode_id)
        if episode is None or not await self._end(episode):
            raise ContractError(410, "episode_gone", f"episode {episode_id!r} has already ended")
        self.counters.abandoned += 1
        return {"episode_id": episode_id, "done": True, "status": "abandoned"}

    async def reap_forever(self) -> None:
        """End parked episodes whose deadline passed; a late /step then gets 410."""
        interval = max(0.05, min(1.0, self.step_timeout / 4))
        while True:
            await asyncio.sleep(interval)
            for episode in list(self._live.values()):
                # Judged one at a time: while the previous one ends, a /step may revive this one.
                if episode.awaiting and episode.deadline < time.monotonic() and await self._end(episode):
                    self.counters.reclaimed += 1

    async def shutdown(self) -> None:
        for episode in list(self._live.values()):
            await self._end(episode)

    @property
    def live(self) -> int:
        return len(self._live)

    # -- internals ---------------------------------------------------------------------------

    def _touch(self, episode: Episode) -> None:
        episode.deadline = time.monotonic() + self.step_timeout

    async def _next_answer(self, episode: Episode) -> dict:
        """The next observation, or the final form, within the step timeout (else 504; 410 once ended)."""
        try:
            kind, payload = await asyncio.wait_for(episode.events.get(), self.step_timeout)
        except TimeoutError:
            if await self._end(episode):
                self.counters.timed_out += 1
                raise ContractError(
                    504,
                    "episode_timeout",
                    f"episode {episode.episode_id} neither asked nor finished within "
                    f"{self.step_timeout:g}s; its world was reclaimed",
                ) from None
            kind, payload = episode.events.get_nowait()  # it ended just now: its last word is queued
        if kind == "gone":
            raise ContractError(410, "episode_gone", f"episode {episode.episode_id} was abandoned or reclaimed")
        if kind == "observation":
            self._touch(episode)
            return {
                "episode_id": episode.episode_id,
                "task_id": episode.task.task_id,
                "slug": episode.task.slug,
                "done": False,
                "observation": payload,
            }
        if kind == "error":
            raise ContractError(500, "episode_failed", payload)
        return payload

    async def _end(self, episode: Episode) -> bool:
        """Stop the episode's run and wait until its world is back in the pool.

        False when it had already ended (its run finished, or another caller ended it): each end
        is counted once, by the caller that got True."""
        if self._live.pop(episode.episode_id, None) is None:
            return False
        # A /step waiting on this episode answers 410 now, not 504 at the step timeout.
        episode.events.put_nowait(("gone", None))
        if episode.runner is not None and not episode.runner.done():
            episode.runner.cancel()
            await asyncio.wait([episode.runner])
        return True

    async def _run(self, episode: Episode, opts: AgentOptions) -> None:
        record, task = episode.record, episode.task
        try:
            try:
                await run_agent(task, episode.world, episode.park, self.support_ask or episode.park, record, opts)
            except InjectedFault as fault:
                if fault.kind == "http_500":
                    self.counters.failed += 1
                    episode.events.put_nowait(("error", "episode grading failed (injected fault)"))
                    return
                episode.events.put_nowait(("final", self._failed_final(episode, fault.kind)))
                self.counters.failed += 1
                return
            except SupportModelError as exc:
                episode.events.put_nowait(("final", self._failed_final(episode, "transport_error", str(exc))))
                self.counters.failed += 1
                return
            score = await episode.world.in_thread(
                grade, task, episode.world, self.pristine_rows, record, episode.profile
            )
            status = "completed" if record.answer is not None else "no_answer"
            episode.events.put_nowait(("final", final_form(episode.episode_id, task, status, record.answer, score)))
            self.counters.finished += 1
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in grading must surface as the contract's 500
            self.counters.failed += 1
            episode.events.put_nowait(("error", f"episode failed: {type(exc).__name__}: {exc}"))
        finally:
            self._live.pop(episode.episode_id, None)
            self.pool.release(episode.world)

    def _failed_final(self, episode: Episode, category: str, detail: str = "") -> dict:
        score = failure_score(episode.record, category, detail)
        return final_form(episode.episode_id, episode.task, "failed", None, score)


class SupportModelError(Exception):
    """The support model (`--support-model`) could not be reached or answered badly."""


def final_form(episode_id: str, task: Task, status: str, answer: str | None, score: dict) -> dict:
    """The `done: true` answer, omitting empty and false fields as GraphJin does."""
    out: dict = {"episode_id": episode_id, "task_id": task.task_id, "slug": task.slug, "done": True}
    if status:
        out["status"] = status
    if answer:
        out["answer"] = answer
    if score.get("pass"):
        out["pass"] = True
    reward = score["vector"]["reward"]
    if reward:
        out["reward"] = reward
    out["score"] = score
    return out
