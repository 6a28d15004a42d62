"""KV-aware admission: how many turns at once each replica is sent, bounded from the replica's own
/metrics (KV-cache usage, the waiting queue, preemptions) so that the service does not drive it into
preemption, where the env pools alone would let every episode's turn in at once.

The bound adapts (AIMD): a poll that finds new preemptions or the KV cache nearly full cuts the
bound to a fraction of the turns in flight (or of those the replica runs, if fewer); a healthy poll
with the bound reached raises it by a step. Polled in the background, never per turn. A replica
whose /metrics is missing or unparseable gets no bound from it (and says so), never an error.
A turn over its replica's bound waits here, first come first served; a wait cancelled gives its
place back, a slot granted to a wait cancelled just then is passed on.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

KvMode = Literal["adaptive", "fixed", "off"]

# vLLM's names: v1 engines say kv_cache_usage_perc, older ones gpu_cache_usage_perc (both 0..1).
_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
_WAITING = "vllm:num_requests_waiting"
_RUNNING = "vllm:num_requests_running"
_PREEMPTIONS = "vllm:num_preemptions_total"
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")

HIGH_USAGE = 0.92  # at or over: cut (vLLM preempts once the cache is full; keep a margin for growth)
LOW_USAGE = 0.80  # under, with no preemption or queue: room to grow
DECREASE = 0.7
MIN_CAP = 1


@dataclass
class KvSnapshot:
    usage: float | None
    waiting: float | None
    preemptions: float | None
    running: float | None = None


def parse_metrics(text: str) -> KvSnapshot:
    """The KV figures of a Prometheus text answer, summed over label sets (one per model/engine);
    ValueError if it carries none of them."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None or match.group(1) not in (*_USAGE, _WAITING, _PREEMPTIONS, _RUNNING):
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        sums[match.group(1)] = sums.get(match.group(1), 0.0) + value
    usage = next((sums[name] for name in _USAGE if name in sums), None)
    if usage is None and _WAITING not in sums and _PREEMPTIONS not in sums:
        raise ValueError("no vLLM KV-cache, waiting or preemption metric in it")
    return KvSnapshot(usage, sums.get(_WAITING), sums.get(_PREEMPTIONS), sums.get(_RUNNING))


@dataclass
class KvGate:
    """One replica's bound on turns in flight, and the turns waiting for it."""

    cap: int | None = None  # None: no bound (not needed yet, off, or no /metrics to bound it from)
    in_flight: int = 0
    why: str = "no bound needed yet"
    last: KvSnapshot | None = None
    cuts: int = 0
    _waiters: deque[asyncio.Future[None]] = field(default_factory=deque, repr=False)

    @property
    def waiting(self) -> int:
        return len(self._waiters)  # a cancelled wait leaves, a granted one is taken off by wake()

    def _open(self) -> bool:
        return self.cap is None or self.in_flight < self.cap

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        await self._acquire()
        try:
            yield
        finally:
            self._release()

    async def _acquire(self) -> None:
        if self._open() and not self._waiters:
            self.in_flight += 1
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._release()  # granted just as it was cancelled: pass the slot on
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise

    def _release(self) -> None:
        self.in_flight -= 1
        self.wake()

    def wake(self) -> None:
        """Grant waiting turns while the bound allows (after a release or a bound raised)."""
        while self._waiters and self._open():
            waiter = self._waiters.popleft()
            if not waiter.done():
                self.in_flight += 1
                waiter.set_result(None)

    def set_cap(self, cap: int | None, why: str) -> None:
        self.cap, self.why = cap, why
        self.wake()

    def observe(self, snapshot: KvSnapshot, step: int) -> None:
        """AIMD on one poll's figures."""
        new_preemptions = (
            snapshot.preemptions is not None
            and self.last is not None
            and self.last.preemptions is not None
            and snapshot.preemptions > self.last.preemptions
        )
        self.last = snapshot
        usage = snapshot.usage or 0.0
        queued = (snapshot.waiting or 0.0) > 0
        if new_preemptions or usage >= HIGH_USAGE:
            # What fits is at most what the replica runs now (the rest of ours wait or were preempted).
            base = min(self.in_flight, int(snapshot.running)) if snapshot.running is not None else self.in_flight
            base = base if self.cap is None else min(self.cap, max(base, MIN_CAP))
            self.cuts += 1
            reason = "preemptions" if new_preemptions else f"KV cache {usage:.0%} used"
            self.set_cap(max(MIN_CAP, int(base * DECREASE)), f"cut: {reason}")
        elif self.cap is not None and usage < LOW_USAGE and not queued and self.in_flight >= self.cap:
            self.set_cap(self.cap + step, f"raised: KV cache {usage:.0%} used, no preemption")
        elif self.cap is not None:
            self.why = f"held: KV cache {usage:.0%} used" + (", requests waiting in the replica" if queued else "")

    def report(self) -> dict[str, object]:
        return {"cap": self.cap, "in_flight": self.in_flight, "waiting": self.waiting, "why": self.why}


class KvAdmission:
    """The gates of one pool's replicas, and the background poll that sets them.

    `mode`: adaptive (AIMD from /metrics), fixed (`fixed_cap` turns per replica), off (no bound).
    `fetch(url)`: a replica's /metrics text, raising on no answer."""

    def __init__(
        self,
        fetch: Callable[[str], Awaitable[str]],
        *,
        mode: KvMode = "adaptive",
        fixed_cap: int | None = None,
        interval_s: float = 1.0,
        step: int = 1,
    ) -> None:
        if mode == "fixed" and not fixed_cap:
            raise ValueError("a fixed KV admission bound needs a cap of at least 1")
        self.mode, self.fixed_cap, self.interval_s, self.step = mode, fixed_cap, interval_s, step
        self._fetch = fetch
        self.gates: dict[str, KvGate] = {}
        self._task: asyncio.Task[None] | None = None

    def gate(self, url: str) -> KvGate:
        gate = self.gates.get(url)
        if gate is None:
            gate = self.gates[url] = KvGate()
            if self.mode == "fixed":
                gate.set_cap(self.fixed_cap, "fixed (--kv-admission fixed)")
            elif self.mode == "off":
                gate.why = "off (--kv-admission off)"
        return gate

    @contextlib.asynccontextmanager
    async def slot(self, url: str) -> AsyncIterator[None]:
        if self.mode == "adaptive" and self._task is None:
            self._task = asyncio.create_task(self._poll_forever())
        async with self.gate(url).slot():
            yield

    def forget(self, url: str) -> None:
        gate = self.gates.pop(url, None)
        if gate is not None:
            gate.set_cap(None, "removed")

    async def poll(self) -> None:
        """One round: every known replica's /metrics, at once."""
        await asyncio.gather(*(self._poll_one(url, gate) for url, gate in list(self.gates.items())))

    async def _poll_one(self, url: str, gate: KvGate) -> None:
        try:
            snapshot = parse_metrics(await self._fetch(url))
        except Exception as exc:
            gate.last = None
            gate.set_cap(None, f"no bound: its /metrics gave none ({str(exc)[:120] or type(exc).__name__})")
            return
        if gate.last is None and gate.cap is None and gate.why.startswith("no bound:"):
            gate.why = "no bound needed yet"
        gate.observe(snapshot, self.step)

    async def _poll_forever(self) -> None:
        while True:
            await self.poll()
            await asyncio.sleep(self.interval_s)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
