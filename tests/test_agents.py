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

import concurrent.futures
import sys
from pathlib import Path

import agent_server
import httpx
import pytest
from helpers import assert_logprobs_are_the_policys, wait_until
from test_routing import post_group

from rollout_service.launch import embedded_model

MODEL = embedded_model.MODEL_NAME
TOOL_CALL_MODEL = Path(__file__).with_name("tool_call_model.py")
SAMPLING = {"temperature": 0.8, "max_tokens": 24, "seed": 11}


@pytest.fixture
def start_agent(launch):
    """start_agent(mode, *flags) -> Running: tests/agent_server.py in `mode`."""

    def start(mode: str, *flags: str):
        return launch("agent", None, agent_server.command(mode, *flags))

    return start


def counters(agent) -> dict:
    return httpx.get(f"{agent.url}/counters", timeout=10).json()


def run_group(service, body: dict) -> dict:
    return post_group(service, body, timeout=300)


def scored_group(start_agent, start_service, mode: str, body: dict) -> tuple[object, list[dict]]:
    """A group on a fresh agent server in `mode` (three calls a run): the server, and the group's
    attempts, each scored."""
    agent = start_agent(mode, "--turns", "3")
    group = run_group(start_service([agent.url]), {"n": 4, "sampling": SAMPLING, "max_turns": 6, **body})
    for attempt in group["attempts"]:
        assert attempt["status"] == "scored", attempt.get("failure")
    return agent, group["attempts"]


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
    Break tried: lane.episode without a trajectory (its turns sent as chat messages) -> no exact
    trajectory (attempt["trajectory"] is None)."""
    agent, attempts = scored_group(start_agent, start_service, "chat", {"task_id": "count-1"})
    tok = tokenizer()
    for attempt in attempts:
        assert len(attempt["turns"]) == 3 and len(attempt["trajectory"]) == 1, attempt["trajectory"]
        assert attempt["agent"]["calls"] == 3 and attempt["agent"]["refused"] == 0
        assert_exact(attempt, tok)
        # What the agent got back is what was sampled: its answer lists its replies.
        assert attempt["answer"] == [t["completion"] for t in attempt["turns"]]
    assert_logprobs_are_the_policys(attempts)
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


def test_an_agent_that_condenses_its_history_gets_labelled_segments_each_exact(start_agent, start_service):
    """The agent drops its first exchange from the third call on: that call opens a new segment cut
    `history_rewritten`, which says why, and each segment is exact on its own.
    Break tried: trajectory._rewritten answering None (no cut seen) -> the third turn is appended to
    the first segment (one segment, and its prompt is not what the model was given: a render mismatch)."""
    _, attempts = scored_group(start_agent, start_service, "rewrite", {"task_id": "name-2"})
    tok = tokenizer()
    for attempt in attempts:
        segments = attempt["trajectory"]
        assert [s["cut"] for s in segments] == [None, "history_rewritten"], [s["cut"] for s in segments]
        assert "differs" in segments[1]["cut_detail"] or "messages" in segments[1]["cut_detail"]
        assert [t["segment"] for t in attempt["turns"]] == [0, 0, 1]
        assert_exact(attempt, tok)
    assert_logprobs_are_the_policys(attempts)


@pytest.fixture
def tool_call_model(launch, vllm_url):
    return launch("model", None, [sys.executable, str(TOOL_CALL_MODEL), "--port", "0", "--upstream", vllm_url],
                  ready_path="/stats")  # fmt: skip


def test_tool_calls_round_trip_and_the_trained_tokens_are_the_sampled_ones(start_agent, start_service, tool_call_model):
    """The stand-in model samples `<tool_call>{...}</tool_call>` on the first turn: the agent's openai
    client gets it as tool_calls (name, arguments, an id), sends it back with the tool's result, and
    the second turn goes on in the same segment from the very ids sampled (the stand-in's record), not
    a re-render of the parsed call.
    Break tried: messages.template_messages ignoring `returned` (the agent's message re-rendered with
    render_tool_call) -> the second turn opens a new segment cut history_rewritten."""
    agent = start_agent("tools")
    service = start_service([agent.url], vllm=tool_call_model.url)
    group = run_group(service, {"task_id": "count-1", "n": 4, "sampling": {**SAMPLING, "max_tokens": 48}})
    # Less the service's one-token probe of token prompts at start.
    forced = [ids for ids in httpx.get(f"{tool_call_model.url}/stats").json()["forced"] if len(ids) > 1]
    assert len(forced) == 4
    tok = tokenizer()
    for attempt in group["attempts"]:
        assert attempt["status"] == "scored", attempt.get("failure")
        calls = attempt["answer"]["tool_calls"]
        assert [(c["name"], c["arguments"]) for c in calls] == [("list_tables", "{}")], calls
        assert calls[0]["id"].startswith("call_")
        assert attempt["answer"]["texts"][0] is None  # nothing but the call: no content
        first, second = attempt["turns"]
        assert first["completion"] == '<tool_call>{"name": "list_tables", "arguments": {}}</tool_call>'
        assert first["completion_token_ids"] in forced  # the ids trained are the ids sampled
        assert second["segment"] == first["segment"] == 0 and len(attempt["trajectory"]) == 1
        segment = attempt["trajectory"][0]
        # Between the two turns: the template's end of turn, the tool's result as a user turn, the prompt.
        between = tok.decode(segment["token_ids"][segment["turns"][0]["end"] : segment["turns"][1]["start"]])
        assert "<tool_response>\nusers, orders\n</tool_response>" in between, between
        assert "list_tables" in tok.decode(segment["token_ids"][: segment["prompt_tokens"]])  # the tools, told
        assert attempt["agent"]["tool_calls"] == 1 and attempt["agent"]["tool_calls_unparsed"] == 0
        assert_exact(attempt, tok)


def test_the_model_endpoint_takes_the_attempts_token_alone(start_agent, start_service):
    """With keys on both planes: on a running attempt's endpoint neither the trainers' key nor the
    operators' nor no key is taken (401); the attempt's own token is (a turn, and /models); its routes
    are on the agent plane in the schema.
    Break tried: agent_routes declared on the data plane -> the attempt's own token is refused by the
    planes' check (401), and the trainers' key reaches the route."""
    keys = {"TEST_DATA_KEY": "trainer-key", "TEST_ADMIN_KEY": "operator-key"}
    agent = start_agent("slow")
    service = start_service(
        [agent.url], "--api-key-env", "TEST_DATA_KEY", "--admin-key-env", "TEST_ADMIN_KEY", env=keys
    )
    trainer = {"authorization": "Bearer trainer-key"}
    body = {"task_id": "count-1", "n": 1, "sampling": SAMPLING, "timeout_s": 20, "retries": 0}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        group = pool.submit(httpx.post, f"{service.url}/groups", json=body, headers=trainer, timeout=120)
        assert wait_until(lambda: counters(agent)["tokens"], timeout_s=30)
        ((base_url, token),) = counters(agent)["tokens"].values()
        call = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
        for key in ("trainer-key", "operator-key", None):
            headers = {"authorization": f"Bearer {key}"} if key else {}
            refused = httpx.post(f"{base_url}/chat/completions", json=call, headers=headers)
            assert refused.status_code == 401, (key, refused.text)
            assert httpx.get(f"{base_url}/models", headers=headers).status_code == 401
        own = {"authorization": f"Bearer {token}"}
        served = httpx.post(f"{base_url}/chat/completions", json=call, headers=own, timeout=60)
        assert served.status_code == 200, served.text
        assert served.json()["choices"][0]["message"]["role"] == "assistant"
        assert httpx.get(f"{base_url}/models", headers=own).json()["data"][0]["id"] == MODEL
        schema = httpx.get(f"{service.url}/openapi.json", headers=trainer).json()
        planes = {path: op["x-plane"] for path, item in schema["paths"].items() for op in item.values()}
        assert planes["/agent/{attempt_id}/v1/chat/completions"] == planes["/agent/{attempt_id}/v1/models"] == "agent"
        answer = group.result().json()
    (attempt,) = answer["attempts"]
    assert attempt["failure"]["kind"] == "deadline" and len(attempt["turns"]) == 1
