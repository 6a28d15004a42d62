"""`rollout-service demo`: the whole system on this machine, and reward groups a person can read."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import httpx

from ..launch.stack import LocalStack, StackError
from ..trainer.client import RolloutClient, RolloutError

# Tasks where a 135M model's attempts differ, and some pass: one easy query away, or in the prompt.
DEMO_TASKS = ("t019", "t020", "t006", "t005", "t001", "t009", "t002", "t010")


def _say(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", flush=True)


def run_demo(args: argparse.Namespace) -> int:
    if args.groups < 1 or args.n < 1:
        print("demo: --groups and --n must be at least 1", file=sys.stderr)
        return 2
    stack = LocalStack(log_dir=Path("results/logs"), pool=args.pool, vllm_url=args.vllm, say=_say)
    try:
        with stack:
            return _run(stack, args)
    except StackError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ndemo: interrupted; every process it started is stopped", file=sys.stderr)
        return 130
    finally:
        _say("stopped every process the demo started")


def _run(stack: LocalStack, args: argparse.Namespace) -> int:
    with RolloutClient(stack.urls["service"]) as client:
        listed = {t["task_id"] for t in client.tasks()}
        # The demo's favourite tasks where the env serves them, else whatever it serves.
        pool = [t for t in DEMO_TASKS if t in listed] or sorted(listed)
        tasks = [pool[i % len(pool)] for i in range(args.groups)]
        requests = [
            {
                "task_id": t,
                "n": args.n,
                "sampling": {
                    "temperature": args.temperature,
                    "top_p": 1.0,
                    "max_tokens": args.max_tokens,
                    "seed": 1234 + i,
                },
            }
            for i, t in enumerate(tasks)
        ]
        _say(f"[demo] sending {args.groups} groups of n={args.n} at T={args.temperature} to POST /groups/batch")
        env_before = httpx.get(f"{stack.urls['env']}/health", timeout=10).json()
        groups: list[dict] = []
        started = time.monotonic()
        try:
            for item in client.groups(requests):
                if item.group is None:
                    _say(f"[demo] group {item.index} failed: {item.error}")
                    continue
                group = item.group.model_dump(mode="json", by_alias=True)
                groups.append(group)
                _say(f"[demo] group {len(groups)}/{args.groups} done ({time.monotonic() - started:.0f}s)")
                print(format_group(group), flush=True)
        except RolloutError as exc:
            print(f"demo: the service refused the batch: {exc}", file=sys.stderr)
            return 1
        wall = time.monotonic() - started
        env_after = httpx.get(f"{stack.urls['env']}/health", timeout=10).json()
        detail = client.health_detail()
    print(format_totals(groups, wall, env_before, env_after, detail), flush=True)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"groups": groups}, indent=1))
    _say(f"[demo] every group, in the POST /groups response shape: {args.json}")
    return 0 if groups else 1


def format_group(group: dict) -> str:
    c = group["counts"]
    head = (
        f"\n== {group['task_id']} {group['slug'][:48]}\n"
        f"   scored {c['scored']}/{c['scheduled']}  mean {_f(group['mean'])}  std {_f(group['std'])}  "
        f"pass rate {_f(group['pass_rate'])}  {group['wall_s']:.1f}s"
    )
    if group["all_equal"]:
        head += f"\n   ! {group['diagnosis']}"
    rows = ["   #  status             reward  advantage  pass  turns  answer"]
    for a in group["attempts"]:
        answer = a.get("answer")
        answer = "" if answer is None else str(answer).replace("\n", " ")[:30]
        rows.append(
            f"   {a['index']:<2} {a['status']:<18} {_f(a['reward']):>6}  {_f(a['advantage'], '+.3f'):>9}  "
            f"{'yes' if a.get('pass') else 'no':<4}  {len(a['turns']):>5}  {answer}"
        )
    return head + "\n" + "\n".join(rows)


def format_totals(groups: list[dict], wall: float, env_before: dict, env_after: dict, service_health: dict) -> str:
    scheduled = sum(g["counts"]["scheduled"] for g in groups)
    scored = sum(g["counts"]["scored"] for g in groups)
    policy_failed = sum(g["counts"]["policy_failed"] for g in groups)
    rewards = [r for g in groups for r in g["rewards"] if r is not None]
    tokens = sum(g["completion_tokens"] for g in groups)
    env_state = service_health["envs"][0]
    pool = env_state["pool"]
    busy = env_state.get("busy_world_seconds", 0.0)
    started = env_after["episodes"]["started"] - env_before["episodes"]["started"]
    lines = [
        "\n== totals",
        f"   groups {len(groups)}   attempts scheduled {scheduled}, scored {scored}, failed by the policy "
        f"{policy_failed}, unscorable {scheduled - scored - policy_failed}",
        f"   mean reward {_f(sum(rewards) / len(rewards) if rewards else None)}   "
        f"groups with all-equal rewards {sum(g['all_equal'] for g in groups)}",
        f"   {len(groups) / wall:.3f} groups/s   {tokens / wall:.1f} completion tokens/s   wall {wall:.1f}s",
        f"   env pool {pool}: kept {busy / (pool * wall):.0%} busy (world-seconds held / pool x wall), "
        f"at most {env_after['max_leased']} worlds held at once, {env_after['leased']} held now, "
        f"{started} episodes started",
    ]
    return "\n".join(lines)


def _f(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)
