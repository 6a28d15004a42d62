"""The benchmarks page's tables, rendered from the records under bench/results/ (bench/record.py).

    python bench/render.py [--out docs/generated]

writes one Markdown file per benchmark, `bench-<benchmark>.md`: each record of it, newest first,
as its title, its provenance (command, commit, machine, date) and a table of its rows; for a
benchmark measured again as the code changed (HISTORY), the newest record, and in
`bench-<benchmark>-history.md` one figure across all its records. The
benchmarks page (docs/benchmarks.md) includes them, so its figures are the records' and nothing
else. Run by `make docs`.
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from record import RESULTS, ROOT, load_all


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):  # as measured: no digits added or dropped
        return f"{int(value):,}" if value.is_integer() and abs(value) >= 1000 else f"{value:,}"
    if isinstance(value, list):
        return " / ".join(_cell(v) for v in value)
    if isinstance(value, dict):
        return ", ".join(f"{k} {_cell(v)}" for k, v in value.items())
    return str(value).replace("|", "\\|").replace("\n", " ")


def _columns(figures: dict[str, Any]) -> list[str]:
    if figures.get("columns"):
        return list(figures["columns"])
    seen: dict[str, None] = {}
    for row in figures["rows"]:
        for key in row:
            seen.setdefault(key, None)
    return list(seen)


def table(figures: dict[str, Any]) -> str:
    columns = _columns(figures)
    lines = ["| " + " | ".join(c.replace("_", " ") for c in columns) + " |", "|" + "---|" * len(columns)]
    for row in figures["rows"]:
        lines.append("| " + " | ".join(_cell(row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def render_record(record: dict[str, Any]) -> str:
    figures = record["figures"]
    parts = [
        f"#### {record['title']}",
        "",
        f"`{record['command']}` · commit `{record['commit']}` · {record['date']} · "
        f"{_cell(record['machine']['description'])} · `bench/results/{record['_file']}`"
        + (" (carried over)" if record.get("provenance") else ""),
        "",
    ]
    if figures.get("notes"):
        parts += [figures["notes"], ""]
    parts += [table(figures), ""]
    for extra in figures.get("tables", []):  # a record may carry more tables of another shape, each titled
        parts += [f"**{extra['title']}**", "", table(extra), ""]
    return "\n".join(parts)


# Benchmarks measured again as the code changed: one table of a figure across their records, oldest
# first, rows keyed by the configuration.
HISTORY: dict[str, tuple[list[str], list[str]]] = {
    "ceiling": (["tokens", "in flight", "completion tokens"], ["turns/s", "CPU ms/turn"]),
}


def history(records: list[dict[str, Any]], keys: list[str], shown: list[str]) -> str:
    records = sorted(records, key=lambda r: (r["date"], r["_file"]))
    configurations: dict[tuple[Any, ...], dict[int, str]] = {}
    for i, record in enumerate(records):
        for row in record["figures"]["rows"]:
            cell = ", ".join(_cell(row.get(k)) for k in shown)
            configurations.setdefault(tuple(row.get(k) for k in keys), {})[i] = cell
    head = [k.replace("_", " ") for k in keys] + [f"`{r['commit']}` {r['date']}" for r in records]
    lines = [
        f"{', '.join(shown)} in each record, oldest first:",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for configuration, cells in configurations.items():
        values = [_cell(v) for v in configuration] + [cells.get(i, "") for i in range(len(records))]
        lines.append("| " + " | ".join(values) + " |")
    lines += ["", "The records, oldest first (each with its command and machine):", ""]
    lines += [f"- `{r['commit']}` {r['date']}: {r['title']} (`bench/results/{r['_file']}`)" for r in records]
    return "\n".join(lines) + "\n"


def render(records: list[dict[str, Any]]) -> dict[str, str]:
    """File name -> Markdown, one file per benchmark, its records newest first."""
    by_benchmark: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        by_benchmark[record["benchmark"]].append(record)
    pages = {}
    for benchmark, items in by_benchmark.items():
        items.sort(key=lambda r: (r["date"], r["_file"]), reverse=True)
        if benchmark in HISTORY:  # the newest in full; every record in the history's table
            pages[f"bench-{benchmark}.md"] = render_record(items[0])
            pages[f"bench-{benchmark}-history.md"] = history(items, *HISTORY[benchmark])
        else:
            pages[f"bench-{benchmark}.md"] = "\n".join(render_record(r) for r in items)
    return pages


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "generated")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in render(load_all(args.results)).items():
        (args.out / name).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
