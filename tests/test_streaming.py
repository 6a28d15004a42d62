"""The batch stream: each group's line as it finishes, and `{index, error}` lines for groups that
could not be run. A scripted stand-in model makes the timing certain (the real one answers in
unpredictable numbers of turns); the env is the real refenv."""

from __future__ import annotations

import json
import os
import signal

import httpx
from helpers import wait_until

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
