"""Hostile and malformed input: the OpenAPI schema fuzzed with schemathesis, never a 500."""

from __future__ import annotations

import sys

import httpx
import hypothesis
import hypothesis.errors
import pytest
import schemathesis
from conftest import SCRIPTED_MODEL
from hypothesis import HealthCheck

MODES = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]


@pytest.fixture
def fuzz_target(start_refenv, start_service):
    env = start_refenv("--pool", "2")
    # Valid-looking requests name random task ids: they are refused with 404 before any work.
    service = start_service([env.url], "--max-n", "2", "--max-batch", "4")
    return service, env


def fuzz(url: str, paths) -> int:
    """Fuzz every operation whose path `paths` accepts; never a 5xx, every 4xx an error body.
    Returns how many requests were sent."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    checked = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        if not paths(operation.path):
            continue
        for mode in MODES:
            seen: list[int] = []

            @hypothesis.settings(
                max_examples=60, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
            )
            @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
            def check(case):
                response = case.call(base_url=url, timeout=60)
                seen.append(response.status_code)  # noqa: B023 - check() runs within this iteration
                assert response.status_code < 500, (case.method, case.path, case.body, response.text[:500])
                if response.status_code >= 400:
                    body = response.json()
                    error = body.get("error")
                    # The agent plane's own answers are in OpenAI's error shape (what an agent's client
                    # reads); refusals made before any route (a control character) in the service's.
                    agent_shape = case.path.startswith("/agent/") and isinstance(error, dict)
                    if agent_shape:
                        assert error.get("message") and error.get("code"), body
                    else:
                        assert error and body.get("message"), body

            try:
                check()
            except hypothesis.errors.Unsatisfiable:
                assert mode is schemathesis.GenerationMode.NEGATIVE  # nothing to make invalid (e.g. GET /health)
            checked += len(seen)
    return checked


def test_fuzzed_requests_never_get_a_server_error(fuzz_target):
    service, env = fuzz_target
    # The policy routes are fuzzed below on a stand-in: here they would pause and relabel the
    # session's vLLM, which every later test shares.
    assert fuzz(service.url, lambda path: not path.startswith("/policy")) > 200
    assert httpx.get(f"{service.url}/health").json()["status"] == "ok"
    assert env.health()["leased"] == 0


def test_fuzzed_policy_updates_never_get_a_server_error(start_refenv, start_service, launch):
    """POST /policy and /policy/pause with hostile bodies, against tests/scripted_model.py (a
    stand-in: it speaks vLLM's adapter routes, answers 404 for a folder that does not exist, and
    has no dev mode, so pausing is refused as a real vLLM without it refuses it)."""
    env = start_refenv("--pool", "2")
    cmd = [sys.executable, str(SCRIPTED_MODEL), "--port", "0", "--script", "answer"]
    model = launch("model", None, cmd, ready_path="/v1/models")
    service = start_service([env.url], vllm=model.url, model="scripted")
    assert fuzz(service.url, lambda path: path.startswith("/policy")) > 50
    state = httpx.get(f"{service.url}/policy").json()
    assert state["version"] == "base" and not state["paused"], state  # nothing hostile was taken


@pytest.fixture
def unstarted_app():
    """The app in this process with its lifespan never run: a body that passes validation is answered
    503 `starting`, one that does not 422, with no backend and no process."""
    from starlette.testclient import TestClient

    from rollout_service.server.config import ServiceConfig
    from rollout_service.server.http.app import create_app

    config = ServiceConfig(env=["http://127.0.0.1:9"], vllm=["http://127.0.0.1:9"], model="m")
    # Not entered: its lifespan, the service's start, never runs.
    return TestClient(create_app(config), base_url="http://127.0.0.1")


JSON_BODY = b'{"task_id": "t001", "n": 1}'


@pytest.mark.parametrize(
    ("content_type", "body", "says"),
    [
        ("application/x-www-form-urlencoded", JSON_BODY, "content-type: application/x-www-form-urlencoded"),
        (None, JSON_BODY, "no content-type"),
        ("text/plain", JSON_BODY, "content-type: text/plain"),
        ("application/x-www-form-urlencoded", b"", "content-type: application/x-www-form-urlencoded"),
    ],
)
def test_a_body_not_labelled_json_is_told_to_send_json(unstarted_app, content_type, body, says):
    """`curl -d '{...}'` without `-H content-type: application/json` labels valid JSON a form: the
    body is never read as JSON, and "body: Input should be a valid dictionary" pointed nowhere. Still
    422 invalid_request, saying what to send. Break tried: the content-type check skipped in
    _describe_validation -> every row fails with pydantic's "valid dictionary" message."""
    headers = {"content-type": content_type} if content_type else {}
    for path in ("/groups", "/groups/batch", "/envs"):
        r = unstarted_app.post(path, content=body, headers=headers)
        assert r.status_code == 422, r.text
        assert r.json()["error"] == "invalid_request"
        message = r.json()["message"]
        assert "content-type: application/json" in message and says in message, message
    # Labelled JSON, the same bytes pass validation (the unstarted service then says it is starting);
    # JSON that is not an object is told so in JSON's words (break tried: that branch skipped ->
    # pydantic's "valid dictionary", fails).
    r = unstarted_app.post("/groups", content=JSON_BODY, headers={"content-type": "application/json; charset=utf-8"})
    assert (r.status_code, r.json()["error"]) == (503, "starting"), r.text
    for sent, kind in ((b"[1]", "an array"), (b'"x"', "a string"), (b"3", "a number"), (b"true", "a boolean")):
        r = unstarted_app.post("/groups", content=sent, headers={"content-type": "application/json"})
        assert r.status_code == 422 and r.json()["error"] == "invalid_request", r.text
        assert r.json()["message"] == f"the body must be a JSON object, not {kind}", r.text
    r = unstarted_app.post("/groups", content=b"null", headers={"content-type": "application/json"})
    assert r.status_code == 422 and r.json()["error"] == "invalid_request", r.text
    r = unstarted_app.post("/groups", content=b"{}", headers={"content-type": "application/json"})  # an object
    assert r.status_code == 422 and "JSON object" not in r.json()["message"], r.text


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"n": True}, "n: Input should be a valid integer, not a boolean"),
        ({"n": "1"}, "n: Input should be a valid integer, not a string"),
        ({"max_turns": "4"}, "max_turns: Input should be a valid integer, not a string"),
        ({"retries": False}, "retries: Input should be a valid integer, not a boolean"),
        ({"max_staleness": True}, "max_staleness: Input should be a valid integer, not a boolean"),
        ({"sampling": {"max_tokens": "64"}}, "sampling.max_tokens: Input should be a valid integer, not a string"),
        ({"sampling": {"seed": True}}, "sampling.seed: Input should be a valid integer, not a boolean"),
        ({"sampling": {"temperature": "0.8"}}, "sampling.temperature: Input should be a valid number, not a string"),
        ({"timeout_s": True}, "timeout_s: Input should be a valid number, not a boolean"),
        ({"policy_failure_reward": "0"}, "policy_failure_reward: Input should be a valid number, not a string"),
        ({"allow_greedy": "yes"}, "allow_greedy: Input should be a valid boolean"),
        ({"constrained": 0}, "constrained: Input should be a valid boolean"),
    ],
)
def test_numbers_and_switches_are_not_coerced(unstarted_app, fields, words):
    """`"n": true` ran a group of n=1 and `"n": "1"` was taken: pydantic's lax mode coerced what the
    README says is validated. A float field still takes a JSON integer (`"temperature": 1` is meant),
    and the batch route words it the same, placed. Break tried: WireInt as plain `int` (the guard
    dropped) -> the integer rows fail (200-path 503 `starting` instead of 422)."""
    r = unstarted_app.post("/groups", json={"task_id": "t001", **fields})
    assert r.status_code == 422 and r.json()["error"] == "invalid_request", r.text
    assert words in r.json()["message"], r.text
    r = unstarted_app.post("/groups/batch", json={"groups": [{"task_id": "t001"}, {"task_id": "t001", **fields}]})
    assert r.status_code == 422 and f"groups.1.{words}" in r.json()["message"], r.text


def test_json_numbers_still_fill_float_fields(unstarted_app):
    """The other side of strict counts: integers where floats are expected, and null where allowed.
    Break tried: the guard refusing ints for float fields too -> `"temperature": 1` gets 422, fails."""
    body = {
        "task_id": "t001",
        "n": 2,
        "sampling": {"temperature": 1, "top_p": 1, "max_tokens": 16, "seed": 0},
        "timeout_s": 60,
        "policy_failure_reward": None,
        "max_staleness": None,
        "allow_greedy": False,
    }
    r = unstarted_app.post("/groups", json=body)
    assert (r.status_code, r.json()["error"]) == (503, "starting"), r.text
    r = unstarted_app.post("/envs", json={"url": "http://127.0.0.1:9", "timeout_s": 5})
    assert (r.status_code, r.json()["error"]) == (503, "starting"), r.text


@pytest.mark.parametrize(
    "bad", ["a\nb", "a\r\nINFO forged", "tab\there", "nul\x00", "esc\x1b[31m", "del\x7f", "nel\x85", "ls\u2028"]
)
def test_names_that_are_logged_refuse_control_characters(unstarted_app, bad):
    """group_id, task ids, slugs, pinned versions and families reach the service's text log: a line
    break in one would start a forged log line. Break tried: LoggedName as plain `str` -> 503 `starting`
    (accepted) for every row."""
    code = f"U+{ord(next(c for c in bad if not c.isprintable())):04X}"
    for body in (
        {"task_id": "t001", "group_id": bad},
        {"task_id": bad},
        {"slug": bad},
        {"task_id": "t001", "pin_version": bad},
        {"task_id": "t001", "model": bad},
    ):
        r = unstarted_app.post("/groups", json=body)
        assert r.status_code == 422 and r.json()["error"] == "invalid_request", (body, r.text)
        assert "control characters" in r.json()["message"] and code in r.json()["message"], r.text
    for draw in ({"task_ids": [bad]}, {"families": {bad: 1.0}}):
        r = unstarted_app.post("/samplers", json={"tasks": draw})
        assert r.status_code == 422 and "control characters" in r.json()["message"], (draw, r.text)
    # A lone surrogate (valid JSON, no UTF-8 can hold it): refused before the group runs.
    r = unstarted_app.post(
        "/groups", content=b'{"task_id": "t001", "group_id": "a\\ud800"}', headers={"content-type": "application/json"}
    )
    assert r.status_code == 422 and "U+D800" in r.json()["message"], r.text
    # Printable text of any script is a name.
    r = unstarted_app.post("/groups", json={"task_id": "t001", "group_id": "étape-7 ✓ 群"})
    assert r.status_code == 503 and r.json()["error"] == "starting", r.text
