"""Several services, each owning its envs: the trainer's sharded clients send each group to a
service that serves its task (rollout_service.trainer.sharded).

Two refenv servers serve the two sides of one split (disjoint task ids), each behind its own
service. The oracle is each env's own episode counter and the env each group names. The model is
the scripted stand-in (`answer`: one turn per episode, at once): what is under test is where
groups go, not what the model says.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from helpers import wait_until

from rollout_service.trainer import AsyncShardedClient, RequestRejected, RolloutClient, ShardedClient

SAMPLING = {"temperature": 0.8, "max_tokens": 16}


def started(env) -> int:
    return httpx.get(f"{env.url}/health", timeout=10).json()["episodes"]["started"]


def test_groups_go_to_the_service_serving_their_task(start_refenv, start_service, start_scripted_model):
    """Break tried: _TaskMap.pick always answering the first service -> the eval side's groups are
    refused by the train side's service (404 unknown_task) and env b starts no episode."""
    model = start_scripted_model("answer")
    env_a = start_refenv("--pool", "2", "--split", "auto:0.5", "--side", "train")
    env_b = start_refenv("--pool", "2", "--split", "auto:0.5", "--side", "eval")
    svc_a = start_service([env_a.url], vllm=model.url, model="scripted")
    svc_b = start_service([env_b.url], vllm=model.url, model="scripted")
    with RolloutClient(svc_a.url) as a, RolloutClient(svc_b.url) as b:
        tasks_a = [t["task_id"] for t in a.tasks()]
        tasks_b = [t["task_id"] for t in b.tasks()]
    assert tasks_a and tasks_b and not set(tasks_a) & set(tasks_b)
    requests = [
        {"task_id": task, "n": 2, "sampling": SAMPLING, "allow_eval_side": True}
        for task in (tasks_a[0], tasks_b[0], tasks_a[1], tasks_b[1], tasks_b[2])
    ]
    with ShardedClient([svc_a.url, svc_b.url]) as client:
        items = list(client.groups(requests))
        single = client.group(task_id=tasks_b[3], n=2, sampling=SAMPLING, allow_eval_side=True)
        with pytest.raises(RequestRejected) as unknown:
            client.group(task_id="no-such-task", n=2, sampling=SAMPLING)
        assert unknown.value.status == 404 and unknown.value.error == "unknown_task"
    assert sorted(item.index for item in items) == list(range(5))
    for item in items:
        assert item.group is not None, item.error
        assert item.group.task_id == requests[item.index]["task_id"]
        expected = env_a.url if item.group.task_id in tasks_a else env_b.url
        assert item.group.env.urls == [expected] and item.group.counts.scored == 2
    assert single.env.urls == [env_b.url] and single.counts.scored == 2
    assert started(env_a) == 2 * 2 and started(env_b) == 3 * 2 + 2  # every attempt where its task lives

    async def from_asyncio() -> None:
        async with AsyncShardedClient([svc_a.url, svc_b.url]) as client:
            got = [item async for item in client.groups(requests[:2])]
            assert sorted(item.index for item in got) == [0, 1] and all(item.group for item in got)
            one = await client.group(task_id=tasks_a[2], n=2, sampling=SAMPLING)
            assert one.env.urls == [env_a.url]

    asyncio.run(from_asyncio())
    assert started(env_a) == 2 * 2 + 2 + 2 and started(env_b) == 3 * 2 + 2 + 2


def test_a_task_several_services_serve_is_spread_over_them():
    """The map alone (no servers): the service with the fewest of the client's groups in flight
    gets the next one. Break tried: pick not counting the group it places -> every group goes to
    the first service."""
    from rollout_service.trainer.sharded import _TaskMap

    owners = _TaskMap(["http://a", "http://b"])
    owners.learn([[{"task_id": "t1", "slug": "one"}], [{"task_id": "t1", "slug": "one"}, {"task_id": "t2"}]])
    assert [owners.pick({"task_id": "t1"}) for _ in range(4)] == [0, 1, 0, 1]
    assert owners.pick({"slug": "one"}) == 0 and owners.pick({"task_id": "t2"}) == 1
    assert owners.pick({"task_id": "one"}) is None  # a slug is not a task id
    owners.learn([[{"task_id": "t1"}], RuntimeError("connection refused")])
    assert isinstance(owners.unknown({"task_id": "t2"}), Exception) and owners.unreachable == {
        "http://b": "RuntimeError: connection refused"
    }


async def _other_tasks() -> list[str]:
    return [repr(t) for t in asyncio.all_tasks() if t is not asyncio.current_task()]


def test_leaving_a_sharded_batch_early_cancels_the_rest_on_every_service(
    start_refenv, start_service, start_scripted_model
):
    """The trainer breaks out after the first group: both services see the streams close and
    abandon the episodes they were running (the envs' own counters), nothing is left running."""
    model = start_scripted_model("sql-then-answer", "--sql-turns", "1", "--delay", "1")
    env_a = start_refenv("--pool", "1", "--split", "auto:0.5", "--side", "train")
    env_b = start_refenv("--pool", "1", "--split", "auto:0.5", "--side", "eval")
    svc_a = start_service([env_a.url], vllm=model.url, model="scripted")
    svc_b = start_service([env_b.url], vllm=model.url, model="scripted")
    with RolloutClient(svc_a.url) as a, RolloutClient(svc_b.url) as b:
        tasks = [t["task_id"] for t in a.tasks()[:3]] + [t["task_id"] for t in b.tasks()[:3]]
    requests = [{"task_id": t, "n": 1, "sampling": SAMPLING, "allow_eval_side": True} for t in tasks]
    with ShardedClient([svc_a.url, svc_b.url]) as client:
        for item in client.groups(requests):
            assert item.group is not None
            break
        # Closed when the loop is left, not after: nothing of the batch still runs on the client's loop
        # (closing the client then destroyed it pending). Break tried: no wait for the pump's end -> the
        # pump and the streams' tasks still pending here, fails.
        assert asyncio.run_coroutine_threadsafe(_other_tasks(), client._loop).result(10) == []

    def all_ended() -> bool:
        healths = [httpx.get(f"{e.url}/health", timeout=5).json() for e in (env_a, env_b)]
        details = [httpx.get(f"{s.url}/health/detail", timeout=5).json() for s in (svc_a, svc_b)]
        return all(h["live_episodes"] == 0 for h in healths) and all(d["groups_in_flight"] == 0 for d in details)

    assert wait_until(all_ended, 20)
    abandoned = [httpx.get(f"{e.url}/health", timeout=5).json()["episodes"]["abandoned"] for e in (env_a, env_b)]
    started = [httpx.get(f"{e.url}/health", timeout=5).json()["episodes"]["started"] for e in (env_a, env_b)]
    assert sum(abandoned) >= 1 and sum(started) < 6, (abandoned, started)  # the rest never ran
