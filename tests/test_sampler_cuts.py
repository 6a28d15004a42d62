"""Sample and pull answers cut off mid-way: by the service, when its reader stops reading
(--stream-stall-timeout), and on the way, when the connection goes (the trainer's client must hand over
what arrived and say the answer was cut).

Oracles: the run log (--runs-dir: every finished group as it finished), the test's own reading of the
bytes that came, refenv's own counters, /health/detail's queued attempts. The scripted stand-in model
where lines must be big and come at once (a reader's socket buffers filled in seconds; the real model
would take many minutes) or must come one at a time. A small proxy stands in for a network that drops
the connection after the first group's line: a real service cannot be made to cut an answer there.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading

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
        b"POST /samplers/%s/pull HTTP/1.1\r\nHost: 127.0.0.1\r\ncontent-type: application/json\r\n"
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
    # The run log is written by its own task: wait for its last line rather than read it mid-write.
    assert wait_until(lambda: len(run_log_groups(runs)) >= budget, timeout_s=30)
    logged = set(run_log_groups(runs))
    assert len(logged) == budget
    handed_ids = [i for i in cut_ids if i != lost_id] + later_ids
    assert len(handed_ids) == len(set(handed_ids)) and set(handed_ids) | {lost_id} == logged
    assert summary["stream"]["handed_out"] == len(handed_ids) == budget - 1, summary["stream"]
    assert httpx.get(f"{service}/health/detail", timeout=10).json()["attempts_queued"] == 0
    assert wait_until(lambda: env_health(env.url)["leased"] == 0, timeout_s=10)
    assert_env_accounted(env_health(env.url))


class CuttingProxy:
    """Forwards each connection to `upstream` and drops it, both ways, right after the first complete
    group line of an answer (a chunk holding "group": {...}) has been passed on."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        self.cuts = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._forward, args=(client,), daemon=True).start()

    def _forward(self, client: socket.socket) -> None:
        server = socket.create_connection(self.upstream)

        def up() -> None:
            try:
                while data := client.recv(1 << 16):
                    server.sendall(data)
            except OSError:
                pass

        threading.Thread(target=up, daemon=True).start()
        seen = b""
        try:
            while data := server.recv(1 << 16):
                seen += data
                start = seen.find(b'"group": {')
                end = seen.find(b"\n\r\n", start) if start >= 0 else -1
                if end >= 0:  # pass on up to the end of that chunk, then cut
                    client.sendall(data[: len(data) - (len(seen) - (end + 3))])
                    self.cuts += 1
                    return
                client.sendall(data)
                if seen.endswith(b"0\r\n\r\n"):  # an answer ended whole: the next one starts afresh
                    seen = b""
        except OSError:
            pass
        finally:
            for sock in (client, server):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                sock.close()

    def close(self) -> None:
        self.listener.close()


def test_the_client_hands_over_what_arrived_when_an_answer_is_cut(start_refenv, start_service, start_scripted_model):
    """The connection drops after the first group's line of a sample (sync client) and of a pull (async
    client): each raises StreamCut (a ServiceUnavailable, error stream_cut) carrying the group that
    arrived (and its lag), never a bare httpx error nor an answer without its groups; the service, seeing
    the client gone, cancels what the sample still ran (refenv: every world back).
    Breaks tried (old code): the transport error escapes the client (httpx.RemoteProtocolError, the
    arrived group lost); result() raising a plain ServiceUnavailable without the groups."""
    from rollout_service.trainer import AsyncRolloutClient, RolloutClient, ServiceUnavailable, StreamCut

    model = start_scripted_model("answer", "--delay", "0.3")  # one group at a time, each line on its own
    env = start_refenv("--pool", "2")
    service = start_service([env.url], vllm=model.url, model="scripted").url
    proxy = CuttingProxy(service)
    group = {"n": 2, "retries": 0, "sampling": SCRIPTED}
    try:
        with RolloutClient(proxy.url) as client:
            with pytest.raises(StreamCut) as cut:
                client.sample(count=4, filter="none", groups_at_once=1, group=group)
        assert isinstance(cut.value, ServiceUnavailable) and cut.value.error == "stream_cut"
        assert len(cut.value.groups) == 1 and cut.value.groups[0].n == 2, cut.value
        assert "cut off" in str(cut.value) and cut.value.dropped == []
        assert wait_until(lambda: env_health(env.url)["leased"] == 0, timeout_s=30), env_health(env.url)

        async def pulled() -> tuple[str, StreamCut]:
            async with AsyncRolloutClient(proxy.url) as client:
                stream = await client.open_stream(buffer=2, filter="none", group=group)
                with pytest.raises(StreamCut) as cut:
                    await client.pull(stream.id, 3)
                return stream.id, cut.value

        stream, pull_cut = asyncio.run(pulled())
        assert len(pull_cut.groups) == 1 and pull_cut.lags == [0], pull_cut
        assert proxy.cuts == 2
        # The group that arrived was handed out (the stream counted it), and the stream lives on.
        assert stream_state(service, stream)["handed_out"] >= 1
    finally:
        proxy.close()
    handed, _, summary = pull(service, stream, 1)
    assert len(handed) == 1 and summary["kept"] == 1
    assert httpx.delete(f"{service}/samplers/{stream}", timeout=60).status_code == 200
    assert wait_until(lambda: env_health(env.url)["leased"] == 0, timeout_s=30)
    assert_env_accounted(env_health(env.url))


def test_a_pulls_late_end_leaves_the_next_pull_marked() -> None:
    """One pull at a time holds even when a pull's end is told after the next pull began (its answer's
    `on_end` runs after its lines are done, and a second request can be answered between the two).
    That window cannot be hit on demand over HTTP, so the rule is checked on the stream alone: no
    sampler, no service (nothing of the stream but its pull mark is touched)."""
    from rollout_service.server.errors import Conflict
    from rollout_service.server.sampler.streams import SamplerStream

    stream = SamplerStream.__new__(SamplerStream)
    stream.id, stream._pull, stream.last_used = "s", None, 0.0
    _, end_a = stream.start_pull(1, 1.0)
    end_a()
    _, end_b = stream.start_pull(1, 1.0)
    end_a()  # A's end, told again (late): B is still the pull in progress
    assert stream.pulling
    with pytest.raises(Conflict):
        stream.start_pull(1, 1.0)
    end_b()
    assert not stream.pulling
    stream.start_pull(1, 1.0)
    assert stream.pulling
