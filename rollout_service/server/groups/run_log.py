"""The run log's writer: every finished group appended, as it finishes, to `<runs-dir>/<run-id>.jsonl`.

A trainer that crashes can recover every group it paid for from the file (`rollout_service.runs`
reads it). Writes go through one writer task, so the event loop never blocks on the disk and lines
never interleave. The queue is bounded: when the disk cannot keep up or refuses (full, no
permission), groups are dropped from the log and counted, the error shows in /health and the log,
and memory stays bounded; writing resumes when the disk does.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
from pathlib import Path

from ...runs import valid_run_id

log = logging.getLogger("rollout_service.runlog")


class RunLog:
    def __init__(self, runs_dir: Path, run_id: str, max_queue: int = 1024) -> None:
        if not valid_run_id(run_id):
            raise ValueError(f"run id {run_id!r}: use letters, digits, '.', '_' and '-' only")
        private_folder(runs_dir)
        self.path = runs_dir / f"{run_id}.jsonl"
        if self.path.is_symlink() or (self.path.exists() and not self.path.is_file()):
            raise ValueError(f"run log {self.path}: is a symlink or not a plain file; the service writes only its own")
        self.groups_written = 0
        self.groups_lost = 0
        self.error: str | None = None  # the last write's error, cleared by a write that succeeds
        self._queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=max_queue)
        self._writer: asyncio.Task | None = None

    def start(self) -> None:
        self._writer = asyncio.create_task(self._write_forever())

    def append(self, group_json: bytes) -> None:
        try:
            self._queue.put_nowait(group_json)
        except asyncio.QueueFull:
            self.groups_lost += 1
            self.error = self.error or f"{self._queue.maxsize} groups waiting for the disk: dropping groups"
            log.error("run log %s: the write queue is full; a group was dropped from the log", self.path)

    async def close(self) -> None:
        """Flush every queued group, then stop the writer."""
        if self._writer is None:
            return
        while True:
            try:
                self._queue.put_nowait(None)
                break
            except asyncio.QueueFull:
                await asyncio.sleep(0.05)
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
                try:
                    await asyncio.to_thread(self._write, batch)
                    self.groups_written += len(batch)
                    self.error = None
                except OSError as exc:
                    self.groups_lost += len(batch)
                    self.error = f"cannot write {self.path}: {exc.strerror or exc}"
                    log.error("run log: %s; %d group(s) lost from the log", self.error, len(batch))
            if done:
                return
            del lines, batch  # not kept while the next group is awaited: an idle writer holds none

    def _write(self, lines: list[bytes]) -> None:
        with open_private_log(self.path) as f:
            _drop_torn_tail(f, self.path)
            f.write(b"".join(line + b"\n" for line in lines))
            f.flush()


def private_folder(folder: Path) -> None:
    """Make `folder` (and its missing parents) the service user's own: run logs hold every prompt and
    completion. A folder someone else owns is refused; one of ours is closed to others (0700)."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.stat()
    if info.st_uid != os.geteuid():
        raise ValueError(f"runs folder {folder}: owned by another user (uid {info.st_uid}); use a folder of your own")
    if stat.S_IMODE(info.st_mode) & 0o077:
        log.warning("runs folder %s: was open to other users (%o); now 0700", folder, stat.S_IMODE(info.st_mode))
        folder.chmod(0o700)


def open_private_log(path: Path):
    """`path` opened for appending and reading, 0600, never through a symlink (whoever planted one would
    have the service truncate its target) and only if it is a plain file (a FIFO would block the writer)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise OSError(f"{path} is not a plain file")
        if stat.S_IMODE(info.st_mode) & 0o077:
            os.fchmod(fd, 0o600)
        os.set_blocking(fd, True)
        return os.fdopen(fd, "a+b")
    except BaseException:
        os.close(fd)
        raise


def _drop_torn_tail(f, path: Path) -> None:
    """A last line cut short (a crash or a full disk mid-write) is no group: drop it before appending,
    so that new groups are not glued onto it and only a log's very last line can ever be torn."""
    end = f.seek(0, os.SEEK_END)
    if end == 0:
        return
    f.seek(end - 1)
    if f.read(1) == b"\n":
        return
    keep, pos = 0, end  # keep everything up to the last newline, read backwards in chunks
    while pos > 0:
        start = max(0, pos - 65536)
        f.seek(start)
        newline = f.read(pos - start).rfind(b"\n")
        if newline >= 0:
            keep = start + newline + 1
            break
        pos = start
    f.truncate(keep)
    log.warning("run log %s: dropped a torn last line (%d bytes) before appending", path, end - keep)
