"""The example agent server (examples/agents/server.py) over HTTP, against a real refenv lending it worlds.

The model is tests/tool_model.py, a scripted OpenAI-compatible stand-in: the real embedded model does not
call tools on demand, and these tests need tool calls, bad tool calls, a hang and a failure on cue. The
oracle for worlds is refenv's own health (leased worlds, its episode counters), not the agent's word."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import httpx
import pytest
from helpers import assert_accounted, assert_env_accounted, unclaimed_ports, wait_until
from tool_model import FAIL, HANG, ToolModel, call, call_raw, text

ROOT = Path(__file__).resolve().parents[1]
SERVER = ROOT / "examples" / "agents" / "server.py"


def start_agent(launch, refenv_url: str):
    cmd = [sys.executable, str(SERVER), "--refenv", refenv_url, "--listen", "127.0.0.1:0"]
    return launch("agent", None, cmd, {**os.environ, "PYTHONPATH": str(ROOT)})


def run_body(base_url: str, attempt_id: str = "g-1-a0", task_id: str = "t001", **limits) -> dict:
    return {
        "attempt_id": attempt_id,
        "task_id": task_id,
        "base_url": base_url,
        "api_key": "key-of-this-attempt",
        "model": "scripted-tools",
        "sampling": {"temperature": 0.7, "max_tokens": 64, "top_k": 5},
        "limits": {"max_turns": 8, **limits},
        "reward_profile": "rl",
    }


def post_run(agent_url: str, body: dict, timeout: float = 60) -> httpx.Response:
    return httpx.post(f"{agent_url}/run", json=body, timeout=timeout)


def settled(refenv) -> dict:
    """refenv's health once no world is leased, its counters checked."""
    assert wait_until(lambda: refenv.health()["leased"] == 0, timeout_s=10), refenv.health()
    health = refenv.health()
    assert health["tool_worlds"] == 0
    assert_env_accounted(health)
    return health


def test_health_and_tasks_are_refenvs_as_an_agent_servers(start_refenv, launch):
    refenv = start_refenv("--pool", "3")
    agent = start_agent(launch, refenv.url)
    health = agent.health()
    assert health["status"] == "ready" and health["capabilities"]["drive_modes"] == ["agent"]
    assert health["workers"] == health["capabilities"]["pool"] == 3
    assert health["tasks"] == refenv.health()["tasks"] and health["dataset"] == refenv.health()["dataset"]
    assert httpx.get(f"{agent.url}/tasks").json() == httpx.get(f"{refenv.url}/tasks").json()


def test_the_tool_loop_solves_a_task_in_a_lent_world(start_refenv, launch):
    refenv = start_refenv("--pool", "1")
    agent = start_agent(launch, refenv.url)
    script = [call("list_tables"), call("run_sql", sql="SELECT COUNT(*) FROM customers"), call("submit", answer="20")]
    with ToolModel(script) as model:
        final = post_run(agent.url, run_body(model.url, task_id="t005")).json()
    assert final["attempt_id"] == "g-1-a0" and final["task_id"] == "t005" and final["done"] is True
    assert final["status"] == "completed" and final["pass"] is True and final["reward"] > 0, final
    first, *_, last = model.requests
    assert len(model.requests) == 3
    assert {t["function"]["name"] for t in first["tools"]} == {"list_tables", "run_sql", "submit"}
    assert first["model"] == "scripted-tools" and first["temperature"] == 0.7 and first["top_k"] == 5
    assert set(model.authorizations) == {"Bearer key-of-this-attempt"}
    # The agent's own history: each tool call answered by its result, the statement's count among them.
    roles = [m["role"] for m in last["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "tool"], roles
    assert "customers(id, name" in last["messages"][3]["content"]
    assert last["messages"][5]["content"].splitlines()[-1].strip() == "20"
    assert last["messages"][5]["tool_call_id"] == last["messages"][4]["tool_calls"][0]["id"]
    assert final["score"]["tokens"]["llm_calls"] == 3 and final["score"]["tokens"]["prompt"] == 300
    health = settled(refenv)
    assert health["episodes"]["finished"] == 1 and health["episodes"]["abandoned"] == 0


def test_tool_errors_are_shown_to_the_model_and_text_is_the_answer(start_refenv, launch):
    refenv = start_refenv("--pool", "1")
    agent = start_agent(launch, refenv.url)
    script = [
        call_raw("run_sql", "SELECT 1"),  # arguments that are not JSON
        call("drop_everything"),
        call("run_sql", query="SELECT 1"),  # no `sql`
        call("run_sql", sql="SELECT * FROM nope"),
        text("paid"),
    ]
    with ToolModel(script) as model:
        final = post_run(agent.url, run_body(model.url, task_id="t001")).json()
    shown = [r["messages"][-1] for r in model.requests[1:]]
    assert all(m["role"] == "tool" for m in shown), shown
    # Break tried: _tool let ToolError out (no `except ToolError`): the run failed with a 500
    # (episode_failed) at the unknown tool instead of showing the model the error.
    assert "not a JSON object" in shown[0]["content"]
    assert "there is no tool 'drop_everything'" in shown[1]["content"]
    assert 'run_sql takes {"sql"' in shown[2]["content"]
    assert shown[3]["content"].startswith("Error:") and "no such table" in shown[3]["content"]
    # The reply without a tool call was the answer, submitted and graded by refenv.
    assert final["status"] == "completed" and final["answer"] == "paid" and final["pass"] is True, final
    assert final["score"]["tool_errors"] == 3
    assert settled(refenv)["episodes"]["finished"] == 1


def test_max_turns_ends_the_loop_and_the_world_is_graded(start_refenv, launch):
    refenv = start_refenv("--pool", "1")
    agent = start_agent(launch, refenv.url)
    with ToolModel([call("list_tables")]) as model:
        final = post_run(agent.url, run_body(model.url, task_id="t005", max_turns=3)).json()
    # Break tried: the loop ran `for _ in range(limits.max_turns + 1)`: 4 requests.
    assert len(model.requests) == 3
    assert final["status"] == "no_answer" and "pass" not in final and final["done"] is True, final
    # The token budget counts sampled tokens: the stand-in samples 10 a call (and reports 100 of prompt),
    # so a budget of 25 allows 3 calls. Break tried: the budget held against prompt + completion (the
    # first call's 110 spent it): 1 call.
    with ToolModel([call("list_tables")]) as model:
        final = post_run(agent.url, run_body(model.url, task_id="t005", max_tokens_total=25)).json()
    assert len(model.requests) == 3 and final["status"] == "no_answer", final
    assert settled(refenv)["episodes"]["finished"] == 2


def test_delete_stops_the_run_and_gives_its_world_back(start_refenv, launch):
    refenv = start_refenv("--pool", "1")
    agent = start_agent(launch, refenv.url)
    answers: list[httpx.Response] = []
    with ToolModel([call("run_sql", sql="SELECT 1"), HANG]) as model:
        running = threading.Thread(target=lambda: answers.append(post_run(agent.url, run_body(model.url))))
        running.start()
        assert wait_until(lambda: len(model.requests) == 2, timeout_s=20)
        assert refenv.health()["leased"] == 1
        stopped = httpx.delete(f"{agent.url}/run/g-1-a0", timeout=30)
        assert stopped.json() == {"attempt_id": "g-1-a0", "done": True, "status": "abandoned"}
        # DELETE answers once the world is back: refenv's own counters show it at once, not eventually.
        # Break tried: solve's `finally` did not abandon the world: leased stayed 1 until refenv's idle
        # deadline (5 min).
        health = refenv.health()
        assert health["leased"] == 0 and health["episodes"]["abandoned"] == 1, health
        running.join(timeout=20)
    assert answers[0].json()["status"] == "abandoned"
    assert httpx.delete(f"{agent.url}/run/g-1-a0", timeout=10).status_code == 410
    runs = agent.health()["runs"]
    assert runs["live"] == 0 and runs["abandoned"] == 1 and runs["started"] == 1
    settled(refenv)


def test_a_run_past_its_timeout_is_a_504_and_releases_its_world(start_refenv, launch):
    refenv = start_refenv("--pool", "1")
    agent = start_agent(launch, refenv.url)
    with ToolModel([HANG]) as model:
        answer = post_run(agent.url, run_body(model.url, timeout_s=1))
    assert answer.status_code == 504 and answer.json()["error"] == "episode_timeout", answer.text
    assert refenv.health()["episodes"]["abandoned"] == 1
    settled(refenv)


def test_a_crashed_model_endpoint_ends_the_run_as_a_transport_error(start_refenv, launch):
    refenv = start_refenv("--pool", "1")
    agent = start_agent(launch, refenv.url)
    nowhere = f"http://127.0.0.1:{unclaimed_ports()}/v1"  # nothing listens: a model server that is down
    final = post_run(agent.url, run_body(nowhere, attempt_id="a-down")).json()
    assert final["status"] == "failed" and final["score"]["failure_category"] == "transport_error", final
    assert "reward" not in final or final["reward"] == 0.0
    with ToolModel([call("run_sql", sql="SELECT 1"), FAIL]) as model:
        final = post_run(agent.url, run_body(model.url, attempt_id="a-500")).json()
    assert final["score"]["failure_category"] == "transport_error" and "500" in final["score"]["failure_detail"]
    assert len(model.requests) == 2
    health = settled(refenv)
    # Each run's world went back by DELETE (abandoned), never graded as the policy's answer.
    assert health["episodes"]["abandoned"] == 2 and health["episodes"]["finished"] == 0
    assert agent.health()["runs"]["failed"] == 2


def test_bad_requests_get_the_contracts_errors(start_refenv, launch):
    refenv = start_refenv("--pool", "1")
    agent = start_agent(launch, refenv.url)
    with ToolModel([text("x")]) as model:
        cases = [
            ({}, 400, "invalid_body"),
            ({**run_body(model.url), "limits": {"max_turns": 0}}, 400, "invalid_body"),
            (run_body(model.url, task_id="t999"), 404, "unknown_task"),
            ({**run_body(model.url), "reward_profile": "nope"}, 400, "invalid_body"),
        ]
        for body, status, code in cases:
            answer = post_run(agent.url, body)
            assert (answer.status_code, answer.json()["error"]) == (status, code), (body, answer.text)
        assert not model.requests
    assert httpx.post(f"{agent.url}/run", content=b"[1", timeout=10).json()["error"] == "invalid_body"
    assert httpx.delete(f"{agent.url}/run/nobody", timeout=10).status_code == 410
    assert settled(refenv)["episodes"]["started"] == 0


def test_a_group_through_the_service_runs_the_example_agent_on_the_real_model(start_refenv, launch, start_service):
    """End to end with real parts only: refenv lending worlds, the example agent server, the service (its
    per-attempt endpoint) and the shared embedded vLLM. The 135M model rarely calls a tool: whatever it
    does, every attempt is graded by refenv or attributed, and every world is back."""
    refenv = start_refenv("--pool", "4")
    agent = start_agent(launch, refenv.url)
    service = start_service([agent.url])
    body = {"task_id": "t001", "n": 4, "sampling": {"temperature": 1.0, "max_tokens": 48, "seed": 5}, "max_turns": 3}
    answer = httpx.post(f"{service.url}/groups", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    group = answer.json()
    assert_accounted(group)
    assert group["n"] == 4 and len(group["attempts"]) == 4
    for attempt in group["attempts"]:
        assert attempt["status"] == "scored" or attempt["failure"]["attribution"], attempt
        assert attempt["turns"], attempt  # each attempt called the model through its endpoint
        if attempt["status"] == "scored":
            # refenv's rl reward for a vocabulary task, from its published weights: 0.7 ground truth,
            # 0.2 method (a vocabulary task needs no query), 0.1 behavior (an answer, no spent budget).
            # Break tried: the agent server dropped `reward` from its final form: every reward was 0.0.
            expected = 0.7 * bool(attempt["pass"]) + 0.2 + 0.1 * bool(attempt["answer"])
            assert attempt["reward"] == pytest.approx(expected), attempt
    health = settled(refenv)
    # The agent server's workers are refenv's pool: the service never had more runs going than worlds.
    assert health["max_waiting"] == 0 and health["max_leased"] <= 4
    # One lent world per attempt, each graded by submit or given back by a failed run.
    assert health["episodes"]["started"] == 4
    assert health["episodes"]["finished"] == sum(a["status"] == "scored" for a in group["attempts"])
    assert health["episodes"]["finished"] + health["episodes"]["abandoned"] == 4
    runs = agent.health()["runs"]
    assert runs["started"] == 4 and runs["live"] == 0


def test_a_caller_that_hangs_up_stops_its_run(start_refenv, launch):
    refenv = start_refenv("--pool", "1")
    agent = start_agent(launch, refenv.url)
    with ToolModel([HANG]) as model:
        try:
            post_run(agent.url, run_body(model.url), timeout=2)
        except httpx.ReadTimeout:
            pass
        # Break tried: POST /run awaited its run without watching for the caller leaving: the run went on
        # hanging on the model, its world leased until refenv's idle deadline.
        assert wait_until(lambda: refenv.health()["episodes"]["abandoned"] == 1, timeout_s=10), refenv.health()
        settled(refenv)
        runs = agent.health()["runs"]
        assert runs["live"] == 0 and runs["abandoned"] == 1


def test_an_env_that_is_gone_ends_the_run_as_an_environment_failure(start_refenv, launch):
    refenv = start_refenv("--pool", "1")
    agent = start_agent(launch, refenv.url)
    refenv.proc.stop()
    with ToolModel([text("paid")]) as model:
        final = post_run(agent.url, run_body(model.url)).json()
        assert not model.requests  # no world, no episode: the model was never asked
    assert final["status"] == "failed" and final["score"]["failure_category"] == "environment_failure", final
    # Its health says so, as the contract's error (a 503 the service reads as an env not ready), not a 500.
    health = httpx.get(f"{agent.url}/health", timeout=10)
    assert health.status_code == 503 and health.json()["error"] == "env_unavailable", health.text


TOOL_CALL_MODEL = ROOT / "tests" / "tool_call_model.py"


def test_the_example_agent_runs_the_tool_calls_the_service_parses(start_refenv, launch, start_service, vllm_url):
    """The real vLLM behind tests/tool_call_model.py (a proxy that makes the first turn of each attempt
    sample `<tool_call>{"name": "list_tables", ...}</tool_call>`: the embedded model would not write
    one): the service parses it into OpenAI tool_calls, the example agent runs list_tables on refenv
    and sends back its result, the next turn goes on from there, and refenv grades the episode."""
    proxy = [sys.executable, str(TOOL_CALL_MODEL), "--port", "0", "--upstream", vllm_url]
    model = launch("model", None, proxy, ready_path="/stats")
    refenv = start_refenv("--pool", "4")
    agent = start_agent(launch, refenv.url)
    service = start_service([agent.url], vllm=model.url)
    body = {"task_id": "t001", "n": 4, "sampling": {"temperature": 1.0, "max_tokens": 48, "seed": 3}, "max_turns": 3}
    answer = httpx.post(f"{service.url}/groups", json=body, timeout=300)
    assert answer.status_code == 200, answer.text
    group = answer.json()
    assert_accounted(group)
    for attempt in group["attempts"]:
        assert attempt["status"] == "scored", attempt.get("failure")
        first, second, *_ = attempt["turns"]
        assert first["completion"] == '<tool_call>{"name": "list_tables", "arguments": {}}</tool_call>'
        assert attempt["agent"]["tool_calls"] >= 1
        # The second call's history holds the tool's result as the agent sent it (refenv's schema), which
        # the service rendered in the template's convention (a <tool_response> block).
        # Break tried: the agent did not append its tool results to its history: no tool response here.
        last = second["messages"][-1]["content"]
        assert "<tool_response>" in last and "customers(id, name" in last, second["messages"]
        assert len(attempt["trajectory"]) == 1  # the agent only appended: one exact segment
    health = settled(refenv)
    assert health["episodes"]["started"] == 4 and health["episodes"]["finished"] == 4
    assert health["max_waiting"] == 0
