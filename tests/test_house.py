"""The service's house: its log settings, its version and the typed /health/detail, checked on a
running service (real refenv, the session's vLLM) and, for the version, on the app."""

from __future__ import annotations

import json

import httpx
from helpers import wait_until

from rollout_service.protocol import GRADED_STATUSES, AttemptStatus


def _log_lines(service) -> list[str]:
    return service.proc.log_path.read_text(errors="replace").splitlines()


def test_log_level_and_json_format_set_the_root_logger_and_health_detail_is_its_model(start_refenv, start_service):
    """--log-level info (the default) logs lifecycle events; --log-format json writes one object a line;
    --log-level warning leaves them out. Breaks tried: configure_logging not setting the root level ->
    the warning-level service logs `started`; the text formatter for json -> no line parses as JSON;
    httpx left at info -> a line per env and model request;
    `side` typed as a str -> /health/detail answers 500 for an env that declares no side."""
    env = start_refenv("--pool", "2")
    service = start_service([env.url], "--log-format", "json")
    assert wait_until(lambda: service.health()["status"] == "ok", 30)

    def started_line() -> dict | None:
        for line in _log_lines(service):
            if line.startswith("{") and '"started: ' in line:
                return json.loads(line)
        return None

    assert wait_until(lambda: started_line() is not None, 10), "\n".join(_log_lines(service)[-20:])
    record = started_line()
    assert record is not None
    assert record["level"] == "info" and record["logger"] == "rollout_service.service", record
    assert record["message"].startswith("started: 1 envs"), record
    # Info is lifecycle events, not a line per request the service makes (httpx logs those at info).
    assert not any("HTTP Request:" in line for line in _log_lines(service)), _log_lines(service)[-5:]

    # /health/detail: what the typed model says, and nothing unset (no start-up keys once started).
    from rollout_service.server.health_detail import HealthDetail

    answer = httpx.get(f"{service.url}/health/detail", timeout=10).json()
    detail = HealthDetail.model_validate(answer)
    assert detail.envs is not None and [e.url for e in detail.envs] == [env.url], answer
    assert detail.envs[0].pool == 2 and "waiting_for" not in answer and "run_log" in answer, answer
    schema = httpx.get(f"{service.url}/openapi.json", timeout=10).json()
    assert "HealthDetail" in schema["components"]["schemas"]

    quiet = start_service([env.url], "--log-level", "warning")
    assert wait_until(lambda: quiet.health()["status"] == "ok", 30)
    assert not any("started: " in line for line in _log_lines(quiet)), "\n".join(_log_lines(quiet)[-20:])


def test_the_app_version_is_the_installed_packages(monkeypatch):
    """The version comes from the package's metadata (pyproject.toml), not a literal. Break tried: the
    literal 0.2.0 back in create_app -> the app says 0.2.0, not the metadata's."""
    from importlib import metadata

    from rollout_service.server.app import create_app
    from rollout_service.server.config import ServiceConfig

    monkeypatch.setattr(metadata, "version", lambda name: "9.8.7" if name == "rollout-service" else "0")
    app = create_app(ServiceConfig(env=["http://a:1"], vllm=["http://m:1"], model="m"))
    assert app.version == "9.8.7"


def test_graded_statuses_are_statuses():
    """The one set of graded statuses names statuses the protocol has."""
    assert GRADED_STATUSES == {"scored", "policy_failure"} and GRADED_STATUSES <= set(AttemptStatus.__args__)  # type: ignore[attr-defined]


def test_backoff_doubles_to_its_cap_and_a_steady_poll_stays():
    """The shared backoff's schedule, as the start-up probes (0.25 s to 5 s) document it. Break tried:
    the cap applied before the delay is handed out -> the first delay is not `first`."""
    from rollout_service.retry import Backoff

    pause = Backoff(0.25, 5.0)
    assert [pause.take() for _ in range(7)] == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    steady = Backoff(1.0, 1.0)
    assert [steady.take() for _ in range(3)] == [1.0, 1.0, 1.0]


def test_all_or_none_raises_the_first_failure_and_cancels_the_rest():
    """Start-up gives up at the first backend that cannot serve: the others stop being asked. Break
    tried: gather without cancelling -> the slow probe runs on after the failure."""
    import asyncio

    from rollout_service.server.errors import StartupError
    from rollout_service.server.tasks import all_or_none

    async def scenario() -> None:
        cancelled = asyncio.Event()

        async def slow() -> None:
            try:
                await asyncio.sleep(60)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        async def refused() -> None:
            await asyncio.sleep(0)
            raise StartupError("wrong model")

        async def fine() -> int:
            return 1

        try:
            await all_or_none([slow(), refused(), fine()])
        except StartupError as exc:
            assert str(exc) == "wrong model"
        else:
            raise AssertionError("no failure raised")
        assert cancelled.is_set()
        assert await all_or_none([fine(), fine()]) == [1, 1]

    asyncio.run(scenario())
