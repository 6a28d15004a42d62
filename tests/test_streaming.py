"""The batch stream: each group's line as it finishes, and `{index, error}` lines for groups that
could not be run. A scripted stand-in model makes the timing certain (the real one answers in
unpredictable numbers of turns); the env is the real refenv."""

from __future__ import annotations

import json
import os
import signal

import httpx
from helpers import results_alive, results_held, wait_until

SQL_ONCE = {"temperature": 0.8, "max_tokens": 16}


def test_a_group_is_streamed_as_soon_as_it_finishes(start_refenv, start_service, start_scripted_model):
    """Group 0 ends after one turn (max_turns=1); group 1 runs for seconds (each env step takes 1 s).
    Group 0's line must arrive while group 1 still holds its world on the env."""
    model = start_scripted_model("sql-forever")
    env = start_refenv("--pool", "2", "--latency-ms", "1000")
    service = start_service([env.url], vllm=model.url, model="scripted")
    body = {
        "groups": [
            {"task_id": "t005", "n": 1, "max_turns": 1, "sampling": SQL_ONCE},
            {"task_id": "t005", "n": 1, "max_turns": 4, "sampling": SQL_ONCE},
        ]
    }
    seen = []
    with httpx.stream("POST", f"{service.url}/groups/batch", json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.strip():
                item = json.loads(line)
                seen.append((item["index"], env.health()["leased"]))
    assert [index for index, _ in seen] == [0, 1]
    assert seen[0][1] == 1, "group 0 was not sent until group 1 had finished"


def test_groups_cancelled_by_shutdown_get_error_lines(start_refenv, start_service, start_scripted_model):
    """SIGTERM while a batch streams: every unfinished group gets an `{index, error}` line (error
    `cancelled`), the stream ends, and the env gets every world back."""
    model = start_scripted_model("sql-forever")
    env = start_refenv("--pool", "2", "--latency-ms", "30000")
    service = start_service([env.url], vllm=model.url, model="scripted")
    body = {"groups": [{"task_id": "t005", "n": 1, "sampling": SQL_ONCE} for _ in range(3)]}
    lines = []
    with httpx.stream("POST", f"{service.url}/groups/batch", json=body, timeout=60) as response:
        assert response.status_code == 200
        assert wait_until(lambda: env.health()["leased"] == 2, 10)
        os.kill(service.proc.proc.pid, signal.SIGTERM)
        lines = [json.loads(line) for line in response.iter_lines() if line.strip()]
    assert sorted(item["index"] for item in lines) == [0, 1, 2]
    for item in lines:
        assert "group" not in item and item["error"]["error"] == "cancelled" and item["error"]["message"]
    assert wait_until(lambda: env.health()["leased"] == 0, 10)
    assert env.health()["episodes"]["abandoned"] == 2


def test_the_http_layer_keeps_no_group_once_it_is_sent(start_refenv, start_scripted_model, tmp_path):
    """Memory stays bounded over a multi-day run only if nothing keeps a group once it is sent: not
    the runner (tests/test_runner_faults.py), and not the HTTP layer around it either (POST /groups,
    the batch stream, the run log). The app runs in this process (TestClient serves it from a
    thread), so the garbage collector sees its objects. The oracle is its own object list: no
    attempt, turn or result alive, and no container anywhere holding a text or bytes with one of the
    groups' ids (results travel as bytes, which the collector does not list themselves).
    The scripted model, so that every attempt takes a known path (a query, then an answer: scored);
    the real one's episodes end after any number of turns, or none scored. It found the run log's
    writer keeping its last batch while it waited for the next. Breaks tried: every streamed line
    kept in a module-level list in the routes -> fails, naming the list; the writer's fix undone -> fails."""
    import gc
    import uuid

    held = results_held()  # what earlier tests in this worker left: not this check's
    from collections import deque

    from starlette.testclient import TestClient

    from rollout_service.server.config import ServiceConfig
    from rollout_service.server.http.app import create_app

    model = start_scripted_model("sql-then-answer", "--sql-turns", "1")
    env = start_refenv("--pool", "4")
    marker = f"kept-{uuid.uuid4().hex}"
    config = ServiceConfig(env=[env.url], vllm=[model.url], model="scripted", runs_dir=str(tmp_path), run_id="r")

    def group(i: int) -> dict:
        return {"task_id": "t005", "n": 2, "group_id": f"{marker}-{i}", "sampling": SQL_ONCE}

    sent = 0
    app = create_app(config)
    with TestClient(app, base_url="http://127.0.0.1") as client:
        assert wait_until(lambda: client.get("/health").json()["status"] == "ok", 60)
        for i in range(3):
            answer = client.post("/groups", json=group(i))
            assert answer.status_code == 200, answer.text
            sent += answer.json()["counts"]["scored"]
        with client.stream("POST", "/groups/batch", json={"groups": [group(i) for i in range(3, 9)]}) as response:
            assert response.status_code == 200
            for line in response.iter_lines():
                if line.strip():
                    sent += json.loads(line)["group"]["counts"]["scored"]
        assert sent == 18, "every attempt scored (two turns each), so each group is a whole one"
        log = tmp_path / "r.jsonl"
        assert wait_until(lambda: log.exists() and log.read_text().count(marker) == 9, 10)
        del answer, response, line
        # The viewer keeps the newest groups on purpose, bounded (viewer/live.py; checked in
        # tests/test_viewer_live_bounds.py): let it go, so that anything else still holding one shows.
        app.state.viewer.results.clear()
        app.state.viewer.summaries.clear()

        results = results_alive(held)  # collects first
        assert not results, f"{len(results)} result objects alive after their groups were sent"
        # Containers by type, through the base classes' own methods: other objects in this process (a
        # lazy mapping of transformers') run code of their own when asked for their items.
        text, raw = marker, marker.encode()  # names, not a container the scan would find
        holders = []  # what holds one, with the id left out (so this list holds none)
        for o in gc.get_objects():
            kind = next((k for k in (dict, list, tuple, deque, set, frozenset) if issubclass(type(o), k)), None)
            items = () if kind is None else dict.values(o) if kind is dict else kind.__iter__(o)
            if any(raw in x if type(x) in (bytes, bytearray) else type(x) is str and text in x for x in items):
                holders.append(f"{type(o).__name__}: {kind.__repr__(o).replace(text, '<id>')[:300]}")
        assert not holders, holders


# -- lines that stay lines ------------------------------------------------------------------------

RAW_BREAKS = ("\u2028", "\u2029", "\u0085")


def _raw(line: bytes) -> bytes:
    """A line as a server that writes those characters raw (orjson, pydantic) would send it."""
    for char in RAW_BREAKS:
        line = line.replace(json.dumps(char).strip('"').encode(), char.encode())
    return line


def test_text_with_unicode_line_breaks_keeps_each_group_one_line(start_refenv, start_service, start_scripted_model):
    """A model's text may hold U+2028, U+2029 or U+0085, which JSON carries raw in a string and which
    str.splitlines and httpx's (and requests') iter_lines take as line ends: a group's line came apart,
    and the trainer client's pull failed with stream_cut ("its last line came in part"), seen in the
    reference trainer's GRPO-only run. Oracles: the stream's bytes split at b"\\n" alone, against
    str.splitlines of the same text, and the answer's text as the stand-in model sent it.

    Breaks tried: one_line() left out of group_json -> the service's lines come apart under
    splitlines (fails at the line count); the client reading with iter_lines/aiter_lines -> its groups
    from a server that sends the characters raw fail with a JSON error (fails in both clients); a pull
    read with iter_lines -> the run's own StreamCut, "its last line came in part"."""
    from scripted_model import ANSWER_BREAKS

    from rollout_service.trainer import AsyncRolloutClient, RolloutClient

    model = start_scripted_model("answer-breaks")
    env = start_refenv("--pool", "2")
    service = start_service([env.url], vllm=model.url, model="scripted")
    body = {"groups": [{"task_id": "t001", "n": 2, "sampling": SQL_ONCE} for _ in range(2)]}
    answer = httpx.post(f"{service.url}/groups/batch", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    lines = [line for line in answer.content.split(b"\n") if line.strip()]
    assert len(lines) == 2
    assert len([line for line in answer.text.splitlines() if line.strip()]) == 2, "a line came apart"
    for line in lines:
        group = json.loads(line)["group"]
        for attempt in group["attempts"]:
            assert any(turn["completion"] == ANSWER_BREAKS for turn in attempt["turns"]), attempt["turns"]

    # The trainer client, against a server that writes them raw (the service above no longer does; a
    # stand-in answering its own lines so), the answer sent in small pieces that cut characters apart.
    raw = b"".join(_raw(line) + b"\n" for line in lines)
    assert all(char.encode() in raw for char in RAW_BREAKS)

    def answer_raw(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=iter([raw[i : i + 7] for i in range(0, len(raw), 7)]))

    requests = [{"task_id": "t001", "n": 2}] * 2
    client = RolloutClient(service.url)
    client._http = httpx.Client(base_url=service.url, transport=httpx.MockTransport(answer_raw))
    got = [item.group for item in client.groups(requests)]
    assert [g.attempts[0].turns[-1].completion for g in got] == [ANSWER_BREAKS, ANSWER_BREAKS]

    # A pull's lines (a group with its lag, then the summary), the same way.
    summary = {"requested": 2, "kept": 2, "complete": True, "stopped": "count reached", "groups_run": 2, "lags": [0, 0]}
    pulled_raw = (
        b"".join(b'{"group": %b, "lag": 0}\n' % _raw(json.dumps(json.loads(line)["group"]).encode()) for line in lines)
        + json.dumps({"summary": summary}).encode()
        + b"\n"
    )

    def answer_pull(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=iter([pulled_raw[i : i + 5] for i in range(0, len(pulled_raw), 5)]))

    client._http = httpx.Client(base_url=service.url, transport=httpx.MockTransport(answer_pull))
    pulled = client.pull("s-any", 2)
    assert [g.attempts[0].turns[-1].completion for g in pulled.groups] == [ANSWER_BREAKS, ANSWER_BREAKS]
    assert pulled.summary.kept == 2

    async def pieces():
        for i in range(0, len(raw), 7):
            yield raw[i : i + 7]

    async def answer_raw_async(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=pieces())

    async def async_groups() -> list:
        aclient = AsyncRolloutClient(service.url)
        aclient._http = httpx.AsyncClient(base_url=service.url, transport=httpx.MockTransport(answer_raw_async))
        try:
            return [item.group async for item in aclient.groups(requests)]
        finally:
            await aclient._http.aclose()

    import asyncio

    got = asyncio.run(async_groups())
    assert [g.attempts[0].turns[-1].completion for g in got] == [ANSWER_BREAKS, ANSWER_BREAKS]


def test_a_batch_answer_that_ends_before_its_first_line_still_cancels_its_groups():
    """The answer's task can end before its lines begin (the client gone as the head is written, a
    `send` that yields): their generator then never runs, so its `finally` cannot clean up, and the
    answer's `on_end` must. The real response, lines and held-results accounting; a stand-in admission
    and ASGI channel, since a real uvicorn cannot be made to yield at that one `send` on demand.
    Break tried: batch_answer without on_end=batch.abandon (as the route was) -> the groups run on for
    nobody and their 8 attempts stay counted against the queue, fails."""
    import asyncio

    from rollout_service.server.groups.streaming import HeldResults, batch_answer
    from rollout_service.server.groups.window import AnswerWindow

    class Admission:  # counts as rollout_service.server.groups.admission.Admission does
        def __init__(self) -> None:
            self.queued_attempts = 0

        def count_held(self, attempts: int) -> None:
            self.queued_attempts += attempts

        def cancel_in_background(self, groups: dict) -> None:
            for task in groups:
                task.cancel()

    async def answer() -> tuple[list[bool], bool, int]:
        admission = Admission()
        release = asyncio.Event()

        async def group() -> bytes:
            await release.wait()
            return b"{}"

        tasks = [asyncio.ensure_future(group()) for _ in range(2)]
        for task in tasks:  # queued from admission, uncounted when done (Admission.start_groups)
            admission.queued_attempts += 4
            task.add_done_callback(lambda _: admission.count_held(-4))
        held = HeldResults(admission)
        for task in tasks:
            held.hold_when_done(task, 4)

        async def receive() -> dict:
            return {"type": "http.disconnect"}  # the client is gone already

        async def send(message: dict) -> None:
            await asyncio.sleep(0)  # the server's send yields (its writes paused)

        request = type("Request", (), {"receive": staticmethod(receive)})()
        response = batch_answer(request, admission, tasks, [4, 4], held, AnswerWindow(2), 5.0)  # type: ignore[arg-type]
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}}
        await response(scope, receive, send)  # type: ignore[arg-type]
        release.set()  # a group that was not cancelled would finish now, and be held for nobody
        await asyncio.wait(tasks)
        return [t.cancelled() for t in tasks], held.closed, admission.queued_attempts

    cancelled, closed, queued = asyncio.run(answer())
    assert cancelled == [True, True] and closed and queued == 0, (cancelled, closed, queued)
