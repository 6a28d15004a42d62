"""`rollout-service loadtest`: drive a running service the way a fleet of trainers would.

K trainers each send batches of groups (POST /groups/batch, through the trainer client) until a
duration or a group count is reached, bounded in time either way, against a service on this
machine only. The tasks are the service's own (GET /tasks) unless given. A sampler reads the
service's /health/detail and the envs' /health twice a second for occupancy over time.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from ..server.http.auth import loopback_url
from ..trainer.client import AsyncRolloutClient, RolloutError


@dataclass
class LoadSpec:
    service: str
    trainers: int = 4
    batch: int = 4
    n: int = 8
    tasks: list[str] = field(default_factory=list)  # empty: every task the service lists
    duration_s: float | None = 60.0
    count: int | None = None
    temperature: float = 0.8
    max_tokens: int = 48
    max_turns: int = 8
    api_key: str | None = None
    grace_s: float = 120.0  # after the duration, how long in-flight batches may take to finish


def require_loopback(url: str) -> None:
    """The load test only ever targets this machine."""
    if not loopback_url(url):
        raise ValueError(f"{url}: the load test only targets loopback addresses (127.0.0.0/8, ::1, localhost)")


@dataclass
class _Tally:
    started: float
    groups: list[dict] = field(default_factory=list)  # {t, latency_s, tokens, statuses}
    errors: list[str] = field(default_factory=list)
    sent: int = 0
    samples: list[dict] = field(default_factory=list)


async def run_load(spec: LoadSpec, progress=print) -> dict:
    require_loopback(spec.service)
    async with AsyncRolloutClient(spec.service, api_key=spec.api_key) as client:
        if not spec.tasks:
            spec.tasks = [t["task_id"] for t in await client.tasks()]
            progress(f"[loadtest] cycling through the {len(spec.tasks)} task(s) the service lists (GET /tasks)")
        else:
            progress(f"[loadtest] cycling through --tasks {','.join(spec.tasks)}")
        if not spec.tasks:
            raise ValueError("the service lists no task")
        detail = await client.health_detail()
        # The envs' own counters are read where the env is on this machine's loopback; one the service
        # reaches on its own network (compose: http://env:8090) is measured from the service's side only.
        envs = [e["url"] for e in detail["envs"] if loopback_url(e["url"])]
        pools = {e["url"]: e["pool"] for e in detail["envs"]}
        before = await _snapshot(client, envs)
        tally = _Tally(started=time.monotonic())
        stop = asyncio.Event()
        sampler = asyncio.create_task(_sample(client, envs, tally, stop))
        reporter = asyncio.create_task(_report(tally, pools, progress, stop))
        trainers = [asyncio.create_task(_trainer(client, spec, i, tally)) for i in range(spec.trainers)]
        hard_deadline = (spec.duration_s or 3600.0) + spec.grace_s
        done, pending = await asyncio.wait(trainers, timeout=hard_deadline)
        for task in pending:  # bounded in time whatever happens
            task.cancel()
            tally.errors.append("a trainer was still waiting at the hard deadline and was stopped")
        await asyncio.gather(*pending, return_exceptions=True)
        wall = time.monotonic() - tally.started
        stop.set()
        await asyncio.gather(sampler, reporter)
        after = await _snapshot(client, envs)
    return _summarize(spec, tally, wall, pools, before, after)


async def _trainer(client: AsyncRolloutClient, spec: LoadSpec, index: int, tally: _Tally) -> None:
    batch_number = 0
    while True:
        elapsed = time.monotonic() - tally.started
        if spec.duration_s is not None and elapsed >= spec.duration_s:
            return
        size = spec.batch
        if spec.count is not None:
            size = min(size, spec.count - tally.sent)
            if size <= 0:
                return
        tally.sent += size
        groups = [
            {
                "task_id": spec.tasks[(index + batch_number + i) % len(spec.tasks)],
                "n": spec.n,
                "max_turns": spec.max_turns,
                "sampling": {"temperature": spec.temperature, "max_tokens": spec.max_tokens},
            }
            for i in range(size)
        ]
        batch_number += 1
        try:
            async for item in client.groups(groups):
                if item.group is None:
                    tally.errors.append(f"group failed: {item.error}"[:200])
                    continue
                g = item.group
                counts = g.counts
                tally.groups.append(
                    {
                        "t": time.monotonic() - tally.started,
                        "latency_s": g.wall_s,
                        "tokens": g.completion_tokens,
                        "statuses": [a.status for a in g.attempts],
                        "accounted": counts.scheduled == counts.scored + counts.failed == len(g.attempts),
                        "unexplained": sum(1 for a in g.attempts if a.status != "scored" and a.failure is None),
                    }
                )
        except RolloutError as exc:
            tally.errors.append(f"batch refused: {exc.status} {exc}"[:200])
            await asyncio.sleep(1.0)
        except httpx.HTTPError as exc:
            tally.errors.append(f"transport: {type(exc).__name__}: {exc}"[:200])
            await asyncio.sleep(1.0)


async def _snapshot(client: AsyncRolloutClient, envs: list[str]) -> dict:
    detail = await client.health_detail()
    out: dict = {"service": {e["url"]: e for e in detail["envs"]}, "env": {}}
    async with httpx.AsyncClient(timeout=10) as plain:
        for url in envs:
            try:
                out["env"][url] = (await plain.get(f"{url}/health")).json()
            except httpx.HTTPError:
                out["env"][url] = {}
    return out


async def _sample(client: AsyncRolloutClient, envs: list[str], tally: _Tally, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            snap = await _snapshot(client, envs)
            tally.samples.append(
                {
                    "t": time.monotonic() - tally.started,
                    "held": {u: s["held"] for u, s in snap["service"].items()},
                    "leased": {u: s.get("leased") for u, s in snap["env"].items()},
                }
            )
        except (httpx.HTTPError, RolloutError, ValueError, KeyError) as exc:
            tally.errors.append(f"health sample failed: {type(exc).__name__}")
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except TimeoutError:
            pass


async def _report(tally: _Tally, pools: dict, progress, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            await asyncio.wait_for(stop.wait(), 5.0)
        except TimeoutError:
            pass
        elapsed = time.monotonic() - tally.started
        done = len(tally.groups)
        tokens = sum(g["tokens"] for g in tally.groups)
        held = tally.samples[-1]["held"] if tally.samples else {}
        occupancy = ", ".join(f"{held.get(u, 0)}/{p}" for u, p in pools.items())
        progress(
            f"[loadtest] {elapsed:6.1f}s  groups {done}  {done / elapsed:.3f}/s  "
            f"{tokens / elapsed:.1f} tok/s  worlds held {occupancy}  errors {len(tally.errors)}"
        )


def _summarize(spec: LoadSpec, tally: _Tally, wall: float, pools: dict, before: dict, after: dict) -> dict:
    latencies = np.array([g["latency_s"] for g in tally.groups]) if tally.groups else np.array([0.0])
    statuses: dict[str, int] = {}
    for g in tally.groups:
        for s in g["statuses"]:
            statuses[s] = statuses.get(s, 0) + 1
    attempts = sum(statuses.values())
    envs = {}
    for url, pool in pools.items():
        svc_busy = after["service"][url]["busy_world_seconds"] - before["service"][url]["busy_world_seconds"]
        env_after, env_before = after["env"].get(url, {}), before["env"].get(url, {})
        env_busy = None
        if "busy_world_seconds" in env_after and "busy_world_seconds" in env_before:
            env_busy = env_after["busy_world_seconds"] - env_before["busy_world_seconds"]
        envs[url] = {
            "pool": pool,
            "utilisation_service": round(svc_busy / (pool * wall), 4),
            "utilisation_env": None if env_busy is None else round(env_busy / (pool * wall), 4),
            "max_held_by_service": max((s["held"].get(url, 0) for s in tally.samples), default=0),
            "max_leased_env": env_after.get("max_leased"),
            "leased_at_end": env_after.get("leased"),
        }
    return {
        "spec": {k: v for k, v in spec.__dict__.items() if k != "api_key"},
        "wall_s": round(wall, 3),
        "groups": len(tally.groups),
        "attempts": attempts,
        "groups_per_s": round(len(tally.groups) / wall, 4),
        "attempts_per_s": round(attempts / wall, 4),
        "completion_tokens_per_s": round(sum(g["tokens"] for g in tally.groups) / wall, 2),
        "group_latency_s": {
            "p50": round(float(np.percentile(latencies, 50)), 3),
            "p90": round(float(np.percentile(latencies, 90)), 3),
            "p99": round(float(np.percentile(latencies, 99)), 3),
            "max": round(float(latencies.max()), 3),
        },
        "attempt_status": statuses,
        "groups_sent": tally.sent,
        "groups_not_accounted": sum(1 for g in tally.groups if not g["accounted"]),
        "failures_without_reason": sum(g["unexplained"] for g in tally.groups),
        "envs": envs,
        "errors": tally.errors[:50],
        "error_count": len(tally.errors),
        "timeline": {"groups": tally.groups, "samples": tally.samples},
    }


def format_report(r: dict) -> str:
    lat = r["group_latency_s"]
    lines = [
        f"groups {r['groups']} in {r['wall_s']:.1f}s: {r['groups_per_s']:.3f} groups/s, "
        f"{r['attempts_per_s']:.2f} attempts/s, {r['completion_tokens_per_s']:.1f} completion tokens/s",
        f"group latency p50 {lat['p50']:.2f}s  p90 {lat['p90']:.2f}s  p99 {lat['p99']:.2f}s  max {lat['max']:.2f}s",
        "attempts: " + ", ".join(f"{k} {v}" for k, v in sorted(r["attempt_status"].items())),
    ]
    for url, e in r["envs"].items():
        env_util = "-" if e["utilisation_env"] is None else f"{e['utilisation_env']:.0%}"
        lines.append(
            f"env {url}: pool {e['pool']}, utilisation {e['utilisation_service']:.0%} (service counters) / "
            f"{env_util} (env counters), most held {e['max_held_by_service']} (service) / "
            f"{e['max_leased_env']} (env), leased at end {e['leased_at_end']}"
        )
    lines.append(f"errors {r['error_count']}" + (f": {r['errors'][0]}" if r["errors"] else ""))
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    """Throughput and latency over time, and pool occupancy, to a PNG. ValueError, saying what to install,
    where matplotlib is not (the service's image has no plotting: the `bench` extra brings it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install 'rollout-service[bench]'") from None

    groups, samples = r["timeline"]["groups"], r["timeline"]["samples"]
    fig, axes = plt.subplots(3, 1, figsize=(9, 9), sharex=True)
    if groups:
        t = np.array([g["t"] for g in groups])
        bins = np.arange(0, max(t.max(), 1) + 10, 10)
        counts, edges = np.histogram(t, bins=bins)
        axes[0].step(edges[:-1], counts / 10.0, where="post")
        axes[1].scatter(t, [g["latency_s"] for g in groups], s=8)
    axes[0].set_ylabel("groups/s (10 s bins)")
    axes[1].set_ylabel("group latency (s)")
    for url, e in r["envs"].items():
        ts = [s["t"] for s in samples]
        axes[2].plot(ts, [s["held"].get(url, 0) for s in samples], label=f"held by service ({url})")
        axes[2].axhline(e["pool"], linestyle="--", color="grey", label=f"pool {e['pool']}")
    axes[2].set_ylabel("worlds held")
    axes[2].set_xlabel("seconds")
    axes[2].legend(loc="lower right", fontsize=7)
    fig.suptitle(f"loadtest: {r['groups']} groups, {r['groups_per_s']:.3f} groups/s")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
