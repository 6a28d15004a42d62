"""One vLLM for every pytest-xdist worker, and turns on it.

Under `pytest -n N` each worker is a session of its own: without this each would start its own CPU
vLLM (N times the memory, N compiles at once on a 2-core machine). The controller starts one as it
creates the workers (the start overlaps their collection and the tests that need no model) and hands
each worker its URL, its pid and a lock file in `workerinput`.

Tests share that server and the machine, except the few marked `alone`, which run while no other
test runs on any worker: those that change what the server answers for everyone (they swap its base
weights, pause it, drop its running requests), and those whose outcome depends on timing that
another test's load would distort (a rate measured at the receiver, two vLLM start-ups against a
deadline). The lock is flock(2): shared for a test, exclusive for a marked one, with a turnstile so
that a waiting `alone` test is not starved by the next shared ones.
"""

from __future__ import annotations

import fcntl
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil

from rollout_service.tools.stack import log_tail

WORKERINPUT_KEY = "rollout_shared_vllm"
ALONE_MARK = "alone"
WAIT_PROPERTY = "shared_vllm_turn_wait"


@contextmanager
def turn(lock_path: Path, exclusive: bool) -> Iterator[None]:
    """Hold the machine for one test: shared with other tests, or alone (`exclusive`)."""
    with open(lock_path.with_suffix(".turnstile"), "a") as gate, open(lock_path, "a") as server:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            if exclusive:
                # Still holding the gate: no other test starts while this one waits for the running ones.
                fcntl.flock(server, fcntl.LOCK_EX)
            else:
                fcntl.flock(gate, fcntl.LOCK_UN)
                fcntl.flock(server, fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(server, fcntl.LOCK_UN)


def wait_ready(url: str, pid: int | None, log_path: str | None, model: str, timeout_s: float = 900) -> None:
    """Poll the controller's vLLM until it lists `model` (not just any server that took the port first: a
    test's stand-in model could, while vLLM was still loading); fail at once if its process is gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            answer = httpx.get(f"{url}/v1/models", timeout=2.0)
            if answer.status_code == 200 and model in {m.get("id") for m in answer.json().get("data", [])}:
                return
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        if pid is not None and not _running(pid):
            tail = log_tail(log_path) if log_path else ""
            raise RuntimeError(f"the shared vLLM (pid {pid}) exited while starting; its log: {log_path}\n{tail}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the shared vLLM at {url} did not answer within {timeout_s:g}s; its log: {log_path}")
        time.sleep(0.5)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
