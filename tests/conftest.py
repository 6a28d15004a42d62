"""Real processes for the tests: one CPU vLLM server per run, refenv and the service per test or module.

Set ROLLOUT_TEST_VLLM_URL to use an already running vLLM server serving the embedded default
model (e.g. `rollout-service vllm`) instead of starting one. Under `pytest -n N` (pytest-xdist, as
`make test` runs) the workers share one server: see tests/shared_vllm.py.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import shared_vllm
from helpers import assert_env_accounted, wait_until

from rollout_service.launch import embedded_model
from rollout_service.launch.stack import (
    ManagedProcess,
    StackError,
    free_port,
    fresh_port_file,
    launch_embedded_vllm,
    refenv_command,
    service_command,
    start_embedded_vllm,
)

SCRIPTED_MODEL = Path(__file__).with_name("scripted_model.py")

MODEL = embedded_model.MODEL_NAME


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        "env_may_wait: the test makes an env's reset wait for a world on purpose (it holds worlds behind "
        "the service's back), so start_service's teardown does not require the env's max_waiting == 0; "
        "the env's episode counters must still add up",
    )
    config.addinivalue_line(
        "markers",
        f"{shared_vllm.ALONE_MARK}: under pytest-xdist the test runs while no other test runs: it changes what "
        "the shared vLLM answers for every caller (weights, a pause, dropped requests), or its outcome depends on "
        "timing that other tests' load would distort",
    )
    config.addinivalue_line(
        "markers",
        f"{shared_vllm.EARLY_MARK}: under pytest-xdist the test's file is sent to a worker first: the test is so "
        "long that, started late, the other workers would wait for it at the end",
    )


_SHARED_VLLM = pytest.StashKey[ManagedProcess | None]()
_SHARED_INFO = pytest.StashKey[dict]()


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node) -> None:
    """xdist's controller, once per worker: the first call starts the shared vLLM (unless one is given)."""
    config = node.config
    if _SHARED_INFO not in config.stash:
        root = config._tmp_path_factory.getbasetemp()
        given = os.environ.get("ROLLOUT_TEST_VLLM_URL")
        info: dict = {"lock": str(root / "vllm.lock"), "url": None, "pid": None, "log": None}
        proc = None
        if not given:
            # Started here and waited for by the workers (shared_vllm.wait_ready), so not picked again if
            # another process takes the port first: that run's workers then report vLLM down.
            port = free_port()
            log = root / "logs" / "vllm.log"
            # Computing on every core but one (one of two here), in its engine process. Every core made
            # tests/test_policy.py alone faster (290 s against 408 s), but the whole suite slower: 38.8 min
            # against 32.1 (the tests' own CPU work, a trainer's included, lost to the server's threads).
            proc = launch_embedded_vllm(port, log, kv_cache_gib=3, die_with_parent=True)
            atexit.register(proc.stop)  # also when the controller leaves without pytest_unconfigure (a second ^C)
            info.update(url=f"http://127.0.0.1:{port}", pid=proc.proc.pid if proc.proc else None, log=str(log))
        config.stash[_SHARED_VLLM] = proc
        config.stash[_SHARED_INFO] = info
    node.workerinput[shared_vllm.WORKERINPUT_KEY] = config.stash[_SHARED_INFO]


def pytest_unconfigure(config) -> None:
    proc = config.stash.get(_SHARED_VLLM, None)
    if proc is not None:
        proc.stop()


def _shared_info(config) -> dict | None:
    """On an xdist worker: what the controller handed it about the shared vLLM; else None."""
    return getattr(config, "workerinput", {}).get(shared_vllm.WORKERINPUT_KEY)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadfile` with the `alone` tests last, as one unit (see shared_vllm.AloneLastScheduling)."""
    if config.getvalue("dist") != "loadfile" or _SHARED_INFO not in config.stash:
        return None
    return shared_vllm.AloneLastScheduling(config, log, Path(config.stash[_SHARED_INFO]["lock"]))


def pytest_collection_modifyitems(config, items) -> None:
    info = _shared_info(config)
    if info is not None:  # on an xdist worker: tell the controller's scheduler which tests are `alone` or `early`
        marked = {
            mark: [item.nodeid for item in items if item.get_closest_marker(mark) is not None]
            for mark in (shared_vllm.ALONE_MARK, shared_vllm.EARLY_MARK)
        }
        shared_vllm.write_marked_list(Path(info["lock"]), marked)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem) -> Iterator[None]:
    """On an xdist worker, each test (its fixtures' set-up and teardown too) holds a turn: shared with the
    other workers' tests, or alone for a test marked `alone`."""
    info = _shared_info(item.config)
    if info is None:
        return (yield)
    exclusive = item.get_closest_marker(shared_vllm.ALONE_MARK) is not None
    if exclusive and info["url"]:
        # The controller's vLLM start-up (a compile on every core) is load no lock covers: let it finish first.
        with contextlib.suppress(RuntimeError):  # it never came up: the test's vllm_url fixture says so, as an error
            shared_vllm.wait_ready(info["url"], info["pid"], info["log"], model=MODEL)
    asked = time.monotonic()
    with shared_vllm.turn(Path(info["lock"]), exclusive):
        # Read back by the controller's summary: the time lost to `alone` turns.
        item.user_properties.append((shared_vllm.WAIT_PROPERTY, (exclusive, round(time.monotonic() - asked, 1))))
        return (yield)


@dataclass
class Running:
    url: str
    proc: ManagedProcess

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()


@pytest.fixture(scope="session")
def logs_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("logs")


@pytest.fixture(scope="session")
def vllm_url(logs_dir, request) -> Iterator[str]:
    """A real vLLM server (CPU build) with the embedded default model, started once per session."""
    given = os.environ.get("ROLLOUT_TEST_VLLM_URL")
    if given:
        yield given.rstrip("/")
        return
    shared = _shared_info(request.config)
    if shared is not None and shared["url"]:
        shared_vllm.wait_ready(shared["url"], shared["pid"], shared["log"], model=MODEL)
        yield shared["url"]
        return
    proc = start_embedded_vllm(
        None,  # a free port, picked again if lost (vLLM cannot report a port it bound)
        logs_dir / "vllm.log",
        kv_cache_gib=3,
        progress=lambda s: print(f"[tests] vLLM still starting... {s:.0f}s", file=sys.stderr),
    )
    try:
        yield f"http://127.0.0.1:{proc.port}"
    finally:
        proc.stop()


@pytest.fixture
def launch(logs_dir, request):
    """launch(kind, port, cmd, env=None, wait=True) -> Running; stopped after the test, last started first
    (a service before its env, so it can abandon its episodes while the env is up).

    `port` None: `cmd` is a server of ours listening on port 0 (refenv, the service, the scripted model);
    it is given `--port-file` and its URL is the port it bound. With `wait=False` a server that exits
    before listening (a test of a refusal at start) gets the URL of port 0, where nothing listens."""
    started: list[ManagedProcess] = []

    def start(
        kind: str,
        port: int | None,
        cmd: list[str],
        env: dict | None = None,
        wait: bool = True,
        ready_path: str = "/health",
    ) -> Running:
        name = f"{kind}-{request.node.name[:40]}-{len(started)}"
        port_file = fresh_port_file(logs_dir, name) if port is None else None
        if port_file is not None:
            cmd = [*cmd, "--port-file", str(port_file)]
        proc = ManagedProcess(name, cmd, logs_dir / f"{name}.log", env)
        started.append(proc)
        proc.start()
        if port_file is not None:
            try:
                port = proc.wait_port(port_file, timeout_s=60)
            except StackError:
                if wait or proc.alive():
                    raise
                port = 0
        url = f"http://127.0.0.1:{port}"
        if wait:
            proc.wait_http(f"{url}{ready_path}", timeout_s=60)
        return Running(url, proc)

    yield start
    for proc in reversed(started):
        proc.stop()


@pytest.fixture
def start_refenv(launch):
    """start_refenv('--pool', '2', ..., step=True, port=None) -> Running; stopped after the test."""

    def start(*flags: str, step: bool = True, port: int | None = None) -> Running:
        return launch("refenv", port, refenv_command(port or 0, *flags, step=step))

    return start


@pytest.fixture
def start_service(launch, request):
    """start_service([env urls], *flags, env={...}, vllm=URL, model=NAME) -> Running; stopped after the test.
    Without `vllm`, the session's vLLM server.

    At teardown, before any process is stopped, every env a service was pointed at that still answers
    is asked /health: the service never asked it for more worlds than it has (`max_waiting == 0`,
    unless the test is marked `env_may_wait`) and its episode counters add up (`assert_env_accounted`)."""
    env_urls: list[str] = []

    def start(
        envs: list[str],
        *flags: str,
        env: dict | None = None,
        wait: bool = True,
        vllm: str | None = None,
        model: str = MODEL,
    ) -> Running:
        env_urls.extend(u.rstrip("/") for u in envs if u.rstrip("/") not in env_urls)
        vllm = vllm or request.getfixturevalue("vllm_url")
        cmd = service_command(0, envs, vllm, *flags, model=model)
        return launch("service", None, cmd, {**os.environ, **(env or {})}, wait)

    yield start
    may_wait = request.node.get_closest_marker("env_may_wait") is not None
    for url in env_urls:
        check_env_at_teardown(url, may_wait)


def refenv_health(url: str) -> dict | None:
    """The env's /health with refenv's counters, or None: it no longer answers (stopped by the test,
    never started) or it is not a refenv (no counters to check)."""
    try:
        health = httpx.get(f"{url}/health", timeout=5).json()
    except (httpx.HTTPError, httpx.InvalidURL, ValueError):  # InvalidURL: a test's deliberately bad --env
        return None
    if not isinstance(health, dict) or not {"episodes", "live_episodes", "max_waiting"} <= health.keys():
        return None
    return health


def check_env_at_teardown(url: str, may_wait: bool) -> None:
    health = refenv_health(url)
    if health is None:
        return
    if not may_wait:
        assert health["max_waiting"] == 0, (
            f"env {url}: up to {health['max_waiting']} reset(s) waited for a world: more worlds were asked for than "
            f"its pool of {health['workers']} has (the service over-subscribed it, or the test held worlds itself: "
            "then mark the test env_may_wait)"
        )

    def accounted() -> bool:
        h = refenv_health(url)
        try:
            assert h is not None
            assert_env_accounted(h)
        except AssertionError:
            return False
        return True

    # An episode being ended is out of `live` a moment before its counter moves: give it time to land.
    if not wait_until(accounted, timeout_s=10):
        health = refenv_health(url)
        if health is not None:
            assert_env_accounted(health)


@pytest.fixture
def start_scripted_model(launch):
    """start_scripted_model(script, *flags) -> Running: tests/scripted_model.py, a stand-in model server
    that answers badly on purpose (see its docstring); it serves the model name "scripted"."""

    def start(script: str, *flags: str, port: int | None = None) -> Running:
        cmd = [sys.executable, str(SCRIPTED_MODEL), "--port", str(port or 0), "--script", script, *flags]
        return launch("model", port, cmd, ready_path="/v1/models")

    return start


def pytest_terminal_summary(terminalreporter) -> None:
    """How long tests waited for their turns on the shared vLLM (what the `alone` marks cost a run on
    several workers); then, last and loudly, any check skipped for want of a tool."""
    waits = [
        value
        for report in terminalreporter.getreports("")
        if report.when == "setup"
        for name, value in report.user_properties
        if name == shared_vllm.WAIT_PROPERTY
    ]
    if waits:
        alone = [s for exclusive, s in waits if exclusive]
        shared = [s for exclusive, s in waits if not exclusive]
        terminalreporter.write_sep(
            "-",
            f"turns: {len(alone)} alone test(s) waited {sum(alone):.0f} s for the others to finish; "
            f"{len(shared)} other tests waited {sum(shared):.0f} s in all for alone ones",
        )
    missing = [r for r in terminalreporter.stats.get("skipped", []) if "is not installed" in str(r.longrepr)]
    if missing:
        terminalreporter.write_sep("!", f"{len(missing)} check(s) NOT RUN: a tool is missing", red=True, bold=True)
        for report in missing:
            terminalreporter.write_line(f"  {report.nodeid}: {report.longrepr[-1]}", red=True)
        terminalreporter.write_line(
            "  `make test` installs them where it can (as root, with apt); see the Makefile's `tools` target", red=True
        )
