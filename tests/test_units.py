"""Pure logic: advantages, the world scheduler's ordering and caps, env error typing, durations."""

from __future__ import annotations

import asyncio

import pytest

from inference.client import normalize_response_format
from refenv.cli import parse_duration
from rollout_service.advantages import group_advantages, summarize
from rollout_service.scheduler import EnvSlots, WorldScheduler


def test_mean_advantages_skip_unscored():
    adv = group_advantages([1.0, None, 0.0, 0.5], "mean")
    assert adv == [0.5, None, -0.5, 0.0]


def test_zscore_advantages_and_all_equal():
    adv = group_advantages([1.0, 0.0], "zscore")
    assert adv == [1.0, -1.0]
    assert group_advantages([0.3, 0.3, None], "zscore") == [0.0, 0.0, None]
    assert summarize([0.3, 0.3, None]) == (0.3, 0.0, True)
    assert summarize([None, None]) == (None, None, False)
    assert group_advantages([None], "mean") == [None]
    with pytest.raises(ValueError):
        group_advantages([1.0], "median")  # type: ignore[arg-type]


def test_scheduler_never_exceeds_capacity_and_serves_earlier_groups_first():
    async def scenario():
        sched = WorldScheduler([EnvSlots("a", 2)])
        order: list[tuple] = []

        async def attempt(priority: tuple, hold: float):
            slot = await sched.acquire(["a"], priority)
            order.append(priority)
            assert slot.held <= slot.capacity
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


def test_scheduler_cancelled_waiter_frees_nothing_and_spreads_over_envs():
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
    assert all(e.held <= e.capacity for e in sched.envs.values())


def test_response_format_normalization():
    schema = {"type": "object", "properties": {"x": {"type": "string"}}}
    wrapped = normalize_response_format(schema)
    assert wrapped["type"] == "json_schema" and wrapped["json_schema"]["schema"] == schema
    openai_shaped = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    assert normalize_response_format(openai_shaped) is openai_shaped
    assert normalize_response_format(None) is None


def test_durations():
    assert parse_duration("5m") == 300 and parse_duration("750ms") == 0.75
    assert parse_duration("1m30s") == 90 and parse_duration("2") == 2
