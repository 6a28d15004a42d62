"""refenv: an episode reads nothing of the episodes that held its world before it.

A real refenv over HTTP with a pool of one world, so consecutive episodes share it. Episode A plants a
marker in the text of its statements, in a row it writes and in the connection's counters; episode B
then looks for it by every introspection route SQLite has. The oracle is the marker itself: B's
observations (what a policy would read) must not hold it."""

from __future__ import annotations

import json

import httpx
import pytest

MARKER = "VICTIM-SECRET-QUERY"
ROWID = 987_654_321  # the row A writes: last_insert_rowid() would give it back
SQL = lambda q: json.dumps({"action": "sql", "input": q})

# Every way SQLite shows a connection's or a database's past: prepared statements (sqlite_stmt),
# schemas (main and temp), pages (dbstat, sqlite_dbpage), pragmas (statement and table-valued), and
# the connection's counters.
PROBES = [
    "SELECT sql FROM sqlite_stmt",
    "SELECT * FROM sqlite_stmt",
    "SELECT sql, ncol, busy, nscan, nstep FROM main.sqlite_stmt",
    "SELECT name, sql FROM sqlite_master",
    "SELECT name, sql FROM sqlite_schema",
    "SELECT name, sql FROM sqlite_temp_master",
    "SELECT name, sql FROM temp.sqlite_master",
    "SELECT name, sql FROM sqlite_temp_schema",
    "SELECT * FROM dbstat",
    "SELECT * FROM sqlite_dbpage",
    "SELECT * FROM pragma_table_list",
    "SELECT * FROM pragma_stats",
    "PRAGMA stats",
    "PRAGMA temp.table_list",
    "SELECT last_insert_rowid(), changes(), total_changes()",
    f"SELECT id, name FROM products WHERE name LIKE '%{MARKER}%' OR id = {ROWID}",
    "SELECT max(id) FROM products",
]


# Honest statements the read rules must leave alone: CTEs the planner keeps apart (read with no
# database named), recursive ones, joins, windows, the JSON table functions, the schema.
HONEST = [
    "WITH s AS (SELECT customer_id FROM orders GROUP BY customer_id HAVING count(*) > 3) SELECT count(*) FROM s",
    "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 5) SELECT count(*) FROM c",
    "WITH c AS (SELECT 1) SELECT count(*) FROM c, products",
    "SELECT c.name, count(o.id) FROM customers c JOIN orders o ON o.customer_id = c.id GROUP BY c.id LIMIT 2",
    "SELECT name, rank() OVER (ORDER BY price DESC) FROM products LIMIT 2",
    "SELECT value FROM json_each('[1, 2]')",
    "SELECT name FROM sqlite_master WHERE type = 'table'",
]


def _post(url: str, path: str, body: dict) -> dict:
    answer = httpx.post(f"{url}{path}", json=body, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


def _step(url: str, episode: str, sql: str) -> str:
    answer = _post(
        url, "/step", {"episode_id": episode, "completion": SQL(sql), "prompt_tokens": 9, "completion_tokens": 9}
    )
    assert not answer["done"], answer
    return answer["observation"]["messages"][-1]["content"]


def _plant(url: str, task_id: str, ending: str) -> None:
    """Episode A: the marker in a statement's text, in a row, in the connection's counters; then it ends."""
    a = _post(url, "/step/reset", {"task_id": task_id})["episode_id"]
    _step(url, a, f"SELECT '{MARKER}', count(*) FROM products")
    _step(url, a, f"INSERT INTO products VALUES ({ROWID}, '{MARKER}', 'toys', 1.0, 1)")
    seen = _step(url, a, "SELECT last_insert_rowid()")
    assert str(ROWID) in seen, seen  # planted: A itself sees its row
    if ending == "abandoned":
        assert httpx.delete(f"{url}/step/{a}", timeout=30).status_code in (200, 204)
    else:
        answer = json.dumps({"action": "answer", "input": "done"})
        assert _post(url, "/step", {"episode_id": a, "completion": answer})["done"]


@pytest.mark.parametrize("ending", ["abandoned", "answered"])
def test_an_episode_reads_nothing_of_the_one_before_on_its_world(start_refenv, ending):
    """Each probe in an episode B of its own, right after an episode A that planted the marker (an
    episode has a budget of steps).
    Breaks tried: the world's connection kept across leases (the old release) -> `SELECT sql FROM
    sqlite_stmt` reads A's statement back and last_insert_rowid() gives A's row; the fresh connection
    without the read allowlist -> sqlite_stmt and dbstat answer (not refused)."""
    env = start_refenv("--pool", "1")
    task = next(t for t in httpx.get(f"{env.url}/tasks").json()["tasks"] if t["writes"])
    leaks, answered = {}, {}
    for probe in PROBES:
        _plant(env.url, task["task_id"], ending)
        assert env.health()["leased"] == 0
        b = _post(env.url, "/step/reset", {"task_id": task["task_id"]})["episode_id"]
        seen = answered[probe] = _step(env.url, b, probe)
        if MARKER in seen or str(ROWID) in seen:
            leaks[probe] = seen
        assert httpx.delete(f"{env.url}/step/{b}", timeout=30).status_code in (200, 204)
    assert leaks == {}, leaks
    # The introspection tables are refused outright, not merely empty.
    for probe in ("SELECT sql FROM sqlite_stmt", "SELECT * FROM dbstat", "SELECT name, sql FROM sqlite_temp_master"):
        assert "prohibited" in answered[probe] or "not authorized" in answered[probe], (probe, answered[probe])
    # The counters start again: B's connection has made no change and inserted no row.
    counters = answered["SELECT last_insert_rowid(), changes(), total_changes()"]
    assert counters.splitlines()[-1].replace(" ", "").split("|") == ["0", "0", "0"], counters


def test_honest_statements_still_run_and_functions_that_reach_outside_do_not(start_refenv):
    """Breaks tried: reads judged by table name alone (the CTE's own rows too) -> the CTE counts are
    `not authorized`; fts3_tokenizer() allowed -> it answers a pointer into the process."""
    env = start_refenv("--pool", "1")
    task = next(t for t in httpx.get(f"{env.url}/tasks").json()["tasks"] if not t["writes"])
    refused = {}
    for sql in [*HONEST, "SELECT hex(fts3_tokenizer('simple'))", "SELECT load_extension('x')"]:
        episode = _post(env.url, "/step/reset", {"task_id": task["task_id"]})["episode_id"]
        seen = _step(env.url, episode, sql)
        if "not authorized" in seen or "prohibited" in seen:
            refused[sql] = seen
        assert httpx.delete(f"{env.url}/step/{episode}", timeout=30).status_code in (200, 204)
    assert sorted(refused) == ["SELECT hex(fts3_tokenizer('simple'))", "SELECT load_extension('x')"], refused
