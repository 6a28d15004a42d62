"""An NDJSON answer nobody reads: after --stream-stall-timeout the service closes the connection
itself, dropping what it had buffered for it, and cancels the groups still running for it.

A raw socket with a small receive buffer that never reads stands in for a trainer that stopped
reading. Oracles: the socket's own TCP state (Linux TCP_INFO: the service reset the connection, so
the socket is no longer established, while nothing was read from it), refenv's own counters, and
/health/detail's queued attempts. The scripted model answers at once with big lines (`sql-forever`
to max_turns: some 150 kB a group), so the socket buffers fill in seconds.
"""

from __future__ import annotations

import json
import socket
import sys

import httpx
import pytest
from helpers import assert_env_accounted, wait_until

ESTABLISHED = 1  # tcpi_state, the first byte of Linux's struct tcp_info


def _tcp_state(sock: socket.socket) -> int:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the socket's state with Linux's TCP_INFO")
@pytest.mark.env_may_wait
def test_an_unread_batch_is_cut_its_connection_closed_and_its_groups_cancelled(
    start_refenv, start_service, start_scripted_model
):
    """Breaks tried, each failing at `the service closed the connection`: BoundedStream not calling
    abort_connection on a stall (the old code: uvicorn's close() waits to write the buffer to a reader
    that never reads); abort_connection without SO_LINGER 0 (transport.abort() alone: the kernel keeps
    the unsent bytes and sends on, the reader's socket stays established)."""
    model = start_scripted_model("sql-forever")
    env = start_refenv("--pool", "4")
    service = start_service([env.url], "--stream-stall-timeout", "3", vllm=model.url, model="scripted")
    groups = [
        {"task_id": "t001", "n": 8, "max_turns": 12, "retries": 0, "sampling": {"temperature": 0.8, "max_tokens": 16}}
    ] * 40
    payload = json.dumps({"groups": groups}).encode()
    host, port = service.url.removeprefix("http://").split(":")
    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    reader.connect((host, int(port)))
    try:
        reader.sendall(
            b"POST /groups/batch HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%b" % (len(payload), payload)
        )
        assert _tcp_state(reader) == ESTABLISHED
        assert wait_until(lambda: _tcp_state(reader) != ESTABLISHED, timeout_s=120), "the service closed the connection"
        queued = {}

        def drained() -> bool:
            queued.update(httpx.get(f"{service.url}/health/detail", timeout=10).json())
            return queued["attempts_queued"] == 0

        assert wait_until(drained, timeout_s=60), queued["attempts_queued"]
    finally:
        reader.close()
    health: dict = {}

    def settled() -> bool:
        health.update(httpx.get(f"{env.url}/health", timeout=10).json())
        return health["leased"] == 0 and health["live_episodes"] == 0

    assert wait_until(settled, timeout_s=30), health
    assert_env_accounted(health)
