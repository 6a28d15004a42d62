"""refenv's learning suite over HTTP, with a real process: one-turn plain answers graded by the oracle
with partial credit, families split by instance (held-out instances of the families trained on), and
`--family` choosing families."""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from test_refenv_contract import play

SUITE = ("--suite", "learning")


def tasks_of(url: str) -> list[dict]:
    return httpx.get(f"{url}/tasks", timeout=10).json()["tasks"]


def test_a_plain_answer_is_graded_with_partial_credit_in_one_turn(start_refenv):
    env = start_refenv(*SUITE, "--family", "learn-order-status")
    task = tasks_of(env.url)[0]
    assert task["prompt"].startswith("Order ") and task["family"] == "learn-order-status"
    status = task["prompt"].split("'")[1]  # the prompt states it: "Order N has status 'S'. ..."
    other = "pending" if status != "pending" else "shipped"
    opened = httpx.post(f"{env.url}/step/reset", json={"task_id": task["task_id"]}, timeout=30).json()
    messages = opened["observation"]["messages"]
    assert "response_format" not in opened["observation"]  # free text: no JSON action asked for
    assert [m["role"] for m in messages] == ["system", "user"] and messages[1]["content"] == task["prompt"]
    assert httpx.delete(f"{env.url}/step/{opened['episode_id']}", timeout=30).status_code == 200

    cases = {
        f"'{status}'.": (1.0, True),  # the value alone: right and well-formed
        f"The status of the order is {status.upper()}.": (0.9, True),  # named in a sentence
        f"It is {status}, or maybe {other}.": (0.2, False),  # another value of the set named too
        "I do not know.": (0.2, False),
    }
    for completion, (reward, passed) in cases.items():
        final = play(env.url, task["task_id"], [completion])
        assert final["done"] and final["score"]["actor_turns"] == 1, final
        assert final.get("reward", 0.0) == pytest.approx(reward), (completion, final)
        assert final.get("pass", False) is passed, (completion, final)


def test_the_split_holds_out_instances_of_the_same_families(start_refenv):
    train = tasks_of(start_refenv(*SUITE, "--split", "auto:0.8", "--side", "train").url)
    evals = tasks_of(start_refenv(*SUITE, "--split", "auto:0.8", "--side", "eval").url)
    families = {t["family"] for t in train}
    assert {t["family"] for t in evals} == families and len(families) > 1
    assert not {t["task_id"] for t in train} & {t["task_id"] for t in evals}
    assert len(train) + len(evals) == start_refenv(*SUITE).health()["tasks"]
    assert len(evals) >= 60  # about a fifth of 100 per family: enough to measure on


def test_family_serves_only_those_families_and_names_an_unknown_one(start_refenv):
    env = start_refenv(*SUITE, "--family", "learn-add,learn-larger")
    assert {t["family"] for t in tasks_of(env.url)} == {"learn-add", "learn-larger"}
    cmd = [sys.executable, "-m", "refenv.cli", "serve", "--step", *SUITE, "--family", "learn-nothing"]
    refused = subprocess.run([*cmd, "--listen", "127.0.0.1:0"], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused
    assert "--family: no such family in the learning suite: learn-nothing" in refused.stderr
    assert "Traceback" not in refused.stderr
