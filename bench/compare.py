"""Benchmarks, side by side in one run on the same vLLM server and the same refenv: ratios, not times.

    .venv/bin/python bench/compare.py --vllm http://127.0.0.1:8000 [overhead] [naive] [pool32] [scaling] [memory]

overhead  completion tokens/s through the service vs a raw client driving the same vLLM at the
          same concurrency, same first-turn prompts, max_tokens, n, logprobs (goal >= 0.95)
naive     groups/s of the service vs the env's own client pattern (one group at a time, a thread
          pool of min(n, pool) workers, one blocking request per model call), at env latency 0
          and 200 ms, with env pool utilisation for both
pool32    at pool 32, n=8: the service vs the naive driver, next to vLLM's own bound for the same
          turn mix at concurrency 8 and 32 (episodes always in flight, no group barrier), with the
          service's attempts broken down (queued / inference / env) and the pool's idle fraction,
          split into idle while attempts waited for a world and idle in the batch's tail (both
          sides; from the env's counters) (run by name: `compare.py --vllm URL pool32`)
scaling   groups/s and service CPU per env step as concurrent groups grow 1 -> 64
memory    service RSS with 10,000 attempts queued for worlds

Start the model server first (`rollout-service vllm`). Everything else is started here, on
loopback, and stopped at the end. Results are printed and written to results/bench.json;
`--record bench/results` also writes each benchmark run as a record there (bench/record.py:
command, commit, machine, date) for the benchmarks page.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil

from rollout_service.trainer import RolloutClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import record  # bench/ is on the path when this runs as a script

from refenv.agent import ACTION_SCHEMA, SYSTEM_PROMPT
from rollout_service.launch.embedded_model import MODEL_NAME
from rollout_service.launch.stack import LocalStack

LOGS = Path("results/logs")
# The task mix, where the env serves these (a mix of one-turn and multi-turn tasks, the same from run
# to run); otherwise whatever the service lists (GET /tasks).
PREFERRED_TASKS = ["t005", "t019", "t020", "t006", "t001", "t009"]


class Stack(LocalStack):
    """refenv + the service on loopback, for one configuration, on the vLLM server being measured."""

    def __init__(self, vllm: str, pool: int, latency_ms: int = 0) -> None:
        super().__init__(
            log_dir=LOGS / "bench",
            pool=pool,
            vllm_url=vllm,
            refenv_args=["--latency-ms", str(latency_ms)],
            service_args=["--max-n", "64", "--max-batch", "1024"],
            say=lambda _: None,
        )

    @property
    def env_url(self) -> str:
        return self.urls["env"]

    @property
    def svc_url(self) -> str:
        return self.urls["service"]

    def env_health(self) -> dict:
        return httpx.get(f"{self.env_url}/health", timeout=10).json()

    def timed(self, run, groups: int) -> dict:
        """groups/s of `run`, the env pool's utilisation while it ran (the env's own busy-world
        seconds), and tokens/s where `run` returns the completion tokens it took."""
        before = self.env_health()["busy_world_seconds"]
        started = time.monotonic()
        tokens = run()
        wall = time.monotonic() - started
        busy = self.env_health()["busy_world_seconds"] - before
        out = {
            "groups_per_s": round(groups / wall, 4),
            "utilisation": round(busy / (self.pool * wall), 3),
            "wall_s": round(wall, 1),
        }
        if isinstance(tokens, int):
            out["tokens_per_s"] = round(tokens / wall, 1)
        return out

    def tasks(self, count: int) -> list[str]:
        """`count` task ids cycling through the mix, from what the service serves."""
        with RolloutClient(self.svc_url) as client:
            served = {t["task_id"] for t in client.tasks()}
        mix = [t for t in PREFERRED_TASKS if t in served] or sorted(served)
        return [mix[i % len(mix)] for i in range(count)]


def run_batch(url: str, groups: list[dict]) -> tuple[float, list[dict]]:
    started = time.monotonic()
    results = []
    with RolloutClient(url) as client:
        for item in client.groups(groups):
            if item.group is None:
                raise RuntimeError(f"group {item.index} failed: {item.error}")
            results.append(item.group.model_dump(mode="json", by_alias=True))
    return time.monotonic() - started, results


# -- 1. overhead --------------------------------------------------------------------------------


def bench_overhead(vllm: str, concurrency: int = 8, requests: int = 48, max_tokens: int = 48) -> dict:
    rf = {"type": "json_schema", "json_schema": {"name": "action", "schema": ACTION_SCHEMA, "strict": True}}
    prompts = [
        [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"How many rows does the {t} table have?"},
        ]
        for t in ("customers", "products", "orders", "invoices")
    ]

    async def raw() -> tuple[float, int]:
        sem, tokens = asyncio.Semaphore(concurrency), 0
        async with httpx.AsyncClient(timeout=300) as http:

            async def one(i: int) -> None:
                nonlocal tokens
                async with sem:
                    r = await http.post(
                        f"{vllm}/v1/chat/completions",
                        json={
                            "model": MODEL_NAME,
                            "messages": prompts[i % 4],
                            "temperature": 0.8,
                            "max_tokens": max_tokens,
                            "logprobs": True,
                            "return_token_ids": True,
                            "response_format": rf,
                        },
                    )
                    tokens += len(r.json()["choices"][0]["token_ids"])

            started = time.monotonic()
            await asyncio.gather(*(one(i) for i in range(requests)))
            return time.monotonic() - started, tokens

    with Stack(vllm, pool=concurrency) as stack:
        # max_turns=1: each attempt makes exactly one completion (the first-turn prompt), like the raw client.
        groups = [
            {
                "task_id": f"t00{5 + i % 4}",
                "n": concurrency,
                "max_turns": 1,
                "sampling": {"temperature": 0.8, "max_tokens": max_tokens},
            }
            for i in range(requests // concurrency)
        ]
        results = {}
        for round_ in range(2):  # alternate, so neither side always runs on a warmer server
            raw_wall, raw_tokens = asyncio.run(raw())
            svc_wall, svc_groups = run_batch(stack.svc_url, groups)
            svc_tokens = sum(g["completion_tokens"] for g in svc_groups)
            results[round_] = (raw_tokens / raw_wall, svc_tokens / svc_wall)
    raw_rate = sum(r for r, _ in results.values()) / 2
    svc_rate = sum(s for _, s in results.values()) / 2
    return {
        "concurrency": concurrency,
        "requests": requests,
        "max_tokens": max_tokens,
        "raw_tokens_per_s": round(raw_rate, 1),
        "service_tokens_per_s": round(svc_rate, 1),
        "ratio": round(svc_rate / raw_rate, 3),
    }


# -- 2 + 3. against the naive driver ------------------------------------------------------------


def _episode(http: httpx.Client, env_url: str, vllm: str, task: str, max_tokens: int) -> int:
    """One episode the way the env's own client runs it (blocking calls, messages sent whole);
    returns the completion tokens it took."""
    tokens = 0
    answer = http.post(f"{env_url}/step/reset", json={"task_id": task}).json()
    while not answer["done"]:
        obs = answer["observation"]
        body = {
            "model": MODEL_NAME,
            "messages": obs["messages"],
            "temperature": 0.8,
            "max_tokens": max_tokens,
            "logprobs": True,
            "return_token_ids": True,
        }
        if obs.get("response_format"):
            body["response_format"] = obs["response_format"]
        out = http.post(f"{vllm}/v1/chat/completions", json=body).json()
        tokens += out["usage"]["completion_tokens"]
        answer = http.post(
            f"{env_url}/step",
            json={
                "episode_id": answer["episode_id"],
                "completion": out["choices"][0]["message"]["content"],
                "prompt_tokens": out["usage"]["prompt_tokens"],
                "completion_tokens": out["usage"]["completion_tokens"],
            },
        ).json()
    return tokens


def naive_group(env_url: str, vllm: str, task: str, n: int, pool: int, max_tokens: int) -> int:
    """The env's own client pattern: a thread pool of min(n, pool) workers, blocking calls; returns
    the group's completion tokens."""

    def attempt(_: int) -> int:
        with httpx.Client(timeout=600) as http:
            return _episode(http, env_url, vllm, task, max_tokens)

    with ThreadPoolExecutor(min(n, pool)) as workers:
        return sum(workers.map(attempt, range(n)))


def bench_naive(vllm: str, latency_ms: int, groups: int = 8, n: int = 4, pool: int = 8, max_tokens: int = 32) -> dict:
    out = {"latency_ms": latency_ms, "groups": groups, "n": n, "pool": pool, "max_tokens": max_tokens}
    with Stack(vllm, pool=pool, latency_ms=latency_ms) as stack:
        tasks = stack.tasks(groups)
        out["naive"] = stack.timed(
            lambda: [naive_group(stack.env_url, vllm, task, n, pool, max_tokens) for task in tasks], groups
        )
        out["service"] = stack.timed(
            lambda: run_batch(
                stack.svc_url,
                [{"task_id": t, "n": n, "sampling": {"temperature": 0.8, "max_tokens": max_tokens}} for t in tasks],
            ),
            groups,
        )
        out["service"]["max_leased"] = stack.env_health()["max_leased"]
    out["ratio"] = round(out["service"]["groups_per_s"] / out["naive"]["groups_per_s"], 2)
    return out


# -- 3b. where the pool-32 throughput goes -------------------------------------------------------


def vllm_bound(stack: Stack, vllm: str, tasks: list[str], concurrency: int, seconds: float, max_tokens: int) -> dict:
    """What vLLM itself gives this turn mix at `concurrency`: that many episodes always in flight
    (each worker starts the next as soon as one ends, no group barrier), completion tokens/s."""
    deadline = time.monotonic() + seconds
    counts: list[tuple[int, int]] = []

    def worker(i: int) -> None:
        tokens = episodes = 0
        with httpx.Client(timeout=600) as http:
            while time.monotonic() < deadline:
                tokens += _episode(http, stack.env_url, vllm, tasks[(i + episodes) % len(tasks)], max_tokens)
                episodes += 1
        counts.append((tokens, episodes))

    started = time.monotonic()
    with ThreadPoolExecutor(concurrency) as workers:
        list(workers.map(worker, range(concurrency)))
    wall = time.monotonic() - started
    return {
        "concurrency": concurrency,
        "tokens_per_s": round(sum(t for t, _ in counts) / wall, 1),
        "episodes_per_s": round(sum(e for _, e in counts) / wall, 3),
        "wall_s": round(wall, 1),
    }


class PoolIdle:
    """Where a pool's idle world-time went while `run` ran, from the env's own counters sampled every
    0.1 s (GET /health: worlds leased, episodes started): idle while some of the run's attempts had
    not started yet (the time between an episode's end and the next reset, or a pool the driver
    does not fill) against idle once every attempt had (the batch's tail). `gap_s`: the first per
    episode started meanwhile, the mean time a world sat idle before its next reset."""

    def __init__(self, stack: Stack, attempts: int) -> None:
        self.stack, self.attempts = stack, attempts
        self.stop = threading.Event()
        self.waiting = self.tail = 0.0  # idle world-seconds
        self.started_while_waiting = 0

    def __enter__(self) -> PoolIdle:
        first = self.stack.env_health()
        self.base = first["episodes"]["started"]
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()

    def _sample(self) -> None:
        last = time.monotonic()
        while not self.stop.wait(0.1):
            health = self.stack.env_health()
            now, started = time.monotonic(), health["episodes"]["started"] - self.base
            idle = max(0, self.stack.pool - health["leased"]) * (now - last)
            if started < self.attempts:
                self.waiting += idle
                self.started_while_waiting = started
            else:
                self.tail += idle
            last = now

    def shares(self, wall: float) -> dict:
        total = self.stack.pool * wall
        return {
            "idle_while_attempts_waited": round(self.waiting / total, 3),
            "idle_in_tail": round(self.tail / total, 3),
            "gap_s": round(self.waiting / max(self.started_while_waiting, 1), 2),
        }


def bench_pool32(
    vllm: str, groups: int = 8, n: int = 8, pool: int = 32, max_tokens: int = 32, bound_s: float = 60.0
) -> dict:
    """The service against the naive driver at pool 32, n=8, next to vLLM's own bound at concurrency
    8 (what the naive driver can use) and 32 (what the pool allows), with the service's attempts
    broken down (queued for a world, in inference, in the env) and each side's pool idle time split
    (PoolIdle)."""
    out: dict = {"groups": groups, "n": n, "pool": pool, "max_tokens": max_tokens}
    with Stack(vllm, pool=pool) as stack:
        tasks = stack.tasks(groups)
        out["vllm_bound"] = [vllm_bound(stack, vllm, tasks, c, bound_s, max_tokens) for c in (min(n, pool), pool)]
        with PoolIdle(stack, groups * n) as naive_idle:
            out["naive"] = stack.timed(
                lambda: sum(naive_group(stack.env_url, vllm, t, n, pool, max_tokens) for t in tasks), groups
            )
        out["naive"]["idle"] = naive_idle.shares(out["naive"]["wall_s"])
        attempts: list[dict] = []

        def service() -> int:
            _, results = run_batch(
                stack.svc_url,
                [{"task_id": t, "n": n, "sampling": {"temperature": 0.8, "max_tokens": max_tokens}} for t in tasks],
            )
            attempts.extend(a for g in results for a in g["attempts"])
            return sum(g["completion_tokens"] for g in results)

        with PoolIdle(stack, groups * n) as service_idle:
            out["service"] = stack.timed(service, groups)
        out["service"]["idle"] = service_idle.shares(out["service"]["wall_s"])
        out["service"]["max_leased"] = stack.env_health()["max_leased"]
        total = sum(a["timings"]["total_s"] for a in attempts) or 1.0
        out["service"]["attempt_time_share"] = {
            part: round(sum(a["timings"][f"{part}_s"] for a in attempts) / total, 3)
            for part in ("queued", "inference", "env")
        }
        out["service"]["attempt_mean_s"] = round(total / max(len(attempts), 1), 2)
    for side in ("naive", "service"):
        out[side]["pool_idle"] = round(1 - out[side]["utilisation"], 3)
    out["ratio_vs_naive"] = round(out["service"]["groups_per_s"] / out["naive"]["groups_per_s"], 2)
    out["share_of_bound"] = round(out["service"]["tokens_per_s"] / out["vllm_bound"][-1]["tokens_per_s"], 3)
    return out


# -- 4. scaling and memory ------------------------------------------------------------------------


def bench_scaling(vllm: str, sizes=(1, 4, 16, 64), n: int = 2, pool: int = 16, max_tokens: int = 8) -> list[dict]:
    rows = []
    with Stack(vllm, pool=pool) as stack:
        proc = psutil.Process(stack.process("service").proc.pid)
        for size in sizes:
            groups = [
                {
                    "task_id": task,
                    "n": n,
                    "max_turns": 4,
                    "sampling": {"temperature": 0.8, "max_tokens": max_tokens},
                }
                for task in stack.tasks(size)
            ]
            cpu_before, steps_before = proc.cpu_times(), stack.env_health()["steps"]
            wall, _ = run_batch(stack.svc_url, groups)
            cpu_after, steps_after = proc.cpu_times(), stack.env_health()["steps"]
            cpu = (cpu_after.user + cpu_after.system) - (cpu_before.user + cpu_before.system)
            steps = max(1, steps_after - steps_before)
            rows.append(
                {
                    "concurrent_groups": size,
                    "groups_per_s": round(size / wall, 4),
                    "service_cpu_ms_per_step": round(1000 * cpu / steps, 3),
                    "steps": steps,
                }
            )
    return rows


def bench_memory(vllm: str, attempts: int = 10_000) -> dict:
    per_group = 64
    with Stack(vllm, pool=2, latency_ms=600_000) as stack:
        groups = [
            {"task_id": task, "n": per_group, "sampling": {"temperature": 0.8, "max_tokens": 8}}
            for task in stack.tasks(attempts // per_group + 1)
        ]
        proc = psutil.Process(stack.process("service").proc.pid)
        idle = proc.memory_info().rss
        stop = threading.Event()

        def send() -> None:
            try:
                with httpx.stream("POST", f"{stack.svc_url}/groups/batch", json={"groups": groups}, timeout=120) as r:
                    for _ in r.iter_lines():
                        if stop.is_set():
                            return
            except httpx.HTTPError:
                pass

        sender = threading.Thread(target=send, daemon=True)
        sender.start()
        deadline = time.monotonic() + 60
        waiting = 0
        while time.monotonic() < deadline:
            waiting = httpx.get(f"{stack.svc_url}/health/detail").json()["attempts_waiting_for_a_world"]
            if waiting >= attempts:
                break
            time.sleep(0.5)
        queued = proc.memory_info().rss
        stop.set()
    return {
        "attempts_waiting": waiting,
        "rss_idle_mib": round(idle / 2**20, 1),
        "rss_queued_mib": round(queued / 2**20, 1),
        "kib_per_queued_attempt": round((queued - idle) / 1024 / max(1, waiting), 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", default="http://127.0.0.1:8000")
    parser.add_argument("which", nargs="*", default=["overhead", "naive", "scaling", "memory"])
    parser.add_argument("--record", metavar="DIR", help="also write each benchmark's rows as a record into DIR")
    args = parser.parse_args()
    vllm = args.vllm.rstrip("/")
    results: dict = {
        "machine": {"cpus": psutil.cpu_count(), "memory_gib": round(psutil.virtual_memory().total / 2**30)},
        "vllm": vllm,
    }
    if "overhead" in args.which:
        results["overhead"] = bench_overhead(vllm)
        print("overhead:", json.dumps(results["overhead"]), flush=True)
    if "naive" in args.which:
        results["naive"] = [bench_naive(vllm, 0), bench_naive(vllm, 200)]
        for row in results["naive"]:
            print("naive:", json.dumps(row), flush=True)
    if "pool32" in args.which:
        results["pool32"] = bench_pool32(vllm)
        print("pool32:", json.dumps(results["pool32"]), flush=True)
    if "scaling" in args.which:
        results["scaling"] = bench_scaling(vllm)
        for row in results["scaling"]:
            print("scaling:", json.dumps(row), flush=True)
    if "memory" in args.which:
        results["memory"] = bench_memory(vllm)
        print("memory:", json.dumps(results["memory"]), flush=True)
    Path("results").mkdir(exist_ok=True)
    Path("results/bench.json").write_text(json.dumps(results, indent=1))
    print("written to results/bench.json")
    if args.record:
        for name in RECORDED:
            if name in results:
                rows = results[name] if isinstance(results[name], list) else [results[name]]
                made = record.make(name, RECORDED[name], [record.flat(row) for row in rows])
                path = Path(args.record) / f"{name}-{made['date']}-{made['commit'].replace('+', '-')}.json"
                print(f"record written to {record.write(made, path)}")
    return 0


# Each benchmark's record: its name on the benchmarks page and its title there.
RECORDED = {
    "overhead": "Service overhead against a raw client",
    "naive": "Against the naive driver",
    "pool32": "Where the pool-32 throughput goes",
    "scaling": "Concurrent groups 1 → 64",
    "memory": "Memory with 10,000 attempts queued for worlds",
}


if __name__ == "__main__":
    sys.exit(main())
