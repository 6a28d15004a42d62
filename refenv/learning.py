"""The `learning` suite: families of many small instances, each answerable from its own prompt in one
turn, for seeing a small model learn under RL on a CPU.

A family here has dozens of instances of one template, and `--split auto:F` splits it by instance (each
task's slug), not by family: the eval side holds unseen instances of the families trained on. The
candidates are kept side by side so the base model's pass rate on each can be measured through the
service (bench/learning_family.py); docs/trl.md says which was chosen and why.
"""

from __future__ import annotations

import random
import sqlite3
from collections.abc import Callable, Iterator

from refenv.tasks import Task, finish_task
from refenv.world import COUNTRIES, ORDER_STATUSES

# The family the examples train on by default: the candidate whose base pass rate (temperature 1.0,
# no grammar constraint) sat inside 20-60 % with most groups of 4 carrying a reward spread.
DEFAULT_FAMILY = "learn-order-status"
INSTANCES = 100  # per family: about 80 to train and 20 unseen instances to evaluate (auto:0.8)
_NAMES = (
    "Ada",
    "Bruno",
    "Chen",
    "Dana",
    "Emeka",
    "Fatima",
    "Goran",
    "Hana",
    "Ivan",
    "Jun",
    "Kofi",
    "Lena",
    "Mateo",
    "Nadia",
    "Omar",
    "Priya",
)

# (prompt, oracle SQL, answer kind, the closed set of a "choice" answer)
Template = tuple[str, str, str, tuple[str, ...]]


def _stated(fact: str, question: str, value: str, choices: tuple[str, ...]) -> Template:
    """A value the prompt states, asked back: one of `choices`."""
    return f"{fact} {question}", f"SELECT '{value}'", "choice", choices


def _order_status(rng: random.Random) -> Template:
    order, status = rng.randint(100, 999), rng.choice(ORDER_STATUSES)
    return _stated(
        f"Order {order} has status '{status}'.", f"What is the status of order {order}?", status, ORDER_STATUSES
    )


def _country(rng: random.Random) -> Template:
    name, country = rng.choice(_NAMES), rng.choice(COUNTRIES)
    return _stated(f"Customer {name} lives in {country}.", f"Which country does {name} live in?", country, COUNTRIES)


def _add(rng: random.Random) -> Template:
    a, b = rng.randint(2, 30), rng.randint(2, 30)
    return f"What is {a} + {b}?", f"SELECT {a} + {b}", "int", ()


def _larger(rng: random.Random) -> Template:
    a, b = rng.sample(range(10, 100), 2)
    return f"Which number is larger, {a} or {b}?", f"SELECT CAST(MAX({a}, {b}) AS TEXT)", "choice", (str(a), str(b))


def _count_items(rng: random.Random) -> Template:
    items = rng.sample(("apple", "pen", "cup", "book", "lamp", "chair", "key", "box"), rng.randint(2, 6))
    return f"How many items are in this list: {', '.join(items)}?", f"SELECT {len(items)}", "int", ()


FAMILIES: dict[str, Callable[[random.Random], Template]] = {
    "learn-order-status": _order_status,
    "learn-customer-country": _country,
    "learn-add": _add,
    "learn-larger": _larger,
    "learn-count-items": _count_items,
}


def _instances(family: str, make: Callable[[random.Random], Template]) -> Iterator[Template]:
    """INSTANCES distinct prompts of one family, the same on every machine (a seed of its own: the
    suite does not move with the database's --seed)."""
    rng, seen = random.Random(f"refenv-learning:{family}"), set[str]()
    while len(seen) < INSTANCES:
        template = make(rng)
        if template[0] not in seen:
            seen.add(template[0])
            yield template


def build_learning_suite(conn: sqlite3.Connection) -> list[Task]:
    tasks: list[Task] = []
    for family, make in FAMILIES.items():
        for k, (prompt, oracle, kind, choices) in enumerate(_instances(family, make), start=1):
            row = dict(family=family, category="learning", difficulty="easy", answer_kind=kind)
            task = Task(
                task_id=f"{family.removeprefix('learn-')}-{k:02d}",
                slug=f"{family}-{k:02d}",
                prompt=prompt,
                oracle=oracle,
                turn_budget=1,
                plain_answer=True,
                choices=choices,
                split_by_instance=True,
                **row,  # type: ignore[arg-type]
            )
            tasks.append(finish_task(conn, task))
    return tasks
