"""Drivers side by side in the GPU regime: simulated GPU replicas (bench/gpusim.py) and the tails env
(bench/tailenv.py), with the ways trainers generate today and the service's two ways.

    .venv/bin/python bench/gpu_regime.py --record bench/results/gpu-regime-small.json       # what ran here
    .venv/bin/python bench/gpu_regime.py --pools 64 256 1024 --replicas 1 4 8 --seconds 240 # the full matrix

Drivers (each on a fresh stack of its own, the same task order, the same env draws):

naive        trainer workers (pool / n of them), each running one group at a time: its n episodes at
             once, each episode calling a replica of its own directly (worker i -> replica i mod R,
             GraphJin's pattern with a static assignment); the next group when the last attempt ends
sync         batch-synchronous (verl's synchronous mode, TRL): a step's groups (pool / n) launched
             together, episodes spread over the replicas round-robin, the step waits for the last
             one, then a stand-in training step (--train-s of simulated time, generation idle)
batch        the service's POST /groups/batch: one batch of 4 x pool groups, read as they finish (the
             service fills the pool from its own queue; no barrier between groups)
stream       the service's sampler stream (max_staleness 1, filter none) beside a stand-in trainer:
             pull a step's groups, train (--train-s), publish a version (POST /policy/pause, POST
             /policy {version}: a pushed update, the replicas paused meanwhile)

Figures per run, in simulated time (wall x --time-scale), over a measured window after a warm-up:
busy %        the simulated GPUs' own busy fraction (time with a sequence running), mean over replicas
tokens/s      generated tokens per simulated second, all replicas (the sims' own count)
groups/s      groups completed in the window per simulated second
p50/p90 s     group latency: from its first world taken to its last attempt's end
load max/mean the replicas' generated tokens: the most loaded over the mean
steps/h       GRPO steps per simulated hour (sync and stream; a step is pool / n groups), and the
              mean simulated time between consecutive steps that ended in the window
stale drops   groups dropped stale (stream), and kept vs dropped: family mix, tokens, pass rate

With --groups N the work is fixed instead of the window (naive, sync and batch): the first N tasks
of the order, measured from the first group's start to the last one's end (no warm-up; --seconds
caps it), so groups/s compares the same groups; sync trains after each of its steps but the last.

Group tail control and the other item-5 options are passed through where given: --deadline-s and
--min-graded go into each group the service drivers send (the service refuses fields it does not
know: the run says so), --service-flag adds flags to `rollout-service serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import record
from tailenv import family_of, task_ids

from rollout_service.launch.stack import ManagedProcess, service_command, start_listening

BENCH = Path(__file__).resolve().parent
LOGS = Path("results/logs/gpu-regime")
DRIVERS = ("naive", "sync", "batch", "stream")
MODEL = "sim-model"


@dataclass
class Config:
    pool: int
    replicas: int
    driver: str
    n: int = 8
    seconds: float = 60.0  # measured window, wall
    warmup: float = 15.0  # wall
    time_scale: float = 10.0
    train_s: float = 30.0  # simulated seconds per stand-in training step
    max_tokens: int = 4096
    params: Path | None = None
    sim_flags: list[str] = field(default_factory=list)
    service_flags: list[str] = field(default_factory=list)
    group_extra: dict[str, Any] = field(default_factory=dict)
    stream_extra: dict[str, Any] = field(default_factory=dict)  # POST /samplers fields (max_staleness, pacing)
    env_flags: list[str] = field(default_factory=list)
    model: str = MODEL
    servers: list[str] | None = None  # model servers already running (a real vLLM): no sims started
    groups: int | None = None  # fixed work: these many groups from the start, timed to the last one's end


class Stack:
    """R simulated replicas, the tails env, and the service where the driver uses it."""

    def __init__(self, cfg: Config, logs: Path, with_service: bool) -> None:
        self.cfg, self.logs, self.with_service = cfg, logs, with_service
        self.procs: list[ManagedProcess] = []
        self.sims: list[str] = []

    def __enter__(self) -> Stack:
        py, c = sys.executable, self.cfg
        try:
            self.sims = list(c.servers or [])
            for i in range(0 if c.servers else c.replicas):
                cmd = [py, str(BENCH / "gpusim.py"), "--port", "0", "--time-scale", str(c.time_scale), "--seed", str(i)]
                if c.params:
                    cmd += ["--params", str(c.params)]
                p = start_listening(f"sim{i}", cmd + c.sim_flags, self.logs, self.procs, ready_path="/v1/models")
                self.sims.append(p.url)
            cmd = [
                py,
                str(BENCH / "tailenv.py"),
                "--port",
                "0",
                "--pool",
                str(c.pool),
                "--time-scale",
                str(c.time_scale),
            ]
            self.env = start_listening("env", cmd + c.env_flags, self.logs, self.procs).url
            if self.with_service:
                flags = ["--max-n", "64", "--max-batch", "4096", "--inference-timeout", "3000", *c.service_flags]
                cmd = service_command(0, [self.env], self.sims[0], *flags, model=c.model)
                for url in self.sims[1:]:
                    cmd += ["--vllm", url]
                self.service = start_listening("service", cmd, self.logs, self.procs, timeout_s=120).url
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for p in reversed(self.procs):
            p.stop()


@dataclass
class GroupDone:
    task_id: str
    latency_s: float  # simulated
    tokens: int
    turns: int
    passes: list[bool]  # of the graded attempts
    ended: float  # wall
    attempts: int = 0
    graded: int = 0  # attempts that carry a reward (min_graded cuts the others)


class Tally:
    def __init__(self) -> None:
        self.groups: list[GroupDone] = []
        self.dropped: list[dict] = []
        self.steps: list[float] = []  # wall time each training step ended
        self.notes: list[str] = []


def _tasks(cfg: Config) -> Iterator[str]:
    """The task order every driver follows; with --groups, its first `groups` tasks only."""
    order = itertools.cycle([t for t, _ in task_ids()])
    return order if cfg.groups is None else itertools.islice(order, cfg.groups)


# -- direct drivers (no service) -----------------------------------------------------------------


async def _episode(
    http: aiohttp.ClientSession, env: str, sim: str, task: str, cfg: Config
) -> tuple[float, float, int, int, bool]:
    """One episode as an env's own client runs it; (start, end wall, tokens, turns, pass)."""
    async with http.post(f"{env}/step/reset", json={"task_id": task}) as r:
        answer = await r.json()
    start, tokens, turns = time.monotonic(), 0, 0
    while not answer["done"]:
        body = {"model": cfg.model, "messages": answer["observation"]["messages"], "max_tokens": cfg.max_tokens,
                "temperature": 1.0, "logprobs": True, "return_token_ids": True}  # fmt: skip
        async with http.post(f"{sim}/v1/chat/completions", json=body) as r:
            out = await r.json()
        tokens += out["usage"]["completion_tokens"]
        turns += 1
        usage = out["usage"]
        step = {"episode_id": answer["episode_id"], "completion": out["choices"][0]["message"]["content"],
                "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"]}  # fmt: skip
        async with http.post(f"{env}/step", json=step) as r:
            answer = await r.json()
    return start, time.monotonic(), tokens, turns, bool(answer.get("pass"))


async def _direct_group(
    http: aiohttp.ClientSession, stack: Stack, task: str, sims: list[str], cfg: Config
) -> GroupDone:
    eps = await asyncio.gather(*(_episode(http, stack.env, sims[i % len(sims)], task, cfg) for i in range(cfg.n)))
    start, end = min(e[0] for e in eps), max(e[1] for e in eps)
    return GroupDone(task, (end - start) * cfg.time_scale, sum(e[2] for e in eps), sum(e[3] for e in eps),
                     [e[4] for e in eps], end, cfg.n, cfg.n)  # fmt: skip


async def drive_naive(stack: Stack, cfg: Config, tally: Tally, stop: float) -> None:
    tasks = _tasks(cfg)
    async with _session() as http:

        async def worker(i: int) -> None:
            sim = stack.sims[i % len(stack.sims)]
            while time.monotonic() < stop and (task := next(tasks, None)) is not None:
                tally.groups.append(await _direct_group(http, stack, task, [sim], cfg))

        await asyncio.gather(*(worker(i) for i in range(max(1, cfg.pool // cfg.n))))


async def drive_sync(stack: Stack, cfg: Config, tally: Tally, stop: float) -> None:
    tasks = _tasks(cfg)
    per_step = max(1, cfg.pool // cfg.n)
    async with _session() as http:
        while time.monotonic() < stop and (step_tasks := list(itertools.islice(tasks, per_step))):
            # Episodes of a step spread round-robin over the replicas (a group's attempts on several).
            rotated = [stack.sims[k % len(stack.sims) :] + stack.sims[: k % len(stack.sims)] for k in range(per_step)]
            done = await asyncio.gather(
                *(_direct_group(http, stack, t, r, cfg) for t, r in zip(step_tasks, rotated, strict=False))
            )
            tally.groups.extend(done)
            if cfg.groups is not None and len(tally.groups) >= cfg.groups:
                return  # fixed work: done when its last group is, with no training step after it
            await asyncio.sleep(cfg.train_s / cfg.time_scale)
            tally.steps.append(time.monotonic())


# -- service drivers -------------------------------------------------------------------------------


def _session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=None, sock_read=None)
    )


def _group_body(task: str, cfg: Config) -> dict:
    return {"task_id": task, "n": cfg.n, "max_turns": 64, "timeout_s": 86400,
            "sampling": {"temperature": 1.0, "max_tokens": cfg.max_tokens}, **cfg.group_extra}  # fmt: skip


def _from_result(g: dict, cfg: Config) -> GroupDone:
    attempts = g["attempts"]
    first = min(a["timings"]["queued_s"] for a in attempts)
    last = max(a["timings"]["total_s"] for a in attempts)
    turns = sum((a.get("score") or {}).get("actor_turns", 0) for a in attempts)
    graded = [a for a in attempts if a["status"] in ("scored", "policy_failure")]
    return GroupDone(g["task_id"], (last - first) * cfg.time_scale, g["completion_tokens"], turns,
                     [bool(a.get("pass")) for a in graded], time.monotonic(), len(attempts),
                     g["counts"]["rewarded"])  # fmt: skip


async def _ndjson(response: aiohttp.ClientResponse) -> AsyncIterator[dict]:
    buf = b""
    async for chunk in response.content.iter_any():
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.strip():
                yield json.loads(line)


async def drive_batch(stack: Stack, cfg: Config, tally: Tally, stop: float) -> None:
    """One batch of more groups than the window can finish (4 x pool; with --groups, those), its results
    read as they come: the service keeps the pool full from its own queue, with no barrier between groups."""
    tasks = _tasks(cfg)
    body = {"groups": [_group_body(t, cfg) for t in itertools.islice(tasks, cfg.groups or min(4096, 4 * cfg.pool))]}
    async with _session() as http, http.post(f"{stack.service}/groups/batch", json=body) as r:
        if r.status >= 400:
            tally.notes.append(f"/groups/batch answered {r.status}: {(await r.text())[:300]}")
            return
        async for item in _ndjson(r):
            if "group" in item:
                tally.groups.append(_from_result(item["group"], cfg))
            if time.monotonic() >= stop:
                return


async def drive_stream(stack: Stack, cfg: Config, tally: Tally, stop: float) -> None:
    per_step = max(1, cfg.pool // cfg.n)
    template = _group_body("x", cfg)
    del template["task_id"]  # the sampler draws it
    body = {"group": template, "buffer": 2 * per_step, "max_staleness": 1, "filter": "none",
            "tasks": {"task_ids": [t for t, _ in task_ids()]}, **cfg.stream_extra}  # fmt: skip
    async with _session() as http:
        async with http.post(f"{stack.service}/samplers", json=body) as r:
            state = await r.json()
            if r.status >= 400:
                tally.notes.append(f"POST /samplers answered {r.status}: {json.dumps(state)[:300]}")
                return
        stream = state["id"]
        version = 0
        while time.monotonic() < stop:
            pull = {"count": per_step, "timeout_s": 3600}
            async with http.post(f"{stack.service}/samplers/{stream}/pull", json=pull) as r:
                async for item in _ndjson(r):
                    if "group" in item:
                        tally.groups.append(_from_result(item["group"], cfg))
                    elif "dropped" in item:
                        tally.dropped.append(item["dropped"])
            if time.monotonic() >= stop:
                break
            # The stand-in training step; the weights it made pushed while the replicas are paused.
            await asyncio.sleep(cfg.train_s / cfg.time_scale)
            version += 1
            async with http.post(f"{stack.service}/policy/pause", json={}) as r:
                await r.read()
            async with http.post(f"{stack.service}/policy", json={"version": f"v{version}"}) as r:
                if r.status >= 400:
                    tally.notes.append(f"POST /policy answered {r.status}: {(await r.text())[:300]}")
            tally.steps.append(time.monotonic())
        async with http.get(f"{stack.service}/samplers/{stream}") as r:
            state = await r.json()
        shown = ("dropped", "handed_out", "groups_run", "lag_histogram", "max_staleness", "pacing", "audit")
        tally.notes.append("stream state: " + json.dumps({k: v for k, v in state.items() if k in shown}))


# -- one run ---------------------------------------------------------------------------------------


async def _sim_stats(urls: list[str], reset: bool) -> list[dict]:
    async with aiohttp.ClientSession() as http:
        out = []
        for u in urls:
            async with http.request("POST" if reset else "GET", f"{u}/sim/stats") as r:
                out.append(await r.json())
        return out


def _q(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return round(values[min(len(values) - 1, int(q * len(values)))], 1)


def _side(groups: list[GroupDone]) -> dict:
    if not groups:
        return {}
    passes = [p for g in groups for p in g.passes]
    return {
        "groups": len(groups),
        "long share": round(sum(family_of(g.task_id) == "long" for g in groups) / len(groups), 3),
        "tokens/group": round(statistics.mean(g.tokens for g in groups)),
        "turns/attempt": round(statistics.mean(g.turns / max(1, g.attempts) for g in groups), 2),
        "pass rate": round(sum(passes) / len(passes), 3) if passes else None,
        "graded/group": round(statistics.mean(g.graded for g in groups), 2),
    }


async def _reset_stats(stack: Stack) -> None:
    await _sim_stats(stack.sims, reset=True)
    async with aiohttp.ClientSession() as http, http.post(f"{stack.env}/stats") as r:
        await r.read()


async def run_one(cfg: Config, logs: Path) -> dict:
    drive = {"naive": drive_naive, "sync": drive_sync, "batch": drive_batch, "stream": drive_stream}[cfg.driver]
    with Stack(cfg, logs / f"{cfg.driver}-p{cfg.pool}-r{cfg.replicas}", cfg.driver in ("batch", "stream")) as stack:
        tally = Tally()
        fixed = cfg.groups is not None
        if fixed:  # fixed work: measured from the first group to the last one's end (--seconds caps it)
            await _reset_stats(stack)
        window_start = time.monotonic() + (0.0 if fixed else cfg.warmup)
        stop = window_start + cfg.seconds
        task = asyncio.create_task(drive(stack, cfg, tally, stop))
        if fixed:
            await asyncio.wait([task], timeout=cfg.seconds)
            if task.done():
                stop = time.monotonic()
            if len(tally.groups) < cfg.groups:  # the cap, or groups the service answered with an error
                cap = "" if task.done() else f" in the {cfg.seconds:.0f} s (wall) cap"
                tally.notes.append(f"{len(tally.groups)} of {cfg.groups} groups ended{cap}")
        else:
            await asyncio.sleep(cfg.warmup)
            await _reset_stats(stack)
            await asyncio.sleep(max(0.0, stop - time.monotonic()))
        sims = await _sim_stats(stack.sims, reset=False)
        async with aiohttp.ClientSession() as http, http.get(f"{stack.env}/stats") as r:
            env = await r.json()
        window_wall = time.monotonic() - window_start
        task.cancel()
        try:
            await asyncio.wait_for(task, 30)
        except (asyncio.CancelledError, TimeoutError):
            pass
        except Exception as exc:  # a driver that broke: the row says so
            tally.notes.append(f"driver failed: {exc!r}")
    sim_window = window_wall * cfg.time_scale
    in_window = [g for g in tally.groups if window_start <= g.ended <= stop]
    tokens = [s["generated_tokens"] for s in sims]
    steps = [t for t in tally.steps if window_start <= t <= stop]
    # Between consecutive steps that ended in the window: a rate that does not move by a whole step
    # when the window's edge falls just before one or just after.
    intervals = [b - a for a, b in itertools.pairwise(tally.steps) if window_start <= b <= stop]
    latencies = [g.latency_s for g in in_window]
    row: dict[str, Any] = {
        "driver": cfg.driver,
        "pool": cfg.pool,
        "replicas": cfg.replicas,
        "busy %": round(100 * statistics.mean(min(1.0, s["busy_s"] / sim_window) for s in sims), 1),
        "tokens/s": round(sum(tokens) / sim_window, 1),
        "groups/s": round(len(in_window) / sim_window, 4),
        "p50 s": _q(latencies, 0.5),
        "p90 s": _q(latencies, 0.9),
        "load max/mean": round(max(tokens) / statistics.mean(tokens), 2) if sum(tokens) else None,
        "steps/h": round(len(steps) * 3600 / sim_window, 1) if cfg.driver in ("sync", "stream") else None,
        "step interval s": round(statistics.mean(intervals) * cfg.time_scale, 1) if intervals else None,
        "stale drops": sum(d.get("reason") == "stale" for d in tally.dropped) if cfg.driver == "stream" else None,
        "mean batch": round(statistics.mean(s["mean_batch"] for s in sims), 1),
        "preemptions": sum(s["preemptions"] for s in sims),
        "prefix hit %": round(100 * statistics.mean(s["prefix_hit_rate"] for s in sims), 1),
        "sim lag s": max(s["lag_s"] for s in sims),
        "env busy %": round(100 * env["busy_world_s"] / (cfg.pool * max(env["window_s"], 1e-9)), 1),
        "kept": _side(in_window),
        "window sim s": round(sim_window),
    }
    if tally.dropped:
        dropped_passes = [r == 1.0 for d in tally.dropped for r in d.get("rewards", []) if r is not None]
        row["dropped"] = {
            "groups": len(tally.dropped),
            "long share": round(sum(family_of(d["task_id"]) == "long" for d in tally.dropped) / len(tally.dropped), 3),
            "tokens/group": round(statistics.mean(d.get("completion_tokens", 0) for d in tally.dropped)),
            "pass rate": round(sum(dropped_passes) / len(dropped_passes), 3) if dropped_passes else None,
        }
    switches = {**cfg.group_extra, **(cfg.stream_extra if cfg.driver == "stream" else {})}
    if switches or cfg.service_flags:
        row["switches"] = " ".join([*(f"{k}={v}" for k, v in switches.items()), *cfg.service_flags])
    if tally.notes:
        row["notes"] = tally.notes
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pools", type=int, nargs="+", default=[256])
    parser.add_argument("--replicas", type=int, nargs="+", default=[4])
    parser.add_argument("--drivers", nargs="+", choices=DRIVERS, default=list(DRIVERS))
    parser.add_argument("--seconds", type=float, default=60.0, help="measured window, wall seconds")
    parser.add_argument("--warmup", type=float, default=15.0, help="wall seconds before the window")
    parser.add_argument("--time-scale", type=float, help="simulated s per wall s (default 2560 / pool)")
    parser.add_argument("--train-s", type=float, default=30.0, help="stand-in training step, simulated seconds")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=4096)
    parser.add_argument("--params", type=Path, help="the sims' engine (gpusim.py --params); default: H100 + 8B")
    parser.add_argument("--deadline-s", type=float, help="sent in each service group (group tail control)")
    parser.add_argument("--min-graded", type=int, help="sent in each service group (k of n)")
    parser.add_argument("--max-staleness", type=int, help="the stream's (default 1; -1: unbounded)")
    parser.add_argument("--no-pacing", action="store_true", help="the stream drops and replaces stale groups")
    parser.add_argument("--service-flag", action="append", default=[], help="a flag for rollout-service serve")
    parser.add_argument("--groups", type=int, help="fixed work: these many groups, timed to the last one's end")
    parser.add_argument("--record", type=Path, help="write the rows as a record here")
    parser.add_argument("--label", default="", help="a word for this run in the record's title")
    args = parser.parse_args()
    if args.groups is not None and args.groups < 1:
        parser.error("--groups must be at least 1")
    if args.groups is not None and "stream" in args.drivers:
        parser.error("--groups fixes the work of naive, sync and batch; the stream's is set by its steps")
    extra: dict[str, Any] = {}
    if args.deadline_s is not None:
        extra["deadline_s"] = args.deadline_s
    if args.min_graded is not None:
        extra["min_graded"] = args.min_graded
    stream: dict[str, Any] = {}
    if args.max_staleness is not None:
        stream["max_staleness"] = None if args.max_staleness < 0 else args.max_staleness
    if args.no_pacing:
        stream["pacing"] = False
    rows = []
    for pool in args.pools:
        for replicas in args.replicas:
            for driver in args.drivers:
                cfg = Config(pool, replicas, driver, n=args.n, seconds=args.seconds, warmup=args.warmup,
                             time_scale=args.time_scale or 2560 / pool, train_s=args.train_s,
                             max_tokens=args.max_tokens, params=args.params,
                             service_flags=args.service_flag, group_extra=extra, stream_extra=stream,
                             groups=args.groups)  # fmt: skip
                row = asyncio.run(run_one(cfg, LOGS))
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.record:
        notes = (
            "Simulated time throughout (wall x time scale). Stack per row: gpusim replicas (Llama-3.1-8B on one "
            "H100 each unless --params), the tails env, the service where the driver uses it; all on this "
            "2-core machine, shared with other sessions. Stand-in trainer: a fixed sleep per step."
        )
        rec = record.make("gpu-regime", f"Drivers side by side in the GPU regime {args.label}".strip(),
                          [record.flat(r) for r in rows], notes=notes)  # fmt: skip
        record.write(rec, args.record)


if __name__ == "__main__":
    main()
