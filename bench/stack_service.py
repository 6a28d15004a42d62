"""`rollout-service` with its HTTP stack swapped for a candidate, for bench/http_stacks.py only.

ROLLOUT_BENCH_HTTP_STACK=httpx: every backend call over an httpx client (no proxies from the
environment, no cap on connections), as the service would make it with httpx; unset or aiohttp:
the service as it is.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# The httpx client lives with the tests (the service never uses it): tests/httpx_stand_in.py.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import httpx
from httpx_stand_in import HttpxTransport

from rollout_service.backends import transport


def _httpx(
    timeout_s: float,
    *,
    max_answer_bytes: int = transport.DEFAULT_MAX_ANSWER_BYTES,
    address_policy: object = None,
) -> transport.HttpTransport:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    client = httpx.AsyncClient(timeout=timeout_s, trust_env=False, limits=limits)
    return HttpxTransport(client, max_answer_bytes)


if os.environ.get("ROLLOUT_BENCH_HTTP_STACK") == "httpx":
    # Before the service's modules import it by name.
    transport.make_transport = _httpx

from rollout_service.tools.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
