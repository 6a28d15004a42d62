"""Sampler streams: generation while the trainer trains (POST /samplers, .../pull, DELETE).

A stream keeps up to `buffer` groups buffered or running, so groups for step k+1 are generated
while the trainer computes step k. Every buffered group is checked against `max_staleness` when it
is handed out: one that fell further behind (policy updates landed while it waited) is dropped,
counted, and replaced. Buffered groups count against --max-queued-attempts until handed out.

Streams live in the service's memory: after a restart, or once deleted or expired (no pull for
`idle_timeout_s`), a pull is told so plainly (410 with the reason; 404 for an id this process never
made, naming a restart as the likely cause).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

from ...sampler_protocol import DroppedGroup, SampleSummary, StreamCreate, StreamState
from ..errors import Conflict, Gone, NotFound
from ..groups.admission import Admission
from ..groups.group_json import group_line, one_line
from ..groups.streaming import HeldResults
from ..lifecycle import Lifecycle
from ..membership.envs import EnvRegistry
from ..policy.manager import PolicyManager
from .caps import StreamCaps
from .metrics import SamplerMetrics
from .sampler import DropCounts, Finished, Sampler, SamplerRooms
from .task_stats import TaskStatsBook

if TYPE_CHECKING:
    from ..metrics import Metrics

log = logging.getLogger("rollout_service.samplers")

_GONE_KEPT = 1024  # ids of closed streams remembered, to answer 410 with the reason
_REAP_EVERY_S = 1.0
_DROPS_KEPT = 256  # dropped-group lines a stream keeps for its next pull


def sample_summary(sampler: Sampler, requested: int, stopped: str, cancelled: int) -> SampleSummary:
    """A one-shot sample's last line: every count is the request's own."""
    t = sampler.tally
    return SampleSummary(
        requested=requested,
        kept=t.kept,
        complete=t.kept >= requested,
        stopped=stopped,
        groups_run=t.groups_run,
        groups_cancelled=cancelled,
        dropped=dict(t.dropped),
        attempts_dropped=t.attempts_dropped,
        completion_tokens_dropped=t.completion_tokens_dropped,
        skipped_tasks=t.skipped_lists(),
        budget=sampler.budget,
    )


def dropped_line(dropped: DroppedGroup) -> bytes:
    return b'{"dropped": %b}\n' % one_line(dropped.model_dump_json().encode())


def summary_line(text: SampleSummary) -> bytes:
    return b'{"summary": %b}\n' % one_line(text.model_dump_json(exclude_none=True).encode())


@dataclass
class Unreported(DropCounts):
    """Dropped groups not yet told in a pull's summary, and how many of their lines were lost."""

    lines_lost: int = 0


class SamplerStream:
    def __init__(
        self, rooms: SamplerRooms, body: StreamCreate, stream_id: str, metrics: SamplerMetrics, caller: str
    ) -> None:
        self.id = stream_id
        self.caller = caller  # the key it was opened with: the per-key cap counts by it
        self.rooms = rooms
        self.body = body
        self.metrics = metrics
        self.held = HeldResults(rooms.admission)
        self.buffer: deque[Finished] = deque()
        # Lines of dropped groups waiting for the next pull, at most _DROPS_KEPT: past that the oldest
        # line goes, counted in `unreported` (the summary says how many), never silently.
        self.drops: deque[DroppedGroup] = deque()
        self.unreported = Unreported()
        self.lines_lost = 0  # over the stream's life
        self.lag_histogram: Counter[int] = Counter()
        self.handed = 0
        self.last_used = time.monotonic()
        self._pull: object | None = None  # the pull in progress: its own mark, so only it ends itself
        self._changed = asyncio.Event()
        self.sampler = Sampler(rooms, body, body.max_groups, self._room, self.held)
        self.sampler.check_first()
        self.producer = asyncio.ensure_future(self._produce())

    def _room(self) -> int:
        return self.body.buffer - len(self.buffer) - len(self.sampler.running)

    async def _produce(self) -> None:
        while True:
            item = await self.sampler.next()
            if item is None:
                break
            if item.body is not None:
                self.buffer.append(item)
            else:
                assert item.dropped is not None
                self._tell(item.dropped)
            self._changed.set()
        self._changed.set()

    def _tell(self, dropped: DroppedGroup) -> None:
        """Queue a dropped group's line for the next pull (the sampler has counted it already)."""
        self.unreported.count(dropped)
        if len(self.drops) >= _DROPS_KEPT:
            self.drops.popleft()
            self._line_lost()
        self.drops.append(dropped)

    def _line_lost(self) -> None:
        self.unreported.lines_lost += 1
        self.lines_lost += 1

    @property
    def stopped(self) -> str | None:
        """Why production is over, once it is."""
        if not self.producer.done():
            return None
        if self.sampler.budget_spent():
            return f"budget spent: max_groups={self.sampler.budget} groups run"
        return self.sampler.stopped or "stopped"

    def lag_of(self, item: Finished) -> int:
        return self.rooms.versions.behind(item.oldest_version) if item.oldest_version else 0

    def _drop_stale(self, item: Finished, lag: int) -> DroppedGroup:
        self.held.release(item.attempts)
        stale = DroppedGroup(
            task_id=item.task_id,
            group_id=item.group_id,
            reason="stale",
            detail=f"its oldest turn (version {item.oldest_version}) is {lag} updates behind "
            f"{self.rooms.versions.current.label} (max_staleness={self.body.max_staleness}): dropped, "
            "replaced",
            attempts=item.attempts,
            completion_tokens=item.completion_tokens,
        )
        self.sampler.count_dropped(stale)
        return stale

    def _undelivered(self, task_id: str, group_id: str | None, attempts: int, tokens: int) -> None:
        """A group's line was being written when the pull was cut off (the reader went or stalled):
        whether any of it arrived is unknown, so it is not handed out again (a trainer must not get a
        group twice) but counted as dropped, told at the next pull, and its queue room given back."""
        self.held.release(attempts)
        lost = DroppedGroup(
            task_id=task_id,
            group_id=group_id,
            reason="undelivered",
            detail="its line was being written when a pull was cut off (the reader went away, or took nothing "
            "for --stream-stall-timeout): it may have arrived in part or whole; not handed out again",
            attempts=attempts,
            completion_tokens=tokens,
        )
        self.sampler.count_dropped(lost)
        self._tell(lost)

    @property
    def pulling(self) -> bool:
        return self._pull is not None

    def expires_in(self, now: float) -> float:
        """Seconds until it is closed if nobody pulls it (a stream being pulled: its whole idle timeout)."""
        return self.body.idle_timeout_s - (0.0 if self.pulling else now - self.last_used)

    def start_pull(self, count: int, timeout_s: float) -> tuple[AsyncIterator[bytes], Callable[[], None]]:
        """A pull's lines and its end, called as its answer ends (also before the first line): one pull at
        a time, or 409 pull_in_progress. A pull's end ends only that pull, however late it comes."""
        if self._pull is not None:
            raise Conflict("pull_in_progress", f"sampler stream {self.id} is being pulled from already")
        mark = self._pull = object()
        end = partial(self._end_pull, mark)
        return self.pull(count, timeout_s, end), end

    def _end_pull(self, mark: object) -> None:
        if self._pull is mark:
            self._pull = None
            self.last_used = time.monotonic()

    async def pull(self, count: int, timeout_s: float, end: Callable[[], None]) -> AsyncIterator[bytes]:
        """NDJSON: `count` groups ({"lag", "group"}), the dropped groups' lines as they come, then the
        summary. Fewer only when production stopped or `timeout_s` passed, and the summary says which."""
        deadline = time.monotonic() + timeout_s
        lags: list[int] = []
        stopped = None
        try:
            while True:
                while self.drops:
                    written = False
                    try:
                        yield dropped_line(self.drops.popleft())
                        written = True
                    finally:
                        if not written:  # cut off while writing it
                            self._line_lost()
                if len(lags) >= count or stopped is not None:
                    break
                if self.buffer:
                    item = self.buffer.popleft()
                    self.sampler.wake()
                    lag = self.lag_of(item)
                    bound = self.body.max_staleness
                    if bound is not None and lag > bound:
                        self._tell(self._drop_stale(item, lag))
                        continue
                    assert item.body is not None
                    line = group_line(b'{"lag": %d, "group": ' % lag, item.body)
                    task_id, group_id, attempts = item.task_id, item.group_id, item.attempts
                    tokens = item.completion_tokens
                    del item
                    written = False
                    try:
                        yield line
                        written = True
                    finally:
                        if not written:
                            self._undelivered(task_id, group_id, attempts, tokens)
                    del line
                    self.held.release(attempts)
                    self.sampler.count_kept()
                    lags.append(lag)
                    self.handed += 1
                    self.lag_histogram[lag] += 1
                    self.metrics.lag.observe(lag)
                    continue
                if self.stopped is not None:
                    stopped = self.stopped
                    continue  # the dropped lines still waiting, then the summary
                left = deadline - time.monotonic()
                if left <= 0:
                    stopped = f"timeout_s={timeout_s:g} passed with {len(lags)} of {count} groups handed out"
                    continue
                self._changed.clear()
                try:
                    await asyncio.wait_for(self._changed.wait(), left)
                except TimeoutError:
                    pass
            # Nothing is awaited from the last drop line to here: the summary tells exactly the lines sent
            # (and those lost).
            told, self.unreported = self.unreported, Unreported()
            yield summary_line(
                SampleSummary(
                    requested=count,
                    kept=len(lags),
                    complete=len(lags) >= count,
                    stopped=stopped or "count reached",
                    groups_run=len(lags) + sum(told.dropped.values()),
                    dropped=dict(told.dropped),
                    attempts_dropped=told.attempts_dropped,
                    completion_tokens_dropped=told.completion_tokens_dropped,
                    dropped_lines_lost=told.lines_lost,
                    lags=lags,
                    policy_version=self.rooms.versions.current.label,
                    stream=self.state(),
                )
            )
        finally:
            end()

    def state(self) -> StreamState:
        t = self.sampler.tally
        return StreamState(
            id=self.id,
            buffer_bound=self.body.buffer,
            buffered=len(self.buffer),
            running=len(self.sampler.running),
            handed_out=self.handed,
            groups_run=t.groups_run,
            dropped=dict(t.dropped),
            attempts_dropped=t.attempts_dropped,
            completion_tokens_dropped=t.completion_tokens_dropped,
            dropped_lines_lost=self.lines_lost,
            skipped_tasks=t.skipped_lists(),
            lag_histogram={str(k): v for k, v in sorted(self.lag_histogram.items())},
            max_staleness=self.body.max_staleness,
            budget=self.sampler.budget,
            idle_timeout_s=self.body.idle_timeout_s,
            idle_s=round(0.0 if self.pulling else time.monotonic() - self.last_used, 3),
            stopped=self.stopped,
        )

    async def close(self) -> None:
        """Stop producing, cancel what runs (worlds released), drop the buffer."""
        self.producer.cancel()
        await asyncio.wait([self.producer])
        self.sampler.close()
        self.buffer.clear()
        self.held.close()
        self._changed.set()  # a pull waiting for groups ends now


class SamplerStreams:
    """The streams of one service, by id, and what every sampler of it uses (`rooms`: the one-shot
    sample's too)."""

    def __init__(
        self,
        envs: EnvRegistry,
        admission: Admission,
        versions: PolicyManager,
        task_stats: TaskStatsBook,
        metrics: Metrics,
        lifecycle: Lifecycle,
        caps: StreamCaps,
    ) -> None:
        self.lifecycle = lifecycle
        self.caps = caps
        self.streams: dict[str, SamplerStream] = {}
        self.gone: OrderedDict[str, str] = OrderedDict()
        self.metrics = SamplerMetrics(metrics, self)
        self.rooms = SamplerRooms(envs, admission, versions, task_stats, self.metrics.kept, self.metrics.dropped)
        self._reaper: asyncio.Task | None = None

    def create(self, body: StreamCreate, caller: str) -> SamplerStream:
        """A new stream for `caller` (the key its request came with), or TooBusy naming the cap it would pass."""
        self.caps.check(list(self.streams.values()), body, caller)
        if body.max_staleness is not None and "max_staleness" not in body.group:
            # The runner bounds it while the group runs; the hand-out check, while it waits.
            body = body.model_copy(update={"group": {**body.group, "max_staleness": body.max_staleness}})
        stream_id = f"s-{uuid.uuid4().hex[:16]}"
        stream = SamplerStream(self.rooms, body, stream_id, self.metrics, caller)
        self.streams[stream_id] = stream
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.ensure_future(self._reap())
        budget = f", max_groups {body.max_groups}" if body.max_groups is not None else ""
        log.info("sampler stream %s opened: buffer %d%s", stream_id, body.buffer, budget)
        return stream

    def get(self, stream_id: str) -> SamplerStream:
        stream = self.streams.get(stream_id)
        if stream is not None:
            return stream
        why = self.gone.get(stream_id)
        if why is not None:
            raise Gone("sampler_gone", f"sampler stream {stream_id} is gone: {why}. Create a new one")
        raise NotFound(
            "unknown_sampler",
            f"no sampler stream {stream_id} here: streams live in the service's memory, so after a restart "
            f"(this one has run {time.time() - self.lifecycle.started_at:.0f}s) every earlier stream is gone. "
            "Create a new one with POST /samplers",
        )

    async def remove(self, stream_id: str, why: str, level: int = logging.INFO) -> SamplerStream:
        stream = self.get(stream_id)
        log.log(level, "sampler stream %s closed: %s", stream_id, why)
        del self.streams[stream_id]
        self.gone[stream_id] = why
        while len(self.gone) > _GONE_KEPT:
            self.gone.popitem(last=False)
        await stream.close()
        return stream

    async def _reap(self) -> None:
        while self.streams:
            await asyncio.sleep(_REAP_EVERY_S)
            now = time.monotonic()
            for stream in list(self.streams.values()):
                if stream.expires_in(now) < 0:
                    why = f"expired: no pull for idle_timeout_s={stream.body.idle_timeout_s:g}s"
                    await self.remove(stream.id, why, logging.WARNING)

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        for stream_id in list(self.streams):
            await self.remove(stream_id, "the service shut down")
