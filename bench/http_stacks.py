"""The HTTP stacks the service could speak to envs and model servers with, side by side; or the
service at two commits (before and after a change to its hot path).

    .venv/bin/python bench/http_stacks.py --rounds 5 --seconds 10 --out bench/results/http-stacks.json
    .venv/bin/python bench/http_stacks.py --stacks aiohttp before=/path/to/a/checkout-of-main ...

Runs bench/ceiling.py's measurement (instant stand-ins; see there) once per stack, configuration and
round, alternating: in each round every configuration (exact and chat turns; 128 and 1,024
completion tokens) is measured with each stack in turn, the order rotated from round to round, so
that the machine's other load falls on every stack alike. `aiohttp` is the service as it is, `httpx`
the service with its HTTP stack swapped for httpx (bench/stack_service.py), `before=DIR` the service
run from another checkout (its own code and stack). The record holds each run, the machine's load
average around it, and per round and configuration the ratio of each stack's service CPU per turn
to the first stack's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import record as bench_record
from ceiling import ROOT, measure  # bench/ is on the path when this runs as a script
from standins import REPLIES


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True, check=False)
    return out.stdout.strip() + ("+uncommitted" if dirty.stdout.strip() else "")


def _machine() -> dict:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpus": os.cpu_count(),
        "cpu_model": model,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


async def run(args: argparse.Namespace) -> dict:
    runs = []
    configs = [(tokens, ct) for tokens in args.tokens for ct in args.completion_tokens]
    for round_no in range(args.rounds):
        shift = round_no % len(args.stacks)
        order = args.stacks[shift:] + args.stacks[:shift]
        for tokens, ct in configs:
            for stack in order:
                one = argparse.Namespace(**vars(args))
                one.tokens = tokens
                if stack.startswith("before="):
                    tree = Path(stack.removeprefix("before="))  # made absolute in main()
                    one.service_cwd, one.service_env = tree, {"PYTHONPATH": str(tree)}
                else:
                    one.service_entry = [str(ROOT / "bench" / "stack_service.py")]
                    one.service_env = {"ROLLOUT_BENCH_HTTP_STACK": stack}
                load_before = os.getloadavg()[0]
                row = await measure(one, args.in_flight, ct)
                row.update(
                    stack=stack,
                    round=round_no,
                    load1_before=round(load_before, 2),
                    load1_after=round(os.getloadavg()[0], 2),
                )
                runs.append(row)
                print(
                    f"round {round_no} {tokens:>5} {ct:>5} {stack:>8}: {row['service_cpu_ms_per_turn']:>7} ms/turn "
                    f"{row['turns_per_s']:>8} turns/s  load {row['load1_before']}  limit {row['limit']}",
                    flush=True,
                )
    ratios = []
    base = args.stacks[0]
    for round_no in range(args.rounds):
        for tokens, ct in configs:
            mine = {
                r["stack"]: r
                for r in runs
                if r["round"] == round_no and r["tokens"] == tokens and r["completion_tokens"] == ct
            }
            ratios.append(
                {
                    "round": round_no,
                    "tokens": tokens,
                    "completion_tokens": ct,
                    **{
                        f"{s}_cpu_over_{base}": round(
                            mine[s]["service_cpu_ms_per_turn"] / mine[base]["service_cpu_ms_per_turn"], 3
                        )
                        for s in args.stacks[1:]
                    },
                }
            )
    return {"runs": runs, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--stacks", nargs="+", default=["aiohttp", "httpx"], help="aiohttp, httpx or before=DIR")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", nargs="+", default=["exact", "chat"], choices=["exact", "chat"])
    parser.add_argument("--completion-tokens", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--in-flight", type=int, default=256)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--replies", choices=REPLIES, default="as-sampled")
    parser.add_argument("--queued", type=int, default=0)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--out", default="results/http-stacks.json", help="every run, as measured")
    parser.add_argument("--record", metavar="PATH", help="also write the pairs as a benchmark record (bench/record.py)")
    args = parser.parse_args()
    args.profile = None
    args.stacks = [f"before={Path(s[7:]).resolve()}" if s.startswith("before=") else s for s in args.stacks]
    os.chdir(ROOT)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    commit = _commit()
    figures = asyncio.run(run(args))
    record = {
        "command": "python bench/http_stacks.py "
        + " ".join(
            f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
            for k, v in vars(args).items()
            if k not in ("profile", "out", "record")
        ),
        "commit": commit,
        "machine": _machine(),
        "date": started,
        "finished": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        **figures,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(f"written to {args.out}")
    if args.record:
        trees = [f"before: the service run from `{s[7:]}`." for s in args.stacks if s.startswith("before=")]
        made = as_record(record, args.out, " ".join(trees))
        print(f"record written to {bench_record.write(made, args.record)}")


def as_record(raw: dict, raw_path: str, notes: str = "") -> dict:
    """The run (as --out writes it) as a benchmark record for the benchmarks pages: per round and
    configuration, each stack's service CPU per turn, the first stack's over each other's and the load;
    `notes` say what the stacks were (a `before=DIR` tree is shown as "before", or by its folder's name
    where there are several)."""
    stacks = list(dict.fromkeys(run["stack"] for run in raw["runs"]))
    trees = [stack for stack in stacks if stack.startswith("before=")]
    names = {stack: stack for stack in stacks}
    names.update({tree: "before" if len(trees) == 1 else Path(tree[7:]).name for tree in trees})
    rows = []
    for ratio in raw["ratios"]:
        mine = [
            r
            for r in raw["runs"]
            if (r["round"], r["tokens"], r["completion_tokens"])
            == (ratio["round"], ratio["tokens"], ratio["completion_tokens"])
        ]
        by_stack = {r["stack"]: r for r in mine}
        row = {"round": ratio["round"], "turns": ratio["tokens"], "completion tokens": ratio["completion_tokens"]}
        for stack in stacks:
            row[f"{names[stack]} CPU ms/turn"] = by_stack[stack]["service_cpu_ms_per_turn"]
        first = by_stack[stacks[0]]["service_cpu_ms_per_turn"]
        for stack in stacks[1:]:
            row[f"{names[stacks[0]]} / {names[stack]}"] = round(first / by_stack[stack]["service_cpu_ms_per_turn"], 3)
        loads = [r[k] for r in mine for k in ("load1_before", "load1_after")]
        row["load (1 min)"] = f"{min(loads)}–{max(loads)}"
        rows.append(row)
    made = bench_record.make(
        "http_stacks",
        f"Service CPU per turn, side by side: {', '.join(names[s] for s in stacks)}",
        rows,
        notes=f"{notes} Every run's figures: `{raw_path}`. The load is the machine's one-minute load average"
        " before and after the pair's runs.".strip(),
        argv=raw["command"].split(),
    )
    made.update(commit=raw["commit"][:7] + ("+uncommitted" if raw["commit"].endswith("+uncommitted") else ""),
                date=raw["date"][:10])  # fmt: skip
    return made


if __name__ == "__main__":
    main()
