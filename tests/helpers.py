"""Small helpers shared by the tests."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx


def wait_until(predicate, timeout_s: float = 5.0, every_s: float = 0.1) -> bool:
    """Poll `predicate` until it is true or `timeout_s` passes; HTTP errors count as not yet."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if predicate():
                return True
        except httpx.HTTPError:
            pass
        time.sleep(every_s)
    try:
        return bool(predicate())
    except httpx.HTTPError:
        return False


def cli(*args: str, timeout: float = 600, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`rollout-service ARGS...` in a child process, its output captured."""
    return subprocess.run([sys.executable, "-m", "rollout_service.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=cwd)


def assert_accounted(group: dict) -> None:
    """Every scheduled attempt is scored with a reward, or failed with a reason and no reward."""
    c = group["counts"]
    assert c["scheduled"] == group["n"] == c["scored"] + c["failed"] == len(group["attempts"])
    for attempt in group["attempts"]:
        if attempt["status"] == "scored":
            assert attempt["reward"] is not None
        else:
            assert attempt["reward"] is None and attempt["failure"]["kind"], attempt
