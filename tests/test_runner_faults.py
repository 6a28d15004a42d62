"""The runner against env and model answers no real server can be made to send: a reset answer that
breaks the contract but names its episode, a DELETE the env refuses for a while, a NaN reward, text
with a lone surrogate. In-process, over httpx's MockTransport (stand-ins, on purpose): the oracle is
what the stand-in env saw (its own log of DELETEs) and the scheduler's slot counts."""

from __future__ import annotations

import asyncio
import json

import httpx
from helpers import results_alive, results_held
from httpx_stand_in import stand_in

from rollout_service.backends.env_client import EnvClient
from rollout_service.backends.replica_pool import ReplicaPool
from rollout_service.protocol import EnvContract, GroupRequest
from rollout_service.server.groups.runner import GroupRunner
from rollout_service.server.membership.targets import EnvHandle, ModelRoute, TaskTarget
from rollout_service.server.membership.world_scheduler import EnvSlots, WorldScheduler
from rollout_service.server.metrics import Metrics

ENV = "http://env"


class StandInEnv:
    """Answers reset/step/DELETE from a script; records every DELETE."""

    def __init__(self, reset: dict, step: dict | None = None, delete_failures: int = 0) -> None:
        self.reset, self.step, self.delete_failures = reset, step, delete_failures
        self.deletes: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            self.deletes.append(request.url.path)
            if len(self.deletes) <= self.delete_failures:
                return httpx.Response(503, json={"error": "busy", "message": "try later"})
            return httpx.Response(200, json={"done": True, "status": "abandoned"})
        if request.url.path == "/step/reset":
            return httpx.Response(200, content=json.dumps(self.reset).encode())
        return httpx.Response(200, content=json.dumps(self.step or {}).encode())


def chat_answer(content: str) -> httpx.MockTransport:
    def answer(request: httpx.Request) -> httpx.Response:
        body = {
            "choices": [{"index": 0, "message": {"content": content}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 3},
        }
        return httpx.Response(200, content=json.dumps(body).encode())  # escapes a lone surrogate, as JSON may

    return httpx.MockTransport(answer)


def run_group(env: StandInEnv, completion: str = "{}", **request) -> tuple[dict, EnvSlots]:
    async def go():
        slots = EnvSlots(ENV, 1)
        scheduler = WorldScheduler([slots])
        chat = ReplicaPool(["http://model"], http=stand_in(chat_answer(completion)))
        client = EnvClient(ENV, http=stand_in(httpx.MockTransport(env)))
        contract = EnvContract(urls=[ENV], catalog_hash="h", reward_version="r", reward_profile="rl")
        target = TaskTarget("t001", "slug", [EnvHandle(ENV, client, slots, contract)])
        policy = ModelRoute("m", chat)
        runner = GroupRunner(scheduler, policy, None, Metrics())
        try:
            result = await runner.run_group(GroupRequest(task_id="t001", **request), target, policy)
            # An ending may still be retrying a DELETE in the background: wait until the slot is free.
            for _ in range(200):
                if slots.held == 0:
                    break
                await asyncio.sleep(0.05)
            return result.model_dump(mode="json", by_alias=True), slots
        finally:
            await client.aclose()
            await chat.aclose()

    return asyncio.run(go())


def test_a_malformed_reset_answer_that_names_its_episode_still_gets_it_abandoned():
    env = StandInEnv(reset={"episode_id": "step-7", "done": False, "reward": "n/a", "observation": {"messages": []}})
    group, slots = run_group(env, n=1, retries=0)
    assert group["attempts"][0]["failure"]["kind"] == "env_bad_answer"
    assert env.deletes == ["/step/step-7"]  # the env's world comes back
    assert slots.held == 0


def test_a_refused_delete_keeps_the_slot_until_the_env_gives_the_world_back():
    obs = {"stage": "executor", "messages": [{"role": "user", "content": "q"}]}
    env = StandInEnv(reset={"episode_id": "step-1", "done": False, "observation": obs}, delete_failures=2)
    # max_turns=0 is refused by the protocol; 1 turn then the env asks again: max_turns ends it.
    env.step = {"episode_id": "step-1", "done": False, "observation": obs}
    group, slots = run_group(env, n=1, retries=0, max_turns=1)
    assert group["attempts"][0]["failure"]["kind"] == "max_turns"
    assert env.deletes == ["/step/step-1"] * 3  # refused twice, then done: the slot waited for it
    assert slots.held == 0 and slots.max_held == 1


def test_a_nan_reward_is_a_contract_breach_not_a_silent_void():
    env = StandInEnv(reset={"episode_id": "step-2", "done": True, "reward": float("nan"), "score": {}})
    group, _ = run_group(env, n=1, retries=0)
    assert group["attempts"][0]["failure"]["kind"] == "env_bad_answer"


def test_a_lone_surrogate_in_a_completion_does_not_void_the_group():
    obs = {"stage": "executor", "messages": [{"role": "user", "content": "q \ud83d"}]}
    env = StandInEnv(
        reset={"episode_id": "step-3", "done": False, "observation": obs},
        step={"episode_id": "step-3", "done": True, "reward": 0.5, "pass": False, "score": {}},
    )
    group, slots = run_group(env, completion="an answer \ud83d", n=1, retries=0)
    attempt = group["attempts"][0]
    assert attempt["status"] == "scored" and attempt["reward"] == 0.5
    assert "\ufffd" in attempt["turns"][0]["completion"] and "\ufffd" in attempt["turns"][0]["messages"][0]["content"]
    json.dumps(group).encode("utf-8")  # the whole group serialises
    assert slots.held == 0


def test_finished_groups_are_not_retained_by_the_runner():
    """Memory stays bounded over a long run only if nothing keeps a group once its result is handed
    on: with the runner, scheduler, clients and metrics alive (as in the service), no attempt, turn
    or group result may survive its group. The oracle is the garbage collector's own object list."""
    obs = {"stage": "executor", "messages": [{"role": "user", "content": "q"}]}
    env = StandInEnv(
        reset={"episode_id": "step-9", "done": False, "observation": obs},
        step={"episode_id": "step-9", "done": True, "reward": 1.0, "pass": True, "score": {}},
    )

    held = results_held()  # what earlier tests in this worker left: not this check's

    def alive() -> int:
        return len(results_alive(held))

    async def go() -> tuple[int, int]:
        slots = EnvSlots(ENV, 4)
        chat = ReplicaPool(["http://model"], http=stand_in(chat_answer("an answer")))
        client = EnvClient(ENV, http=stand_in(httpx.MockTransport(env)))
        contract = EnvContract(urls=[ENV], catalog_hash="h", reward_version="r", reward_profile="rl")
        target = TaskTarget("t001", "slug", [EnvHandle(ENV, client, slots, contract)])
        policy = ModelRoute("m", chat)
        runner = GroupRunner(WorldScheduler([slots]), policy, None, Metrics())
        try:
            before = alive()
            for _ in range(3):
                result = await runner.run_group(GroupRequest(task_id="t001", n=4, retries=0), target, policy)
                assert result.counts.scored == 4 and len(result.attempts[0].turns) == 1
                del result
            # The loop's handle that woke this task from the last gather holds that gather's result
            # until another wakes it: asyncio's, not the runner's.
            await asyncio.sleep(0)
            return before, alive()
        finally:
            await client.aclose()
            await chat.aclose()

    before, after = asyncio.run(go())
    assert after == before == 0


def test_an_unexpected_error_outside_the_episode_fails_the_attempt_as_internal_error_once():
    """A bug outside the episode (here the target raising when asked for the env of its slot) fails
    the attempt as internal_error, never run again, whatever the exception's type: a TimeoutError
    is not read as the env's (which would be env_no_world, retryable); and the world slot it took is
    given back (the scheduler's own count). Breaks tried: the branch returning a retryable kind ->
    fails; failures.classify in place of failures.bug -> env_failure, tried twice, fails; the slot's
    release on that path removed -> one slot held for good, fails."""

    class BrokenTarget(TaskTarget):
        def env(self, url: str) -> EnvHandle:
            raise TimeoutError("a bug's own timeout")

    slots = EnvSlots(ENV, 4)  # room for a second try, had the failure been retryable

    async def go() -> dict:
        chat = ReplicaPool(["http://model"], http=stand_in(chat_answer("{}")))
        client = EnvClient(ENV, http=stand_in(httpx.MockTransport(StandInEnv(reset={}))))
        contract = EnvContract(urls=[ENV], catalog_hash="h", reward_version="r", reward_profile="rl")
        target = BrokenTarget("t001", "slug", [EnvHandle(ENV, client, slots, contract)])
        policy = ModelRoute("m", chat)
        runner = GroupRunner(WorldScheduler([slots]), policy, None, Metrics())
        try:
            result = await runner.run_group(GroupRequest(task_id="t001", n=1, retries=1), target, policy)
            return result.model_dump(mode="json", by_alias=True)
        finally:
            await client.aclose()
            await chat.aclose()

    [attempt] = asyncio.run(go())["attempts"]
    assert attempt["status"] == "internal_error" and attempt["tries"] == 1 and attempt["earlier_failures"] == []
    assert attempt["failure"]["kind"] == "internal_error" and attempt["failure"]["attribution"] == "infrastructure"
    assert attempt["failure"]["detail"] == "TimeoutError: a bug's own timeout"
    assert slots.held == 0, "the attempt kept its world slot"
