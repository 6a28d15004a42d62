"""The base model on the learning suite's candidate families, through the service: which family gives
GRPO a signal from its first step (docs/trl.md, "The task family").

    python bench/learning_family.py --vllm http://127.0.0.1:18000 --tasks 24 --n 4 \
        --out bench/results/learning-family.json

Starts refenv (`--suite learning`, training side) and the service with the CLI against a running vLLM,
and asks each family's first `--tasks` tasks for groups of `--n` attempts as examples/trl_grpo.py does
(token prompts, no grammar constraint, temperature 1.0, at most 2 model calls of `--max-tokens`). Per
family: the pass rate graded by refenv's oracle (Wilson 95 % interval), the mean reward (partial credit)
with its interval, and the share of groups whose rewards differ (the groups GRPO learns from).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record

from refenv.learning import FAMILIES
from rollout_service.launch.stack import LocalStack
from rollout_service.tools.measure import mean_interval, wilson_interval
from rollout_service.trainer import RolloutClient


def family_row(family: str, groups: list) -> dict:
    attempts = [a for g in groups for a in g.attempts if a.reward is not None]
    passes = sum(bool(a.pass_) for a in attempts)
    rewards = [a.reward for a in attempts]
    lo, hi = wilson_interval(passes, len(attempts))
    ci = mean_interval(rewards)
    spread = [g for g in groups if len({a.reward for a in g.attempts if a.reward is not None}) > 1]
    turns = [len(a.turns) for g in groups for a in g.attempts]
    return {
        "family": family,
        "attempts": len(attempts),
        "unscored": sum(len(g.attempts) for g in groups) - len(attempts),
        "pass_rate": round(passes / len(attempts), 3) if attempts else None,
        "pass_ci95": f"{lo:.2f}..{hi:.2f}",
        "mean_reward": round(statistics.mean(rewards), 3) if rewards else None,
        "reward_ci95": f"{ci[0]:.2f}..{ci[1]:.2f}" if ci else "-",
        "groups_with_spread": f"{len(spread)}/{len(groups)}",
        "mean_turns": round(statistics.mean(turns), 2) if turns else None,
        "completion_tokens": sum(g.completion_tokens for g in groups),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", required=True, help="a running vLLM serving the embedded model")
    parser.add_argument("--tasks", type=int, default=24, help="tasks per family")
    parser.add_argument("--n", type=int, default=4, help="attempts per task (a group)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of the groups")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    families = args.families.split(",")
    with tempfile.TemporaryDirectory() as logs:
        stack = LocalStack(
            log_dir=Path(logs),
            pool=8,
            vllm_url=args.vllm,
            refenv_args=["--suite", "learning", "--split", "auto:0.8", "--side", "train", "--family", args.families],
        )
        with stack, RolloutClient(stack.urls["service"]) as client:
            client.wait_ready(timeout_s=120)
            by_family: dict[str, list[str]] = defaultdict(list)
            for task in client.tasks():  # the learning suite's ids: <family without learn->-<k>
                by_family["learn-" + task["task_id"].rsplit("-", 1)[0]].append(task["task_id"])
            rows = []
            for family in families:
                requests = [
                    {
                        "task_id": task_id,
                        "n": args.n,
                        "tokens": "exact",
                        "constrained": False,
                        "max_turns": 2,
                        "sampling": {"temperature": 1.0, "max_tokens": args.max_tokens, "seed": args.seed},
                    }
                    for task_id in sorted(by_family[family])[: args.tasks]
                ]
                groups = [item.group for item in client.groups(requests) if item.group is not None]
                rows.append(family_row(family, groups))
                print(rows[-1], flush=True)
    if args.out:
        notes = (
            "SmolLM2-135M-Instruct (the embedded model) on the learning suite's training side; temperature 1.0, "
            f"no grammar constraint, token prompts, one model call of at most {args.max_tokens} tokens per attempt. "
            "Pass: refenv's oracle (the answer names the expected value and no other of the family's set); "
            "reward: refenv's rl profile (0.7 right answer + 0.2 method + 0.1 the value alone)."
        )
        record.write(record.make("learning-family", "Base model on the learning suite's families", rows, notes=notes),
                     args.out)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
