"""The agent lane (docs/agents.md): agent servers that drive their own episodes, calling the model
through the per-attempt endpoint, with the tokens kept exact.

Real parts: the service, the shared embedded vLLM, and a real agent server over HTTP
(tests/agent_server.py, written with the `openai` client). The stand-in is the tool-call model
(tests/tool_call_model.py): the real vLLM behind a proxy that makes the first turn sample a
`<tool_call>` block (a structured-output regex), which the small model would not write on its own.
The oracles: the tokenizer of the model files (transformers) and the model itself in float32
(helpers.assert_logprobs_are_the_policys), the agent server's own counters and what its client got.
"""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import pytest
from helpers import assert_accounted, assert_logprobs_are_the_policys, wait_until

from rollout_service.launch import embedded_model

MODEL = embedded_model.MODEL_NAME
AGENT_SERVER = Path(__file__).with_name("agent_server.py")
TOOL_CALL_MODEL = Path(__file__).with_name("tool_call_model.py")
SAMPLING = {"temperature": 0.8, "max_tokens": 24, "seed": 11}


@pytest.fixture
def start_agent(launch):
    """start_agent(mode, *flags) -> Running: tests/agent_server.py in `mode`."""

    def start(mode: str, *flags: str):
        return launch("agent", None, [sys.executable, str(AGENT_SERVER), "--port", "0", "--mode", mode, *flags])

    return start


def counters(agent) -> dict:
    return httpx.get(f"{agent.url}/counters", timeout=10).json()


def run_group(service, body: dict, timeout: float = 300) -> dict:
    answer = httpx.post(f"{service.url}/groups", json=body, timeout=timeout)
    assert answer.status_code == 200, answer.text
    group = answer.json()
    assert_accounted(group)
    return group


def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_model.cache_dir()))


def assert_exact(attempt: dict, tok) -> None:
    """Each segment: its spans hold each turn's sampled ids as they were sampled, the mask is 1 on them
    alone, and each turn's prompt is the segment up to its span (what the model was given)."""
    assert attempt["tokens"] == "exact"
    for turn in attempt["turns"]:
        segment = attempt["trajectory"][turn["segment"]]
        span = next(s for s in segment["turns"] if s["turn"] == turn["index"])
        assert segment["token_ids"][span["start"] : span["end"]] == turn["completion_token_ids"]
        assert tok.decode(turn["completion_token_ids"], skip_special_tokens=True) == turn["completion"]
        assert turn["prompt_tokens"] == span["start"]
    for segment in attempt["trajectory"]:
        assert len(segment["loss_mask"]) == len(segment["logprobs"]) == len(segment["token_ids"])
        sampled = {i for s in segment["turns"] for i in range(s["start"], s["end"])}
        assert {i for i, m in enumerate(segment["loss_mask"]) if m} == sampled
        assert all((lp is None) == (not m) for lp, m in zip(segment["logprobs"], segment["loss_mask"], strict=True))


def test_a_group_on_an_agent_server_is_exact_and_its_logprobs_are_the_policys(start_agent, start_service):
    """n=4 attempts, each a three-call conversation the agent keeps itself (its history as the openai
    client returned it): one segment per attempt, every turn appended to it, each sampled id where it
    was sampled, the logprobs the model's own (transformers, float32); the worlds back at the end.
    Break tried: messages.template_messages rendering the agent's assistant message as it came (not
    the sampled text): identical here, so the break used was `returned_key` ignoring content -> the
    sampled text of another turn is put back, the prefix breaks and each attempt has 3 segments."""
    agent = start_agent("chat", "--turns", "3")
    service = start_service([agent.url])
    group = run_group(service, {"task_id": "count-1", "n": 4, "sampling": SAMPLING, "max_turns": 6})
    tok = tokenizer()
    for attempt in group["attempts"]:
        assert attempt["status"] == "scored", attempt.get("failure")
        assert len(attempt["turns"]) == 3 and len(attempt["trajectory"]) == 1, attempt["trajectory"]
        assert attempt["agent"]["calls"] == 3 and attempt["agent"]["refused"] == 0
        assert_exact(attempt, tok)
        # What the agent got back is what was sampled: its answer lists its replies.
        assert attempt["answer"] == [t["completion"] for t in attempt["turns"]]
    assert_logprobs_are_the_policys(group["attempts"])
    seen = counters(agent)
    assert seen["runs"] == 4 and seen["answered"] == 4 and seen["running"] == 0 and seen["deleted"] == []
    # Each run was told the group's limits and sampling.
    assert all(r["limits"]["max_turns"] == 6 and r["sampling"]["max_tokens"] == 24 for r in seen["requests"])
    # Its tokens are revoked: a late call with a run's own token is 410.
    base_url, token = next(iter(seen["tokens"].values()))
    late = httpx.post(f"{base_url}/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]},
                      headers={"authorization": f"Bearer {token}"})  # fmt: skip
    assert late.status_code == 410 and late.json()["error"]["code"] == "attempt_ended", late.text
    assert wait_until(lambda: counters(agent)["running"] == 0, timeout_s=10)
