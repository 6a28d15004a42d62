"""Hostile agents on the agent lane (docs/agents.md): each is refused, its run ended, its world given
back, and the attempt says who failed.

Real parts: the service, the shared embedded vLLM and a real agent server over HTTP
(tests/agent_server.py). The oracles: what the agent's own HTTP client was answered (its run's
answer records it), the agent server's counters (runs running, runs ended by DELETE), and the
service's env list (worlds held).
"""

from __future__ import annotations

import agent_server
import httpx
import pytest
from helpers import wait_until
from test_agents import SAMPLING, counters, run_group


@pytest.fixture
def start_agent(launch):
    def start(mode: str, *flags: str):
        return launch("agent", None, agent_server.command(mode, *flags))

    return start


def _worlds_back(service, agent) -> None:
    """Every run over on the agent's side and every world slot free on the service's."""
    assert wait_until(lambda: counters(agent)["running"] == 0, timeout_s=30), counters(agent)
    held = lambda: [e["held"] for e in httpx.get(f"{service.url}/envs", timeout=10).json()]
    assert wait_until(lambda: held() == [0], timeout_s=30), held()


def test_a_hostile_agent_is_refused_call_by_call(start_agent, start_service):
    """Another attempt's endpoint with this attempt's token and a wrong token: 401; max_tokens,
    temperature or n over the group's: 400 over_group_sampling; a 10 MB history: 413 before it is
    rendered (the service's own body cap raised above it, so the agent's cap is what refuses); then a
    good call is served and the attempt is graded, every refusal counted on it.
    Breaks tried: `_sampling`'s over-asking check removed -> max_tokens and temperature answered 200 (n
    too); the route's --agent-max-body-bytes check removed -> the 10 MB history rendered and sent to the
    model (vLLM's context-length 400 fails the attempt: context_overflow, after ~20 s of rendering);
    sessions.check comparing only the id's presence -> wrong_token and other_attempt 200."""
    agent = start_agent("hostile")
    service = start_service([agent.url], "--max-body-bytes", str(64 << 20))
    group = run_group(service, {"task_id": "count-1", "n": 2, "sampling": SAMPLING})
    for attempt in group["attempts"]:
        assert attempt["status"] == "scored", attempt.get("failure")
        seen = attempt["answer"]
        assert seen["wrong_token"] == [401, "unauthorized"], seen
        assert seen["max_tokens"] == [400, "over_group_sampling"], seen
        assert seen["temperature"] == [400, "over_group_sampling"], seen
        assert seen["n"] == [400, "over_group_sampling"], seen
        assert seen["history_10mb"] == [413, "body_too_large"], seen
        assert seen["good"] == [200, None], seen
        assert attempt["agent"]["calls"] == len(attempt["turns"]) == 1
        assert attempt["agent"]["refused"] == 4, attempt["agent"]
        assert any("max_tokens=25" in r for r in attempt["agent"]["refusals"]), attempt["agent"]["refusals"]
    # The attempt that started second saw its sibling's endpoint refuse its token.
    assert [401, "unauthorized"] in [a["answer"].get("other_attempt") for a in group["attempts"]]
    _worlds_back(service, agent)


def test_a_never_ending_stream_of_calls_is_stopped_by_max_turns_and_the_token_budget(start_agent, start_service):
    """An agent that calls the model until refused: stopped at max_turns (the call past it is 429
    max_turns, the attempt fails max_turns, the policy's), or at the token budget; its run is ended
    and its world given back.
    Break tried: take_turn's max_turns check removed -> the loop goes on to the token budget (18 turns
    of 4 tokens in 3 * 24), the attempt holds more than 3 turns."""
    agent = start_agent("loop")
    service = start_service([agent.url])
    group = run_group(service, {"task_id": "count-1", "n": 2, "sampling": SAMPLING, "max_turns": 3, "retries": 0})
    for attempt in group["attempts"]:
        assert attempt["status"] == "policy_failure", attempt
        assert attempt["failure"]["kind"] == "max_turns" and attempt["failure"]["attribution"] == "policy"
        assert len(attempt["turns"]) == 3, len(attempt["turns"])
        assert any(r.startswith("max_turns") for r in attempt["agent"]["refusals"])
    _worlds_back(service, agent)
    budget = run_group(
        service, {"task_id": "count-1", "n": 2, "sampling": SAMPLING, "max_turns": 100, "max_tokens_total": 8}
    )
    for attempt in budget["attempts"]:
        assert attempt["failure"]["kind"] == "max_turns" and "token budget" in attempt["failure"]["detail"]
        assert sum(t["completion_tokens"] for t in attempt["turns"]) <= 8 and len(attempt["turns"]) == 2
    _worlds_back(service, agent)


def test_an_agent_server_that_never_answers_is_ended_at_the_deadline(start_agent, start_service):
    """A run that never answers: the try fails `deadline` at timeout_s, the service ends the run with
    DELETE /run/{id} (the agent server's own record), and the world is back.
    Break tried: EnvClient.abandon's path for agent servers (/run) back to /step -> the agent server
    answers 404 to each DELETE, nothing is deleted and its runs stay running."""
    agent = start_agent("slow")
    service = start_service([agent.url])
    group = run_group(service, {"task_id": "count-1", "n": 2, "sampling": SAMPLING, "timeout_s": 3, "retries": 0})
    ids = [a["episode_id"] for a in group["attempts"]]
    for attempt in group["attempts"]:
        assert attempt["failure"]["kind"] == "deadline", attempt["failure"]
    assert wait_until(lambda: sorted(counters(agent)["deleted"]) == sorted(ids), timeout_s=30), counters(agent)
    _worlds_back(service, agent)


@pytest.mark.parametrize(
    ("mode", "kind"), [("huge", "env_answer_too_large"), ("crash", "env_episode_failed")], ids=["10mb", "crash"]
)
def test_an_agent_server_that_answers_10mb_or_crashes_fails_on_the_infrastructures_side(
    start_agent, start_service, mode, kind
):
    """A 10 MB answer (cut off as it comes, --max-answer-bytes) or a 500: the infrastructure's failure,
    no reward, the world back, the endpoint closed behind it.
    Break tried: lane.episode reading the run's answer from a wrapper that turns every EnvError into a
    deadline -> attribution policy (the kind test fails)."""
    agent = start_agent(mode)
    service = start_service([agent.url], "--max-answer-bytes", str(1 << 20))
    group = run_group(service, {"task_id": "name-2", "n": 2, "sampling": SAMPLING, "retries": 0})
    for attempt in group["attempts"]:
        assert attempt["failure"]["kind"] == kind, attempt["failure"]
        assert attempt["failure"]["attribution"] == "infrastructure" and attempt["reward"] is None
        assert len(attempt["turns"]) == 1
    _worlds_back(service, agent)
