"""Soak: full load with 10% injected env faults for a bounded time; memory flat, nothing leaked.

    .venv/bin/python bench/soak.py --vllm http://127.0.0.1:8000 [--minutes 10] [--fail-rate 0.1]

Starts refenv (pool 8, --fail-rate) and the service on loopback, drives them with the load test
for the given time, samples the service's memory every 10 s, then checks: no world leased at
the end, never more than the pool held, every scheduled attempt scored or failed with a reason.
Prints the figures and writes results/soak.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rollout_service.launch.stack import LocalStack
from rollout_service.tools.loadtest import LoadSpec, format_report, run_load


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", default="http://127.0.0.1:8000")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--fail-rate", type=float, default=0.1)
    parser.add_argument("--pool", type=int, default=8)
    args = parser.parse_args()
    stack = LocalStack(
        log_dir=Path("results/logs/soak"),
        pool=args.pool,
        vllm_url=args.vllm,
        refenv_args=["--fail-rate", str(args.fail_rate), "--seed", "11"],
    )
    memory: list[tuple[float, float]] = []
    health_failures = 0
    stop = threading.Event()
    with stack:
        try:
            env_url, svc_url = stack.urls["env"], stack.urls["service"]
            proc = psutil.Process(stack.process("service").proc.pid)
            started = time.monotonic()

            def sample() -> None:
                nonlocal health_failures
                while not stop.is_set():
                    memory.append((time.monotonic() - started, proc.memory_info().rss / 2**20))
                    try:
                        if httpx.get(f"{svc_url}/health", timeout=5).status_code != 200:
                            health_failures += 1
                    except httpx.HTTPError:
                        health_failures += 1
                    stop.wait(10)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            spec = LoadSpec(
                service=svc_url,
                trainers=4,
                batch=4,
                n=8,
                duration_s=args.minutes * 60,
                max_tokens=32,
                max_turns=8,
                grace_s=300,
            )
            report = asyncio.run(run_load(spec))
            stop.set()
            sampler.join()
            env_health = httpx.get(f"{env_url}/health").json()
        finally:
            stop.set()  # the sampler stops even when the load fails
    groups = report["timeline"]["groups"]
    statuses = report["attempt_status"]
    first = [m for t, m in memory if t < 60] or [memory[0][1]]
    last = [m for t, m in memory if t > memory[-1][0] - 60] or [memory[-1][1]]
    result = {
        "minutes": args.minutes,
        "fail_rate": args.fail_rate,
        "pool": args.pool,
        "groups": len(groups),
        "attempts": sum(statuses.values()),
        "attempt_status": statuses,
        "groups_sent": report["groups_sent"],
        "groups_not_accounted": report["groups_not_accounted"],
        "failures_without_reason": report["failures_without_reason"],
        "rss_mib_first_minute": round(sum(first) / len(first), 1),
        "rss_mib_last_minute": round(sum(last) / len(last), 1),
        "rss_mib_max": round(max(m for _, m in memory), 1),
        "env_max_leased": env_health["max_leased"],
        "env_leased_at_end": env_health["leased"],
        "env_episodes": env_health["episodes"],
        "health_failures": health_failures,
        "errors": report["error_count"],
        "groups_per_s": report["groups_per_s"],
    }
    print(format_report(report))
    print(json.dumps(result, indent=1))
    Path("results").mkdir(exist_ok=True)
    Path("results/soak.json").write_text(json.dumps({"summary": result, "memory": memory}, indent=1))
    ok = (
        result["env_leased_at_end"] == 0
        and result["env_max_leased"] <= args.pool
        and health_failures == 0
        and result["groups_not_accounted"] == 0
        and result["failures_without_reason"] == 0
        and result["groups_sent"] == len(groups)
    )
    print("soak: OK" if ok else "soak: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
