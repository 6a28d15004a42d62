"""An env with the tails agents have: the step contract over a bimodal task mix with drawn turns,
reply lengths, tool outputs and step latency, for the GPU-regime benchmark (bench/gpu_regime.py).

    python bench/tailenv.py --port 0 --port-file env.port --pool 256 --time-scale 20

Two task families, each with its own distributions (FAMILIES below; all in simulated seconds and
tokens, drawn per episode from a generator seeded by the task and how many times it was reset, so
the k-th episode of a task is the same in every run and for every driver):

- turns: model calls per episode (1 + a geometric or log-normal draw, capped);
- reply tokens: each turn's reply length, log-normal; the env writes `<len=N>` in each observation
  and the GPU-shaped model server (bench/gpusim.py) generates exactly that many tokens;
- tool tokens: what each step adds to the conversation, log-normal;
- step latency: the env's time on a completion (tools run), log-normal, slept scaled by --time-scale;
- pass: drawn once per episode at the family's pass rate (reward 1 or 0).

A world is held from reset to the episode's end; a reset waits for a free one (the contract's
blocking acquire). GET /stats is the benchmark's oracle on the env side: episodes started and
finished by family, open worlds now and at most, and busy world-seconds (simulated).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from aiohttp import web
from aioserve import serve


@dataclass(frozen=True)
class Family:
    name: str
    weight: float  # share of the task list
    turns_median: float  # log-normal over 1 + turns, capped at turns_max
    turns_sigma: float
    turns_max: int
    reply_median: float
    reply_sigma: float
    reply_max: int
    tool_median: float
    tool_sigma: float
    latency_median_s: float
    latency_sigma: float
    pass_rate: float
    system_tokens: int


# Short tasks: a lookup or two (median 2 turns, replies ~200 tokens); long tasks: agentic runs
# (median 10 turns, up to 40, replies ~700 tokens with a heavy tail, slow tools), passed less often.
FAMILIES = {
    "short": Family("short", 0.6, 2, 0.5, 6, 200, 0.6, 2048, 120, 0.7, 0.3, 0.6, 0.7, 1500),
    "long": Family("long", 0.4, 10, 0.6, 40, 700, 0.8, 4096, 400, 0.9, 1.5, 1.0, 0.3, 2500),
}
# For calibrating against the CPU vLLM (bench/calibrate_gpusim.py): the same two families, made
# small enough for a 135M model on two cores (few turns, short tool outputs, no tool latency).
CALIBRATION = {
    "short": Family("short", 0.6, 1.5, 0.4, 3, 32, 0.0, 32, 30, 0.3, 0.001, 0.0, 0.7, 200),
    "long": Family("long", 0.4, 4, 0.3, 6, 32, 0.0, 32, 30, 0.3, 0.001, 0.0, 0.3, 300),
}
MIXES = {"agents": FAMILIES, "calibration": CALIBRATION}
TASKS_PER_FAMILY = 64


def lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma))


def task_ids() -> list[tuple[str, str]]:
    """(task id, family) of every task, the families interleaved by weight."""
    out = []
    for fam in FAMILIES.values():
        out += [(f"{fam.name}-{i:03d}", fam.name) for i in range(round(TASKS_PER_FAMILY * fam.weight / 0.5))]
    return sorted(out, key=lambda t: zlib.crc32(t[0].encode()))


def family_of(task_id: str) -> str:
    return task_id.split("-", 1)[0]


# Three-letter words that are one token each, after a space, to SmolLM2's tokenizer, as every
# 4 characters are to the sim's: filler of N tokens is N tokens to both engines, so the calibration
# (bench/calibrate_gpusim.py) gives the real engine and the sim the same work.
WORDS = (
    "act add age aid aim air all and any arm art ask bad bag bar bed big bit box boy bus buy car cat cup cut "
    "day dog dry ear eat egg end eye far few fit fix fly fun gas get gun hat hit hot ice job key kid law leg "
    "let lot low man map mix net new oil old one pay pen pet pig pot put red run say sea see set sit six sky "
    "son sun tax ten tie top try two use van war way web wet win yes yet"
).split()


def filler(tag: str, tokens: int) -> str:
    """`tokens` tokens of text to the sim's tokenizer and to SmolLM2's, one word repeated, distinct per tag."""
    return (WORDS[zlib.crc32(tag.encode()) % len(WORDS)] + " ") * tokens


def first_messages(fam: Family, task_id: str, reply: int) -> list[dict]:
    """An episode's first observation: its family's system prompt and the task, asking `reply` tokens."""
    return [
        {"role": "system", "content": filler(f"system-{fam.name}", fam.system_tokens)},
        {"role": "user", "content": f"task {task_id}: " + filler(task_id, 200) + f"<len={reply}>"},
    ]


def tool_message(tag: str, tokens: int, reply: int) -> dict:
    """A step's observation: `tokens` tokens of tool output, asking `reply` tokens."""
    return {"role": "user", "content": filler(tag, tokens) + f"<len={reply}>"}


def tasks_of(family: str) -> list[str]:
    """The family's tasks, in the order every driver follows."""
    return [t for t, f in task_ids() if f == family]


@dataclass
class Episode:
    task_id: str
    family: Family
    rng: random.Random
    turns: int
    passed: bool
    messages: list[dict]
    started: float
    turn: int = 0


class TailEnv:
    def __init__(
        self, pool: int, time_scale: float, seed: int, fixed_reply: list[int] | None = None, mix: str = "agents"
    ) -> None:
        self.pool, self.scale, self.seed = pool, time_scale, seed
        self.families = MIXES[mix]
        self.fixed_reply = fixed_reply  # calibration: reply lengths drawn from a measured list instead
        self.free = asyncio.Semaphore(pool)
        self.episodes: dict[str, Episode] = {}
        self.resets_of: dict[str, int] = {}
        self.count = 0
        self.t0 = time.monotonic()
        self.stats_reset()

    def stats_reset(self) -> None:
        self.window_start = time.monotonic()
        self.busy_world_s = 0.0
        self.max_open = len(self.episodes)
        self.started = {f: 0 for f in self.families}
        self.finished = {f: 0 for f in self.families}
        self.steps = 0

    def _reply(self, ep: Episode) -> int:
        if self.fixed_reply:
            return ep.rng.choice(self.fixed_reply)
        f = ep.family
        return max(1, min(f.reply_max, round(lognormal(ep.rng, f.reply_median, f.reply_sigma))))

    async def _sleep(self, ep: Episode, median: float, sigma: float) -> None:
        await asyncio.sleep(lognormal(ep.rng, median, sigma) / self.scale)

    def _observation(self, episode_id: str, ep: Episode) -> dict:
        return {
            "episode_id": episode_id,
            "task_id": ep.task_id,
            "slug": ep.task_id,
            "done": False,
            "observation": {"stage": "executor", "messages": ep.messages},
        }

    async def reset(self, request: web.Request) -> web.Response:
        body = await request.json() if request.can_read_body else {}
        task_id = body.get("task_id") or body.get("slug") or task_ids()[0][0]
        fam = self.families.get(family_of(task_id))
        if fam is None:
            return web.json_response({"error": "unknown_task", "message": f"no task {task_id}"}, status=404)
        await self.free.acquire()
        k = self.resets_of.get(task_id, 0)
        self.resets_of[task_id] = k + 1
        rng = random.Random(zlib.crc32(f"{task_id}:{k}".encode(), self.seed))
        turns = max(1, min(fam.turns_max, round(lognormal(rng, fam.turns_median, fam.turns_sigma))))
        passed = rng.random() < fam.pass_rate
        ep = Episode(task_id, fam, rng, turns, passed, [], time.monotonic())
        ep.messages = first_messages(fam, task_id, self._reply(ep))
        self.count += 1
        episode_id = f"e{self.count}"
        self.episodes[episode_id] = ep
        self.started[fam.name] += 1
        self.max_open = max(self.max_open, len(self.episodes))
        await asyncio.sleep(0.2 / self.scale)  # a world's reset
        return web.json_response(self._observation(episode_id, ep))

    def _end(self, episode_id: str) -> Episode | None:
        ep = self.episodes.pop(episode_id, None)
        if ep is not None:
            self.busy_world_s += time.monotonic() - max(ep.started, self.window_start)
            self.free.release()
        return ep

    async def step(self, request: web.Request) -> web.Response:
        body = await request.json()
        episode_id = body["episode_id"]
        ep = self.episodes.get(episode_id)
        if ep is None:
            return web.json_response({"error": "episode_gone", "message": "unknown episode"}, status=410)
        self.steps += 1
        ep.turn += 1
        ep.messages = [*ep.messages, {"role": "assistant", "content": body.get("completion") or ""}]
        await self._sleep(ep, ep.family.latency_median_s, ep.family.latency_sigma)
        if episode_id not in self.episodes:  # abandoned meanwhile
            return web.json_response({"error": "episode_gone", "message": "abandoned"}, status=410)
        if ep.turn >= ep.turns:
            self._end(episode_id)
            self.finished[ep.family.name] += 1
            return web.json_response(
                {
                    "episode_id": episode_id,
                    "task_id": ep.task_id,
                    "slug": ep.task_id,
                    "done": True,
                    "status": "finished",
                    "answer": "a",
                    "pass": ep.passed,
                    "reward": 1.0 if ep.passed else 0.0,
                    "score": {"pass": ep.passed, "actor_turns": ep.turns, "family": ep.family.name},
                }
            )
        tool = max(1, round(lognormal(ep.rng, ep.family.tool_median, ep.family.tool_sigma)))
        ep.messages = [*ep.messages, tool_message(f"{episode_id}-{ep.turn}", tool, self._reply(ep))]
        return web.json_response(self._observation(episode_id, ep))

    async def abandon(self, request: web.Request) -> web.Response:
        episode_id = request.match_info["episode_id"]
        if self._end(episode_id) is None:
            return web.json_response({"error": "episode_gone", "message": "unknown episode"}, status=410)
        return web.json_response({"episode_id": episode_id, "done": True, "status": "abandoned"})

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response(
            {
                "status": "ready",
                "workers": self.pool,
                "tasks": len(task_ids()),
                "dataset": {"name": "tails", "catalog_hash": "tails-1"},
                "reward_version": "tails-1",
                "reward_profile": "rl",
                "capabilities": {"drive_modes": ["step"], "pool": self.pool},
            }
        )

    async def tasks(self, _: web.Request) -> web.Response:
        tasks = [
            {
                "task_id": t,
                "slug": t,
                "prompt": f"task {t}",
                "category": f,
                "difficulty": f,
                "writes": False,
                "family": f,
            }
            for t, f in task_ids()
        ]
        return web.json_response({"tasks": tasks, "count": len(tasks)})

    async def stats(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        busy = self.busy_world_s + sum(now - max(e.started, self.window_start) for e in self.episodes.values())
        answer = {
            "open": len(self.episodes),
            "max_open": self.max_open,
            "pool": self.pool,
            "started": self.started,
            "finished": self.finished,
            "steps": self.steps,
            "busy_world_s": round(busy * self.scale, 2),
            "window_s": round((now - self.window_start) * self.scale, 2),
        }
        if request.method == "POST":
            self.stats_reset()
        return web.json_response(answer)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.add_routes(
            [
                web.post("/step/reset", self.reset),
                web.post("/step", self.step),
                web.delete("/step/{episode_id}", self.abandon),
                web.get("/health", self.health),
                web.get("/tasks", self.tasks),
                web.get("/stats", self.stats),
                web.post("/stats", self.stats),
            ]
        )
        return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-file", type=Path)
    parser.add_argument("--pool", type=int, default=256)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mix", choices=sorted(MIXES), default="agents", help="the families' distributions")
    parser.add_argument("--reply-tokens", type=int, nargs="*", help="draw reply lengths from these (calibration)")
    args = parser.parse_args()

    serve(lambda: TailEnv(args.pool, args.time_scale, args.seed, args.reply_tokens, args.mix).app(), args.port,
          args.port_file)  # fmt: skip


if __name__ == "__main__":
    main()
