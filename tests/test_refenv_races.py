"""refenv under races: requests that cross an episode's end, and statements that try to exhaust it."""

from __future__ import annotations

import asyncio
import json
import os
import random
import threading
import time
from pathlib import Path

import httpx
import pytest
from helpers import wait_until

SQL = lambda q: json.dumps({"action": "sql", "input": q})
ANSWER = lambda a: json.dumps({"action": "answer", "input": a})
ISSUE_DRAFTS = "UPDATE invoices SET status = 'issued' WHERE status = 'draft'"


def task_id_of(url: str, family: str) -> str:
    return next(t["task_id"] for t in httpx.get(f"{url}/tasks").json()["tasks"] if t["family"] == family)


def accounted(health: dict) -> bool:
    """Every started episode ended exactly one way, or is still live."""
    e = health["episodes"]
    ended = e["finished"] + e["abandoned"] + e["failed"] + e["reclaimed"] + e["timed_out"]
    return e["started"] == ended + health["live_episodes"]


async def _final_step_raced_by_delete(client: httpx.AsyncClient, task_id: str, delay_s: float) -> tuple[int, int]:
    """A write task's last /step, and a DELETE up to `delay_s` later: while it is being graded, mostly."""
    eid = (await client.post("/step/reset", json={"task_id": task_id})).json()["episode_id"]
    await client.post("/step", json={"episode_id": eid, "completion": SQL(ISSUE_DRAFTS)})
    final = asyncio.create_task(client.post("/step", json={"episode_id": eid, "completion": ANSWER("done")}))
    await asyncio.wait([final], timeout=delay_s)  # a late DELETE costs nothing once the answer is in
    gone = await client.delete(f"/step/{eid}")
    return (await final).status_code, gone.status_code


async def _races(url: str, task_id: str, rounds: int, lanes: int) -> list:
    delays = random.Random(12)

    async def lane(client: httpx.AsyncClient) -> list:
        return [await _final_step_raced_by_delete(client, task_id, delays.uniform(0, 0.5)) for _ in range(rounds)]

    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        lanes_out = await asyncio.gather(*(lane(client) for _ in range(lanes)), return_exceptions=True)
    return lanes_out


def test_delete_while_grading_never_releases_the_world_under_the_grader(start_refenv):
    # Scale 300: grading a write task reads ~90k rows (~0.2 s), a wide window for the DELETE.
    env = start_refenv("--pool", "2", "--scale", "300")
    task_id = task_id_of(env.url, "issue-drafts")
    rounds, lanes = 100, 2
    lanes_out = asyncio.run(_races(env.url, task_id, rounds, lanes))
    assert env.proc.proc.poll() is None, f"refenv died (exit {env.proc.proc.returncode}): {lanes_out!r:.300}"
    outcomes = [o for out in lanes_out for o in out]
    assert len(outcomes) == rounds * lanes, lanes_out
    # Exactly one side wins each race: the graded answer, or the abandonment (and the other gets 410).
    assert set(outcomes) <= {(200, 410), (410, 200)}, set(outcomes)
    health = env.health()
    assert health["leased"] == 0 and health["live_episodes"] == 0
    e = health["episodes"]
    assert e["started"] == rounds * lanes and accounted(health), e
    assert e["finished"] == outcomes.count((200, 410)) and e["abandoned"] == outcomes.count((410, 200)), e
    assert e["failed"] == e["reclaimed"] == e["timed_out"] == 0, e
    assert e["abandoned"] > 0 and e["finished"] > 0, e  # both sides of the race were reached
    # The worlds a DELETE took back mid-grading are whole: a right answer still passes on both.
    for _ in range(2):
        final = asyncio.run(_play(env.url, task_id, [SQL(ISSUE_DRAFTS), ANSWER("done")]))
        assert final.get("pass") is True, final


async def _play(url: str, task_id: str, completions: list[str]) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        answer = (await client.post("/step/reset", json={"task_id": task_id})).json()
        for completion in completions:
            answer = (
                await client.post("/step", json={"episode_id": answer["episode_id"], "completion": completion})
            ).json()
        return answer


def test_step_in_flight_when_its_episode_is_deleted_answers_410_at_once(start_refenv):
    env = start_refenv("--pool", "1", "--latency-ms", "3000", "--step-timeout", "10s")
    eid = httpx.post(f"{env.url}/step/reset", json={}).json()["episode_id"]
    answered: dict = {}

    def step() -> None:
        answered["r"] = httpx.post(
            f"{env.url}/step", json={"episode_id": eid, "completion": SQL("SELECT 1")}, timeout=30
        )
        answered["at"] = time.monotonic()

    stepper = threading.Thread(target=step)
    stepper.start()
    assert wait_until(lambda: env.health()["steps"] == 1)  # delivered: its action now "executes" for 3 s
    deleted_at = time.monotonic()
    assert httpx.delete(f"{env.url}/step/{eid}").status_code == 200
    stepper.join(30)
    r = answered["r"]
    assert r.status_code == 410 and r.json()["error"] == "episode_gone", r.text
    assert answered["at"] - deleted_at < 10  # not held until the step timeout
    health = env.health()
    e = health["episodes"]
    assert e["abandoned"] == 1 and e["timed_out"] == 0 and accounted(health), e
    assert health["leased"] == 0


def memory_mib(pid: int) -> dict[str, float]:
    """The process's resident memory now (VmRSS) and at its peak so far (VmHWM), in MiB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {key: int(fields[key].split()[0]) / 1024 for key in ("VmRSS", "VmHWM")}


FOREVER = "WITH RECURSIVE c(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM c)"  # a count that never ends by itself
HOSTILE_READS = [
    "SELECT length(randomblob(150000000))",  # one 150 MB value, made in a single VM step
    "WITH RECURSIVE r(s) AS (SELECT 'x' UNION ALL SELECT s || s FROM r) SELECT max(length(s)) FROM r",
    "SELECT " + ", ".join(["zeroblob(250000)"] * 100) + " FROM order_items",  # 25 MB rows
]
HOSTILE_COSTS = [
    # Few VM steps, each one slow (n keeps SQLite from computing instr() once): only a clock stops it.
    f"{FOREVER} SELECT count(*) FROM c "
    "WHERE instr(printf('%.*c', 200000 + n % 2, 'a'), printf('%.*c', 2000, 'a') || 'b') = 0",
    # 200 MB of rows: a world lives in memory, so its growth is the process's.
    f"INSERT INTO customers {FOREVER} SELECT 100000 + n, zeroblob(200000), '', '', '', '' FROM c LIMIT 1000",
]
# Under the limits, but 60 values of 200 kB a row: each value is cut as its row arrives.
WIDE_BUT_ALLOWED = "SELECT " + ", ".join(["zeroblob(200000)"] * 60) + " FROM order_items"


def _sql_turn(client: httpx.Client, eid: str, sql: str) -> dict:
    answer = client.post("/step", json={"episode_id": eid, "completion": SQL(sql)}).json()
    assert answer["done"] is False, answer  # the episode goes on, whatever the statement did
    return answer["observation"]


def _result(observation: dict) -> str:
    """The last statement's result (a finalize stage follows it with "out of turns")."""
    return next(m["content"] for m in reversed(observation["messages"]) if m["content"].startswith("Result:"))


def _count_and_answer(client: httpx.Client, eid: str, table: str) -> tuple[str, dict]:
    """The episode's last turns: a plain count (it must still work), then that count as the answer."""
    observation = _sql_turn(client, eid, f"SELECT COUNT(*) FROM {table}")
    count = _result(observation).splitlines()[-1].strip()
    last_word = json.dumps({"answer": count}) if observation["stage"] == "finalize" else ANSWER(count)
    final = client.post("/step", json={"episode_id": eid, "completion": last_word}).json()
    assert final["done"] is True, final
    return count, final


def test_hostile_statements_get_an_error_and_cost_neither_memory_nor_the_world(start_refenv):
    env = start_refenv("--pool", "1")
    pid = env.proc.proc.pid
    task = next(
        t
        for t in httpx.get(f"{env.url}/tasks").json()["tasks"]
        if t["family"] == "count-table" and "customers" in t["prompt"]
    )
    assert task["prompt"] == "How many rows does the customers table have?"  # 4 turns, then finalize
    with httpx.Client(base_url=env.url, timeout=30) as client:

        def episode(statements: list[str]) -> tuple[list[str], str, dict]:
            eid = client.post("/step/reset", json={"task_id": task["task_id"]}).json()["episode_id"]
            seen = [_result(_sql_turn(client, eid, sql)) for sql in statements]
            return (seen, *_count_and_answer(client, eid, "customers"))

        _, pristine_count, _ = episode([])
        before = memory_mib(pid)
        seen, count, final = episode(HOSTILE_READS)
        for sql, text in zip(HOSTILE_READS, seen, strict=True):
            assert text.startswith("Result:\nError: "), (sql[:60], text[:300])
        assert count == pristine_count and final.get("pass") is True, final
        seen, count, final = episode([WIDE_BUT_ALLOWED, *HOSTILE_COSTS])
        assert not seen[0].startswith("Result:\nError") and "..." in seen[0] and len(seen[0]) < 2100, seen[0][:300]
        for sql, text in zip(HOSTILE_COSTS, seen[1:], strict=True):
            assert text.startswith("Result:\nError: "), (sql[:60], text[:300])
        assert count == pristine_count, (count, pristine_count)  # the failed INSERT left nothing
        # The next lease of the same (only) world sees the pristine data.
        _, count, final = episode([])
        assert count == pristine_count and final.get("pass") is True, final
    after = memory_mib(pid)
    assert env.proc.proc.poll() is None
    assert after["VmRSS"] - before["VmRSS"] < 100 and after["VmHWM"] - before["VmHWM"] < 100, (before, after)


def cpu_seconds(pid: int) -> float:
    """CPU time the process has used so far (user + system): unlike the wall clock, not stretched
    by whatever else the machine runs."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# One printf() is one VM step, and the progress handler runs between steps: these ran 7 s and 3.8 s of
# CPU and came back as a normal (NULL) result, whatever the statement deadline (2 s) said.
ONE_STEP_COSTS = [
    "SELECT printf('%.*c', 1000000000, 'x')",
    "SELECT " + ", ".join(["printf('%.*c', 100000000, 'x') IS NULL"] * 5),
    "SELECT format('%!.*c', '1e9', 'x')",  # the alias, the unicode flag, and the count as text
    "SELECT printf('%s %5.1f%% %.*c', 'a', 2.5, 1000000000, 'x')",  # the count after other arguments
]


def test_a_single_function_call_is_bounded_by_the_statement_limit(start_refenv):
    """Issue #39 item 6: refused within the statement limit as an error observation; the episode goes
    on, the process lives, and printf() still formats what fits in a value."""
    env = start_refenv("--pool", "1")
    pid = env.proc.proc.pid
    task = task_id_of(env.url, "count-table")
    with httpx.Client(base_url=env.url, timeout=60) as client:

        def one_turn(sql: str) -> str:
            eid = client.post("/step/reset", json={"task_id": task}).json()["episode_id"]
            text = _result(_sql_turn(client, eid, sql))
            assert client.delete(f"/step/{eid}").status_code == 200
            return text

        for sql in ONE_STEP_COSTS:
            before = cpu_seconds(pid)
            text = one_turn(sql)
            spent = cpu_seconds(pid) - before
            assert text.startswith("Result:\nError: ") and "printf()" in text, (sql[:60], text[:300])
            assert spent < 2.0, (sql[:60], spent)
        honest = "SELECT printf('%.2f|%5d|%-3s|%%', 3.14159, 42, 'ab'), length(printf('%.*c', 200000, 'y'))"
        assert "3.14|   42|ab |%" in one_turn(honest)
    assert env.proc.proc.poll() is None and accounted(env.health())


# instr() and replace() of 256 KiB values (the cap) compare the needle at every position: SQLite's own
# took ~0.3 s a call, and the clock is checked only between VM steps, so 30 columns of them in one row
# ran ~10 s before "statement stopped after 2 s". The needle is never there: each answer is 0 / the
# whole text, which the test knows without SQLite.
_HAY, _NEEDLE = "printf('%.250000c', 'a')", "printf('%.125000c', 'a') || 'b'"
QUADRATIC_CALLS = [
    "SELECT " + ", ".join(f"instr({_HAY}, {_NEEDLE}) AS c{i}" for i in range(30)),
    "SELECT " + ", ".join(f"length(replace({_HAY}, {_NEEDLE}, 'x')) AS c{i}" for i in range(30)),
]


def test_instr_and_replace_of_the_longest_values_answer_within_the_statement_limit(start_refenv):
    """Issue #39 item 6 (instr/replace): the row comes back, right, having cost the env's process
    under the statement limit in CPU."""
    env = start_refenv("--pool", "1")
    pid = env.proc.proc.pid
    task = task_id_of(env.url, "count-table")
    with httpx.Client(base_url=env.url, timeout=120) as client:
        for sql, expected in zip(QUADRATIC_CALLS, ("0", "250000"), strict=True):
            eid = client.post("/step/reset", json={"task_id": task}).json()["episode_id"]
            before = cpu_seconds(pid)
            text = _result(_sql_turn(client, eid, sql))
            spent = cpu_seconds(pid) - before
            assert client.delete(f"/step/{eid}").status_code == 200
            assert spent < 2.0, (sql[:60], spent, text[:300])
            assert not text.startswith("Result:\nError"), (sql[:60], text[:300])
            row = text.splitlines()[-1].split("|")
            assert [v.strip() for v in row] == [expected] * 30, (sql[:60], text[-300:])
    assert env.proc.proc.poll() is None and accounted(env.health())


# LIKE and GLOB compare the pattern at every position too: one call with a 40,000-byte pattern on a
# 256 KiB value ran 25 s. A longer pattern than refenv allows (100 bytes) is refused; the longest
# allowed, in 30 columns, stays within the limit and answers (0: the value has no 'b').
_LONGEST_LIKE = 100


@pytest.mark.alone  # the 2 s statement limit is wall time: beside two other workers and vLLM the row outran it
def test_like_and_glob_patterns_are_bounded_so_a_row_of_them_answers_within_the_limit(start_refenv):
    env = start_refenv("--pool", "1")
    pid = env.proc.proc.pid
    task = task_id_of(env.url, "count-table")
    wide = ", ".join(
        f"{_HAY} {op} {w} || printf('%.{_LONGEST_LIKE - 2}c', 'a') || 'b' AS c{i}"
        for i, (op, w) in enumerate([("LIKE", "'%'"), ("GLOB", "'*'")] * 15)
    )
    too_long = [
        f"SELECT {_HAY} {op} {w} || printf('%.40000c', 'a') || 'b'" for op, w in (("LIKE", "'%'"), ("GLOB", "'*'"))
    ]
    with httpx.Client(base_url=env.url, timeout=120) as client:
        for sql in [f"SELECT {wide}", *too_long]:
            eid = client.post("/step/reset", json={"task_id": task}).json()["episode_id"]
            before = cpu_seconds(pid)
            text = _result(_sql_turn(client, eid, sql))
            spent = cpu_seconds(pid) - before
            assert client.delete(f"/step/{eid}").status_code == 200
            assert spent < 2.0, (sql[:60], spent, text[:300])
            if sql in too_long:
                assert text.startswith("Result:\nError: ") and "pattern" in text, text[:300]
            else:
                assert [v.strip() for v in text.splitlines()[-1].split("|")] == ["0"] * 30, text[-300:]
        eid = client.post("/step/reset", json={"task_id": task}).json()["episode_id"]
        honest = _result(_sql_turn(client, eid, "SELECT 'Ergonomic Chair' LIKE '%chair', 'abc' GLOB 'a*'"))
        assert honest.splitlines()[-1].replace(" ", "") == "1|1", honest
    assert env.proc.proc.poll() is None


def test_a_reset_whose_driver_left_while_it_waited_gives_its_world_back(start_refenv):
    """A driver waits in /step/reset (every world held), gives up and disconnects; the world then
    frees. The episode the env starts for nobody must be ended at once, not left to the reaper."""
    import socket

    env = start_refenv("--pool", "1", "--step-timeout", "5m")
    held = httpx.post(f"{env.url}/step/reset", json={}).json()["episode_id"]
    host, port = env.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        b"POST /step/reset HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    )
    assert wait_until(lambda: env.health()["waiting"] == 1, 10)
    sock.close()
    httpx.delete(f"{env.url}/step/{held}")  # the world frees as the driver leaves
    assert wait_until(lambda: env.health()["leased"] == 0 and env.health()["live_episodes"] == 0, 5)
    e = env.health()["episodes"]
    assert e["reclaimed"] == 0 and e["started"] == e["abandoned"] + e["finished"], e
