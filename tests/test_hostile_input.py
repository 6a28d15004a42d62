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

from rollout_service.tools.stack import free_port

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
                    assert body.get("error") and body.get("message"), body

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
    port = free_port()
    cmd = [sys.executable, str(SCRIPTED_MODEL), "--port", str(port), "--script", "answer"]
    model = launch("model", port, cmd, ready_path="/v1/models")
    service = start_service([env.url], vllm=model.url, model="scripted")
    assert fuzz(service.url, lambda path: path.startswith("/policy")) > 50
    state = httpx.get(f"{service.url}/policy").json()
    assert state["version"] == "base" and not state["paused"], state  # nothing hostile was taken
