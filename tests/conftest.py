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
def start_refenv(logs_dir, request):
    """start_refenv('--pool', '2', ..., step=True) -> Running; stopped after the test."""
    started: list[ManagedProcess] = []

    def start(*flags: str, step: bool = True) -> Running:
        port = free_port()
        name = f"refenv-{request.node.name[:40]}-{len(started)}"
        proc = ManagedProcess(name, refenv_command(port, *flags, step=step), logs_dir / f"{name}.log")
        started.append(proc)
        proc.start()
        proc.wait_http(f"http://127.0.0.1:{port}/health", timeout_s=60)
        return Running(f"http://127.0.0.1:{port}", proc)

    yield start
    for proc in started:
        proc.stop()


@pytest.fixture
def start_service(logs_dir, request, vllm_url):
    """start_service([env urls], *flags, env={...}) -> Running; stopped after the test."""
    started: list[ManagedProcess] = []

    def start(envs: list[str], *flags: str, env: dict | None = None, wait: bool = True) -> Running:
        port = free_port()
        name = f"service-{request.node.name[:40]}-{len(started)}"
        proc = ManagedProcess(name, service_command(port, envs, vllm_url, *flags, model=MODEL), logs_dir / f"{name}.log", {**os.environ, **(env or {})})
        started.append(proc)
        proc.start()
        if wait:
            proc.wait_http(f"http://127.0.0.1:{port}/health", timeout_s=60)
        return Running(f"http://127.0.0.1:{port}", proc)

    yield start
    for proc in started:
        proc.stop()
