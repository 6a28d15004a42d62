"""Pull answers cut off mid-way by the service, when its reader stops reading (--stream-stall-timeout).

Oracles: the run log (--runs-dir: every finished group as it finished), the test's own reading of the
bytes that came, refenv's own counters, /health/detail's queued attempts. The scripted stand-in model,
because the lines must be big and come at once (a reader's socket buffers filled in seconds; the real
model would take many minutes).
"""

from __future__ import annotations

import json
import socket

import httpx
import pytest
from helpers import assert_env_accounted, wait_until
from test_sampler import SCRIPTED, env_health, pull
from test_sampler_accounting import run_log_groups, stream_state


def _chunked_lines(raw: bytes) -> list[bytes]:
    """The complete NDJSON lines of a chunked HTTP answer that may have been cut anywhere."""
    body = raw.split(b"\r\n\r\n", 1)[1] if b"\r\n\r\n" in raw else b""
    data = b""
    while b"\r\n" in body:
        size_line, rest = body.split(b"\r\n", 1)
        size = int(size_line, 16)
        if size == 0 or len(rest) < size:
            data += rest[:size]
            break
        data += rest[:size]
        body = rest[size + 2 :]
    return [line for line in data.split(b"\n")[:-1] if line.strip()]


@pytest.mark.env_may_wait
def test_a_pull_cut_off_mid_group_tells_of_it_and_gives_its_queue_room_back(
    start_refenv, start_service, start_scripted_model, tmp_path
):
    """A pull whose reader stops reading is cut off (--stream-stall-timeout) while it writes a group's
    line. That group is neither lost silently nor handed out twice: the next pull tells of it as a
    dropped line (`undelivered`), its queue room is given back, and every group of the budget is
    accounted for exactly once (run log: each group id in the cut answer's complete lines, the next
    pull's groups, or the undelivered line). The scripted model, answering at once with big lines, so
    the socket's buffers fill in seconds.
    Breaks tried (old code): the popped group's line cut -> attempts_queued stays at n once
    everything else is handed out, and no line tells of the group."""
    model = start_scripted_model("sql-forever")
    env = start_refenv("--pool", "4")
    runs = tmp_path / "runs"
    service = start_service(
        [env.url], "--stream-stall-timeout", "3", "--runs-dir", str(runs), vllm=model.url, model="scripted"
    ).url
    budget, n = 60, 8  # some 150 kB a group: the budget's lines are more than the sockets hold
    body = {
        "buffer": 8,
        "max_groups": budget,
        "filter": "none",
        "group": {"n": n, "max_turns": 12, "retries": 0, "sampling": SCRIPTED},
    }
    stream = httpx.post(f"{service}/samplers", json=body, timeout=30).json()["id"]
    host, port = service.removeprefix("http://").split(":")
    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    reader.connect((host, int(port)))
    payload = json.dumps({"count": budget}).encode()
    reader.sendall(
        b"POST /samplers/%s/pull HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%b" % (stream.encode(), len(payload), payload)
    )
    try:
        assert wait_until(lambda: stream_state(service, stream)["handed_out"] > 0, timeout_s=120)
        # Cut off: the pull ends (the stream is idle again) although the reader asked for every group.
        assert wait_until(lambda: stream_state(service, stream)["idle_s"] > 0, timeout_s=120)
        # Production runs on until the buffer is full (or the budget spent); then only the buffered
        # groups hold queue room.
        assert wait_until(lambda: stream_state(service, stream)["running"] == 0, timeout_s=300)
        state = stream_state(service, stream)
        assert state["handed_out"] < budget, state
        queued = httpx.get(f"{service}/health/detail", timeout=10).json()["attempts_queued"]
        assert queued == n * state["buffered"], (queued, state)
        # What the cut answer carried: its complete lines, no summary.
        reader.settimeout(10)
        raw = b""
        while chunk := reader.recv(1 << 16):
            raw += chunk
    finally:
        reader.close()
    cut_lines = [json.loads(line) for line in _chunked_lines(raw)]
    assert not any("summary" in line for line in cut_lines), "the pull was not cut off: nothing was tested"
    cut_ids = [line["group"]["group_id"] for line in cut_lines if "group" in line]

    handed, dropped, summary = pull(service, stream, budget)
    undelivered = [d for d in dropped if d["reason"] == "undelivered"]
    assert len(undelivered) == 1 and undelivered[0]["attempts"] == n, dropped
    assert summary["dropped"] == {"undelivered": 1} and summary["dropped_lines_lost"] == 0, summary
    later_ids = [line["group"]["group_id"] for line in handed]
    lost_id = undelivered[0]["group_id"]
    assert lost_id not in later_ids
    # Every group of the budget, once: handed out before the cut, after it, or told of as undelivered.
    logged = set(run_log_groups(runs))
    assert len(logged) == budget
    handed_ids = [i for i in cut_ids if i != lost_id] + later_ids
    assert len(handed_ids) == len(set(handed_ids)) and set(handed_ids) | {lost_id} == logged
    assert summary["stream"]["handed_out"] == len(handed_ids) == budget - 1, summary["stream"]
    assert httpx.get(f"{service}/health/detail", timeout=10).json()["attempts_queued"] == 0
    assert wait_until(lambda: env_health(env.url)["leased"] == 0, timeout_s=10)
    assert_env_accounted(env_health(env.url))
