"""The world scheduler: pool caps, no idle env, fairness across requests, priority within one,
cancellation (contract and cost). Pure asyncio, no servers; imports only the scheduler module."""

from __future__ import annotations

import asyncio
import random
from collections import deque

import pytest

from rollout_service.server.membership.world_scheduler import EnvSlots, NoEnvLeft, WorldScheduler


async def settle(rounds: int = 3) -> None:
    """Let woken tasks run (a granted waiter resumes on a later loop iteration)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


def test_never_exceeds_capacity_and_serves_earlier_groups_first():
    async def scenario():
        sched = WorldScheduler([EnvSlots("a", 2)])
        order: list[tuple] = []

        async def attempt(priority: tuple, hold: float):
            slot = await sched.acquire(["a"], priority)
            order.append(priority)
            assert slot.held <= slot.pool
            await asyncio.sleep(hold)
            sched.release(slot, hold)

        # Group 2 arrives first and fills the pool; group 1's attempts then queue ahead of group 2's rest.
        tasks = [asyncio.create_task(attempt((2, i), 0.02)) for i in range(4)]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(attempt((1, i), 0.02)) for i in range(2)]
        await asyncio.gather(*tasks)
        return sched, order

    sched, order = asyncio.run(scenario())
    assert order[:2] == [(2, 0), (2, 1)]
    assert order[2:4] == [(1, 0), (1, 1)]
    assert sched.envs["a"].max_held == 2 and sched.envs["a"].held == 0


def test_cancelled_waiter_frees_nothing_and_spreads_over_envs():
    async def scenario():
        sched = WorldScheduler([EnvSlots("a", 1), EnvSlots("b", 1)])
        first = await sched.acquire(["a", "b"], (1, 0))
        second = await sched.acquire(["a", "b"], (1, 1))
        assert {first.url, second.url} == {"a", "b"}
        waiter = asyncio.create_task(sched.acquire(["a", "b"], (1, 2)))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert sched.waiting == 0
        sched.release(first)
        third = await sched.acquire(["a", "b"], (1, 3))
        assert third.url == first.url
        return sched

    sched = asyncio.run(scenario())
    assert all(e.held <= e.pool for e in sched.envs.values())


def test_waiter_granted_as_it_is_cancelled_gives_the_slot_back_to_the_next():
    async def scenario():
        sched = WorldScheduler([EnvSlots("a", 1)])
        held = await sched.acquire(["a"], (1, 0))
        granted = asyncio.create_task(sched.acquire(["a"], (1, 1)))
        after = asyncio.create_task(sched.acquire(["a"], (1, 2)))
        await settle()
        sched.release(held)  # hands the slot to `granted`, which is cancelled before it resumes
        granted.cancel()
        with pytest.raises(asyncio.CancelledError):
            await granted
        slot = await asyncio.wait_for(after, 1)
        assert slot.held == 1 and sched.waiting == 0

    asyncio.run(scenario())


class CountingPriority(tuple):
    """A priority that counts how often the scheduler compares it."""

    compares = 0

    def __eq__(self, other):
        CountingPriority.compares += 1
        return tuple.__eq__(self, other)

    def __lt__(self, other):
        CountingPriority.compares += 1
        return tuple.__lt__(self, other)

    __hash__ = tuple.__hash__


def test_cancelling_queued_waiters_costs_no_comparisons_per_other_waiter():
    """Cancelling n waiters queued behind n others must not compare each with the queue (issue #11.4:
    a sorted list made that O(n^2): 4000 cancels froze the loop for 5 s, a 65,536 batch for minutes)."""
    n = 1000

    async def scenario():
        sched = WorldScheduler([EnvSlots("a", 1)])
        held = await sched.acquire(["a"], (0, 0))
        front = [asyncio.create_task(sched.acquire(["a"], CountingPriority((1, i)), "x")) for i in range(n)]
        back = [asyncio.create_task(sched.acquire(["a"], CountingPriority((2, i)), "x")) for i in range(n)]
        await settle()
        assert sched.waiting == 2 * n
        CountingPriority.compares = 0
        for task in back:
            task.cancel()
        await asyncio.gather(*back, return_exceptions=True)
        compares = CountingPriority.compares
        assert sched.waiting == n and held.held == 1
        # The front is still served, best first, and the cancelled ones never are.
        order = []
        slot = held
        for task in front:
            sched.release(slot)
            slot = await asyncio.wait_for(task, 1)
            order.append(task)
        assert order == front and sched.waiting == 0 and slot.held == 1
        return compares

    compares = asyncio.run(scenario())
    assert compares <= 20 * n, f"{compares} priority comparisons to cancel {n} waiters"


def test_a_free_env_is_not_held_back_by_a_waiter_that_cannot_use_it():
    """Envs serving different task sets: W1 waits for a; b is free and W1 cannot use it."""

    async def scenario():
        sched = WorldScheduler([EnvSlots("a", 1), EnvSlots("b", 1)])
        held_a = await sched.acquire(["a"], (0, 0))
        w1 = asyncio.create_task(sched.acquire(["a"], (1, 0)))
        await settle()
        assert sched.waiting == 1
        either = asyncio.create_task(sched.acquire(["a", "b"], (2, 0)))
        await settle()
        assert either.done(), "acquire([a, b]) waited behind a waiter for a while b was free"
        assert either.result().url == "b"
        sched.release(either.result())
        only_b = asyncio.create_task(sched.acquire(["b"], (3, 0)))  # worse priority than W1
        await settle()
        assert only_b.done() and only_b.result().url == "b"
        # W1 still gets a as soon as it frees.
        sched.release(held_a)
        held_a2 = await asyncio.wait_for(w1, 1)
        assert held_a2.url == "a"
        # And a slot freed on b goes to the best waiter that can use b, even a worse one.
        w_a = asyncio.create_task(sched.acquire(["a"], (4, 0)))
        w_b = asyncio.create_task(sched.acquire(["b"], (5, 0)))
        await settle()
        sched.release(only_b.result())
        await settle()
        assert w_b.done() and not w_a.done()
        sched.release(held_a2)
        assert (await asyncio.wait_for(w_a, 1)).url == "a"
        assert sched.waiting == 0

    asyncio.run(scenario())


def test_concurrent_requests_share_the_pool_fairly_and_keep_priority_within_each():
    """Share X (a big batch) queues 100 attempts, then share Y 10: Y is served interleaved with X,
    not after all of X; within each share, best priority first."""

    async def scenario():
        sched = WorldScheduler([EnvSlots("a", 2)])
        holders = deque([await sched.acquire(["a"], (0, 0)), await sched.acquire(["a"], (0, 1))])
        grants: list[tuple[str, tuple]] = []

        async def attempt(share: str, priority: tuple):
            slot = await sched.acquire(["a"], priority, share)
            grants.append((share, priority))
            holders.append(slot)

        x = [(g, i) for g in range(1, 11) for i in range(10)]
        random.Random(0).shuffle(x)  # queued in any order, served by priority
        tasks = [asyncio.create_task(attempt("X", p)) for p in x]
        await settle()
        tasks += [asyncio.create_task(attempt("Y", (11, i))) for i in range(10)]
        await settle()
        assert sched.waiting == 110
        while sched.waiting:  # slots free one at a time
            sched.release(holders.popleft())
            await settle()
        await asyncio.gather(*tasks)
        assert sched.envs["a"].max_held == 2
        return grants

    grants = asyncio.run(scenario())
    first_20 = [share for share, _ in grants[:20]]
    assert first_20.count("Y") >= 8, first_20
    for share in ("X", "Y"):
        served = [p for s, p in grants if s == share]
        assert served == sorted(served)


def test_random_workload_keeps_the_invariants():
    """Random acquires, cancels and releases over envs with different task sets and several
    requests: pools never exceeded, no env idle while a waiter could use it, `waiting` exact,
    and every slot back at the end (enough cancels for the lazy heaps to be rebuilt)."""
    rng = random.Random(11)
    task_sets = [["a"], ["b"], ["a", "b"], ["b", "c"], ["c"], ["a", "b", "c"]]

    async def scenario():
        sched = WorldScheduler([EnvSlots("a", 2), EnvSlots("b", 1), EnvSlots("c", 3)])
        held: list[EnvSlots] = []
        pending: dict[asyncio.Task, list[str]] = {}

        async def attempt(candidates: list[str], priority: tuple, share: object):
            held.append(await sched.acquire(candidates, priority, share))

        for step in range(6000):
            op = rng.random()
            if op < 0.5:
                candidates = rng.choice(task_sets)
                task = asyncio.create_task(attempt(candidates, (rng.randrange(50), step), rng.randrange(4)))
                pending[task] = candidates
            elif op < 0.75 and pending:
                rng.choice(list(pending)).cancel()  # may be waiting or granted but not yet resumed
            elif held:
                sched.release(held.pop(rng.randrange(len(held))), 0.1)
            await settle(rng.choice([0, 1, 3]))
            if rng.random() < 0.3:
                await settle()
                for task in [t for t in pending if t.done()]:
                    del pending[task]
                assert sched.waiting == len(pending)
                for candidates in pending.values():
                    assert all(sched.envs[u].free == 0 for u in candidates), "an env idles while wanted"
            for env in sched.envs.values():
                assert 0 <= env.held <= env.pool
            assert sum(e.held for e in sched.envs.values()) >= len(held)
        for _ in range(10_000):  # drain: every waiter is served once the held slots come back
            if not (pending or held):
                break
            for slot in held:
                sched.release(slot)
            held.clear()
            await settle()
            for task in [t for t in pending if t.done()]:
                del pending[task]
        assert not pending, "waiters left with every slot back: a slot leaked"
        return sched

    sched = asyncio.run(scenario())
    assert sched.waiting == 0
    assert all(e.held == 0 for e in sched.envs.values())


def test_an_env_added_serves_queued_waiters_and_a_removed_one_fails_only_its_orphans():
    async def scenario():
        sched = WorldScheduler([EnvSlots("a", 1)])
        first = await sched.acquire(["a"], (1, 0), task="t")
        queued = [asyncio.create_task(sched.acquire(["a"], (1, i), task="t")) for i in (1, 2, 3)]
        other = asyncio.create_task(sched.acquire(["a"], (1, 4), task="u"))  # a task "b" does not serve
        await settle()
        assert sched.waiting == 4
        sched.add_env(EnvSlots("b", 2), tasks={"t"})
        await settle()
        # b's two worlds went to the best two waiters of its task, at once; "u" still waits for a.
        assert [t.done() for t in queued] == [True, True, False] and not other.done()
        assert {t.result().url for t in queued[:2]} == {"b"}
        sched.drain_env("a")
        sched.release(first)  # a is draining: its slot goes back to nobody
        await settle()
        assert not queued[2].done() and not other.done()
        with pytest.raises(NoEnvLeft):  # a new attempt for "u" finds only a draining env
            await sched.acquire(["a"], (2, 0), task="u")
        sched.remove_env("a")
        await settle()
        with pytest.raises(NoEnvLeft):  # "u" lost its only env; "t" still has b
            await asyncio.wait_for(other, 5)
        assert not queued[2].done() and sched.waiting == 1
        sched.release(queued[0].result())
        assert (await queued[2]).url == "b"
        with pytest.raises(ValueError):  # b is neither drained nor empty
            sched.remove_env("b")
        return sched

    sched = asyncio.run(scenario())
    assert list(sched.envs) == ["b"] and sched.envs["b"].held == 2 and sched.waiting == 0


def test_random_membership_changes_keep_the_pool_cap_and_strand_nobody():
    """Envs added, drained and removed among random acquires, cancels and releases. The oracle is
    the test's own bookkeeping: which env serves which task (so which waiter an added env must
    take), the worlds each env has out, which envs were drained."""
    rng = random.Random(5)
    tasks = ["t1", "t2", "t3"]

    async def scenario():
        serves: dict[str, set[str]] = {"e0": {"t1", "t2"}, "e1": {"t2", "t3"}}
        pools = {"e0": 2, "e1": 1}
        sched = WorldScheduler([EnvSlots(u, p) for u, p in pools.items()])
        out: dict[str, int] = {u: 0 for u in serves}  # worlds granted and not released, per env
        drained: set[str] = set()
        held: list[EnvSlots] = []
        pending: dict[asyncio.Task, str] = {}
        orphaned = 0
        next_env = 2
        unserved: list[set[str]] = []  # per step, after its op: the tasks no env takes attempts for

        def note_unserved() -> None:
            unserved.append({t for t in tasks if not any(t in serves[u] for u in serves if u not in drained)})

        async def attempt(task: str, priority: tuple):
            nonlocal orphaned
            since = len(unserved)
            candidates = [u for u, ts in serves.items() if task in ts]
            try:
                slot = await sched.acquire(candidates, priority, rng.randrange(3), task=task)
            except NoEnvLeft:
                assert any(task in unserved[k] for k in range(since - 1, len(unserved))), (
                    "an attempt was failed while a present env served its task all along"
                )
                orphaned += 1
                return
            assert slot.url not in drained, "a slot of a draining env was granted"
            assert task in serves[slot.url], "a slot of an env that does not serve the task was granted"
            out[slot.url] += 1
            assert out[slot.url] <= pools[slot.url], "more worlds out than the env's pool"
            held.append(slot)

        for step in range(4000):
            op = rng.random()
            if op < 0.45:
                task = rng.choice(tasks)
                pending[asyncio.create_task(attempt(task, (rng.randrange(20), step)))] = task
            elif op < 0.55 and pending:
                rng.choice(list(pending)).cancel()
            elif op < 0.8 and held:
                slot = held.pop(rng.randrange(len(held)))
                out[slot.url] -= 1
                sched.release(slot)
            elif op < 0.85:
                url = f"e{next_env}"
                next_env += 1
                serves[url], pools[url], out[url] = set(rng.sample(tasks, rng.randint(1, 2))), rng.randint(1, 3), 0
                sched.add_env(EnvSlots(url, pools[url]), tasks=serves[url])
            elif op < 0.9:
                live = [u for u in serves if u not in drained]
                if len(live) > 1:
                    url = rng.choice(live)
                    await settle()  # waiters granted before the drain have resumed: any later grant is a fault
                    drained.add(url)
                    sched.drain_env(url)
            else:
                for url in [u for u in drained if out[u] == 0 and u in sched.envs]:
                    sched.remove_env(url)
                    del serves[url]
            note_unserved()
            await settle(rng.choice([0, 1, 3]))
            if rng.random() < 0.3:
                await settle()
                for task in [t for t in pending if t.done()]:
                    if not task.cancelled() and task.exception() is not None:
                        raise task.exception()
                    del pending[task]
                assert sched.waiting == len(pending)
                for task in pending.values():
                    for url, ts in serves.items():
                        if task in ts and url not in drained:
                            assert out[url] == pools[url], f"{url} idles while a waiter for {task} could use it"
        # Wind down: every world comes back and every drained env is removed. No waiter may be left:
        # each is served by an env that takes attempts, or failed when its last env went.
        for _ in range(1000):
            if not pending:
                break
            for slot in held:
                out[slot.url] -= 1
                sched.release(slot)
            held.clear()
            for url in [u for u in drained if u in sched.envs]:
                sched.remove_env(url)
                del serves[url]
            note_unserved()
            await settle()
            for task in [t for t in pending if t.done()]:
                del pending[task]
        assert not pending, "waiters stranded with every world back and every drained env gone"
        return orphaned, out, drained

    orphaned, out, drained = asyncio.run(scenario())
    assert orphaned > 0 and drained, "the workload never exercised a removal"


def test_an_env_that_is_down_gets_an_attempt_only_when_no_other_has_a_world_free():
    """A down env looks idle (its episodes fail at once); preferring it would drain every retry.
    Break tried: acquire ignoring `down` -> the first attempt goes to the idle down env."""

    async def scenario():
        up, down = EnvSlots("up", 2, held=1), EnvSlots("down", 2)
        down.down = True
        sched = WorldScheduler([up, down])
        first = await sched.acquire(["up", "down"], (1, 0))
        second = await sched.acquire(["up", "down"], (1, 1))  # "up" is full now: better a try than a wait
        down.down = False
        third = await sched.acquire(["up", "down"], (1, 2))
        return first.url, second.url, third.url

    assert asyncio.run(scenario()) == ("up", "down", "down")
