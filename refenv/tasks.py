"""The task suite: questions generated from the schema, each with a hidden oracle and a family."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, cast

from refenv.world import COUNTRIES, INVOICE_STATUSES, ORDER_STATUSES, PRODUCT_CATEGORIES, SEGMENTS

AnswerKind = Literal["int", "money", "text", "list", "choice"]


@dataclass(frozen=True)
class Task:
    """One task. `oracle` is hidden from the model; for write tasks it is the reference UPDATE."""

    task_id: str
    slug: str
    prompt: str
    category: str
    difficulty: str
    family: str
    answer_kind: AnswerKind
    oracle: str
    writes: bool = False
    # Write tasks: the table the UPDATE touches and the value the matched rows must end with.
    target_table: str = ""
    target_column: str = ""
    turn_budget: int = 4
    # One turn, answered in plain words (no JSON action, no query): the prompt holds what the answer
    # needs. The learning suite's tasks.
    plain_answer: bool = False
    # "choice" tasks: the closed set the answer is one of; an answer passes when it names the expected
    # value and no other of the set.
    choices: tuple[str, ...] = ()
    # `--split auto:F` sends each instance (slug) to a side, not the whole family: held-out instances
    # of a family trained on (the learning suite's families of many instances).
    split_by_instance: bool = False
    expected: object = field(default=None, compare=False)

    def public(self) -> dict:
        return {
            "task_id": self.task_id,
            "slug": self.slug,
            "prompt": self.prompt,
            "category": self.category,
            "difficulty": self.difficulty,
            "writes": self.writes,
            "family": self.family,
        }


def _slugify(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def _templates() -> list[dict]:
    """(family, category, difficulty, kind, prompt, oracle, extra) rows before ids are given."""
    rows: list[dict] = []

    def add(family, category, difficulty, kind, prompt, oracle, **extra):
        rows.append(
            dict(
                family=family,
                category=category,
                difficulty=difficulty,
                answer_kind=kind,
                prompt=prompt,
                oracle=oracle,
                **extra,
            )
        )

    # Vocabulary: the closed sets are in the prompt, so a small model can pass without SQL.
    add(
        "vocab-invoice-paid",
        "lookup",
        "easy",
        "text",
        f"Which status marks a fully paid invoice? Choose one of: {', '.join(INVOICE_STATUSES)}.",
        "SELECT 'paid'",
        turn_budget=2,
    )
    add(
        "vocab-order-arrived",
        "lookup",
        "easy",
        "text",
        f"Which status marks an order that reached the customer? Choose one of: {', '.join(ORDER_STATUSES)}.",
        "SELECT 'delivered'",
        turn_budget=2,
    )
    add(
        "vocab-invoice-late",
        "lookup",
        "easy",
        "text",
        f"Which status marks an unpaid invoice past its due date? Choose one of: {', '.join(INVOICE_STATUSES)}.",
        "SELECT 'overdue'",
        turn_budget=2,
    )
    add(
        "vocab-segment-large",
        "lookup",
        "easy",
        "text",
        f"Which customer segment holds the largest companies? Choose one of: {', '.join(SEGMENTS)}.",
        "SELECT 'enterprise'",
        turn_budget=2,
    )
    for table in ("customers", "products", "orders", "invoices"):
        add(
            "count-table",
            "counts",
            "easy",
            "int",
            f"How many rows does the {table} table have?",
            f"SELECT COUNT(*) FROM {table}",
        )
    for status in INVOICE_STATUSES:
        add(
            "count-invoices-by-status",
            "filters",
            "easy",
            "int",
            f"How many invoices have status '{status}'?",
            f"SELECT COUNT(*) FROM invoices WHERE status = '{status}'",
        )
    for status in ORDER_STATUSES:
        add(
            "count-orders-by-status",
            "filters",
            "easy",
            "int",
            f"How many orders have status '{status}'?",
            f"SELECT COUNT(*) FROM orders WHERE status = '{status}'",
        )
    for category in ("books", "toys"):
        add(
            "count-products-by-category",
            "filters",
            "easy",
            "int",
            f"How many products are in the '{category}' category?",
            f"SELECT COUNT(*) FROM products WHERE category = '{category}'",
        )
    for country in COUNTRIES[:4]:
        add(
            "count-customers-by-country",
            "filters",
            "easy",
            "int",
            f"How many customers are in {country}?",
            f"SELECT COUNT(*) FROM customers WHERE country = '{country}'",
        )
    for segment in SEGMENTS:
        add(
            "count-customers-by-segment",
            "filters",
            "easy",
            "int",
            f"How many customers are in the '{segment}' segment?",
            f"SELECT COUNT(*) FROM customers WHERE segment = '{segment}'",
        )
    for status in ("paid", "overdue", "issued"):
        add(
            "sum-invoice-amount",
            "aggregates",
            "medium",
            "money",
            f"What is the total amount of all invoices with status '{status}'? Round to 2 decimals.",
            f"SELECT ROUND(SUM(amount), 2) FROM invoices WHERE status = '{status}'",
        )
    for category in PRODUCT_CATEGORIES:
        add(
            "max-product-price",
            "aggregates",
            "medium",
            "money",
            f"What is the highest price of any product in the '{category}' category?",
            f"SELECT MAX(price) FROM products WHERE category = '{category}'",
        )
    for category in PRODUCT_CATEGORIES[:3]:
        add(
            "avg-product-price",
            "aggregates",
            "medium",
            "money",
            f"What is the average price of products in the '{category}' category? Round to 2 decimals.",
            f"SELECT ROUND(AVG(price), 2) FROM products WHERE category = '{category}'",
        )
    for country in COUNTRIES[:4]:
        add(
            "count-orders-by-country",
            "joins",
            "medium",
            "int",
            f"How many orders were placed by customers in {country}?",
            f"SELECT COUNT(*) FROM orders o JOIN customers c ON c.id = o.customer_id WHERE c.country = '{country}'",
        )
    for category in PRODUCT_CATEGORIES[:3]:
        add(
            "units-sold-by-category",
            "joins",
            "hard",
            "int",
            f"How many units of '{category}' products were ordered in total (sum of quantities)?",
            "SELECT COALESCE(SUM(i.quantity), 0) FROM order_items i JOIN products p ON p.id = i.product_id "
            f"WHERE p.category = '{category}'",
        )
    for k in (1, 3):
        add(
            "top-products-by-price",
            "top-k",
            "medium",
            "list",
            f"List the names of the {k} most expensive products, most expensive first, comma-separated.",
            f"SELECT name FROM products ORDER BY price DESC LIMIT {k}",
        )
    add(
        "top-customer-by-orders",
        "top-k",
        "hard",
        "list",
        "Which customer (name) placed the most orders? If tied, the one with the lowest id.",
        "SELECT c.name FROM customers c JOIN orders o ON o.customer_id = c.id "
        "GROUP BY c.id ORDER BY COUNT(*) DESC, c.id LIMIT 1",
    )
    for cid in (1, 2, 3):
        add(
            "customer-email-by-id",
            "lookup",
            "easy",
            "text",
            f"What is the email address of the customer with id {cid}?",
            f"SELECT email FROM customers WHERE id = {cid}",
        )
    add(
        "void-overdue-before",
        "writes",
        "medium",
        "text",
        "Set the status of every 'overdue' invoice with a due_date before '2024-06-01' to 'void'.",
        "UPDATE invoices SET status = 'void' WHERE status = 'overdue' AND due_date < '2024-06-01'",
        writes=True,
        target_table="invoices",
        target_column="status",
    )
    add(
        "issue-drafts",
        "writes",
        "easy",
        "text",
        "Set the status of every 'draft' invoice to 'issued'.",
        "UPDATE invoices SET status = 'issued' WHERE status = 'draft'",
        writes=True,
        target_table="invoices",
        target_column="status",
    )
    for cid in (4, 5):
        add(
            "cancel-pending-of-customer",
            "writes",
            "medium",
            "text",
            f"Cancel every 'pending' order of the customer with id {cid} (set its status to 'cancelled').",
            f"UPDATE orders SET status = 'cancelled' WHERE status = 'pending' AND customer_id = {cid}",
            writes=True,
            target_table="orders",
            target_column="status",
        )
    return rows


def build_suite(conn: sqlite3.Connection) -> list[Task]:
    """All tasks with their expected answers computed on the pristine database."""
    tasks: list[Task] = []
    for index, row in enumerate(_templates(), start=1):
        slug = _slugify(row["prompt"])[:60].rstrip("-")
        tasks.append(finish_task(conn, Task(task_id=f"t{index:03d}", slug=f"{slug}-{index:03d}", **row)))
    return tasks


def finish_task(conn: sqlite3.Connection, task: Task) -> Task:
    """The task with its expected answer, computed by its oracle on the pristine database."""
    expected: object
    if task.writes:
        expected = _expected_after_write(conn, task)
    else:
        expected = normalize_expected(task, conn.execute(task.oracle).fetchall())
    return dataclasses.replace(task, expected=expected)


def _expected_after_write(conn: sqlite3.Connection, task: Task) -> dict[int, tuple]:
    """The target table's rows after the reference UPDATE, applied to a scratch copy."""
    scratch = sqlite3.connect(":memory:", isolation_level=None)
    scratch.deserialize(conn.serialize())
    scratch.execute(task.oracle)
    rows = scratch.execute(f"SELECT * FROM {task.target_table} ORDER BY id").fetchall()
    scratch.close()
    return {r[0]: r for r in rows}


def is_exact(task: Task, answer: str | None) -> bool:
    """The answer is the expected value alone (quotes and a final period aside)."""
    if answer is None:
        return False
    return answer.strip().rstrip(".").strip().strip("\"'`").strip().lower() == str(task.expected).lower()


def normalize_expected(task: Task, rows: list[tuple]) -> object:
    if task.answer_kind == "list":
        return [str(r[0]) for r in rows]
    value = rows[0][0] if rows else None
    if task.answer_kind == "int":
        return int(value or 0)
    if task.answer_kind == "money":
        return round(float(value or 0.0), 2)
    return str(value)


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def answer_matches(task: Task, answer: str | None) -> bool:
    """Compare the model's answer with the oracle's, forgiving format but not value."""
    if answer is None or task.writes:
        return False
    text = answer.strip().strip("\"'`").rstrip(".").strip()
    if task.answer_kind in ("int", "money"):
        numbers = _NUMBER.findall(text)
        if len(numbers) != 1:
            return False
        value = float(numbers[0].replace(",", ""))
        return abs(value - float(cast(float, task.expected))) <= 0.01 + 1e-9
    if task.answer_kind == "choice":
        named = {c.lower() for c in task.choices if re.search(rf"\b{re.escape(c)}\b", text, re.IGNORECASE)}
        return named == {str(task.expected).lower()}
    if task.answer_kind == "list":
        got = [p.strip().strip("\"'").lower() for p in re.split(r"[,\n;]", text) if p.strip()]
        return got == [e.lower() for e in cast(list[str], task.expected)]
    return text.lower() == str(task.expected).lower()


@dataclass(frozen=True)
class Split:
    """Which side of the split is served; `spec` as given on the command line."""

    spec: str | None
    side: str | None

    def select(self, tasks: list[Task]) -> list[Task]:
        if not self.spec:
            return tasks
        if self.spec.startswith("auto:"):
            fraction = float(self.spec.removeprefix("auto:"))

            # Whole families go to one side: a template seen in training never grades eval. A family of
            # many instances (split_by_instance) is split by instance: unseen instances of it grade eval.
            def side_of(task: Task) -> str:
                key = task.slug if task.split_by_instance else task.family
                bucket = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF
                return "train" if bucket < fraction else "eval"

            return [t for t in tasks if side_of(t) == (self.side or "train")]
        sides = json.loads(Path(self.spec).read_text())
        wanted = set(sides.get(self.side or "train", []))
        return [t for t in tasks if t.task_id in wanted or t.slug in wanted or t.family in wanted]


def parse_split(spec: str | None) -> None:
    """Validate a `--split` value early, so a typo fails at start rather than serving nothing."""
    if spec is None:
        return
    if spec.startswith("auto:"):
        fraction = float(spec.removeprefix("auto:"))
        if not 0.0 < fraction < 1.0:
            raise ValueError("--split auto:F needs 0 < F < 1")
    elif not Path(spec).is_file():
        raise ValueError(f"--split {spec}: no such file (expected auto:F or a JSON file)")
