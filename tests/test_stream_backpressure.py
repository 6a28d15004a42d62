"""An NDJSON answer nobody reads: after --stream-stall-timeout the service closes the connection
itself, dropping what it had buffered for it, and cancels the groups still running for it.

A raw socket with a small receive buffer that never reads stands in for a trainer that stopped
reading. Oracles: the socket's own TCP state (Linux TCP_INFO: the service reset the connection, so
the socket is no longer established, while nothing was read from it), refenv's own counters, and
/health/detail's queued attempts. The scripted model answers at once with big lines (`sql-forever`
to max_turns: some 150 kB a group), so the socket buffers fill in seconds.
"""

from __future__ import annotations

import math
import socket
import sys

import httpx
import pytest
from helpers import assert_env_accounted, send_unread_batch, wait_until

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
    reader = send_unread_batch(service.url, groups)
    try:
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


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the kernel's TCP buffer bounds")
@pytest.mark.env_may_wait
def test_a_batch_nobody_reads_starts_no_more_groups_than_its_window_and_the_socket_hold(
    start_refenv, start_service, start_scripted_model
):
    """200 groups in one batch, a window of 2, a reader that takes nothing (the stall timeout far off).
    Once nothing runs any more (refenv: no live episode, no world leased, no episode started since the
    last look), the groups started (refenv's episodes started / n) are at most the window plus the lines
    the socket's buffers can hold: the reader's receive buffer, the kernel's largest send buffer
    (tcp_wmem's max) and asyncio's write buffer, over the smallest line read afterwards, plus the line
    being written. Oracles: refenv's counters, the kernel's own bounds, the lines themselves.
    Break tried: the window not entered (every group of the batch starts at once, the old code) -> all
    200 groups start (1,600 episodes) where at most ~40 may."""
    model = start_scripted_model("sql-forever")
    env = start_refenv("--pool", "4")
    service = start_service(
        [env.url], "--stream-stall-timeout", "600", "--answer-window", "2", vllm=model.url, model="scripted"
    )
    n, total = 8, 200
    group = {"task_id": "t001", "n": n, "max_turns": 12, "retries": 0, "sampling": {"max_tokens": 16}}
    reader = send_unread_batch(service.url, [group] * total)
    try:
        seen: dict = {"started": -1}

        def stuck() -> bool:
            health = httpx.get(f"{env.url}/health", timeout=10).json()
            before, seen["started"] = seen["started"], health["episodes"]["started"]
            return health["live_episodes"] == 0 and health["leased"] == 0 and before == seen["started"] > 0

        assert wait_until(stuck, timeout_s=300, every_s=1.0), seen
        assert _tcp_state(reader) == ESTABLISHED
        started = seen["started"]
        assert started % n == 0, started
        # The lines' size, from the answer itself (reading lets the batch go on: only a few are read).
        reader.settimeout(60)
        stream = reader.makefile("rb")
        assert stream.readline().startswith(b"HTTP/1.1 200")
        while stream.readline() not in (b"\r\n", b""):
            pass
        sizes = []
        while len(sizes) < 3:
            size = int(stream.readline().strip(), 16)  # chunked: each line is a chunk of its own
            sizes.append(size)
            stream.read(size + 2)
    finally:
        reader.close()
    rcvbuf = 2 * 4096  # what the kernel gives for SO_RCVBUF 4096, at most
    with open("/proc/sys/net/ipv4/tcp_wmem") as limits:
        wmem_max = int(limits.read().split()[2])
    socket_lines = math.ceil((rcvbuf + wmem_max + 65536) / min(sizes))
    assert started // n <= 2 + socket_lines + 1 < total, (started // n, socket_lines, sizes)
