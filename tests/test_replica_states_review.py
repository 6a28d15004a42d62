"""Replica states against what a user or a backend can do next (a review of replica_states.py): a
second POST /replicas/drain, and a draining replica left paused on the model server. The replicas are
tests/fake_vllm.py's in-process stand-ins (a resume cannot be made to fail on demand on a real vLLM);
the oracle is the stand-in's own paused flag and the answer the registry gives, not the states read back.
"""

from __future__ import annotations

import asyncio

from fake_vllm import checkpoint, make_manager

from rollout_service.protocol import PolicyUpdate, ReplicaRef
from rollout_service.server.config import ServiceConfig
from rollout_service.server.lifecycle import Lifecycle
from rollout_service.server.membership.allowed_backends import AllowedBackends
from rollout_service.server.membership.replicas import ReplicaRegistry
from rollout_service.server.metrics import Metrics


def test_draining_a_draining_replica_again_answers_its_state_not_a_500():
    """POST /replicas/drain twice on one replica (a retried request) is the user's to send: the second
    answers the same draining state, as before the state machine, rather than raising IllegalTransition
    (a 500). Nothing here talks to a replica, so the registry is built over URLs nobody serves. Break
    seen: ReplicaRegistry.drain without its `already draining` answer -> IllegalTransition
    'drain while draining'."""
    config = ServiceConfig(env=["http://e"], vllm=["http://127.0.0.1:1", "http://127.0.0.1:2"], model="m")
    lifecycle = Lifecycle(30)
    lifecycle.ready = True
    registry = ReplicaRegistry(config, lifecycle, Metrics(), AllowedBackends([], []))
    first = registry.drain(ReplicaRef(url="http://127.0.0.1:1"))
    again = registry.drain(ReplicaRef(url="http://127.0.0.1:1"))
    assert first.draining and again.draining and not again.routed, again
    assert again.state == "draining" and again.reason == first.reason


def test_a_draining_replica_a_resume_failed_on_is_resumed_by_the_next_probe(tmp_path):
    """A replica drained while the trainer's pause holds it, whose resume then fails at the trainer's
    POST /policy: still paused on the model server, so the turns the pause froze there never end and
    it can never be removed (409 replica_busy) unless something resumes it. Before the state machine
    the monitor's probe restored it (resuming it first); a draining replica is no longer restored, so
    the probe must still resume it. Break seen: PolicyManager.reconcile returning for a draining
    replica before `_resume_draining` -> the stand-in stays paused after the probe."""

    async def go():
        fleet, chat, pm = await make_manager(2)
        r1, ep1 = fleet[1], chat.endpoints[1]
        await pm.pause(600)
        pm.states.drain(ep1, "draining: no new turn goes to it")  # what POST /replicas/drain does
        r1.resume_fail = 1
        await pm.update(PolicyUpdate(version="v1"))  # the trainer's push, labelled; r1's resume fails
        assert r1.paused and not fleet[0].paused
        await pm.reconcile(ep1, await chat.list_models(ep1))  # the monitor's next probe
        assert not r1.paused, "a draining replica stays paused: its frozen turns never end"
        assert pm.states.report(ep1).state == "draining" and ep1 not in chat.routable()
        await pm.close()
        await chat.aclose()

    asyncio.run(asyncio.wait_for(go(), 20))


def test_a_replica_that_joins_paused_is_resumed_before_it_is_routed(tmp_path):
    """A replica this service could not resume, drained and removed (nothing forbids it), then added
    again at its URL: the model server is still paused, and a turn routed there would hang. The join
    must find it paused (as start-up does) and resume it before routing it. Break seen: PolicyManager.join
    without its `is_paused` look -> the replica is routed while the stand-in is paused."""

    async def go():
        fleet, chat, pm = await make_manager(2)
        r1, ep1 = fleet[1], chat.endpoints[1]
        r1.resume_fail = 2  # the update's resume, and the probe's after the drain
        await pm.update(PolicyUpdate(version="v1", weights={"path": checkpoint(tmp_path, "v1")}))
        pm.states.drain(ep1, "draining: no new turn goes to it")
        await pm.reconcile(ep1, await chat.list_models(ep1))  # its resume fails again
        await pm.leave(ep1)  # POST /replicas/remove: no turn in flight there
        assert r1.paused and ep1 not in chat.endpoints
        again = chat.new_endpoint(r1.url)
        assert await pm.join(again, await chat.list_models(again), 5)  # POST /replicas with its URL
        if pm._tasks:
            await asyncio.wait_for(asyncio.gather(*pm._tasks), 5)
        assert not r1.paused, "joined, and still paused on the model server"
        assert again in chat.routable() and pm.states.report(again).version == "v1"
        assert r1.weights == fleet[0].weights and r1.label == "v1"
        await pm.close()
        await chat.aclose()

    asyncio.run(asyncio.wait_for(go(), 20))
