"""One vLLM for every pytest-xdist worker, and turns on it.

Under `pytest -n N` each worker is a session of its own: without this each would start its own CPU
vLLM (N times the memory, N compiles at once on a 2-core machine). The controller starts one as it
creates the workers (the start overlaps their collection and the tests that need no model) and hands
each worker its URL, its pid and a lock file in `workerinput`.

Tests share that server and the machine, except the few marked `alone`, which run while no other
test runs on any worker: those that change what the server answers for everyone (they swap its base
weights, pause it, drop its running requests), and those whose outcome depends on timing that
another test's load would distort (a rate measured at the receiver, two vLLM start-ups against a
deadline). The lock is flock(2): shared for a test, exclusive for a marked one, with a turnstile so
that a waiting `alone` test is not starved by the next shared ones.

Each `alone` test waits for the test running on the other worker, and that worker then waits for it:
one worker idle twice per mark. `AloneLastScheduling` (`--dist loadfile`, as `make test` runs it)
therefore sends the marked tests as one work unit after every file, where nothing is left to wait for.
It sends the files of tests marked `early` first: one so long that, started late, the others would
wait for it at the end.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import psutil
from xdist.scheduler import LoadFileScheduling

from rollout_service.launch.stack import log_tail

WORKERINPUT_KEY = "rollout_shared_vllm"
ALONE_MARK = "alone"
EARLY_MARK = "early"
WAIT_PROPERTY = "shared_vllm_turn_wait"


@contextmanager
def turn(lock_path: Path, exclusive: bool) -> Iterator[None]:
    """Hold the machine for one test: shared with other tests, or alone (`exclusive`)."""
    with open(lock_path.with_suffix(".turnstile"), "a") as gate, open(lock_path, "a") as server:
        fcntl.flock(gate, fcntl.LOCK_EX)
        try:
            if exclusive:
                # Still holding the gate: no other test starts while this one waits for the running ones.
                fcntl.flock(server, fcntl.LOCK_EX)
            else:
                fcntl.flock(gate, fcntl.LOCK_UN)
                fcntl.flock(server, fcntl.LOCK_SH)
        finally:
            fcntl.flock(gate, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(server, fcntl.LOCK_UN)


def wait_ready(url: str, pid: int | None, log_path: str | None, model: str, timeout_s: float = 900) -> None:
    """Poll the controller's vLLM until it lists `model` (not just any server that took the port first: a
    test's stand-in model could, while vLLM was still loading); fail at once if its process is gone."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            answer = httpx.get(f"{url}/v1/models", timeout=2.0)
            if answer.status_code == 200 and model in {m.get("id") for m in answer.json().get("data", [])}:
                return
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        if pid is not None and not _running(pid):
            tail = log_tail(log_path) if log_path else ""
            raise RuntimeError(f"the shared vLLM (pid {pid}) exited while starting; its log: {log_path}\n{tail}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the shared vLLM at {url} did not answer within {timeout_s:g}s; its log: {log_path}")
        time.sleep(0.5)


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def marked_list(lock_path: Path) -> Path:
    """Where the workers write the node ids of the tests marked `alone` and `early`, by mark: xdist's
    controller sees only node ids, not marks."""
    return lock_path.with_suffix(".marked.json")


def write_marked_list(lock_path: Path, marked: dict[str, list[str]]) -> None:
    """Every worker writes the same lists (they collect the same tests); a rename keeps a reader from
    seeing half of one."""
    path = marked_list(lock_path)
    partial = path.with_suffix(f".{os.getpid()}.partial")
    partial.write_text(json.dumps(marked))
    os.replace(partial, path)


ALONE_UNIT = "tests marked alone"


class _WorkQueue(OrderedDict):
    """xdist's queue of work units, which it fills in its own order (the most tests first): `early`
    units go to the front, and the `alone` unit stays at the end whatever comes after it."""

    def __init__(self, early: Callable[[str], bool] = lambda unit: False) -> None:  # a default: copy() calls it bare
        super().__init__()
        self._early = early

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        if key == ALONE_UNIT:
            return
        if self._early(key):
            self.move_to_end(key, last=False)
        elif ALONE_UNIT in self:
            self.move_to_end(ALONE_UNIT)


class AloneLastScheduling(LoadFileScheduling):
    """`--dist loadfile`, except that the tests marked `alone` make one work unit of their own, sent
    after every file's (so a file's module fixtures are set up twice if some of its tests are marked
    and others not: mark a whole module when its set-up is what the mark is for)."""

    def __init__(self, config, log, lock_path: Path) -> None:
        super().__init__(config, log)
        self.workqueue = _WorkQueue(lambda unit: unit in self._marked(EARLY_MARK))
        self._lock_path = lock_path
        self._marks: dict[str, set[str]] | None = None

    def _reschedule(self, node) -> None:
        if node not in self.registered_collections:
            return  # a worker that replaces a crashed one, still collecting: scheduled once it has
        if self._alone_held_back(node):
            # Not while another worker has tests to run: each marked test would wait for theirs. A worker
            # down to its last test would only ever get this unit, which the busier one takes after its
            # file: it stops, so it runs that last test now instead of holding it until then.
            if not node.shutting_down and self._pending_of(self.assigned_work.get(node, {})) <= 1:
                node.shutdown()
            return
        super()._reschedule(node)

    def _assign_work_unit(self, node) -> None:
        if not self._alone_held_back(node):  # xdist's first distribution calls this directly
            super()._assign_work_unit(node)

    def _alone_held_back(self, node) -> bool:
        return bool(self.workqueue) and next(iter(self.workqueue)) == ALONE_UNIT and self._others_busy(node)

    def _others_busy(self, node) -> bool:
        # A worker holds its last test until it is sent more work or told to stop (it runs each test
        # knowing the next): one pending test is not running, and waiting on it would never end.
        return any(self._pending_of(work) > 1 for other, work in self.assigned_work.items() if other is not node)

    def mark_test_complete(self, node, item_index: int, duration: float = 0) -> None:
        super().mark_test_complete(node, item_index, duration)
        for other in self.nodes:  # a worker held back from the `alone` unit may take it now
            if other is not node:
                self._reschedule(other)

    def _marked(self, mark: str) -> set[str]:
        """The node ids marked `alone`, or the files (units) of those marked `early`."""
        if self._marks is None:
            # First called once every worker has reported its collection, so the lists are written.
            path = marked_list(self._lock_path)
            lists = json.loads(path.read_text()) if path.exists() else {}
            self._marks = {
                ALONE_MARK: set(lists.get(ALONE_MARK, [])),
                EARLY_MARK: {super(AloneLastScheduling, self)._split_scope(n) for n in lists.get(EARLY_MARK, [])},
            }
        return self._marks[mark]

    def _split_scope(self, nodeid: str) -> str:
        return ALONE_UNIT if nodeid in self._marked(ALONE_MARK) else super()._split_scope(nodeid)
