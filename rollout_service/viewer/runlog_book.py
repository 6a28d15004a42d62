"""The viewer over a run log (`rollout-service view RUNLOG`): the file indexed once (a byte offset and a
summary per group; a group's page reads its one line again), and indexed on from where it stopped
whenever asked, so a log the service still writes shows its new groups. Read-only: the file is never
written. Memory: a summary per group (about 2 KB), never the groups themselves.

The file may change under the viewer: truncated or replaced (the index starts over), deleted or
unreadable (the index made so far stays, and a group's page says the log changed), or end in a line
still being written (read again once the file grows, not on every request).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import stat
from pathlib import Path
from typing import BinaryIO

from pydantic import ValidationError

from ..protocol import GroupResult
from ..server.metrics import Metrics
from ..server.sampler.task_stats import TaskStatsBook
from .book import GroupPage, GroupQuery, GroupSummary, RunLogChanged, RunTally, page, summarize
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


def _open_file(path: Path) -> BinaryIO:
    """`path` opened to read if it is a plain file; OSError if not. Without O_NONBLOCK, a FIFO put where
    the log was would block the open until some writer came, and every request behind it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a plain file", str(path))
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


class RunLogBook:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.run_id = path.stem
        self._start()
        self._lock = asyncio.Lock()

    def _start(self) -> None:
        self.offsets: list[int] = []
        self.summaries: list[GroupSummary] = []
        self.tally = RunTally()
        self.versions = _RunVersions()
        self.stats = TaskStatsBook(self.versions, Metrics())  # type: ignore[arg-type]
        self.unreadable = 0  # lines that are not groups (not the last: a torn one is read again later)
        self._read_to = 0
        self._seen: tuple[int, int, int] | None = None  # the file's (device, inode, size) when last indexed

    async def refresh(self) -> None:
        """Index what the file gained since the last call, in a thread: the event loop never reads it.
        A file that cannot be read now keeps the index made so far (said in the log, not to the page)."""
        async with self._lock:
            try:
                await asyncio.to_thread(self._index)
            except OSError as exc:
                log.warning("%s: cannot read it now (%s); showing the groups indexed so far", self.path, exc)

    def _index(self) -> None:
        with _open_file(self.path) as f:
            st = os.fstat(f.fileno())
            seen = (st.st_dev, st.st_ino, st.st_size)
            if seen == self._seen:
                return  # nothing new: a torn last line is not read again until the file grows
            if self._seen is not None and (seen[:2] != self._seen[:2] or st.st_size < self._read_to):
                log.warning("%s: replaced or truncated under the viewer; indexing it again", self.path)
                self._start()
            self._seen = seen
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
        summary = self.summaries[seq]
        try:
            result = await asyncio.to_thread(self._read, self.offsets[seq])
        except (OSError, ValidationError) as exc:
            raise RunLogChanged(f"{self.path} changed under the viewer: group {seq} cannot be read again") from exc
        if (result.group_id, result.task_id) != (summary.group_id, summary.task_id):
            raise RunLogChanged(f"{self.path} changed under the viewer: group {seq} is not where it was")
        return result

    def _read(self, offset: int) -> GroupResult:
        with _open_file(self.path) as f:
            f.seek(offset)
            return GroupResult.model_validate_json(f.readline())

    def tasks(self) -> list[TaskRow]:
        return [TaskRow(**s.model_dump()) for s in self.stats.stats()]
