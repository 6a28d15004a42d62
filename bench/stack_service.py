"""`rollout-service` with its HTTP stack swapped for a candidate, for bench/http_stacks.py only.

ROLLOUT_BENCH_HTTP_STACK=httpx: every backend call over an httpx client (no proxies from the
environment, no cap on connections), as the service would make it with httpx; unset or aiohttp:
the service as it is.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from inference import transport
from inference.httpx_transport import HttpxTransport


def _httpx(
    timeout_s: float,
    stand_in: httpx.AsyncBaseTransport | None = None,
    *,
    max_answer_bytes: int = transport.DEFAULT_MAX_ANSWER_BYTES,
) -> transport.HttpTransport:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    client = httpx.AsyncClient(transport=stand_in, timeout=timeout_s, trust_env=False, limits=limits)
    return HttpxTransport(client, max_answer_bytes)


if os.environ.get("ROLLOUT_BENCH_HTTP_STACK") == "httpx":
    # Before the service's modules import it by name.
    transport.make_transport = _httpx

from rollout_service.tools.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
