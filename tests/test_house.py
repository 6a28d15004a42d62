"""The service's house: its log settings, its version and the typed /health/detail, checked on a
running service (real refenv, the session's vLLM) and, for the version, on the app."""

from __future__ import annotations

import json

import httpx
from helpers import cli, wait_until

from rollout_service.protocol import GRADED_STATUSES, AttemptStatus


def _log_lines(service) -> list[str]:
    return service.proc.log_path.read_text(errors="replace").splitlines()


def test_log_level_and_json_format_set_the_root_logger_and_health_detail_is_its_model(start_refenv, start_service):
    """--log-level info (the default) logs lifecycle events; --log-format json writes one object a line;
    --log-level warning leaves them out. Breaks tried: configure_logging not setting the root level ->
    the warning-level service logs `started`; the text formatter for json -> no line parses as JSON;
    httpx left at info -> a line per env and model request;
    `side` typed as a str -> /health/detail answers 500 for an env that declares no side; a replica's
    `draining` left unset in policy.replica_state -> /health/detail leaves it out."""
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
    from rollout_service.server.status import HealthDetail

    answer = httpx.get(f"{service.url}/health/detail", timeout=10).json()
    detail = HealthDetail.model_validate(answer)
    assert detail.envs is not None and [e.url for e in detail.envs] == [env.url], answer
    assert detail.envs[0].pool == 2 and "waiting_for" not in answer and "run_log" in answer, answer
    # The policy is typed (PolicyState) and still whole: a nested default, such as a replica's
    # `draining`, is said as GET /policy says it, not left out as unset.
    policy = httpx.get(f"{service.url}/policy", timeout=10).json()
    assert answer["policy"]["replicas"] == policy["replicas"] and "pause_expires_in" in answer["policy"], answer
    # `leased` is the env's own count of worlds in use: refenv's /health is the oracle.
    assert wait_until(
        lambda: (
            httpx.get(f"{service.url}/health/detail", timeout=10).json()["envs"][0].get("leased")
            == env.health()["leased"]
        ),
        10,
    )
    schema = httpx.get(f"{service.url}/openapi.json", timeout=10).json()
    assert "HealthDetail" in schema["components"]["schemas"]

    quiet = start_service([env.url], "--log-level", "warning")
    assert wait_until(lambda: quiet.health()["status"] == "ok", 30)
    assert not any("started: " in line for line in _log_lines(quiet)), "\n".join(_log_lines(quiet)[-20:])


def test_the_app_version_is_the_installed_packages(monkeypatch):
    """The version comes from the package's metadata (pyproject.toml), not a literal. Break tried: the
    literal 0.2.0 back in create_app -> the app says 0.2.0, not the metadata's."""
    from importlib import metadata

    from rollout_service.server.config import ServiceConfig
    from rollout_service.server.http.app import create_app

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
    from rollout_service.server.task_sets import all_or_none

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


def test_a_policy_update_is_info_when_every_replica_took_it_and_a_warning_when_some_did_not(tmp_path, caplog):
    """Lifecycle events are info: a full update, the trainer's pause taken and released. An update some
    replica did not take stays a warning (that replica is out of routing). Over fake_vllm's fleet (a
    stand-in for vLLM that can fail a reload on demand), through the real PolicyManager. Breaks tried:
    the update's line back at log.warning -> the full update is a WARNING record; no line on the pause
    -> no `policy pause taken` record."""
    import asyncio
    import logging

    from fake_vllm import checkpoint, make_manager

    from rollout_service.protocol import PolicyUpdate

    caplog.set_level(logging.INFO, logger="rollout_service")

    def policy_records() -> list[tuple[str, str]]:
        return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "rollout_service.policy"]

    async def go() -> None:
        fleet, pool, manager = await make_manager(2)
        try:
            await manager.update(PolicyUpdate(version="v1", weights={"path": checkpoint(tmp_path, "v1")}))
            assert ("INFO", "policy version v1 (weights) served by 2 of 2 replicas") in policy_records()

            await manager.pause(30)
            await manager.update(PolicyUpdate(version="v2"))  # the trainer pushed the weights itself
            assert ("INFO", "policy pause taken: 2 replica(s) paused for up to 30s") in policy_records()
            assert ("INFO", "policy pause released: 2 replica(s) resumed, 0 kept paused") in policy_records()
            assert ("INFO", "policy version v2 (pushed) served by 2 of 2 replicas") in policy_records()

            fleet[1].reload_fail = "clean"
            await manager.update(PolicyUpdate(version="v3", weights={"path": checkpoint(tmp_path, "v3")}))
            assert ("WARNING", "policy version v3 (weights) served by 1 of 2 replicas") in policy_records()
        finally:
            await manager.close()
            await pool.aclose()

    asyncio.run(go())
    assert not [m for level, m in policy_records() if level == "WARNING" and "2 of 2" in m], policy_records()


def test_a_failed_start_under_json_logging_is_a_json_error_record(tmp_path):
    """`serve --log-format json` whose start-up gives up exits 1, its failure one JSON object at level
    error like every other line; in text mode the same words, in the text format. Break tried: the
    `print` back in _serve -> the failure line is not JSON."""
    flags = [
        "serve", "--env", "http://127.0.0.1:9", "--vllm", "http://127.0.0.1:9", "--model", "m",
        "--runs-dir", str(tmp_path / "runs"), "--startup-timeout", "1", "--listen", "127.0.0.1:0",
    ]  # fmt: skip
    done = cli(*flags, "--log-format", "json", timeout=120)
    assert done.returncode == 1, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    records = [json.loads(line) for line in lines]  # every line, the failure's included, is JSON
    [failure] = [r for r in records if "cannot start" in r["message"]]
    assert failure["level"] == "error" and failure["logger"].startswith("rollout_service"), failure
    assert failure["message"].startswith("cannot start: still waiting after 1s (--startup-timeout)"), failure
    assert "http://127.0.0.1:9" in failure["message"], failure

    text = cli(*flags, timeout=120)
    assert text.returncode == 1, text.stderr
    [line] = [line for line in text.stderr.splitlines() if "cannot start" in line]
    assert " ERROR rollout_service." in line and "cannot start: still waiting" in line and not line.startswith("{")
