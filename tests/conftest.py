"""Real processes for the tests: one CPU vLLM server per session, refenv and the service per test or module.

Set ROLLOUT_TEST_VLLM_URL to use an already running vLLM server serving the embedded default
model (e.g. `rollout-service vllm`) instead of starting one.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from inference import embedded_model, local_server
from rollout_service.stack import ManagedProcess, free_port, refenv_command, service_command

MODEL = embedded_model.MODEL_NAME


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
def vllm_url(logs_dir) -> str:
    """A real vLLM server (CPU build) with the embedded default model, started once per session."""
    given = os.environ.get("ROLLOUT_TEST_VLLM_URL")
    if given:
        yield given.rstrip("/")
        return
    model_dir = embedded_model.prepare()
    port = free_port()
    proc = ManagedProcess("vllm", local_server.vllm_command(model_dir, served_name=MODEL, port=port),
                          logs_dir / "vllm.log", local_server.vllm_environment(kv_cache_gib=3))
    proc.start()
    try:
        proc.wait_http(f"http://127.0.0.1:{port}/v1/models", timeout_s=900,
                       progress=lambda s: print(f"[tests] vLLM still starting... {s:.0f}s", file=sys.stderr))
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.stop()


@pytest.fixture
def launch(logs_dir, request):
    """launch(kind, port, cmd, env=None, wait=True) -> Running; stopped after the test, last started first
    (a service before its env, so it can abandon its episodes while the env is up)."""
    started: list[ManagedProcess] = []

    def start(kind: str, port: int, cmd: list[str], env: dict | None = None, wait: bool = True) -> Running:
        name = f"{kind}-{request.node.name[:40]}-{len(started)}"
        proc = ManagedProcess(name, cmd, logs_dir / f"{name}.log", env)
        started.append(proc)
        proc.start()
        url = f"http://127.0.0.1:{port}"
        if wait:
            proc.wait_http(f"{url}/health", timeout_s=60)
        return Running(url, proc)

    yield start
    for proc in reversed(started):
        proc.stop()


@pytest.fixture
def start_refenv(launch):
    """start_refenv('--pool', '2', ..., step=True, port=None) -> Running; stopped after the test."""

    def start(*flags: str, step: bool = True, port: int | None = None) -> Running:
        port = port or free_port()
        return launch("refenv", port, refenv_command(port, *flags, step=step))

    return start


@pytest.fixture
def start_service(launch, request):
    """start_service([env urls], *flags, env={...}, vllm=URL) -> Running; stopped after the test.
    Without `vllm`, the session's vLLM server."""

    def start(envs: list[str], *flags: str, env: dict | None = None, wait: bool = True,
              vllm: str | None = None) -> Running:
        port = free_port()
        vllm = vllm or request.getfixturevalue("vllm_url")
        return launch("service", port, service_command(port, envs, vllm, *flags, model=MODEL),
                      {**os.environ, **(env or {})}, wait)

    return start
