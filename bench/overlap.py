"""Generation while training: GRPO steps per hour, synchronous vs overlapped, side by side in one run.

    .venv/bin/python bench/overlap.py --vllm URL [--model NAME] [--train-s 5 20] [--steps 4]
        [--groups 4] [--n 4] [--max-turns 3] [--max-tokens 48] [--json bench/results/overlap.json]

On this machine the trainer and vLLM share the CPU, so the training step is a stand-in of fixed
length (a sleep of --train-s seconds: it takes no CPU, as a GPU trainer's step takes none of the
model servers'). Each step needs --groups groups of --n attempts:

- synchronous (today's way): POST /groups/sample for the step's groups, then the training step; the
  model servers idle while it trains, the trainer while they generate.
- overlapped: one sampler stream (buffer = 2 x --groups) generates meanwhile; each step pulls its
  groups, then trains.

Both use filter "none" (every group kept) so that the two do the same work per step. The modes
alternate per training length on the same service, env and vLLM. Reports seconds per step and
steps per hour for each, their ratio, and each pulled group's lag (no policy update lands here, so
0). refenv and the service are started here and stopped in a `finally`; vLLM is the one given.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import record  # noqa: E402

from rollout_service import ndjson  # noqa: E402
from rollout_service.launch.stack import ManagedProcess, refenv_command, service_command, start_listening  # noqa: E402


def ndjson_lines(client: httpx.Client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json=body, timeout=3600) as response:
        if response.status_code >= 400:
            raise RuntimeError(f"{path}: {response.status_code} {response.read()[:500]!r}")
        return [json.loads(line) for line in ndjson.lines(response.iter_bytes()) if line.strip()]


def run_sync(client: httpx.Client, template: dict, groups: int, steps: int, train_s: float) -> list[float]:
    walls = []
    for _ in range(steps):
        started = time.monotonic()
        lines = ndjson_lines(client, "/groups/sample", {"count": groups, "filter": "none", "group": template})
        assert sum("group" in line for line in lines) == groups, lines[-1]
        time.sleep(train_s)  # the stand-in training step
        walls.append(time.monotonic() - started)
    return walls


def run_overlapped(
    client: httpx.Client, template: dict, groups: int, steps: int, train_s: float
) -> tuple[list[float], list[int]]:
    created = client.post("/samplers", json={"buffer": 2 * groups, "filter": "none", "group": template})
    created.raise_for_status()
    stream = created.json()["id"]
    walls, lags = [], []
    try:
        for _ in range(steps):
            started = time.monotonic()
            lines = ndjson_lines(client, f"/samplers/{stream}/pull", {"count": groups})
            handed = [line for line in lines if "group" in line]
            assert len(handed) == groups, lines[-1]
            lags += [line["lag"] for line in handed]
            time.sleep(train_s)
            walls.append(time.monotonic() - started)
    finally:
        client.delete(f"/samplers/{stream}")
    return walls, lags


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm", default=os.environ.get("ROLLOUT_TEST_VLLM_URL", "http://127.0.0.1:18000"))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--train-s", type=float, nargs="+", default=[5.0, 20.0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--pool", type=int, default=8)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="overlap-"))
    started: list[ManagedProcess] = []
    template = {
        "n": args.n,
        "max_turns": args.max_turns,
        "retries": 0,
        "sampling": {"temperature": 1.0, "max_tokens": args.max_tokens},
    }
    figures = []
    try:

        def start(name: str, cmd: list[str]) -> str:
            return start_listening(f"overlap-{name}", cmd, logs, started, timeout_s=120).url

        env_url = start("refenv", refenv_command(0, "--pool", str(args.pool), step=True))
        service_url = start("service", service_command(0, [env_url], args.vllm, model=args.model))
        with httpx.Client(base_url=service_url, timeout=3600) as client:
            for train_s in args.train_s:
                sync = run_sync(client, template, args.groups, args.steps, train_s)
                overlapped, lags = run_overlapped(client, template, args.groups, args.steps, train_s)
                # The first overlapped step waits for a cold buffer as a synchronous one does: steady state
                # is what a run of many steps sees, so both are reported.
                row = {
                    "train_s": train_s,
                    "sync_step_s": [round(w, 2) for w in sync],
                    "overlapped_step_s": [round(w, 2) for w in overlapped],
                    "sync_steps_per_hour": round(3600 / statistics.mean(sync), 1),
                    "overlapped_steps_per_hour": round(3600 / statistics.mean(overlapped), 1),
                    "overlapped_steps_per_hour_after_first": round(
                        3600 / statistics.mean(overlapped[1:] or overlapped), 1
                    ),
                    "lags": lags,
                }
                row["speedup"] = round(row["overlapped_steps_per_hour"] / row["sync_steps_per_hour"], 3)
                figures.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for proc in reversed(started):
            proc.stop()
    rows = [
        {
            "training step (s)": row["train_s"],
            "synchronous steps/hour": row["sync_steps_per_hour"],
            "overlapped steps/hour": row["overlapped_steps_per_hour"],
            "overlapped after the first step": row["overlapped_steps_per_hour_after_first"],
            "speed-up": row["speedup"],
            "synchronous step (s)": row["sync_step_s"],
            "overlapped step (s)": row["overlapped_step_s"],
            "lags": row["lags"],
        }
        for row in figures
    ]
    result = record.make(
        "overlap",
        "Generation while training: GRPO steps per hour, synchronous vs a sampler stream",
        rows,
        notes=f"stand-in training step (a sleep); {args.groups} groups of n={args.n} per step; vLLM {args.vllm} "
        f"serving {args.model}",
    )
    out = args.json or record.RESULTS / f"overlap-{result['date']}.json"
    record.write(result, out)
    print(f"wrote {out} (process logs in {logs})")


if __name__ == "__main__":
    main()
