"""Policy updates against replica faults no real vLLM can be made to show on demand: a reload that
fails half-way, a resume that is refused, a replica that goes down and comes back restarted on its
launch checkpoint between two probes, a trainer's push that reached only some replicas, shutdown in
the middle of a reload. The replicas are an in-process stand-in (tests/fake_vllm.py, over httpx's
MockTransport; a stand-in on purpose), and so is the env. The oracle is the stand-in's own state:
the weights that generate each completion (every answer names them), the /weight_info label, the
paused flag and its log of calls, not values read back from the service.

One test per reviewer finding (r1 ... r13) that applies to the current code.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fake_vllm import BASE, LAUNCH_WEIGHTS, adapter, checkpoint, made_by, make_manager
from httpx_stand_in import stand_in

from rollout_service.backends.env_client import EnvClient
from rollout_service.backends.errors import InferenceUnreachable
from rollout_service.backends.replica_pool import ReplicaPool
from rollout_service.protocol import EnvContract, GroupRequest, PolicyUpdate, PolicyUpdateResult
from rollout_service.server.errors import RequestRefused
from rollout_service.server.groups.runner import GroupRunner
from rollout_service.server.http.app import http_status
from rollout_service.server.membership.monitor import BackendMonitor
from rollout_service.server.membership.targets import EnvHandle, ModelRoute, TaskTarget
from rollout_service.server.membership.world_scheduler import EnvSlots, WorldScheduler
from rollout_service.server.metrics import Metrics
from rollout_service.server.policy.manager import PolicyManager

ENV = "http://env"
OBS = {"messages": [{"role": "user", "content": "q"}], "stage": "executor"}
MESSAGES = [{"role": "user", "content": "x"}]


def run(coro, timeout_s: float = 10.0):
    """Run a test's coroutine; a hang (a turn blocked on a paused replica) fails instead of stalling."""

    async def bounded():
        return await asyncio.wait_for(coro, timeout_s)

    return asyncio.run(bounded())


async def until(predicate, timeout_s: float = 3.0) -> bool:
    for _ in range(int(timeout_s / 0.02)):
        if predicate():
            return True
        await asyncio.sleep(0.02)
    return predicate()


async def turn(chat: ReplicaPool, pm: PolicyManager, affinity: str) -> tuple[str, str]:
    """One routed turn as the runner sends it: (the version it is labelled with, what generated it)."""
    lease = await asyncio.wait_for(pm.lease(), 2)
    try:
        out = await asyncio.wait_for(
            chat.chat(model=lease.version.served_model, messages=MESSAGES, sampling={}, affinity=affinity), 2
        )
    finally:
        pm.release(lease)
    return lease.version.label, made_by(out.choices[0].text)


class StandInEnv:
    """An env whose episodes last `turns` steps; `on_reset(k)` runs before the k-th reset answers."""

    def __init__(self, turns: int = 1, on_reset=None) -> None:
        self.turns, self.on_reset, self.resets = turns, on_reset, 0
        self.steps: dict[str, int] = {}

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":
            return httpx.Response(200, json={"done": True, "status": "abandoned"})
        if request.url.path == "/step/reset":
            self.resets += 1
            if self.on_reset is not None:
                await self.on_reset(self.resets)
            episode = f"e{self.resets}"
            self.steps[episode] = 0
            return httpx.Response(200, json={"episode_id": episode, "done": False, "observation": OBS})
        episode = json.loads(request.content)["episode_id"]
        self.steps[episode] += 1
        if self.steps[episode] >= self.turns:
            return httpx.Response(200, json={"episode_id": episode, "done": True, "reward": 1.0, "pass": True})
        return httpx.Response(200, json={"episode_id": episode, "done": False, "observation": OBS})


def make_runner(pm: PolicyManager, chat: ReplicaPool, env: StandInEnv) -> tuple[GroupRunner, TaskTarget, ModelRoute]:
    slots = EnvSlots(ENV, 1)
    client = EnvClient(ENV, http=stand_in(httpx.MockTransport(env)))
    contract = EnvContract(urls=[ENV], catalog_hash="h", reward_version="r", reward_profile="rl")
    target = TaskTarget("t001", "slug", [EnvHandle(ENV, client, slots, contract)])
    policy = ModelRoute(BASE, chat)
    return GroupRunner(WorldScheduler([slots]), policy, None, Metrics(), versions=pm), target, policy


# -- updates and the replicas they reach -------------------------------------------------------------


def test_r1_a_trainer_push_is_credited_only_to_the_replicas_its_pause_held(tmp_path):
    async def go():
        fleet, chat, pm = await make_manager(2)
        await pm.update(PolicyUpdate(version="v1", weights={"path": checkpoint(tmp_path, "v1")}))
        r0, r1, ep1 = fleet[0], fleet[1], chat.endpoints[1]
        r1.up = False
        chat.on_failure(ep1, InferenceUnreachable("connection refused"))  # a turn found r1 down
        await pm.pause(600)
        assert r0.paused and not r1.paused  # the pause held r0 only
        r0.weights = "pushed-v2"  # the trainer pushes into what it paused
        r1.up = True
        r1.restart()  # r1 is back on the launch checkpoint, got no push
        await pm.update(PolicyUpdate(version="v2"))
        assert r0.label == "v2"
        assert r1.label != "v2", "a replica the push never reached was labelled with the pushed version"
        assert fleet.paused == [False, False]
        before = len(r1.chats())
        for k in range(4):
            assert await turn(chat, pm, f"g{k}") == ("v2", "pushed-v2")
        assert len(r1.chats()) == before  # no v2 turn was generated on the launch weights

    run(go())


def test_r2_a_restore_racing_an_update_leaves_the_replica_on_the_new_version(tmp_path):
    async def go():
        fleet, chat, pm = await make_manager(2)
        v1, v2 = checkpoint(tmp_path, "v1"), checkpoint(tmp_path, "v2")
        await pm.update(PolicyUpdate(version="v1", weights={"path": v1}))
        r1, ep1 = fleet[1], chat.endpoints[1]
        r1.restart()
        r1.reload_delay = 0.4  # the restore's reload of v1 is slow ...
        await pm.reconcile(ep1, await chat.list_models(ep1))  # the monitor: r1 lost v1, restore it
        assert ep1.excluded is not None
        assert await until(lambda: bool(r1.calls("/collective_rpc")))  # the restore's reload is under way
        r1.reload_delay = 0.0  # ... the update's reload of v2 is fast
        await pm.update(PolicyUpdate(version="v2", weights={"path": v2}))
        assert await until(lambda: not pm.states.restoring())  # the restore has ended, one way or the other
        assert (r1.weights, r1.label) == (v2, "v2"), "the restore of v1 landed over the update to v2"
        assert ep1.excluded is None
        for ep in chat.routable():
            assert fleet.replicas[ep.url].weights == v2
        for k in range(4):
            assert await turn(chat, pm, f"g{k}") == ("v2", v2)

    run(go())


def test_r3_a_reload_failing_half_way_excludes_the_replica_and_marks_the_frozen_turn_mixed(tmp_path):
    async def go():
        fleet, chat, pm = await make_manager(1)
        v1, v2 = checkpoint(tmp_path, "v1"), checkpoint(tmp_path, "v2")
        await pm.update(PolicyUpdate(version="v1", weights={"path": v1}))
        r0, ep0 = fleet[0], chat.endpoints[0]
        r0.reload_fail, r0.chat_delay = "half", 0.3
        lease = await pm.lease()
        in_flight = asyncio.ensure_future(
            chat.chat(model=lease.version.served_model, messages=MESSAGES, sampling={}, affinity="g")
        )
        # The turn is being generated when the update pauses r0.
        assert await until(lambda: bool(r0.chats()))
        with pytest.raises(RequestRefused) as refused:
            await pm.update(PolicyUpdate(version="v2", weights={"path": v2}))
        assert http_status(refused.value) == 502
        assert r0.weights == v2 + "-HALF"  # the fake: neither v1 nor v2 any more
        assert ep0.excluded is not None, "a replica with half-reloaded weights stayed in routing"
        out = await in_flight
        ended_on = pm.release(lease)
        assert "->" in made_by(out.choices[0].text)  # the fake: the weights changed under the turn
        assert ended_on is not None, "a turn the failed reload changed under was not marked mixed"
        served = len(r0.chats())
        with pytest.raises(TimeoutError):  # no turn reaches r0 until it is checked
            await asyncio.wait_for(chat.chat(model=BASE, messages=MESSAGES, sampling={}), 0.3)
        assert len(r0.chats()) == served
        # The monitor's next look brings it back to v1.
        r0.reload_fail, r0.chat_delay = None, 0.0
        await pm.reconcile(ep0, await chat.list_models(ep0))
        assert await until(lambda: ep0.excluded is None)
        assert (r0.weights, r0.label) == (v1, "v1")
        assert await turn(chat, pm, "g2") == ("v1", v1)

    run(go())


def test_r4_a_replica_that_could_not_be_resumed_stays_out_of_routing_until_resumed(tmp_path):
    async def go():
        fleet, chat, pm = await make_manager(2)
        v1 = checkpoint(tmp_path, "v1")
        r1, ep1 = fleet[1], chat.endpoints[1]
        r1.resume_fail = 1
        await pm.update(PolicyUpdate(version="v1", weights={"path": v1}))
        assert r1.paused  # the fake: its resume was refused
        assert ep1.excluded is not None, "a replica still paused was put back in routing"
        before = len(r1.chats())
        for k in range(4):  # none hangs on the paused replica
            assert await turn(chat, pm, f"g{k}") == ("v1", v1)
        assert len(r1.chats()) == before
        # A look that finds it reachable must not route it while it is paused.
        await pm.reconcile(ep1, await chat.list_models(ep1))
        assert await until(lambda: ep1.excluded is None)
        assert not r1.paused and r1.label == "v1" and r1.weights == v1

    run(go())


def test_r5_a_lora_update_sent_during_a_trainer_pause_resumes_the_replicas(tmp_path):
    async def go():
        fleet, chat, pm = await make_manager(2)
        await pm.pause(600)
        assert fleet.paused == [True, True]
        await pm.update(PolicyUpdate(version="v1", lora={"path": adapter(tmp_path, "v1")}))
        assert fleet.paused == [False, False]
        label, by = await turn(chat, pm, "g")  # its lease does not block
        assert (label, by) == ("v1", f"ckpt0+{tmp_path}/v1")

    run(go())


def test_r5_close_resumes_a_pause_the_trainer_still_holds():
    async def go():
        fleet, chat, pm = await make_manager(2)
        await pm.pause(600)
        assert fleet.paused == [True, True]
        await pm.close()
        assert fleet.paused == [False, False]

    run(go())


def test_r5_start_resumes_a_replica_an_earlier_service_left_paused():
    async def go():
        fleet, _, earlier = await make_manager(2)
        await earlier.pause(600)  # ... and that service died without closing
        assert fleet.paused == [True, True]
        _, chat, pm = await make_manager(fleet=fleet)
        assert fleet.paused == [False, False]
        assert await turn(chat, pm, "g") == ("base", "ckpt0")

    run(go())


def test_r7_a_probe_finding_a_replica_down_excludes_it_unless_the_policy_is_base(tmp_path):
    async def go():
        # On the base weights a restarted replica serves the policy too: nothing to exclude.
        fleet, chat, pm = await make_manager(2)
        monitor = BackendMonitor({}, [("policy", ModelRoute(BASE, chat))], pm)
        fleet[1].up = False
        await monitor.probe()
        assert not monitor.model_state("policy", "http://r1")["ok"]
        assert chat.endpoints[1].excluded is None

        fleet, chat, pm = await make_manager(2)
        v1 = checkpoint(tmp_path, "v1")
        await pm.update(PolicyUpdate(version="v1", weights={"path": v1}))
        monitor = BackendMonitor({}, [("policy", ModelRoute(BASE, chat))], pm)
        r1, ep1 = fleet[1], chat.endpoints[1]
        r1.up = False
        await monitor.probe()
        assert ep1.excluded is not None, "a probe found the replica down and left it in routing"
        r1.up = True
        r1.restart()  # back on the launch weights before the next probe
        before = len(r1.chats())
        for k in range(4):
            assert await turn(chat, pm, f"g{k}") == ("v1", v1)
        assert len(r1.chats()) == before  # no turn labelled v1 generated on ckpt0
        await monitor.probe()  # the next probe restores it
        assert await until(lambda: ep1.excluded is None)
        assert (r1.weights, r1.label) == (v1, "v1")

    run(go())


def test_r9_a_second_bare_update_after_one_pause_is_refused_not_paused():
    async def go():
        fleet, _, pm = await make_manager(2)
        await pm.pause(600)
        labelled = [len(r.calls("/update_weight_version")) for r in fleet.replicas.values()]
        first, second = await asyncio.gather(
            pm.update(PolicyUpdate(version="p1")), pm.update(PolicyUpdate(version="p2")), return_exceptions=True
        )
        results = [first, second]
        done = [r for r in results if isinstance(r, PolicyUpdateResult)]
        refused = [r for r in results if isinstance(r, RequestRefused)]
        assert len(done) == 1 and len(refused) == 1, results
        assert (http_status(refused[0]), refused[0].error) == (409, "not_paused")
        # The fake: each replica was labelled once, with the version that was accepted.
        now = [len(r.calls("/update_weight_version")) for r in fleet.replicas.values()]
        assert [a - b for a, b in zip(now, labelled, strict=True)] == [1, 1]
        assert [r.label for r in fleet.replicas.values()] == [done[0].version] * 2
        assert fleet.paused == [False, False]

    run(go())


# -- the runner around a paused or moving policy -----------------------------------------------------


def test_r10_a_try_timing_out_on_a_paused_policy_is_not_the_policys_failure():
    async def go():
        fleet, chat, pm = await make_manager(2)
        runner, target, policy = make_runner(pm, chat, StandInEnv(turns=1))
        await pm.pause(600)  # the trainer holds the replicas longer than timeout_s
        result = await runner.run_group(GroupRequest(task_id="t001", n=1, timeout_s=0.3, retries=1), target, policy)
        await pm.close()
        attempt = result.attempts[0]
        assert attempt.failure is not None
        assert (attempt.status, attempt.failure.kind, attempt.failure.attribution) == (
            "inference_failure",
            "policy_paused",
            "infrastructure",
        )
        assert attempt.reward is None
        assert all(not r.chats() for r in fleet.replicas.values())  # the fake: no turn was ever sent

    run(go())


def test_r11_a_group_returns_no_attempt_behind_the_version_current_when_it_returns(tmp_path):
    async def go():
        fleet, chat, pm = await make_manager(2)

        async def update_before_second_reset(k: int) -> None:
            if k == 2:  # attempt 0 has finished on base; attempt 1 starts after the update
                await pm.update(PolicyUpdate(version="v1", lora={"path": adapter(tmp_path, "v1")}))

        runner, target, policy = make_runner(pm, chat, StandInEnv(turns=1, on_reset=update_before_second_reset))
        request = GroupRequest(task_id="t001", n=2, max_staleness=0, sampling={"temperature": 1.0})
        result = await runner.run_group(request, target, policy)
        generated = [made_by(t.completion) for a in result.attempts for t in a.turns]
        assert generated and all(g == f"ckpt0+{tmp_path}/v1" for g in generated), generated
        assert all(a.status == "scored" for a in result.attempts)
        assert sorted(a.tries for a in result.attempts) == [1, 2]
        rerun = next(a for a in result.attempts if a.tries == 2)
        assert [f.kind for f in rerun.earlier_failures] == ["stale"]
        # The fake: one turn on base (the stale try), then one per attempt on the adapter.
        assert sorted(c["model"] for r in fleet.replicas.values() for c in r.chats()) == [BASE, "m@v1", "m@v1"]

    run(go())


def test_r12_an_attempt_ending_in_a_policy_failure_is_checked_for_staleness_too(tmp_path):
    async def go():
        fleet, chat, pm = await make_manager(2)
        chats = 0

        async def overflow_after_an_update(request: httpx.Request) -> httpx.Response | None:
            nonlocal chats
            chats += 1
            if chats != 2:
                return None
            await pm.update(PolicyUpdate(version="v1", lora={"path": adapter(tmp_path, "v1")}))
            return httpx.Response(400, json={"error": {"message": "This model's maximum context length is 2048"}})

        fleet.on_chat = overflow_after_an_update
        runner, target, policy = make_runner(pm, chat, StandInEnv(turns=5))
        result = await runner.run_group(GroupRequest(task_id="t001", n=1, max_staleness=0, retries=0), target, policy)
        attempt = result.attempts[0]
        generated = [made_by(t.completion) for t in attempt.turns]
        assert generated and all(g == f"ckpt0+{tmp_path}/v1" for g in generated), (attempt.status, generated)
        assert attempt.status == "scored" and attempt.tries == 2
        assert [f.kind for f in attempt.earlier_failures] == ["stale"]

    run(go())


def test_r14_a_lora_update_before_a_restore_puts_the_adapter_on_the_right_full_weights(tmp_path):
    """r1 restarted on its launch weights while the policy stood on full weights v1; the monitor found it
    and spawned its restore, but a LoRA update took the lock first. The adapter must not be routed over
    the launch weights: every turn labelled with it comes from v1 + the adapter, on both replicas."""

    async def go():
        fleet, chat, pm = await make_manager(2)
        v1 = checkpoint(tmp_path, "v1")
        await pm.update(PolicyUpdate(version="v1", weights={"path": v1}))
        r1, ep1 = fleet[1], chat.endpoints[1]
        r1.restart()
        await pm.reconcile(ep1, await chat.list_models(ep1))  # the restore is spawned, not yet holding the lock
        await pm.update(PolicyUpdate(version="a2", lora={"path": adapter(tmp_path, "a2")}))
        assert await until(lambda: not pm.states.restoring() and ep1.excluded is None)
        before = len(r1.chats())
        for k in range(8):
            assert await turn(chat, pm, f"g{k}") == ("a2", f"{v1}+{tmp_path}/a2")
        assert len(r1.chats()) > before, "r1 was never routed: the test did not look at it"

    run(go())


# -- shutdown ------------------------------------------------------------------------------------------


def test_r13_close_during_a_full_weight_update_leaves_nothing_paused(tmp_path):
    async def go():
        fleet, chat, pm = await make_manager(2)
        for replica in fleet.replicas.values():
            replica.reload_delay = 0.3
        v1 = checkpoint(tmp_path, "v1")
        # As the API runs it: shielded from the request's cancellation.
        update = asyncio.ensure_future(asyncio.shield(pm.update(PolicyUpdate(version="v1", weights={"path": v1}))))
        assert await until(lambda: fleet.paused == [True, True])  # the reload is under way
        await pm.close()  # what RolloutService.close does
        await chat.aclose()  # the pool the replicas' engines speak through
        result = await update  # no unhandled exception
        assert isinstance(result, PolicyUpdateResult)
        assert fleet.paused == [False, False]
        assert [(r.weights, r.label) for r in fleet.replicas.values()] == [(v1, "v1")] * 2

    run(go())


@pytest.mark.parametrize("fault", ["half", "clean", "silent-restart"])
def test_r16_a_lora_update_never_routes_its_adapter_over_other_full_weights(tmp_path, fault):
    """From the review of r14: r1's reload of v2 failed half-way or cleanly (it stays out of routing, its
    last label v1 or `reloading:v2`), or r1 restarted on its launch weights and nothing has noticed yet
    (still in routing). A LoRA update then lands: every turn labelled with it comes from the full weights
    it stands on plus the adapter, on whichever replicas serve it."""

    async def go():
        fleet, chat, pm = await make_manager(2)
        v1, v2 = checkpoint(tmp_path, "v1"), checkpoint(tmp_path, "v2")
        await pm.update(PolicyUpdate(version="v1", weights={"path": v1}))
        r1 = fleet[1]
        beneath = v1
        if fault == "silent-restart":
            r1.restart()
        else:
            r1.reload_fail = fault
            await pm.update(PolicyUpdate(version="v2", weights={"path": v2}))  # r0 takes it, r1 does not
            r1.reload_fail, beneath = None, v2
        await pm.update(PolicyUpdate(version="a3", lora={"path": adapter(tmp_path, "a3")}))
        for k in range(8):
            assert await turn(chat, pm, f"g{k}") == ("a3", f"{beneath}+{tmp_path}/a3")

    run(go())


@pytest.mark.parametrize("stop", ["manager_close", "service_stop"])
def test_r15_a_replica_found_restarted_after_a_stop_gets_no_restore(tmp_path, stop):
    """Shutting down: a probe (or a join that waited for the update lock) finding a replica on other weights
    must not start a reload that outlives the service. The stop is the policy manager's close(), or the
    service's own `cancel_running` (which the server calls as its shutdown begins, before its groups have
    drained). Break tried for the second: cancel_running not telling the policy manager -> the probe starts
    a reload."""
    from rollout_service.server.config import ServiceConfig
    from rollout_service.server.service import RolloutService

    async def go():
        fleet, chat, pm = await make_manager(2)
        await pm.update(PolicyUpdate(version="v1", weights={"path": checkpoint(tmp_path, "v1")}))
        r1, ep1 = fleet[1], chat.endpoints[1]
        r1.restart()
        reloads = len(r1.calls("/collective_rpc"))
        if stop == "manager_close":
            await pm.close()
        else:
            svc = RolloutService(ServiceConfig(env=["http://a:1"], vllm=["http://r0"], model=BASE))
            await svc.replicas.policy.client.aclose()
            svc.replicas.versions = pm
            svc.cancel_running()
        await pm.reconcile(ep1, await chat.list_models(ep1))
        await asyncio.sleep(0)  # a restore spawned now would have made its first call by the next check
        assert not pm._tasks and len(r1.calls("/collective_rpc")) == reloads and r1.label == "default"
        assert not pm.states.restoring()  # nothing marked as being restored that no task will ever clear
        await pm.close()
        await chat.aclose()

    run(go())


def test_r15_a_turn_ending_after_close_starts_no_adapter_unload(tmp_path):
    """A turn still on an old adapter ends after close: its adapter is left loaded (the replicas outlive the
    service), rather than an unload task started that nothing will wait for."""

    async def go():
        _, chat, pm = await make_manager(1)
        await pm.update(PolicyUpdate(version="a1", lora={"path": adapter(tmp_path, "a1")}))
        lease = await pm.lease()
        await pm.update(PolicyUpdate(version="a2", lora={"path": adapter(tmp_path, "a2")}))  # a1 still in flight
        await pm.close()
        pm.release(lease)  # the last a1 turn: an unload of a1 would be spawned here
        assert not pm._tasks
        await chat.aclose()

    run(go())


def test_r17_close_lets_a_restore_under_way_finish_its_reload(tmp_path):
    """A restore in the middle of a reload when the service stops: close() waits for it (bounded), so the
    replica is left on the version's weights and label, not half-way with a `reloading:` label that its
    next start would refuse. Break tried: close() cancelling its tasks at once (no bounded wait) -> the
    replica is left on its launch weights."""

    async def go():
        fleet, chat, pm = await make_manager(2)
        path = checkpoint(tmp_path, "v1")
        await pm.update(PolicyUpdate(version="v1", weights={"path": path}))
        r1, ep1 = fleet[1], chat.endpoints[1]
        label = r1.label
        r1.restart()
        r1.reload_delay = 0.5
        reloads = len(r1.calls("/collective_rpc"))
        await pm.reconcile(ep1, await chat.list_models(ep1))
        assert await until(lambda: len(r1.calls("/collective_rpc")) > reloads)  # the reload is under way
        await pm.close()
        assert (r1.weights, r1.label) == (path, label), (r1.weights, r1.label)
        assert not pm._tasks and not pm.states.restoring()
        await chat.aclose()

    run(go())


# -- the trainer's pause is a lease (issue #39 item 7) -------------------------------------------------
# The replicas are the fake fleet (tests/fake_vllm.py): a trainer that dies mid-push is what is tested,
# and the fleet's own state (paused, /weight_info label, chats received) is the oracle.


def test_a_pause_whose_lease_runs_out_resumes_the_replicas_that_still_show_the_old_weights():
    async def go():
        fleet, chat, pm = await make_manager(2)
        r0, r1 = fleet[0], fleet[1]
        await pm.pause(0.5)
        assert fleet.paused == [True, True] and pm.state().pause_expires_in is not None
        # The trainer pushed into r1 and relabelled it, then died: no POST /policy comes.
        r1.weights, r1.label = "half-pushed", "trainer-v7"
        assert await until(lambda: not pm.paused, 10)
        assert r0.paused is False and r1.paused is True  # only what still shows the old label resumes
        state = {r.url: r for r in pm.state().replicas}
        assert state[r0.url].routed and not state[r1.url].routed, state
        reason = state[r1.url].reason or ""
        assert "pause lease ran out" in reason and "'trainer-v7'" in reason, reason
        before = len(r1.chats())
        for k in range(4):
            assert await turn(chat, pm, f"g{k}") == ("base", LAUNCH_WEIGHTS)
        assert len(r1.chats()) == before  # no turn reached the weights nobody named
        await pm.close()

    run(go())


def test_asking_again_renews_the_lease_and_an_update_ends_it():
    async def go():
        fleet, chat, pm = await make_manager(2)
        await pm.pause(0.4)
        await pm.pause(30)  # renewed before it ran out
        assert not await until(lambda: not pm.paused, 1.5)  # well past the first lease: still held
        assert fleet.paused == [True, True]
        for r in (fleet[0], fleet[1]):
            r.weights = "pushed-v1"
        await pm.update(PolicyUpdate(version="v1"))
        assert fleet.paused == [False, False] and pm.pause_lease.task is None
        assert await turn(chat, pm, "g") == ("v1", "pushed-v1")
        await pm.close()

    run(go())


def test_a_pause_lease_ends_with_the_service_and_close_does_not_wait_for_it():
    async def go():
        fleet, chat, pm = await make_manager(2)
        await pm.pause(3600)
        closing = asyncio.get_running_loop().time()
        await pm.close()
        assert asyncio.get_running_loop().time() - closing < 5  # not close's 30 s wait for its tasks
        assert fleet.paused == [False, False]

    run(go())
