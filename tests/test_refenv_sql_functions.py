"""refenv's own instr() and replace() (linear time) answer as SQLite's built-ins do.

The oracle is SQLite itself: the same expression on a plain connection, where instr() and replace()
are SQLite's. Arguments are SQL literals, so each keeps its SQLite type (TEXT, BLOB, INTEGER, REAL,
NULL) on the way in."""

from __future__ import annotations

import asyncio
import sqlite3
import time
import tracemalloc

import pytest

from refenv.world import _MAX_VALUE_BYTES, _STATEMENT_DEADLINE_S, LinearTextSearch, QueryError, WorldPool

# (haystack, needle): ASCII, multi-byte characters (positions count characters), BLOBs (positions count
# bytes), a BLOB and a TEXT mixed (searched as text), numbers (searched as SQLite's text of them),
# empty and NULL arguments, NUL bytes, bytes that are not UTF-8 in BLOBs.
INSTR_CASES = [
    ("'abcabc'", "'c'"),
    ("'abcabc'", "'bca'"),
    ("'abc'", "'abcd'"),
    ("'abc'", "'x'"),
    ("'abc'", "''"),
    ("''", "''"),
    ("''", "'a'"),
    ("'héllo wörld'", "'wö'"),
    ("'日本語のテキスト'", "'テ'"),
    ("'ab😀cd😀'", "'cd'"),
    ("'aaaaab'", "'aab'"),
    ("x'616263'", "x'63'"),
    ("x'00010203'", "x'0203'"),
    ("x'c3a9c3a9'", "x'a9'"),  # BLOBs: a byte in the middle of a character is found
    ("x'c3a9c3a9'", "'é'"),  # mixed: text positions
    ("'éé'", "x'a9'"),  # mixed, the needle starting inside a character
    ("x'a9c3a9'", "x'a9c3'"),
    ("x'68c3a96c6c6f'", "'l'"),
    ("x'ff616263'", "'b'"),
    ("x''", "x''"),
    ("x'6162'", "x''"),
    ("''", "x''"),
    ("12345", "34"),
    ("12345", "'45'"),
    ("1.5", "'.'"),
    ("-0.25", "5"),
    ("1e300", "'e'"),
    ("123", "x'32'"),
    ("0.1", "'1'"),
    ("NULL", "'a'"),
    ("'a'", "NULL"),
    ("NULL", "NULL"),
    ("'a' || char(0) || 'b'", "'b'"),
    ("'a' || char(0) || 'b'", "char(0)"),
]

# (text, pattern, replacement): the NULLs in each place (an empty pattern wins over a NULL
# replacement), overlapping and repeated patterns, multi-byte text, BLOBs (the result is TEXT),
# numbers, a pattern starting with a NUL byte (SQLite reads it as empty).
REPLACE_CASES = [
    ("'abcabc'", "'b'", "'XY'"),
    ("'aaaa'", "'aa'", "'b'"),
    ("'aaa'", "'aa'", "''"),
    ("'abc'", "''", "'z'"),
    ("'abc'", "''", "NULL"),
    ("'abc'", "NULL", "'z'"),
    ("NULL", "'a'", "'z'"),
    ("'abc'", "'b'", "NULL"),
    ("''", "'a'", "'z'"),
    ("'héllo wörld'", "'ö'", "'oe'"),
    ("'日本語'", "'本'", "'😀'"),
    ("x'616263'", "x'62'", "x'7a7a'"),
    ("x'616263'", "'b'", "'z'"),
    ("'abc'", "x'62'", "x'7a'"),
    ("x'c3a9'", "''", "'z'"),  # an empty pattern gives the text back as it is: a BLOB stays one
    ("12", "''", "'z'"),
    ("1.5", "x'00'", "'z'"),
    ("12345", "3", "'x'"),
    ("12.5", "'.'", "','"),
    ("1e300", "'e+'", "2.5"),
    ("'abc'", "x'00'", "'z'"),
    ("'abc'", "char(0) || 'b'", "'z'"),
    ("'a' || char(0) || 'b'", "char(98)", "'c'"),
    ("'abc'", "'abcd'", "'z'"),
    ("'abc'", "'abc'", "''"),
    ("x''", "'a'", "'b'"),
]


@pytest.fixture
def pair():
    """(refenv's, SQLite's): two connections with the same limits, one with LinearTextSearch."""
    ours, theirs = sqlite3.connect(":memory:"), sqlite3.connect(":memory:")
    for conn in (ours, theirs):
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, _MAX_VALUE_BYTES)
    LinearTextSearch().install(ours)
    yield ours, theirs
    ours.close()
    theirs.close()


def both(pair, expression: str) -> tuple:
    """The expression's value and SQLite type on each connection (a BLOB compared as its hex)."""
    sql = f"SELECT typeof({expression}), hex({expression}), {expression} IS NULL"
    return tuple(conn.execute(sql).fetchone() for conn in pair)


@pytest.mark.parametrize(("haystack", "needle"), INSTR_CASES)
def test_instr_answers_as_sqlites(pair, haystack, needle):
    ours, theirs = both(pair, f"instr({haystack}, {needle})")
    assert ours == theirs


@pytest.mark.parametrize(("text", "pattern", "replacement"), REPLACE_CASES)
def test_replace_answers_as_sqlites(pair, text, pattern, replacement):
    ours, theirs = both(pair, f"replace({text}, {pattern}, {replacement})")
    assert ours == theirs


def test_instr_and_replace_of_table_columns_answer_as_sqlites(pair):
    """Values read from rows (the model's usual case), each column a different type."""
    rows = [("héllo", b"h\xc3\xa9llo", 42, 4.25, None), ("", b"", 0, -1.0, None)]
    for conn in pair:
        conn.execute("CREATE TABLE t (s TEXT, b BLOB, i INTEGER, r REAL, n)")
        conn.executemany("INSERT INTO t VALUES (?,?,?,?,?)", rows)
    columns = ("s", "b", "i", "r", "n", "'l'", "x'6c'", "2", "''", "x''")
    sql = "SELECT " + ", ".join(
        f"instr({x}, {y}), hex(replace({x}, {y}, 'Z')), typeof(replace({x}, {y}, 'Z'))"
        for x in columns
        for y in columns
    )
    ours, theirs = (conn.execute(sql + " FROM t").fetchall() for conn in pair)
    assert ours == theirs


def test_a_replace_whose_result_is_not_utf8_is_an_error_as_reading_sqlites_would_be(pair):
    """Cutting a character of a BLOB in two: SQLite makes TEXT that is not UTF-8, which Python (so
    refenv's renderer) cannot read back; ours says why instead."""
    cut = "replace(x'c3a9c3a9', x'a9c3', '-')"
    ours, theirs = pair
    assert theirs.execute(f"SELECT typeof({cut})").fetchone() == ("text",)
    with pytest.raises(sqlite3.OperationalError, match="decode"):
        theirs.execute(f"SELECT {cut}").fetchone()
    with pytest.raises(sqlite3.OperationalError):
        ours.execute(f"SELECT {cut}").fetchone()


def test_a_replace_past_the_value_cap_is_refused_before_it_is_built(pair):
    """SQLite refuses a result over the length limit; ours refuses it too, without first making it
    (here 500 MB: Python's allocations during the call are counted)."""
    grow = "replace(printf('%.250000c', 'a'), 'a', printf('%.2000c', 'b'))"
    ours, theirs = pair
    with pytest.raises(sqlite3.DataError, match="too big"):
        theirs.execute(f"SELECT length({grow})").fetchone()
    tracemalloc.start()
    try:
        with pytest.raises(sqlite3.Error):
            ours.execute(f"SELECT length({grow})").fetchone()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 << 20, peak


def _stopped(sql: str) -> tuple[str, float, float]:
    """(why the statement was refused or stopped, CPU seconds and wall seconds this process spent
    on it), on a real world."""
    image = sqlite3.connect(":memory:")
    image.execute("CREATE TABLE t (a)")
    image.commit()

    async def run() -> str:
        world = await WorldPool(image, 1).acquire()
        with pytest.raises(QueryError) as stopped:
            world.execute(sql, 10, 100)
        return str(stopped.value)

    cpu, wall = time.process_time(), time.monotonic()
    reason = asyncio.run(run())
    return reason, time.process_time() - cpu, time.monotonic() - wall


# One value at the cap, for the statements below: 'aaa...' of 262,000 characters.
BIG = "SELECT printf('%.262000c', 'a')"


@pytest.mark.parametrize(
    ("name", "sql", "reason"),
    [
        # 60 columns of 300 constant hex() calls each: ran 9 s before the program was capped.
        (
            "constant calls",
            "SELECT "
            + ", ".join(
                "+".join(f"length(hex(zeroblob({131000 - j * 300 - i})))" for i in range(300)) for j in range(60)
            ),
            "statement too complex",
        ),
        # 3,600 constant instr() calls of values at the cap: 11 s before instr() checked the clock.
        (
            "constant instr() calls",
            "SELECT "
            + ", ".join(
                "+".join(["instr(printf('%.250000c', 'a'), printf('%.125000c', 'a') || 'b')"] * 900) + f" AS c{i}"
                for i in range(4)
            ),
            "statement too complex",
        ),
        # One row's expressions run straight through too: 4 columns of 400 upper() of a value at the cap.
        (
            "one row's calls",
            f"WITH v(b) AS ({BIG}) SELECT "
            + ", ".join("+".join(f"length(upper(b || {i}))" for i in range(400)) for _ in range(4))
            + " FROM v",
            "statement too complex",
        ),
        # A glob() character class of 90 costs 90 compares per character: ~10 ms a call at the cap.
        (
            "glob classes",
            f"WITH v(b) AS ({BIG}) SELECT " + "+".join(f"(b GLOB '*[{'b' * 90}]{i}')" for i in range(300)) + " FROM v",
            f"statement stopped after {_STATEMENT_DEADLINE_S:g} s",
        ),
        # One trim() by a set of 20,000 characters: 10 s in one call.
        (
            "a trim set",
            "SELECT length(trim(printf('%.200000c', 'a'), printf('%.20000c', 'b') || 'a'))",
            "a set of more than",
        ),
    ],
)
def test_a_statement_of_many_costly_calls_ends_within_the_statement_limit(name, sql, reason):
    """SQLite checks its progress handler (the statement's clock) only where its program jumps, so
    what runs straight through (constants, one row's expressions) or inside one call never met the
    2 s deadline. Now the program is capped, and the calls whose one call can be slow check the clock
    themselves: each statement is refused at once or stopped at the deadline, and this process spends
    at most the deadline and a margin on it (the margin: ~2,000 instructions at the cap, the thread,
    the error path). Breaks tried: no program cap (SQLITE_LIMIT_VDBE_OP left at SQLite's default) ->
    the constant calls ran 9 s, fails; glob() and trim() unwrapped (ClockedPatterns not installed) ->
    the glob classes ran 4 s past the deadline, the trim 10 s, fails."""
    why, cpu, wall = _stopped(sql)
    assert reason in why, (name, why)
    assert cpu < _STATEMENT_DEADLINE_S + 0.75 and wall < _STATEMENT_DEADLINE_S + 3, (name, cpu, wall)


def test_the_costliest_program_under_the_cap_stays_within_the_margin():
    """What the cap lets through unchecked: a program just under it, every instruction it can spare an
    upper() of a value at the cap. It runs to its end, in less than the margin the deadline is given
    above. Break tried: the cap at 20,000 -> 9.5 times the calls, past the margin, fails."""
    from refenv.world import _MAX_PROGRAM_OPS

    capped = sqlite3.connect(":memory:")
    capped.setlimit(sqlite3.SQLITE_LIMIT_VDBE_OP, _MAX_PROGRAM_OPS)
    terms = 1
    while True:  # the most upper() calls that still compile under the cap (SQLite's own answer)
        wider = f"WITH v(b) AS ({BIG}) SELECT " + "+".join(f"length(upper(b || {i}))" for i in range(terms + 1))
        try:
            capped.execute(f"EXPLAIN {wider} FROM v").fetchall()
        except MemoryError:
            break
        terms += 1
    assert terms > 100, terms
    sql = f"WITH v(b) AS ({BIG}) SELECT " + "+".join(f"length(upper(b || {i}))" for i in range(terms)) + " FROM v"
    image = sqlite3.connect(":memory:")
    image.execute("CREATE TABLE t (a)")
    image.commit()

    async def run() -> list:
        world = await WorldPool(image, 1).acquire()
        return world.execute(sql, 10, 100).rows

    cpu = time.process_time()
    rows = asyncio.run(run())
    spent = time.process_time() - cpu
    assert rows and rows[0][0] > 262000 * terms, rows
    assert spent < 0.75, (terms, spent)


def test_an_honest_statement_fits_the_program_cap(pair):
    """A five-table join with a CTE, a window, subqueries, CASE, LIKE, trim() and printf() (~400
    instructions) runs on a world: the cap is for programs no task needs."""
    from refenv.world import build_database

    image = build_database(1, 1)

    async def run() -> int:
        world = await WorldPool(image, 1).acquire()
        result = world.execute(HONEST, 100, 1000)
        return len(result.rows)

    assert asyncio.run(run()) > 0


HONEST = """WITH spend AS (SELECT c.id, c.name, c.country, SUM(i.quantity * p.price) AS total, COUNT(DISTINCT o.id) AS n
FROM customers c JOIN orders o ON o.customer_id = c.id JOIN order_items i ON i.order_id = o.id
JOIN products p ON p.id = i.product_id
WHERE o.status IN ('delivered', 'paid', 'shipped') AND p.category <> 'misc' AND trim(c.name) LIKE '%a%'
GROUP BY c.id)
SELECT s.name, s.country, ROUND(s.total, 2), RANK() OVER (PARTITION BY s.country ORDER BY s.total DESC) AS r,
 CASE WHEN s.total > 1000 THEN 'big' WHEN s.total > 100 THEN 'mid' ELSE 'small' END,
 (SELECT COUNT(*) FROM invoices v WHERE v.status = 'overdue' AND v.amount > (SELECT AVG(amount) FROM invoices)),
 upper(substr(s.name, 1, 3)) || '-' || lower(s.country), printf('%05.2f', s.total)
FROM spend s WHERE s.country IN (SELECT country FROM customers GROUP BY country HAVING COUNT(*) > 0)
ORDER BY r, s.total DESC LIMIT 20"""
