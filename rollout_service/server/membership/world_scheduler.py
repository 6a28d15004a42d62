"""World slots: the service never holds more episodes on an env than its pool has worlds.

Attempts beyond the pools wait here, in the service, not in HTTP requests parked on the env
(a blocked /step/reset holds a connection and gives the env no way to prefer one group over
another). The policy:

- Pool cap: at most `pool` slots of an env are held at once. An attempt takes the least busy
  (held/pool) free env among its candidates at once, an env that answers before one that is down;
  it waits only when all of them are full.
- Per env: a slot freed on env E goes to a waiter that can use E. Waiters for other envs never
  hold it back (envs may serve different task sets), so no env sits idle while one could use it.
- Fairness across requests: each waiter belongs to a `share`, the HTTP request its group came
  with. The shares waiting for E are served round-robin (the share granted a slot longest ago
  goes first; a new share joins at the end of the round), so one trainer's 1024-group batch
  cannot starve another trainer's request.
- Priority within a share: best first, (group sequence, attempt index): earlier groups finish
  first, and a later group becomes the earliest as soon as those before it finish.

Membership changes at runtime (the admin API): `add_env` puts an env's slots in play at once, for
new attempts and for the waiters already queued for one of its tasks; `drain_env` stops granting
its slots (the episodes on it finish); `remove_env` takes a drained, empty env out and fails the
waiters left with no env at all (`NoEnvLeft`) rather than letting them wait forever.

Cost: acquire and release are O(log n) amortised and cancelling a waiter is O(1), so cancelling
a whole batch of queued attempts does not stall the event loop. Waiters sit in heaps and are
never removed from the middle: a granted or cancelled waiter is only marked, and skipped when it
reaches the top (lazy deletion); the heaps are rebuilt once the dead entries outnumber the live.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from collections.abc import Container, Hashable, Sequence
from dataclasses import dataclass, field


@dataclass
class EnvSlots:
    """Slot accounting of one environment."""

    url: str
    pool: int
    held: int = 0
    max_held: int = 0
    busy_seconds: float = 0.0  # world-seconds held, for utilisation
    draining: bool = False  # being taken out: its episodes finish, none starts
    down: bool = False  # its last probe (or an episode) found it unreachable: others are preferred
    emptied: asyncio.Event | None = None  # set once draining with no slot held

    @property
    def free(self) -> int:
        return 0 if self.draining else self.pool - self.held


class NoEnvLeft(Exception):
    """Every env the attempt could use was drained or removed while it waited (or before it asked)."""


@dataclass(eq=False, slots=True)  # identity only: waiters are never compared, heaps order (priority, seq)
class _Waiter:
    candidates: tuple[str, ...]
    share: _Share
    future: asyncio.Future
    task: Hashable  # what it runs: an env added later that serves it joins its candidates
    entry: tuple[tuple, int] = ((), 0)  # (priority, seq): its place in every heap it is in
    queued: bool = True  # False once granted or gone; its heap entries are dead from then on

    @property
    def dead(self) -> bool:  # a cancelled future may still be queued until its task runs again
        return not self.queued or self.future.done()


@dataclass(eq=False, slots=True)
class _Share:
    """The waiters of one request: per env they can use, a heap of (priority, seq, waiter)."""

    key: object
    order: int  # unique, so heap entries never compare two shares
    turn: int  # tick of its last grant (or of its arrival): the lowest is served next
    queued: int = 0  # live waiters
    heaps: dict[str, list[tuple[tuple, int, _Waiter]]] = field(default_factory=dict)


class WorldScheduler:
    """Grants env slots to attempts: at most `pool` per env, requests in turn, best priority first."""

    def __init__(self, envs: Sequence[EnvSlots]) -> None:
        self.envs = {e.url: e for e in envs}
        self._shares: dict[object, _Share] = {}  # shares with live waiters, by key
        # Per env: the shares with a heap for it, by turn; an entry exists iff share.heaps has the env.
        self._lines: dict[str, list[tuple[int, int, _Share]]] = {u: [] for u in self.envs}
        self._waiting = 0
        self._live_entries = 0  # heap entries of live waiters
        self._dead_entries = 0  # upper bound on dead heap entries since the last rebuild
        self._seq = itertools.count()
        self._tick = itertools.count()

    @property
    def waiting(self) -> int:
        return self._waiting

    async def acquire(
        self, candidates: Sequence[str], priority: tuple, share: object = None, task: Hashable = None
    ) -> EnvSlots:
        """Wait for a slot on one of `candidates` (env URLs); the least busy free one wins.

        `share` (hashable) names the request the attempt came with, `priority` orders the
        attempts within it, `task` what it runs (see `add_env`). No live waiter ever wants a free
        env (release hands each freed slot straight to one), so a free candidate is taken at once:
        nobody better could use it. NoEnvLeft when no candidate is present and taking attempts."""
        present = [self.envs[u] for u in candidates if u in self.envs]
        free = [e for e in present if e.free > 0]
        if free:
            # A down env looks idle (its episodes fail at once): it gets an attempt only if no env
            # that answers has a world free, so that it does not drain every retry.
            free = [e for e in free if not e.down] or free
            return self._grant(min(free, key=lambda e: e.held / e.pool), self._shares.get(share))
        if not any(not e.draining for e in present):
            raise NoEnvLeft(f"no env takes attempts for it: {_named(candidates, self.envs)}")
        waiter = self._enqueue([e.url for e in present], priority, share, task)
        try:
            return await waiter.future
        except asyncio.CancelledError:
            future = waiter.future
            if future.done() and not future.cancelled() and future.exception() is None:
                self.release(future.result())  # granted just as we were cancelled
            raise
        finally:
            if waiter.queued:  # cancelled while waiting: it only leaves the queue, O(1)
                self._leave(waiter)

    def release(self, env: EnvSlots, held_seconds: float = 0.0) -> None:
        env.held -= 1
        env.busy_seconds += held_seconds
        if env.draining:  # its slots go back to nobody
            if env.held == 0 and env.emptied is not None:
                env.emptied.set()
            return
        self._hand_out(env)

    def _hand_out(self, env: EnvSlots) -> bool:
        """Give one free slot of `env` to the waiter whose turn it is; whether there was one."""
        waiter = self._next_waiter(env.url)
        if waiter is None:
            return False
        self._leave(waiter)
        waiter.future.set_result(self._grant(env, waiter.share))
        return True

    def _grant(self, env: EnvSlots, share: _Share | None) -> EnvSlots:
        env.held += 1
        env.max_held = max(env.max_held, env.held)
        assert env.held <= env.pool, "a world slot was granted beyond the pool"
        if share is not None:
            share.turn = next(self._tick)  # to the end of the round
        return env

    # -- membership ---------------------------------------------------------------------------

    def add_env(self, env: EnvSlots, tasks: Container[Hashable] = ()) -> None:
        """Put a new env's slots in play: queued waiters whose `task` is in `tasks` may use it too,
        and get its free slots now (in turn, as a release would hand them out)."""
        if env.url in self.envs:
            raise ValueError(f"env {env.url} is already scheduled")
        self.envs[env.url] = env
        self._lines[env.url] = []
        for queued in self._live_waiters():
            if queued.task is not None and queued.task in tasks:
                queued.candidates += (env.url,)
                self._push(queued, env.url)
                self._live_entries += 1
        while env.free > 0 and self._hand_out(env):
            pass

    def drain_env(self, url: str) -> EnvSlots:
        """Grant no more slots of this env; the episodes holding one finish and release it."""
        env = self.envs[url]
        env.draining = True
        if env.emptied is None:
            env.emptied = asyncio.Event()
        if env.held == 0:
            env.emptied.set()
        return env

    def remove_env(self, url: str) -> None:
        """Take a drained env with no slot held out. Waiters left with no candidate fail with
        NoEnvLeft; the others wait on for the envs they have left."""
        env = self.envs[url]
        if not env.draining or env.held:
            raise ValueError(f"env {url} must be drained and hold no slot to be removed ({env.held} held)")
        orphans = []
        for waiter in self._live_waiters():
            if url in waiter.candidates:
                waiter.candidates = tuple(u for u in waiter.candidates if u != url)
                self._live_entries -= 1
                if not waiter.candidates:
                    orphans.append(waiter)
        del self.envs[url]
        del self._lines[url]
        for share in self._shares.values():
            share.heaps.pop(url, None)
        for waiter in orphans:
            self._leave(waiter)
            waiter.future.set_exception(NoEnvLeft(f"env {url} was removed while the attempt waited for a world"))

    def _live_waiters(self) -> list[_Waiter]:
        """Every queued waiter once: O(heap entries), for the rare membership change."""
        seen: dict[int, _Waiter] = {}
        for share in self._shares.values():
            for heap in share.heaps.values():
                for _, _, waiter in heap:
                    if not waiter.dead:
                        seen.setdefault(id(waiter), waiter)
        return list(seen.values())

    def _enqueue(self, candidates: Sequence[str], priority: tuple, key: object, task: Hashable = None) -> _Waiter:
        share = self._shares.get(key)
        if share is None:
            share = self._shares[key] = _Share(key, next(self._seq), next(self._tick))
        future = asyncio.get_running_loop().create_future()
        waiter = _Waiter(tuple(dict.fromkeys(candidates)), share, future, task)
        waiter.entry = (priority, next(self._seq))
        for url in waiter.candidates:
            self._push(waiter, url)
        share.queued += 1
        self._waiting += 1
        self._live_entries += len(waiter.candidates)
        return waiter

    def _push(self, waiter: _Waiter, url: str) -> None:
        """Queue `waiter` for `url` at its place (priority, seq), its share in that env's line."""
        share = waiter.share
        heap = share.heaps.get(url)
        if heap is None:
            heap = share.heaps[url] = []
            heapq.heappush(self._lines[url], (share.turn, share.order, share))
        heapq.heappush(heap, (*waiter.entry, waiter))

    def _leave(self, waiter: _Waiter) -> None:
        """The waiter was granted or cancelled: its heap entries die where they are."""
        waiter.queued = False
        share = waiter.share
        share.queued -= 1
        if not share.queued:
            del self._shares[share.key]  # its dead entries go at the next rebuild or pop
        self._waiting -= 1
        self._live_entries -= len(waiter.candidates)
        self._dead_entries += len(waiter.candidates)
        if self._dead_entries > self._live_entries + 1024:
            self._rebuild()  # O(live + dead), paid for by the dead: amortised O(1) per waiter

    def _next_waiter(self, url: str) -> _Waiter | None:
        """Whom a slot freed on `url` goes to: of the shares waiting for it, the one whose turn it
        is, and its best waiter. Pops the dead entries it meets on the way."""
        line = self._lines[url]
        while line:
            turn, _, share = line[0]
            heap = share.heaps.get(url, [])
            while heap and heap[0][2].dead:
                heapq.heappop(heap)
            if not heap:  # this share has nobody left for url
                heapq.heappop(line)
                share.heaps.pop(url, None)
            elif turn != share.turn:  # it was granted a slot since (on another env): back of the round
                heapq.heapreplace(line, (share.turn, share.order, share))
            else:
                return heapq.heappop(heap)[2]
        return None

    def _rebuild(self) -> None:
        """Drop every dead entry: keeps memory O(live waiters) however many were cancelled."""
        self._lines = {u: [] for u in self.envs}
        for share in self._shares.values():
            for url, heap in list(share.heaps.items()):
                heap[:] = [e for e in heap if not e[2].dead]
                if heap:
                    heapq.heapify(heap)
                    self._lines[url].append((share.turn, share.order, share))
                else:
                    del share.heaps[url]
        for line in self._lines.values():
            heapq.heapify(line)
        self._dead_entries = 0


def _named(candidates: Sequence[str], envs: dict[str, EnvSlots]) -> str:
    if not candidates:
        return "no env serves it"
    return ", ".join(f"{u} ({'draining' if u in envs else 'removed'})" for u in candidates)
