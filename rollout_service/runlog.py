"""The run log: every finished group appended, as it finishes, to `<runs-dir>/<run-id>.jsonl`.

A trainer that crashes can recover every group it paid for from the file; `export` reads it.
Writes go through one writer task, so the event loop never blocks on the disk and lines never
interleave.
"""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Iterator

from .schemas import GroupResult

_RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def valid_run_id(run_id: str) -> bool:
    """Run ids become file names: letters, digits, '.', '_' and '-' only."""
    return bool(_RUN_ID.match(run_id)) and ".." not in run_id


class RunLog:
    def __init__(self, runs_dir: Path, run_id: str) -> None:
        if not valid_run_id(run_id):
            raise ValueError(f"run id {run_id!r}: use letters, digits, '.', '_' and '-' only")
        runs_dir.mkdir(parents=True, exist_ok=True)
        self.path = runs_dir / f"{run_id}.jsonl"
        self.groups_written = 0
        self._queue: asyncio.Queue[str | None] = asyncio.Queue()
        self._writer: asyncio.Task | None = None

    def start(self) -> None:
        self._writer = asyncio.create_task(self._write_forever())

    def append(self, group: GroupResult) -> None:
        self._queue.put_nowait(group.model_dump_json(by_alias=True))

    async def close(self) -> None:
        """Flush every queued group, then stop the writer."""
        if self._writer is None:
            return
        self._queue.put_nowait(None)
        await self._writer
        self._writer = None

    async def _write_forever(self) -> None:
        while True:
            lines = [await self._queue.get()]
            while not self._queue.empty():
                lines.append(self._queue.get_nowait())
            done = None in lines
            batch = [line for line in lines if line is not None]
            if batch:
                await asyncio.to_thread(self._write, batch)
            if done:
                return

    def _write(self, lines: list[str]) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
            f.flush()
        self.groups_written += len(lines)


def find_run(run: str, runs_dir: Path) -> Path:
    """A run id in `runs_dir`, or a path to a run log."""
    candidate = Path(run)
    if candidate.suffix == ".jsonl" and candidate.is_file():
        return candidate
    if valid_run_id(run) and (runs_dir / f"{run}.jsonl").is_file():
        return runs_dir / f"{run}.jsonl"
    raise FileNotFoundError(f"no run log {run!r} (looked for {runs_dir / (run + '.jsonl')}); "
                            f"runs there: {', '.join(p.stem for p in sorted(runs_dir.glob('*.jsonl'))) or 'none'}")


def read_groups(path: Path) -> Iterator[GroupResult]:
    """Every group of a run log; a torn last line (a crash mid-write) is skipped."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield GroupResult.model_validate(json.loads(line))
            except ValueError:
                if f.readline() == "":  # only the very last line may be torn
                    return
                raise ValueError(f"{path}:{number}: not a group record") from None
