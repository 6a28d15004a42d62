"""Measurements as data: one JSON record per benchmark run, under bench/results/.

A record says what was run (`command`), on which code (`commit`), on what (`machine`), when
(`date`) and what came out (`figures`: `rows`, a list of flat objects, and optionally `columns`, the
keys to show and their order, `notes`, and `tables`: more tables of another shape, each a `title`
with its own `rows` and optional `columns`). bench/render.py turns the records into the tables of
the benchmarks page, so a figure and its provenance are kept together and the prose carries
neither dates nor commits. Standard library only.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
REQUIRED = ("benchmark", "title", "command", "commit", "machine", "date", "figures")


def commit(tree: Path = ROOT) -> str:
    """`tree`'s checked-out commit, `+dirty` when tracked files differ from it; `unknown` outside git."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=7", "HEAD"], cwd=tree, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"], cwd=tree, capture_output=True, text=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return round(pages * size / 2**30, 1)


def machine() -> dict[str, Any]:
    """This machine, as a record describes it."""
    cpus = os.cpu_count()
    memory = _memory_gib()
    model = _cpu_model()
    return {
        "description": f"{cpus} CPUs ({model}), {memory} GiB, Python {platform.python_version()}, {platform.system()}",
        "cpus": cpus,
        "cpu_model": model,
        "memory_gib": memory,
        "python": platform.python_version(),
    }


def make(benchmark: str, title: str, rows: list[dict[str, Any]], *, columns: list[str] | None = None,
         notes: str | None = None, argv: list[str] | None = None,
         code: str | None = None) -> dict[str, Any]:  # fmt: skip
    """A record of this run: the command as typed (`sys.argv` by default), this commit (or `code`: the
    commit a long run started at, read then, since the checkout may move on while it runs), this
    machine, today."""
    argv = sys.argv if argv is None else argv
    script = Path(argv[0])
    shown = script.relative_to(ROOT).as_posix() if script.is_absolute() and script.is_relative_to(ROOT) else argv[0]
    figures: dict[str, Any] = {"rows": rows}
    if columns:
        figures["columns"] = columns
    if notes:
        figures["notes"] = notes
    return {
        "benchmark": benchmark,
        "title": title,
        "command": " ".join([shown, *argv[1:]]),
        "commit": code or commit(),
        "machine": machine(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "figures": figures,
    }


def flat(row: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """A result's nested objects as one flat row (`outer.inner` keys); lists kept as they are."""
    out: dict[str, Any] = {}
    for key, value in row.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def check(record: Any, where: str = "record") -> dict[str, Any]:
    """The record, or ValueError naming what it lacks."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: a record is a JSON object")
    missing = [key for key in REQUIRED if key not in record]
    if missing:
        raise ValueError(f"{where}: missing {', '.join(missing)}")
    machine = record["machine"]
    if not isinstance(machine, dict) or not machine.get("description"):
        raise ValueError(f"{where}: machine needs a description")
    figures = record["figures"]
    rows = figures.get("rows") if isinstance(figures, dict) else None
    if not isinstance(rows, list) or not rows or not all(isinstance(row, dict) for row in rows):
        raise ValueError(f"{where}: figures.rows must be a non-empty list of objects")
    return record


def write(record: dict[str, Any], path: str | os.PathLike[str]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(check(record), indent=1, ensure_ascii=False) + "\n")
    return out


def is_record(data: Any) -> bool:
    """A record names its benchmark; other JSON under bench/results/ is a script's raw output that a
    page cites by its path (it is not rendered)."""
    return isinstance(data, dict) and "benchmark" in data


def normalize(data: dict[str, Any]) -> dict[str, Any]:
    """A record written by another script in a near shape, read as this module writes one: figures as a
    list of rows, a machine as a string or without a description, a date with its time, no title."""
    record = dict(data)
    record.setdefault("title", record.get("what") or str(record.get("benchmark", "")).replace("_", " "))
    machine = record.get("machine")
    if isinstance(machine, str):
        record["machine"] = {"description": machine}
    elif isinstance(machine, dict) and not machine.get("description"):
        record["machine"] = {**machine, "description": ", ".join(f"{k} {v}" for k, v in machine.items())}
    if isinstance(record.get("date"), str):
        record["date"] = record["date"][:10]
    figures = record.get("figures")
    if isinstance(figures, list):
        record["figures"] = {"rows": [flat(row) if isinstance(row, dict) else {"value": row} for row in figures]}
    elif isinstance(figures, dict) and "rows" not in figures:
        record["figures"] = {"rows": [flat(figures)]}
    note = record.get("note")
    if note and isinstance(record["figures"], dict):
        record["figures"].setdefault("notes", note)
    return record


def load_all(folder: Path = RESULTS) -> list[dict[str, Any]]:
    """Every record under `folder`, checked; ordered by benchmark, then date, then file name."""
    records = []
    for path in sorted(folder.glob("*.json")):
        data = json.loads(path.read_text())
        if not is_record(data):
            continue
        record = check(normalize(data), str(path))
        record["_file"] = path.name
        records.append(record)
    return sorted(records, key=lambda r: (r["benchmark"], r["date"], r["_file"]))
