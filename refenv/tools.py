"""Tool mode: refenv lends a world to an agent program that works it through tool calls.

An agent server (examples/agents/) owns its episode's loop and its model calls; refenv owns the world
and the grading, as in step mode: `open` leases a world from the same pool (blocking while all are
held), `run_sql` runs one statement under the same rules and caps as a step-mode action, `submit`
grades the answer with the same oracle and gives the world back. Every world is an episode of the
same counters (`Counters`: started, finished, abandoned, reclaimed), so the identity
started == ended + live holds across step and tool worlds alike, and an idle world is reclaimed after
the step timeout as a parked step episode is.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field

from refenv.agent import execute_sql
from refenv.episodes import ContractError, Counters, final_form
from refenv.grading import EpisodeRecord, grade
from refenv.tasks import Task
from refenv.world import SCHEMA_DESCRIPTION, TABLES, World, WorldPool


@dataclass
class ToolWorld:
    world_id: str
    task: Task
    world: World
    profile: str
    record: EpisodeRecord = field(default_factory=EpisodeRecord)
    # One call at a time per world: a statement must never run on a world being graded or given back.
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    deadline: float = 0.0


class ToolWorlds:
    """The worlds lent to agents, the pool behind them (shared with step mode), and their reaper."""

    def __init__(self, pool: WorldPool, pristine_rows: dict, counters: Counters, idle_timeout: float) -> None:
        self.pool = pool
        self.pristine_rows = pristine_rows
        self.counters = counters
        self.idle_timeout = idle_timeout
        self._live: dict[str, ToolWorld] = {}

    @property
    def live(self) -> int:
        return len(self._live)

    async def open(self, task: Task, profile: str) -> dict:
        world = await self.pool.acquire()  # blocks while every world is held, as /step/reset does
        # Unguessable, as step mode's episode ids: whoever holds one can query, grade or end that world.
        lent = ToolWorld(f"tools-{secrets.token_urlsafe(16)}", task, world, profile)
        self._live[lent.world_id] = lent
        self.counters.started += 1
        self._touch(lent)
        return {
            "world_id": lent.world_id,
            "task_id": task.task_id,
            "slug": task.slug,
            "prompt": task.prompt,
            "schema": SCHEMA_DESCRIPTION,
            "tables": list(TABLES),
            "turn_budget": task.turn_budget,
        }

    async def list_tables(self, world_id: str) -> dict:
        lent = self._get(world_id)
        self._touch(lent)
        return {"world_id": world_id, "tables": list(TABLES), "schema": SCHEMA_DESCRIPTION}

    async def run_sql(self, world_id: str, sql: str) -> dict:
        lent = self._get(world_id)
        async with lent.lock:
            self._still_live(lent)
            record = lent.record
            if record.actor_turns >= lent.task.turn_budget:
                # Step mode would now ask for the final answer: here the agent is told to submit (and is
                # graded as finalized, no behavior credit, as step mode grades it).
                raise ContractError(
                    409,
                    "turn_budget_spent",
                    f"this task allows {lent.task.turn_budget} statement(s); submit the answer now",
                )
            record.actor_turns += 1
            text, ok = await execute_sql(lent.world, sql, record)
            self._touch(lent)
        turns_left = lent.task.turn_budget - record.actor_turns
        out: dict = {"world_id": world_id, "ok": ok, "text": text, "turns_left": turns_left}
        if not ok:
            out["error"] = text.removeprefix("Error: ")
        return out

    async def submit(self, world_id: str, answer: str | None, usage: dict[str, int]) -> dict:
        lent = self._get(world_id)
        async with lent.lock:
            self._still_live(lent)
            del self._live[world_id]
            record = lent.record
            # The answer is an action as in step mode, where it takes a turn; with every turn spent on
            # statements, step mode would have asked for the answer out of turns (finalize).
            if record.actor_turns < lent.task.turn_budget:
                record.actor_turns += 1
            else:
                record.finalized = True
            record.answer = answer if answer else None
            record.prompt_tokens += max(0, usage.get("prompt_tokens", 0))
            record.completion_tokens += max(0, usage.get("completion_tokens", 0))
            record.llm_calls += max(0, usage.get("llm_calls", 0))
            try:
                score = await lent.world.in_thread(
                    grade, lent.task, lent.world, self.pristine_rows, record, lent.profile
                )
            except asyncio.CancelledError:  # its caller left mid-grading: nobody learns the grade
                self.counters.abandoned += 1
                raise
            except Exception as exc:  # a bug in grading surfaces as the contract's 500, the world still returned
                self.counters.failed += 1
                raise ContractError(500, "episode_failed", f"grading failed: {type(exc).__name__}: {exc}") from None
            else:
                self.counters.finished += 1
            finally:
                self.pool.release(lent.world)
        status = "completed" if record.answer is not None else "no_answer"
        out = final_form(world_id, lent.task, status, record.answer, score)
        del out["episode_id"]
        return {"world_id": world_id, **out}

    async def abandon(self, world_id: str) -> dict:
        lent = self._live.get(world_id)
        if lent is None or not await self._end(lent):
            raise ContractError(410, "world_gone", f"world {world_id!r} was submitted, abandoned or reclaimed")
        self.counters.abandoned += 1
        return {"world_id": world_id, "done": True, "status": "abandoned"}

    async def reap_forever(self) -> None:
        """Give back worlds idle past the step timeout; a later call on one gets 410."""
        interval = max(0.05, min(1.0, self.idle_timeout / 4))
        while True:
            await asyncio.sleep(interval)
            for lent in list(self._live.values()):
                if not lent.lock.locked() and lent.deadline < time.monotonic() and await self._end(lent):
                    self.counters.reclaimed += 1

    async def shutdown(self) -> None:
        for lent in list(self._live.values()):
            await self._end(lent)

    # -- internals ---------------------------------------------------------------------------

    def _touch(self, lent: ToolWorld) -> None:
        lent.deadline = time.monotonic() + self.idle_timeout

    def _get(self, world_id: str) -> ToolWorld:
        lent = self._live.get(world_id)
        if lent is None:
            raise ContractError(410, "world_gone", f"world {world_id!r} was submitted, abandoned or reclaimed")
        return lent

    def _still_live(self, lent: ToolWorld) -> None:
        """After waiting for the world's lock: another call may have ended it meanwhile."""
        if self._live.get(lent.world_id) is not lent:
            raise ContractError(410, "world_gone", f"world {lent.world_id!r} was submitted, abandoned or reclaimed")

    async def _end(self, lent: ToolWorld) -> bool:
        """Give the world back once no statement runs on it. False when another caller ended it first:
        each end is counted once, by the caller that got True."""
        if self._live.pop(lent.world_id, None) is None:
            return False
        async with lent.lock:  # a running statement finishes (at most its deadline) before the world goes
            self.pool.release(lent.world)
        return True
