"""Worlds: isolated SQLite copies of one deterministic business database, leased from a pool."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import random
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

# Closed sets: the prompt lists them, tasks filter on them, write tasks move rows between them.
INVOICE_STATUSES = ("draft", "issued", "paid", "overdue", "void")
ORDER_STATUSES = ("pending", "shipped", "delivered", "cancelled", "returned")
SEGMENTS = ("consumer", "business", "enterprise")
PRODUCT_CATEGORIES = ("books", "electronics", "garden", "kitchen", "toys")
COUNTRIES = ("Brazil", "Canada", "France", "Germany", "India", "Japan", "Kenya", "Spain")

SCHEMA = """
CREATE TABLE customers (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL, email TEXT NOT NULL,
    country TEXT NOT NULL, segment TEXT NOT NULL, created_at TEXT NOT NULL);
CREATE TABLE products (
    id INTEGER PRIMARY KEY, name TEXT NOT NULL, category TEXT NOT NULL,
    price REAL NOT NULL, stock INTEGER NOT NULL);
CREATE TABLE orders (
    id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id),
    order_date TEXT NOT NULL, status TEXT NOT NULL);
CREATE TABLE order_items (
    id INTEGER PRIMARY KEY, order_id INTEGER NOT NULL REFERENCES orders(id),
    product_id INTEGER NOT NULL REFERENCES products(id),
    quantity INTEGER NOT NULL, unit_price REAL NOT NULL);
CREATE TABLE invoices (
    id INTEGER PRIMARY KEY, order_id INTEGER NOT NULL REFERENCES orders(id),
    amount REAL NOT NULL, status TEXT NOT NULL, due_date TEXT NOT NULL);
"""

TABLES = ("customers", "products", "orders", "order_items", "invoices")

SCHEMA_DESCRIPTION = f"""Tables (SQLite):
- customers(id, name, email, country, segment, created_at)
  segment is one of: {", ".join(SEGMENTS)}
  country is one of: {", ".join(COUNTRIES)}
- products(id, name, category, price, stock)
  category is one of: {", ".join(PRODUCT_CATEGORIES)}
- orders(id, customer_id, order_date, status)
  status is one of: {", ".join(ORDER_STATUSES)}
- order_items(id, order_id, product_id, quantity, unit_price)
- invoices(id, order_id, amount, status, due_date)
  status is one of: {", ".join(INVOICE_STATUSES)}"""

_FIRST = (
    "Ada",
    "Ben",
    "Chen",
    "Dara",
    "Eli",
    "Fay",
    "Gus",
    "Hana",
    "Ivo",
    "Jun",
    "Kai",
    "Lea",
    "Mo",
    "Nia",
    "Oto",
    "Pia",
    "Quin",
    "Rui",
    "Sol",
    "Tao",
    "Uma",
    "Vic",
    "Wen",
    "Yara",
)
_LAST = (
    "Abe",
    "Brun",
    "Costa",
    "Diaz",
    "Eng",
    "Fox",
    "Gray",
    "Holm",
    "Ito",
    "Jones",
    "Kim",
    "Lund",
    "Mori",
    "Nash",
    "Ortiz",
    "Park",
    "Rossi",
    "Silva",
    "Tan",
    "Vogel",
    "Wu",
)
_ADJ = (
    "Amber",
    "Brisk",
    "Cozy",
    "Deft",
    "Eager",
    "Fleet",
    "Grand",
    "Handy",
    "Ivory",
    "Jolly",
    "Keen",
    "Lucid",
    "Mellow",
    "Nimble",
    "Orbit",
    "Prime",
    "Quiet",
    "Royal",
    "Swift",
    "Tidy",
)
_NOUN = {
    "books": ("Atlas", "Novel", "Primer", "Almanac"),
    "electronics": ("Speaker", "Charger", "Monitor", "Router"),
    "garden": ("Trowel", "Planter", "Hose", "Shears"),
    "kitchen": ("Kettle", "Skillet", "Blender", "Whisk"),
    "toys": ("Kite", "Puzzle", "Robot", "Yo-yo"),
}


def build_database(seed: int, scale: int) -> sqlite3.Connection:
    """Create the pristine in-memory database for (seed, scale); same inputs, same bytes."""
    rng = random.Random(f"refenv:{seed}:{scale}")
    conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
    conn.executescript(SCHEMA)
    n_customers, n_products, n_orders = 20 * scale, 15 * scale, 60 * scale

    customers = []
    for cid in range(1, n_customers + 1):
        first, last = rng.choice(_FIRST), rng.choice(_LAST)
        customers.append(
            (
                cid,
                f"{first} {last}",
                f"{first.lower()}.{last.lower()}{cid}@example.com",
                rng.choice(COUNTRIES),
                rng.choice(SEGMENTS),
                f"2023-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}",
            )
        )
    conn.executemany("INSERT INTO customers VALUES (?,?,?,?,?,?)", customers)

    products, used_names = [], set()
    for pid in range(1, n_products + 1):
        category = rng.choice(PRODUCT_CATEGORIES)
        name = f"{rng.choice(_ADJ)} {rng.choice(_NOUN[category])}"
        while name in used_names:  # unique names keep top-k answers unambiguous
            name = f"{rng.choice(_ADJ)} {rng.choice(_NOUN[category])} {pid}"
        used_names.add(name)
        # Distinct prices (a cent offset per id) so rankings never tie.
        price = round(rng.randint(3, 400) + pid / 100, 2)
        products.append((pid, name, category, price, rng.randint(0, 250)))
    conn.executemany("INSERT INTO products VALUES (?,?,?,?,?)", products)

    orders, items, invoices = [], [], []
    item_id = invoice_id = 0
    for oid in range(1, n_orders + 1):
        status = rng.choices(ORDER_STATUSES, weights=(2, 3, 6, 1, 1))[0]
        month, day = rng.randint(1, 12), rng.randint(1, 28)
        orders.append((oid, rng.randint(1, n_customers), f"2024-{month:02d}-{day:02d}", status))
        total = 0.0
        for _ in range(rng.randint(1, 4)):
            item_id += 1
            product = rng.choice(products)
            quantity = rng.randint(1, 5)
            items.append((item_id, oid, product[0], quantity, product[3]))
            total += quantity * product[3]
        if status != "cancelled":
            invoice_id += 1
            inv_status = rng.choices(INVOICE_STATUSES, weights=(1, 2, 5, 2, 1))[0]
            due_month = min(12, month + 1)
            invoices.append((invoice_id, oid, round(total, 2), inv_status, f"2024-{due_month:02d}-{day:02d}"))
    conn.executemany("INSERT INTO orders VALUES (?,?,?,?)", orders)
    conn.executemany("INSERT INTO order_items VALUES (?,?,?,?,?)", items)
    conn.executemany("INSERT INTO invoices VALUES (?,?,?,?,?)", invoices)
    return conn


def table_rows(conn: sqlite3.Connection) -> dict[str, list[tuple]]:
    """Every row of every table, ordered by primary key: the state a write task is graded on."""
    return {t: conn.execute(f"SELECT * FROM {t} ORDER BY id").fetchall() for t in TABLES}


def catalog_hash(conn: sqlite3.Connection) -> str:
    """Fingerprint of the data: two worlds with equal hashes grade identically."""
    digest = hashlib.sha256()
    for table, rows in table_rows(conn).items():
        digest.update(table.encode())
        for row in rows:
            digest.update(repr(row).encode())
    return "sha256:" + digest.hexdigest()[:32]


class QueryError(Exception):
    """A statement the model sent failed; its text goes back to the model as an observation."""


# The model may read and modify rows; it may not reshape the database or reach outside it.
_DENIED_ACTIONS = {
    sqlite3.SQLITE_ATTACH,
    sqlite3.SQLITE_DETACH,
    sqlite3.SQLITE_PRAGMA,
    sqlite3.SQLITE_CREATE_TABLE,
    sqlite3.SQLITE_DROP_TABLE,
    sqlite3.SQLITE_ALTER_TABLE,
    sqlite3.SQLITE_CREATE_INDEX,
    sqlite3.SQLITE_DROP_INDEX,
    sqlite3.SQLITE_CREATE_TRIGGER,
    sqlite3.SQLITE_DROP_TRIGGER,
    sqlite3.SQLITE_CREATE_VIEW,
    sqlite3.SQLITE_DROP_VIEW,
    sqlite3.SQLITE_CREATE_TEMP_TABLE,
    sqlite3.SQLITE_CREATE_TEMP_VIEW,
    sqlite3.SQLITE_CREATE_TEMP_TRIGGER,
    sqlite3.SQLITE_CREATE_TEMP_INDEX,
    sqlite3.SQLITE_CREATE_VTABLE,
    sqlite3.SQLITE_DROP_VTABLE,
}
# What a statement may read of the database: the world's own tables and its schema (the same in
# every world), and SQLite's JSON table functions. Every other table SQLite would show is
# introspection of the connection or its storage (sqlite_stmt lists the statements prepared on it,
# dbstat and sqlite_dbpage its pages, the temp schema what was made on it): refused, whatever a later
# SQLite adds. A CTE's or a subquery's own rows are read with no database named: the statement's own.
_READABLE = frozenset({*TABLES, "sqlite_master", "sqlite_schema", "json_each", "json_tree"})
# Functions that reach outside the world: fts3_tokenizer() reads and sets pointers into the process
# (an address leak), load_extension() loads code.
_DENIED_FUNCTIONS = frozenset({"fts3_tokenizer", "load_extension"})


def _authorize(action: int, arg1: str | None, arg2: str | None, database: str | None, _trigger: str | None) -> int:
    if action in _DENIED_ACTIONS:
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_READ and database is not None and (database != "main" or arg1 not in _READABLE):
        return sqlite3.SQLITE_DENY
    if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in _DENIED_FUNCTIONS:
        return sqlite3.SQLITE_DENY
    return sqlite3.SQLITE_OK


# What one statement from the model may cost. Steps bound a runaway cross join; the clock bounds
# steps that are each slow; the value cap bounds memory. SQLite checks the clock (the progress
# handler) only where the program jumps: constant expressions, computed once before the first row,
# and the expressions of one row run straight through (thousands of constant hex() calls in one
# SELECT ran seconds past the deadline). So the program's length is capped: SQLite refuses to compile
# past _MAX_PROGRAM_OPS instructions (it grows the program by doubling: ~1,400 fit), which holds ~220
# upper() calls of a value at the cap, 0.14 s of CPU on a loaded 2-core host. And no instruction may
# be slow either: printf(), instr() and replace() are linear and check the clock on each call
# (BoundedPrintf, LinearTextSearch), and so do trim(), like() and glob(), whose one call costs the
# value times the pattern (ClockedPatterns).
# Honest values here are under 100 bytes; an honest statement compiles to tens of instructions (a
# five-table join with a CTE, a window, subqueries and CASE: ~400).
_MAX_VM_STEPS = 2_000_000
_MAX_PROGRAM_OPS = 2_000
_STATEMENT_DEADLINE_S = 2.0
_PROGRESS_EVERY = 100  # VM steps between checks: no cost measured on a scale-300 join (every 10: +40%)
_MAX_VALUE_BYTES = 256 << 10
_MAX_COLUMNS = 64  # one result row holds at most this many values at once (SQLite's default: 2000)
# LIKE and GLOB cost (value length) x (pattern length) in one step: at SQLite's default (50,000
# bytes) one call on a 256 KiB value ran 25 s; at this cap ~35 ms. Honest patterns are a few words.
_MAX_LIKE_PATTERN_BYTES = 100
# Room for any honest write; not for a table of blobs (an in-memory world grows in RAM).
_MAX_GROWTH_BYTES = 16 << 20

T = TypeVar("T")


@dataclass
class QueryResult:
    columns: list[str]
    rows: list[tuple]
    truncated: bool
    changed_rows: int


class BoundedPrintf:
    """SQLite's printf() (and its alias format()), refusing a width or precision over the value cap
    before SQLite runs it.

    The progress handler runs between VM steps, and one printf() is one step: '%.*c' with precision
    1e9 loops a billion times inside it (7 s, past the statement's deadline), and the length limit only
    makes the result NULL at the end. Past the cap the result could never be kept anyway, so refusing
    changes no honest answer. What is allowed is formatted by SQLite itself, on a connection of its own
    (this one's printf is this function)."""

    def __init__(self) -> None:
        self._builtin = sqlite3.connect(":memory:", check_same_thread=False)
        self._builtin.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, _MAX_VALUE_BYTES)
        self.refused = ""  # why the last call was refused: the error the model is shown
        self.budget: _StatementBudget | None = None  # the running statement's: see LinearTextSearch

    def install(self, conn: sqlite3.Connection) -> None:
        for name in ("printf", "format"):
            conn.create_function(name, -1, self.__call__, deterministic=True)

    def __call__(self, fmt: object = None, *args: object) -> str | None:
        if self.budget is not None and self.budget.past_deadline():
            raise ValueError(self.budget.reason)
        if fmt is None:
            return None
        text = fmt.decode("utf-8", "replace") if isinstance(fmt, bytes) else str(fmt)
        self.refused = self._oversized(text, args)
        if self.refused:
            raise ValueError(self.refused)
        marks = ", ".join("?" * (1 + len(args)))
        return self._builtin.execute(f"SELECT printf({marks})", (fmt, *args)).fetchone()[0]

    def _oversized(self, fmt: str, args: tuple) -> str:
        """What in `fmt` asks for a field wider than the cap, or "". Parsed as SQLite's printf.c does:
        %, flags, width (digits or *), .precision (digits or *), l or ll, the conversion; every
        conversion but %% and %n takes one argument, and so does each *."""
        used, i, n = 0, 0, len(fmt)

        def too_big(size: int, what: str) -> str:
            return f"printf(): a {what} of {size:,} is over the {_MAX_VALUE_BYTES:,} a value may hold"

        while i < n:
            if fmt[i] != "%":
                i += 1
                continue
            i += 1
            while i < n and fmt[i] in "-+ #!0,":
                i += 1
            for what in ("width", "precision"):
                if what == "precision":
                    if i >= n or fmt[i] != ".":
                        break
                    i += 1
                if i < n and fmt[i] == "*":
                    size = self._as_int(args[used]) if used < len(args) else 0
                    used, i = used + 1, i + 1
                else:
                    start = i
                    while i < n and fmt[i] in "0123456789":
                        i += 1
                    size = int(fmt[start:i]) if i > start else 0
                if abs(size) > _MAX_VALUE_BYTES:
                    return too_big(abs(size), what)
            while i < n and fmt[i] == "l":
                i += 1
            if i < n:
                used += fmt[i] not in "%n"
                i += 1
        return ""

    def _as_int(self, value: object) -> int:
        """A * argument as SQLite reads it (its integer, or the integer of its real: '1e9' is 1e9)."""
        row = self._builtin.execute("SELECT CAST(?1 AS INTEGER), CAST(CAST(?1 AS REAL) AS INTEGER)", (value,))
        return max((abs(v) for v in row.fetchone() if isinstance(v, int)), default=0)


_UTF8_CONTINUATION = bytes(range(0x80, 0xC0))
SqlValue = str | bytes | int | float | None  # what SQLite hands a Python function, by type


class LinearTextSearch:
    """SQLite's instr() and replace(), in linear time.

    SQLite's own compare the needle at every position of the haystack (n*m work in one VM step: 30
    instr() of 256 KiB values in one row ran 10 s past the 2 s deadline, which is only checked between
    steps). These give SQLite's answers through bytes.find, bytes.count and bytes.replace, which are
    linear: on the values' UTF-8 bytes, as func.c works, so a TEXT position counts characters and a
    BLOB position (both arguments BLOBs) counts bytes. A number is searched as SQLite's text of it.
    Text that is not UTF-8 cannot pass between SQLite and Python: such an argument, or a replace() of
    BLOBs whose result would be such text, is an error here (SQLite's result could not be shown to
    the model either: reading it back fails)."""

    def __init__(self) -> None:
        self._builtin = sqlite3.connect(":memory:", check_same_thread=False)
        self.refused = ""  # why the last call failed: the error the model is shown
        # The running statement's budget. SQLite evaluates constant expressions once, up front,
        # where its progress handler never runs: 3,600 constant instr() calls in one SELECT ran
        # 11 s. Each call checks the clock itself.
        self.budget: _StatementBudget | None = None

    def install(self, conn: sqlite3.Connection) -> None:
        conn.create_function("instr", 2, self.instr, deterministic=True)
        conn.create_function("replace", 3, self.replace, deterministic=True)

    def _bytes(self, value: SqlValue) -> bytes:
        """The bytes SQLite's sqlite3_value_text() gives for `value` (a BLOB's own bytes)."""
        if isinstance(value, bytes):
            return value
        if not isinstance(value, str):  # a number: SQLite's text of it, not Python's
            value = self._builtin.execute("SELECT CAST(? AS TEXT)", (value,)).fetchone()[0]
        return str(value).encode()

    def _check_clock(self) -> None:
        if self.budget is not None and self.budget.past_deadline():
            raise ValueError(self.budget.reason)

    def instr(self, haystack: SqlValue, needle: SqlValue) -> int | None:
        self._check_clock()
        if haystack is None or needle is None:
            return None
        as_text = not (isinstance(haystack, bytes) and isinstance(needle, bytes))
        hay, pin = self._bytes(haystack), self._bytes(needle)
        if not pin:
            return 1
        if as_text and pin[0] in _UTF8_CONTINUATION:
            # SQLite tries the first byte, then only a character's first byte: such a needle can
            # only match at the start.
            return 1 if hay.startswith(pin) else 0
        at = hay.find(pin)
        if at < 0:
            return 0
        if not as_text:
            return at + 1
        return 1 + len(hay[1 : at + 1].translate(None, _UTF8_CONTINUATION))

    def replace(self, text: SqlValue, pattern: SqlValue, replacement: SqlValue) -> SqlValue:
        self.refused = ""
        self._check_clock()
        if text is None or pattern is None:
            return None
        old = self._bytes(pattern)
        if not old or old[0] == 0:
            # SQLite reads the pattern as a C string: empty, it gives back `text` as it read it
            # (a number as it is, a BLOB's bytes as TEXT).
            return self._text(text) if isinstance(text, bytes) else text
        if replacement is None:
            return None
        whole, new = self._bytes(text), self._bytes(replacement)
        size = len(whole) + whole.count(old) * (len(new) - len(old))
        if size > _MAX_VALUE_BYTES:  # refused before it is built, as SQLite does
            self.refused = "string or blob too big"
            raise ValueError(self.refused)
        return self._text(whole.replace(old, new))

    def _text(self, data: bytes) -> str:
        try:
            return data.decode()
        except UnicodeDecodeError:
            self.refused = "replace(): the result is not UTF-8 text"
            raise ValueError(self.refused) from None


class ClockedPatterns:
    """SQLite's trim(), ltrim(), rtrim(), like() and glob(), each call checking the statement's clock
    first: one call costs the value's length times the pattern's (a glob() character class, a trim()
    character set), ~10 ms for a pattern at the cap over a value at the cap, and a statement may
    hold hundreds. trim()'s set is capped as LIKE's pattern is (one trim() of 200,000 characters
    by a set of 20,000 ran 10 s). The work itself is SQLite's, on a connection of its own with the
    same limits."""

    _CALLS: tuple[tuple[str, int], ...] = (
        *((name, arity) for name in ("trim", "ltrim", "rtrim") for arity in (1, 2)),
        ("like", 2),
        ("like", 3),
        ("glob", 2),
    )

    def __init__(self) -> None:
        self._builtin = sqlite3.connect(":memory:", check_same_thread=False)
        self._builtin.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, _MAX_VALUE_BYTES)
        self._builtin.setlimit(sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH, _MAX_LIKE_PATTERN_BYTES)
        self.refused = ""  # why the last call failed: the error the model is shown
        self.budget: _StatementBudget | None = None  # the running statement's: see LinearTextSearch

    def install(self, conn: sqlite3.Connection) -> None:
        for name, arity in self._CALLS:
            conn.create_function(name, arity, functools.partial(self._call, name), deterministic=True)

    def _call(self, name: str, *args: SqlValue) -> SqlValue:
        self.refused = ""
        if self.budget is not None and self.budget.past_deadline():
            raise ValueError(self.budget.reason)
        if name.endswith("trim") and len(args) == 2 and isinstance(args[1], (str, bytes)):
            if len(args[1]) > _MAX_LIKE_PATTERN_BYTES:
                self.refused = f"{name}(): a set of more than {_MAX_LIKE_PATTERN_BYTES} characters to trim"
                raise ValueError(self.refused)
        marks = ", ".join("?" * len(args))
        try:
            return self._builtin.execute(f"SELECT {name}({marks})", args).fetchone()[0]
        except sqlite3.Error as exc:  # SQLite's own refusal (a pattern too complex, a value too big)
            self.refused = str(exc)
            raise ValueError(self.refused) from None


@dataclass
class World:
    """One isolated copy of the database; `dirty` once a statement changed a row."""

    index: int
    conn: sqlite3.Connection
    printf: BoundedPrintf
    search: LinearTextSearch
    patterns: ClockedPatterns
    dirty: bool = False

    def execute(self, sql: str, max_rows: int, max_chars: int) -> QueryResult:
        """Run one statement from the model. Blocking: call it through `in_thread`.

        Longer text and blob values come back cut to `max_chars + 1`, so a renderer can mark the cut."""
        stopped = _StatementBudget()
        self.conn.set_authorizer(_authorize)
        self.conn.set_progress_handler(stopped.check, _PROGRESS_EVERY)
        before = self.conn.total_changes
        guards = (self.printf, self.search, self.patterns)
        for guard in guards:
            guard.refused, guard.budget = "", stopped
        try:
            try:
                cursor = self.conn.execute(sql)
            except MemoryError:  # SQLite's answer to a program over SQLITE_LIMIT_VDBE_OP
                raise QueryError(
                    f"statement too complex: it compiles to more than {_MAX_PROGRAM_OPS:,} instructions"
                ) from None
            columns = [d[0] for d in cursor.description or ()]
            rows = _fetch_cut(cursor, max_rows + 1, max_chars)
        except sqlite3.Warning as exc:  # e.g. "You can only execute one statement at a time."
            raise QueryError(str(exc)) from None
        except sqlite3.Error as exc:
            if self.conn.in_transaction:
                self.conn.execute("ROLLBACK")
            refused = next((g.refused for g in guards if g.refused), "")
            raise QueryError(stopped.reason or refused or str(exc)) from None
        finally:
            self.conn.set_authorizer(None)
            self.conn.set_progress_handler(None, 0)
            for guard in guards:
                guard.budget = None
            if self.conn.total_changes != before:
                self.dirty = True
        return QueryResult(columns, rows[:max_rows], len(rows) > max_rows, self.conn.total_changes - before)

    async def in_thread(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` on a worker thread: the statements and grading that read this world.

        A cancelled caller goes on to give the world back, and the pool closes its connection and
        opens a fresh one: that must never happen under a thread still reading it (SQLite segfaults). So
        cancellation interrupts the thread's statement and waits for the thread to end."""
        future = asyncio.get_running_loop().run_in_executor(None, functools.partial(fn, *args))
        try:
            return await asyncio.shield(future)
        except asyncio.CancelledError:
            self.conn.interrupt()
            while not future.done():
                with contextlib.suppress(asyncio.CancelledError):  # a second cancel must wait too
                    await asyncio.wait([future])
            raise


class _StatementBudget:
    """The progress handler of one statement: stops it past its steps or its deadline."""

    def __init__(self) -> None:
        self.ticks = 0
        self.deadline = time.monotonic() + _STATEMENT_DEADLINE_S
        self.reason = ""

    def check(self) -> int:
        self.ticks += 1
        if self.ticks > _MAX_VM_STEPS // _PROGRESS_EVERY:
            self.reason = f"statement stopped after {_MAX_VM_STEPS:,} steps"
        else:
            self.past_deadline()
        return 1 if self.reason else 0

    def past_deadline(self) -> bool:
        if not self.reason and time.monotonic() > self.deadline:
            self.reason = f"statement stopped after {_STATEMENT_DEADLINE_S:g} s"
        return bool(self.reason)


def _fetch_cut(cursor: sqlite3.Cursor, limit: int, max_chars: int) -> list[tuple]:
    """Up to `limit` rows, long values cut as each row arrives: only one full row is ever held."""
    rows = []
    for row in cursor:
        rows.append(tuple(v[: max_chars + 1] if isinstance(v, (str, bytes)) else v for v in row))
        if len(rows) == limit:
            break
    return rows


class WorldPool:
    """`size` worlds; `acquire` blocks FIFO while all are leased; `release` gives the world a fresh
    connection on the pristine image."""

    def __init__(self, pristine: sqlite3.Connection, size: int) -> None:
        self._image = pristine.serialize()
        self._free: asyncio.Queue[World] = asyncio.Queue()
        self.size = size
        self.max_leased = 0
        # Acquires blocked on an empty pool: the demand the pool could not meet, which `max_leased`
        # (never above `size`) cannot show.
        self.waiting = 0
        self.max_waiting = 0
        self._busy_closed = 0.0  # world-seconds of leases that ended
        self._lease_started: dict[int, float] = {}  # world index -> when its open lease began
        for index in range(size):
            printf, search, patterns = BoundedPrintf(), LinearTextSearch(), ClockedPatterns()
            conn = self._fresh_connection(printf, search, patterns)
            self._free.put_nowait(World(index, conn, printf, search, patterns))

    def _fresh_connection(
        self, printf: BoundedPrintf, search: LinearTextSearch, patterns: ClockedPatterns
    ) -> sqlite3.Connection:
        conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, _MAX_VALUE_BYTES)
        conn.setlimit(sqlite3.SQLITE_LIMIT_COLUMN, _MAX_COLUMNS)
        conn.setlimit(sqlite3.SQLITE_LIMIT_LIKE_PATTERN_LENGTH, _MAX_LIKE_PATTERN_BYTES)
        conn.setlimit(sqlite3.SQLITE_LIMIT_VDBE_OP, _MAX_PROGRAM_OPS)
        printf.install(conn)
        search.install(conn)
        patterns.install(conn)
        self._load_image(conn)
        return conn

    def _load_image(self, conn: sqlite3.Connection) -> None:
        conn.deserialize(self._image)
        # The page cap belongs to the database, not the connection: every load sets it again.
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {(len(self._image) + _MAX_GROWTH_BYTES) // page_size}")

    async def acquire(self) -> World:
        world = self._free.get_nowait() if not self._free.empty() else await self._wait_for_world()
        self._lease_started[world.index] = time.monotonic()
        self.max_leased = max(self.max_leased, self.leased)
        return world

    async def _wait_for_world(self) -> World:
        self.waiting += 1
        self.max_waiting = max(self.max_waiting, self.waiting)
        try:
            return await self._free.get()
        finally:  # a waiter cancelled (its driver gave up) no longer waits either
            self.waiting -= 1

    @property
    def leased(self) -> int:
        return len(self._lease_started)

    @property
    def busy_world_seconds(self) -> float:
        """World-seconds leased so far, the leases still open included: utilisation's numerator."""
        now = time.monotonic()
        return self._busy_closed + sum(now - t for t in self._lease_started.values())

    def release(self, world: World) -> None:
        # Nothing of this lease may reach the next: not its writes, not an open transaction, and not
        # the connection's own state (the statements it prepared and cached, last_insert_rowid(),
        # total_changes()). A new connection on the pristine image holds none of it.
        world.conn.close()
        world.conn = self._fresh_connection(world.printf, world.search, world.patterns)
        world.dirty = False
        self._busy_closed += time.monotonic() - self._lease_started.pop(world.index)
        self._free.put_nowait(world)
