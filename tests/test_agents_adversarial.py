"""Holes an adversarial review found in the agent lane (docs/agents.md), each pinned by a test.

The message tests call the renderer of an agent's messages (server/agents/messages.py) directly: it
is a pure function of the messages and what the service returned, and the oracle is the sampled
text written out by hand. The budget test uses real parts: the service, the shared embedded vLLM
and a real agent server over HTTP (tests/agent_server.py, `slow`: its run waits, so the test calls
the attempt's endpoint itself with the token the run was given, as a misbehaving agent would).
"""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest
from helpers import wait_until
from test_agents import SAMPLING, counters, start_agent  # noqa: F401  (a fixture)

from rollout_service.backends.tool_calls import parse_tool_calls
from rollout_service.server.agents.messages import returned_key, template_messages

# Spaced as the service's own re-render would not be: a re-render is told from the sampled text.
SAMPLED = '<tool_call>{"name":"run_sql","arguments":{"sql":"SELECT 1"}}</tool_call>'


def _returned() -> dict:
    """What the service remembers after answering SAMPLED with one tool call of id call_1."""
    parsed = parse_tool_calls(SAMPLED)
    ((name, arguments),) = parsed.calls
    return {returned_key(parsed.content, [("call_1", name, arguments)]): SAMPLED}


def _assistant(arguments: object, call_id: str = "call_1") -> dict:
    call = {"id": call_id, "type": "function", "function": {"name": "run_sql", "arguments": arguments}}
    return {"role": "assistant", "content": None, "tool_calls": [call]}


def _rendered(message: dict) -> str:
    messages = [{"role": "user", "content": "q"}, message]
    return template_messages(messages, None, _returned())[1]["content"]


def _waiting_run(launch_agent, launch_service, body: dict, pool) -> tuple[concurrent.futures.Future, str, dict]:
    """A group of one attempt on a `slow` agent server, whose run waits while the test calls its
    endpoint: (the group's answer to come, the endpoint's chat completions URL, the token's header)."""
    agent = launch_agent("slow")
    service = launch_service([agent.url])
    group = pool.submit(httpx.post, f"{service.url}/groups", json=body, timeout=120)
    assert wait_until(lambda: counters(agent)["tokens"], timeout_s=30)
    ((base_url, token),) = counters(agent)["tokens"].values()
    return group, f"{base_url}/chat/completions", {"authorization": f"Bearer {token}"}


def test_a_returned_tool_call_sent_back_unchanged_is_put_back_as_sampled():
    """The arguments as returned, or the same JSON written again with other spacing or key order (a
    framework that parses and re-serializes them): the sampled text, so the trajectory goes on."""
    assert _rendered(_assistant('{"sql": "SELECT 1"}')) == SAMPLED
    assert _rendered(_assistant('{ "sql":"SELECT 1" }')) == SAMPLED


def test_a_returned_tool_call_sent_back_with_changed_arguments_is_rendered_as_changed():
    """An agent that sends a returned call back with other arguments (same id, same content): the
    conversation holds the arguments the agent sent, not the sampled ones (a new segment follows).
    Break seen failing: the returned message recognised by content and call ids alone (the key
    before this test) -> the sampled text with SELECT 1 is rendered in place of SELECT 2."""
    rendered = _rendered(_assistant('{"sql": "SELECT 2"}'))
    assert "SELECT 2" in rendered and "SELECT 1" not in rendered
    assert _rendered(_assistant('{"sql": "SELECT 1"}', call_id="call_2")) != SAMPLED  # another id: not ours


def test_tool_call_arguments_sent_as_an_object_are_kept():
    """arguments as a JSON object rather than OpenAI's string (some clients send it so): rendered with
    those arguments. Break seen failing: non-string arguments read as "" -> rendered `"arguments": {}`."""
    rendered = template_messages([_assistant({"sql": "SELECT 3"}, call_id="mine")], None, {})[0]["content"]
    assert '"sql": "SELECT 3"' in rendered, rendered
    assert _rendered(_assistant({"sql": "SELECT 1"})) == SAMPLED  # the returned call, as an object


def test_concurrent_calls_of_one_attempt_stay_within_its_token_budget(start_agent, start_service):  # noqa: F811
    """Four calls at once on one attempt whose budget (max_tokens_total=12) is half of one call's
    max_tokens: served one at a time, each cut to what is left when its turn comes, so the attempt
    never samples past its budget; the call that finds it spent is 429 token_budget and ends the try.
    Break seen failing: each call's max_tokens cut to the budget left when the call arrived (before
    waiting for the attempt's turn, as before this test) -> the queued calls each sampled up to 12
    tokens, 4 turns and 48 tokens against a budget of 12."""
    body = {"task_id": "count-1", "n": 1, "sampling": SAMPLING, "max_tokens_total": 12, "timeout_s": 30, "retries": 0}
    call = {"messages": [{"role": "user", "content": "Write a long story about a dragon and a knight."}]}
    with concurrent.futures.ThreadPoolExecutor(5) as pool:
        group, url, own = _waiting_run(start_agent, start_service, body, pool)
        calls = [pool.submit(httpx.post, url, json=call, headers=own, timeout=60) for _ in range(4)]
        statuses = sorted(c.result().status_code for c in calls)
        (attempt,) = group.result().json()["attempts"]
    sampled = sum(t["completion_tokens"] for t in attempt["turns"])
    assert sampled <= 12, (sampled, statuses, attempt["turns"])
    assert attempt["failure"]["kind"] in ("max_turns", "deadline"), attempt["failure"]


def test_a_trainer_that_leaves_and_a_service_that_stops_end_every_run(start_agent, start_service):  # noqa: F811
    """The trainer hangs up while both runs wait (the group cancelled): each run gets DELETE /run/{id}
    (the agent server's own record), its world is back, and its token then answers 410. Then a
    service stopped (SIGTERM) with runs in flight: each of those runs is ended too.
    Break seen failing: lane.episode not setting attempt.episode_id before POST /run -> no DELETE
    /run was sent, both runs kept running (`deleted` empty after 30 s)."""
    agent = start_agent("slow")
    service = start_service([agent.url])
    body = {"task_id": "count-1", "n": 2, "sampling": SAMPLING, "timeout_s": 120, "retries": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{service.url}/groups", json=body, timeout=4)
    ids = sorted(counters(agent)["tokens"])
    assert len(ids) == 2
    assert wait_until(lambda: sorted(counters(agent)["deleted"]) == ids, timeout_s=30), counters(agent)
    assert wait_until(lambda: counters(agent)["running"] == 0, timeout_s=30)
    assert wait_until(lambda: httpx.get(f"{service.url}/envs", timeout=10).json()[0]["held"] == 0, timeout_s=30)
    base_url, token = counters(agent)["tokens"][ids[0]]
    late = httpx.post(
        f"{base_url}/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}]},
        headers={"authorization": f"Bearer {token}"},
        timeout=30,
    )
    assert late.status_code == 410 and late.json()["error"]["code"] == "attempt_ended", late.text

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(httpx.post, f"{service.url}/groups", json=body, timeout=120)
        assert wait_until(lambda: counters(agent)["running"] == 2, timeout_s=30), counters(agent)
        running = sorted(set(counters(agent)["tokens"]) - set(ids))
        service.proc.stop()
    assert sorted(set(counters(agent)["deleted"]) - set(ids)) == running, counters(agent)
    assert counters(agent)["running"] == 0


def test_sampling_fields_the_service_does_not_apply_are_recorded_on_the_attempt(start_agent, start_service):  # noqa: F811
    """logprobs, top_logprobs, logit_bias, presence and frequency penalties, seed and a tool_choice
    that forces a call: the turn samples as the group does (200), and the attempt says which of the
    call's fields were not applied (the contract: over-asking is refused or replaced, "and the
    attempt records which").
    Breaks seen failing: the fields read as unknown ones (ignored unsaid, as before this test) ->
    `adjusted` empty; tool_choice "required" not recorded -> no tool_choice in `adjusted`."""
    body = {"task_id": "count-1", "n": 1, "sampling": SAMPLING, "timeout_s": 8, "retries": 0}
    call = {
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 4,
        "logprobs": True,
        "top_logprobs": 5,
        "logit_bias": {"42": 100},
        "presence_penalty": 1.5,
        "frequency_penalty": 0.0,
        "seed": 3,
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "tool_choice": "required",
    }
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        group, url, own = _waiting_run(start_agent, start_service, body, pool)
        served = httpx.post(url, json=call, headers=own, timeout=60)
        assert served.status_code == 200, served.text
        (attempt,) = group.result().json()["attempts"]
    adjusted = " ".join(attempt["agent"]["adjusted"])
    for name in ("logprobs", "top_logprobs", "logit_bias", "presence_penalty", "seed", "tool_choice"):
        assert name in adjusted, attempt["agent"]
    assert "frequency_penalty" not in adjusted  # its default asks for nothing the group lacks


def test_calls_queued_behind_the_call_that_ended_the_attempt_are_told_it_ended(start_agent, start_service):  # noqa: F811
    """Three calls at once on an attempt with max_turns=1: one turn, the call past it 429 max_turns
    (which ends the attempt), and the call queued behind that one 410 attempt_ended: it is not served
    (nor a model call started for it) on an attempt already failed, nor counted as a second refusal.
    Break seen failing: take_turn checking only `session.open` (the code before), which the lane
    clears a moment after the failing call -> the queued call is a second 429 max_turns, refused 2."""
    body = {"task_id": "count-1", "n": 1, "sampling": SAMPLING, "max_turns": 1, "timeout_s": 30, "retries": 0}
    call = {"messages": [{"role": "user", "content": "Write a long story about a dragon."}]}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        group, url, own = _waiting_run(start_agent, start_service, body, pool)
        calls = [pool.submit(httpx.post, url, json=call, headers=own, timeout=60) for _ in range(3)]
        answers = sorted((c.result().status_code, c.result().json().get("error", {}).get("code")) for c in calls)
        (attempt,) = group.result().json()["attempts"]
    assert answers == [(200, None), (410, "attempt_ended"), (429, "max_turns")], answers
    assert attempt["failure"]["kind"] == "max_turns" and attempt["agent"]["refused"] == 1, attempt["agent"]
    assert len(attempt["turns"]) == 1
