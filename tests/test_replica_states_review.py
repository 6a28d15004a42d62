"""Replica states against what a user or a backend can do next (a review of replica_states.py): a
second POST /replicas/drain, and a draining replica left paused on the model server. The replicas are
tests/fake_vllm.py's in-process stand-ins (a resume cannot be made to fail on demand on a real vLLM);
the oracle is the stand-in's own paused flag and the answer the registry gives, not the states read back.
"""

from __future__ import annotations

import asyncio
import contextlib
import random

from fake_vllm import adapter, checkpoint, make_manager

from rollout_service.backends.errors import InferenceError
from rollout_service.protocol import PolicyUpdate, ReplicaRef
from rollout_service.server.config import ServiceConfig
from rollout_service.server.errors import RequestRefused
from rollout_service.server.lifecycle import Lifecycle
from rollout_service.server.membership.allowed_backends import AllowedBackends
from rollout_service.server.membership.replicas import ReplicaRegistry
from rollout_service.server.metrics import Metrics
from rollout_service.server.policy.replica_states import Phase


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


FAULTS = ["weights", "lora", "push", "short_pause", "restart", "probe", "resume_fails", "reload_fails", "down"]
MEMBERSHIP = ["drain", "remove", "join", "join", "unreachable"]


async def _random_interleaving(seed: int, root) -> list[str]:
    """Up to four of the trainer's, the backends' and the operator's acts at once, 40 times; then every
    fault cleared, the pause ended and every replica probed (as the monitor would) until restores end.
    What is wrong then, read from the stand-ins: a routed replica paused or not on the current version,
    a draining one left paused (its frozen turns never end), a refused transition (a 500)."""
    rnd = random.Random(seed)
    loop_errors: list[object] = []
    asyncio.get_running_loop().set_exception_handler(lambda _, ctx: loop_errors.append(ctx.get("exception")))
    fleet, chat, pm = await make_manager(3)
    versions = iter(f"v{n}" for n in range(1, 1000))
    joining: set[str] = set()

    async def act() -> None:
        what, replica = rnd.choice(FAULTS + MEMBERSHIP), fleet[rnd.randrange(3)]
        endpoint = rnd.choice(chat.endpoints)
        others = [e for e in chat.endpoints if e is not endpoint and pm.states.phase(e) is Phase.SERVING]
        with contextlib.suppress(RequestRefused, InferenceError):  # refused; a probe of a replica down
            if what == "weights":
                v = next(versions)
                await pm.update(PolicyUpdate(version=v, weights={"path": checkpoint(root, v)}))
            elif what == "lora":
                v = next(versions)
                await pm.update(PolicyUpdate(version=v, lora={"path": adapter(root, v)}))
            elif what == "push":
                await pm.pause(600)
                await pm.update(PolicyUpdate(version=next(versions)))
            elif what == "short_pause":
                await pm.pause(0.05)
            elif what == "restart":
                replica.restart()
            elif what == "probe":
                await pm.reconcile(endpoint, await chat.list_models(endpoint))
            elif what == "resume_fails":
                replica.resume_fail = 1
            elif what == "reload_fails":
                replica.reload_fail = rnd.choice(["half", "clean", None])
            elif what == "down":
                replica.up = not replica.up
            elif what == "unreachable":
                pm.replica_unreachable(endpoint, "unreachable at a probe")
            elif what in ("drain", "remove") and others and pm.states.phase(endpoint) is not Phase.DRAINING:
                pm.states.drain(endpoint, "draining")  # as ReplicaRegistry.drain and .remove do
                if (
                    what == "remove"
                    and not pm.paused
                    and await chat.until(endpoint, lambda: not endpoint.outstanding, 1)
                ):
                    await pm.leave(endpoint)
            elif what == "join":
                gone = [u for u in fleet.replicas if u not in joining and all(e.url != u for e in chat.endpoints)]
                if gone:
                    url = rnd.choice(gone)
                    joining.add(url)  # as ReplicaRegistry.adding
                    try:
                        endpoint = chat.new_endpoint(url)
                        await pm.join(endpoint, await chat.list_models(endpoint), 0.3)
                    finally:
                        joining.discard(url)

    for _ in range(40):
        await asyncio.gather(*(act() for _ in range(rnd.randint(1, 4))))
    for replica in fleet.replicas.values():
        replica.up, replica.resume_fail, replica.reload_fail = True, 0, None
    if pm.paused:
        async with pm._lock:
            await pm.pause_lease.resume(pm.pause_lease.held)
    for _ in range(3):
        for endpoint in list(chat.endpoints):
            await pm.reconcile(endpoint, await chat.list_models(endpoint))
        if pm._tasks:
            await asyncio.wait(set(pm._tasks), timeout=5)
    current, wrong = pm.current, [f"raised: {e!r}" for e in loop_errors]
    beneath = current.weights if current.kind == "lora" else current
    for endpoint in chat.endpoints:
        replica = fleet.replicas[endpoint.url]
        if endpoint.excluded is None:
            if replica.paused:
                wrong.append(f"{endpoint.url} routed while paused")
            if current.kind == "lora" and current.served_model not in replica.adapters:
                wrong.append(f"{endpoint.url} routed without the adapter {current.served_model}")
            if beneath is not None and beneath.kind != "base" and replica.label != beneath.label:
                wrong.append(f"{endpoint.url} routed labelled {replica.label}, not {beneath.label}")
        if endpoint.draining and replica.paused:
            wrong.append(f"{endpoint.url} draining and still paused")
    await pm.close()
    await chat.aclose()
    return wrong


def test_random_interleavings_leave_no_replica_routed_wrongly_or_draining_paused(tmp_path):
    """25 random interleavings (fixed seeds) of updates, the trainer's pushes, pause leases running out,
    restarts, failed reloads and resumes, replicas down, drains, removals and joins, over the stand-in
    fleet (faults a real vLLM cannot show on demand). Break seen: the code as merged (draining replicas
    never resumed, joins not checked for a pause) -> seeds 4, 15 and 17 end with a draining replica
    still paused."""

    async def go() -> dict[int, list[str]]:
        found = {}
        for seed in range(25):
            folder = tmp_path / str(seed)
            if wrong := await asyncio.wait_for(_random_interleaving(seed, folder), 60):
                found[seed] = wrong
        return found

    assert asyncio.run(go()) == {}
