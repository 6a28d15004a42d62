"""Reading run logs: the file format the server's run log writes, for export and for trainers.

Each line of `<runs-dir>/<run-id>.jsonl` is one finished group, in the POST /groups answer's shape.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

from pydantic import ValidationError

from .protocol import GroupResult

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def valid_run_id(run_id: str) -> bool:
    """Run ids become file names: letters, digits, '.', '_' and '-' only."""
    return bool(_RUN_ID.fullmatch(run_id)) and ".." not in run_id  # fullmatch: `$` alone lets "x\n" through


def find_run(run: str, runs_dir: Path) -> Path:
    """A run id in `runs_dir`, or a path to a run log."""
    candidate = Path(run)
    if candidate.suffix == ".jsonl" and candidate.is_file():
        return candidate
    if valid_run_id(run) and (runs_dir / f"{run}.jsonl").is_file():
        return runs_dir / f"{run}.jsonl"
    runs = ", ".join(p.stem for p in sorted(runs_dir.glob("*.jsonl"))) or "none"
    raise FileNotFoundError(f"no run log {run!r} (looked for {runs_dir / (run + '.jsonl')}); runs there: {runs}")


def read_groups(path: Path) -> Iterator[GroupResult]:
    """Every group of a run log; a torn last line (a crash mid-write) is skipped."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield GroupResult.model_validate_json(line)
            except ValidationError:
                if f.readline() == "":  # only the very last line may be torn
                    return
                raise ValueError(f"{path}:{number}: not a group record") from None
