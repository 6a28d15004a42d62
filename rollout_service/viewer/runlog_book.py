"""The viewer over a run log (`rollout-service view RUNLOG`): the file indexed once (a byte offset and a
summary per group; a group's page reads its one line again), and indexed on from where it stopped
whenever asked, so a log the service still writes shows its new groups. Read-only: the file is never
written. Memory: a summary per group (a few hundred bytes), never the groups themselves.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from pydantic import ValidationError

from ..protocol import GroupResult
from ..server.metrics import Metrics
from ..server.sampler.task_stats import TaskStatsBook
from .book import GroupPage, GroupQuery, GroupSummary, RunTally, page, summarize
from .overview import Overview, RunPoint, TaskRow

log = logging.getLogger("rollout_service.viewer")

POINTS_SHOWN = 2000  # the overview's per-group charts: the newest groups of the log


class _Current:
    label = "(none)"


class _RunVersions:
    """What TaskStatsBook asks of the policy: the versions in the order the log met them."""

    def __init__(self) -> None:
        self.order: dict[str, int] = {}
        self.current = _Current()

    def saw(self, version: str | None) -> None:
        if version is not None and version not in self.order:
            self.order[version] = len(self.order)

    def behind(self, label: str) -> int:
        return len(self.order) - 1 - self.order.get(label, len(self.order) - 1)


class RunLogBook:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.run_id = path.stem
        self.offsets: list[int] = []
        self.summaries: list[GroupSummary] = []
        self.tally = RunTally()
        self.versions = _RunVersions()
        self.stats = TaskStatsBook(self.versions, Metrics())  # type: ignore[arg-type]
        self.unreadable = 0  # lines that are not groups (not the last: a torn one is read again later)
        self._read_to = 0
        self._lock = asyncio.Lock()

    async def refresh(self) -> None:
        """Index what the file gained since the last call, in a thread: the event loop never reads it."""
        async with self._lock:
            await asyncio.to_thread(self._index)

    def _index(self) -> None:
        with open(self.path, "rb") as f:
            f.seek(self._read_to)
            while True:
                start = f.tell()
                line = f.readline()
                if not line.endswith(b"\n"):
                    break  # the end, or a line still being written: read again next time
                self._read_to = f.tell()
                if not line.strip():
                    continue
                try:
                    result = GroupResult.model_validate_json(line)
                except ValidationError:
                    self.unreadable += 1
                    log.warning("%s: a line at byte %d is not a group record; skipped", self.path, start)
                    continue
                self._add(start, result)

    def _add(self, offset: int, result: GroupResult) -> None:
        summary = summarize(len(self.summaries), result, None)  # a run log does not record task families
        self.offsets.append(offset)
        self.summaries.append(summary)
        self.tally.add(summary, result)
        self.versions.saw(result.newest_policy_version)
        self.stats.record(result)

    # -- what the endpoints ask ------------------------------------------------------------------

    def overview(self) -> Overview:
        return Overview(
            mode="runlog",
            run_id=self.run_id,
            status="finished",
            groups=len(self.summaries),
            policy_version=next(reversed(self.versions.order), None),
            by_group=[
                RunPoint(seq=s.seq, mean=s.mean, completion_tokens=s.completion_tokens)
                for s in self.summaries[-POINTS_SHOWN:]
            ],
            signal_by_version=self.tally.signal_by_version(),
            failures=self.tally.failures_by_kind(),
        )

    def groups(self, query: GroupQuery) -> GroupPage:
        return page(self.summaries, query)

    async def group(self, seq: int) -> GroupResult | None:
        if not 0 <= seq < len(self.offsets):
            return None
        return await asyncio.to_thread(self._read, self.offsets[seq])

    def _read(self, offset: int) -> GroupResult:
        with open(self.path, "rb") as f:
            f.seek(offset)
            return GroupResult.model_validate_json(f.readline())

    def tasks(self) -> list[TaskRow]:
        return [TaskRow(**s.model_dump()) for s in self.stats.stats()]
