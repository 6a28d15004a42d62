"""Hostile and malformed input: the OpenAPI schema fuzzed with schemathesis, never a 500."""

from __future__ import annotations

import httpx
import hypothesis
import hypothesis.errors
import pytest
import schemathesis
from hypothesis import HealthCheck

MODES = [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE]


@pytest.fixture
def fuzz_target(start_refenv, start_service):
    env = start_refenv("--pool", "2")
    # Valid-looking requests name random task ids: they are refused with 404 before any work.
    service = start_service([env.url], "--max-n", "2", "--max-batch", "4")
    return service, env


def test_fuzzed_requests_never_get_a_server_error(fuzz_target):
    service, env = fuzz_target
    schema = schemathesis.openapi.from_url(f"{service.url}/openapi.json")
    checked = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in MODES:
            seen: list[int] = []

            @hypothesis.settings(
                max_examples=60, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
            )
            @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
            def check(case):
                response = case.call(base_url=service.url, timeout=60)
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
    assert checked > 200
    assert httpx.get(f"{service.url}/health").json()["status"] == "ok"
    assert env.health()["leased"] == 0
