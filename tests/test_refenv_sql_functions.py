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


def test_constant_calls_stop_at_the_statement_deadline():
    """SQLite computes constant expressions once, before the statement's first row, where its
    progress handler (the statement deadline) never runs: 3,600 constant instr() calls of 256 KiB
    values spent 11 s of CPU. Each call checks the clock, so the statement stops at its deadline
    plus at most one call (~5 ms; the margin is for the thread and the error path). On a real world."""
    image = sqlite3.connect(":memory:")
    image.execute("CREATE TABLE t (a)")
    image.commit()

    async def run(sql: str) -> str:
        pool = WorldPool(image, 1)
        world = await pool.acquire()
        with pytest.raises(QueryError) as stopped:
            world.execute(sql, 10, 100)
        return str(stopped.value)

    term = "instr(printf('%.250000c', 'a'), printf('%.125000c', 'a') || 'b')"
    sql = "SELECT " + ", ".join("+".join([term] * 900) + f" AS c{i}" for i in range(4))
    before = time.process_time()
    reason = asyncio.run(run(sql))
    spent = time.process_time() - before
    assert reason == f"statement stopped after {_STATEMENT_DEADLINE_S:g} s"
    assert spent < _STATEMENT_DEADLINE_S + 0.5, spent
