"""Small helpers shared by the tests."""

from __future__ import annotations

import time

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
