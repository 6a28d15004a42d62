"""What reading a turn's answers costs the service, in instructions: counted, not timed, so that it
holds on a machine shared with others' work (the ceiling's CPU per turn there varies by ±15% from
run to run; the count by well under 1%).

    .venv/bin/python bench/decode_cost.py --trees /path/to/checkout-before . --record bench/results/NAME.json

Per tree (its `rollout_service` is the one imported) and completion length, a process reads the
answers of one exact turn as the tree's clients read them, from the bytes bench/standins.py's
instant stand-ins send: the model server's /v1/completions answer (ids as "token_id:<id>", one
logprob each) into a Completion, and the env's /step answer (a 100-token observation) into a
StepAnswer. It runs under valgrind's callgrind twice, for --few and --many reads; the difference
of the two counts over the difference of the reads is what one turn's reading costs, the process's
start and imports left out. Needs valgrind.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import record

ROOT = Path(__file__).resolve().parents[1]

# Run in the tree's own process: builds the stand-ins' answers, then reads them `reads` times as that
# tree's engine and env client do (before typed decoding: the body parsed to dicts, then read).
_CHILD = r"""
import asyncio, inspect, sys
sys.path.insert(0, sys.argv[4])
import orjson
from standins import Env, Model
from rollout_service.backends import answers, engine, env_client
from rollout_service.backends.transport import HttpAnswer

reads, tokens = int(sys.argv[1]), int(sys.argv[2])
prompt = list(range(2000))
completion = HttpAnswer(200, Model(tokens).handle(
    "POST", "/v1/completions", orjson.dumps({"prompt": prompt, "return_tokens_as_token_ids": True}))[1])
env = Env(pool=1, turns=4, prompt_tokens=2000, observation_tokens=100)
episode = orjson.loads(env.handle("POST", "/step/reset", b'{"task_id": "t1"}')[1])["episode_id"]
step = HttpAnswer(200, env.handle("POST", "/step", orjson.dumps(
    {"episode_id": episode, "completion": "w" * 400, "prompt_tokens": 2000, "completion_tokens": tokens}))[1])
typed = "parse_completion(response.json()" not in inspect.getsource(engine.VllmServer._generate)
if typed:
    read_completion = lambda a: answers.parse_completion(a, "e", "m", 0.1, prompt)
    read_step = lambda a: env_client._step_answer(a, "POST /step")
else:
    read_completion = lambda a: answers.parse_completion(a.json(), "e", "m", 0.1, prompt)
    read_step = lambda a: env_client._validate(env_client.StepAnswer, a.json())
assert read_completion(completion).choices[0].completion_token_ids == list(range(1000, 1000 + tokens))
assert read_step(step).observation is not None
for _ in range(reads):
    read_completion(completion)
    read_step(step)
"""


def _count(tree: Path, tokens: int, reads: int) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, "-c", _CHILD,
             str(reads), str(tokens), str(tree), str(ROOT / "bench")],
            cwd=tree, env={**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0"}, check=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        summary = re.search(r"^summary:\s+(\d+)", out.read_text(), re.MULTILINE)
        assert summary, "no summary in callgrind's output"
        return int(summary.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", type=Path, nargs="+", default=[ROOT], help="checkouts, the first the baseline")
    parser.add_argument("--completion-tokens", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--few", type=int, default=20)
    parser.add_argument("--many", type=int, default=120)
    parser.add_argument("--record", metavar="PATH", help="also write the rows as a benchmark record")
    args = parser.parse_args()
    trees = [tree.resolve() for tree in args.trees]
    rows = []
    for tokens in args.completion_tokens:
        base = None
        for tree in trees:
            per_turn = (_count(tree, tokens, args.many) - _count(tree, tokens, args.few)) / (args.many - args.few)
            base = base or per_turn
            row = {
                "tree": tree.name,
                "completion tokens": tokens,
                "instructions a turn": round(per_turn),
                "over the first tree": round(per_turn / base, 3),
            }
            rows.append(row)
            print(row, flush=True)
    if args.record:
        notes = (
            "One exact turn's answers read: the model server's completion (a 2,000-id prompt sent; the"
            " answer's ids as token_id strings, a logprob each) and the env's step (a 100-token observation),"
            f" {args.few} and {args.many} times under callgrind. Trees: "
            + ", ".join(f"`{tree.name}` = `{tree}`" for tree in trees)
            + "."
        )
        made = record.make("decode_cost", "Reading a turn's answers, in instructions", rows, notes=notes)
        print(f"record written to {record.write(made, args.record)}")


if __name__ == "__main__":
    main()
