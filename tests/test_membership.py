"""Envs added, drained and removed while groups run (POST /envs, /envs/drain, /envs/remove).

Real refenv servers over HTTP; their own counters are the oracle (worlds leased at most, resets that
had to wait for a world, episodes started, finished and abandoned). The model is the scripted
stand-in (tests/scripted_model.py, `sql-then-answer` with a delay): every episode takes two turns of
a known length, so groups are certainly still running when the membership changes; what is under
test is the service's scheduling, not the model.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from helpers import wait_until

from rollout_service.trainer.client import BatchItem, RequestRejected, RolloutClient

SAMPLING = {"temperature": 0.8, "max_tokens": 24}


def detail(service) -> dict:
    return httpx.get(f"{service.url}/health/detail", timeout=10).json()


def test_an_env_added_under_load_takes_queued_attempts_and_removing_it_cuts_nothing_short(
    start_refenv, start_service, start_scripted_model
):
    """Break tried: the scheduler's add_env not handing the new env to queued attempts -> env b never
    leases a world while the batch waits (fails at `b takes queued attempts`)."""
    model = start_scripted_model("sql-then-answer", "--sql-turns", "1", "--delay", "0.3")
    a = start_refenv("--pool", "2")
    b = start_refenv("--pool", "3")
    other_data = start_refenv("--pool", "1", "--seed", "1")  # same task ids, another dataset
    service = start_service([a.url], vllm=model.url, model="scripted")
    groups = [{"task_id": f"t00{i}", "n": 4, "retries": 0, "sampling": SAMPLING} for i in range(1, 7)]
    items: list[BatchItem] = []
    with RolloutClient(service.url, timeout_s=120) as client:
        batch = threading.Thread(target=lambda: items.extend(RolloutClient(service.url, timeout_s=120).groups(groups)))
        batch.start()
        try:
            assert wait_until(lambda: a.health()["leased"] == 2 and detail(service)["attempts_waiting_for_a_world"], 20)
            added = client.add_env(b.url)
            assert added.pool == 3 and not added.draining
            assert wait_until(lambda: b.health()["leased"] > 0, 10), "b takes queued attempts"

            with pytest.raises(RequestRejected) as refused:
                client.add_env(other_data.url)
            assert refused.value.status == 409 and refused.value.error == "env_incomparable"
            assert "not comparable" in refused.value.message
            assert other_data.health()["episodes"]["started"] == 0

            assert detail(service)["attempts_waiting_for_a_world"] > 0, "the batch still runs as b is removed"
            removed = client.remove_env(b.url, timeout_s=60)
            assert removed.url == b.url and removed.tasks_no_longer_served == []  # a serves them all
            after = b.health()
            # Removed only once its episodes were over, and none was cut short.
            assert after["leased"] == 0 and after["live_episodes"] == 0
            assert after["episodes"]["abandoned"] == 0 and after["episodes"]["started"] > 0
            assert after["episodes"]["started"] == after["episodes"]["finished"]
            assert [e.url for e in client.envs()] == [a.url]
        finally:
            batch.join(120)
    assert not batch.is_alive()
    assert len(items) == 6 and all(item.group is not None for item in items), [item.error for item in items]
    assert all(item.group.counts.scored == 4 for item in items if item.group), "an attempt was lost"
    final_b, final_a = b.health(), a.health()
    assert final_b["episodes"]["started"] == after["episodes"]["started"], "an episode started on b after removal"
    assert final_a["episodes"]["started"] + final_b["episodes"]["started"] == 24  # each attempt ran once
    # The pool cap followed the membership: never more worlds than each env's pool asked for.
    assert final_a["max_leased"] <= 2 and final_b["max_leased"] <= 3
    assert final_a["max_waiting"] == 0 and final_b["max_waiting"] == 0


def test_removing_the_only_env_of_its_tasks_fails_queued_attempts_and_abandons_nothing(
    start_refenv, start_service, start_scripted_model
):
    """While its every env drains, a task's queued attempts wait (an env added for it would take them)
    and /health says so; at the removal they end as env_no_world, and a service left with no env says
    that. Breaks tried: the scheduler's remove_env leaving the orphaned waiters queued -> the group
    never answers (fails at the join); no reason for the draining task -> fails at `degraded`; the
    removed env's metrics series kept -> fails at its check."""
    model = start_scripted_model("sql-then-answer", "--sql-turns", "1", "--delay", "0.5")
    a = start_refenv("--pool", "1")
    service = start_service([a.url], vllm=model.url, model="scripted")
    answers: list[httpx.Response] = []
    body = {"task_id": "t001", "n": 3, "retries": 0, "sampling": SAMPLING}
    group = threading.Thread(target=lambda: answers.append(httpx.post(f"{service.url}/groups", json=body, timeout=120)))
    group.start()
    with RolloutClient(service.url, timeout_s=120) as client:
        try:
            assert wait_until(lambda: a.health()["leased"] == 1, 20)
            with pytest.raises(RequestRejected) as busy:  # do not wait: its episode is still running
                client.remove_env(a.url, timeout_s=0)
            assert busy.value.status == 409 and busy.value.error == "env_busy"
            assert [e.draining for e in client.envs()] == [True]
            refused = httpx.post(f"{service.url}/groups", json=body, timeout=30)
            assert refused.status_code == 503 and refused.json()["error"] == "envs_draining"
            assert detail(service)["attempts_waiting_for_a_world"] == 2  # they wait: nothing is lost yet
            assert httpx.get(f"{service.url}/health", timeout=10).json()["status"] == "degraded"
            reasons = detail(service)["reasons"]
            assert any("draining envs (all, or all on the training side): t001," in r for r in reasons), reasons
            assert f'rollout_episodes_in_flight{{env="{a.url}"}} 1.0' in httpx.get(f"{service.url}/metrics").text

            removed = client.remove_env(a.url, timeout_s=60)
            assert "t001" in removed.tasks_no_longer_served
        finally:
            group.join(120)
        assert not group.is_alive() and answers, "the group never answered"
        result = answers[0].json()
        kinds = sorted(a["failure"]["kind"] if a["failure"] else a["status"] for a in result["attempts"])
        assert kinds == ["env_no_world", "env_no_world", "scored"], kinds
        health = a.health()
        assert health["episodes"]["started"] == health["episodes"]["finished"] == 1
        assert health["episodes"]["abandoned"] == 0 and health["leased"] == 0

        unknown = httpx.post(f"{service.url}/groups", json=body, timeout=30)
        assert unknown.status_code == 404 and unknown.json()["error"] == "unknown_task"
        assert client.tasks() == [] and client.envs() == []
        alone = detail(service)
        assert alone["status"] == "degraded" and any(r.startswith("no env") for r in alone["reasons"]), alone
        assert a.url not in httpx.get(f"{service.url}/metrics").text  # no series stays at 0 for a removed env
        with pytest.raises(RequestRejected) as gone:
            client.remove_env(a.url)
        assert gone.value.status == 404 and gone.value.error == "unknown_env"
        bad = httpx.post(f"{service.url}/envs", json={"url": "not a url"}, timeout=30)
        assert bad.status_code == 422
        # The env comes back: the service schedules on it again and its tasks are served.
        back = client.add_env(a.url)
        assert back.tasks > 0 and client.group(body).counts.scored == 3
        assert wait_until(lambda: detail(service)["status"] == "ok", 10), detail(service)["reasons"]


def test_an_env_under_a_second_name_is_refused(start_refenv, start_service, start_scripted_model):
    """One refenv reached as 127.0.0.1, localhost or 127.1 is one pool: scheduled twice, the service
    would hold twice its worlds (the env parks the resets it has no world for: its `max_waiting`,
    which the fixture checks at teardown). Refused when added and at start; a URL with credentials is
    refused too (it would be shown in /envs and the metrics). Break tried: _same_server answering
    None -> localhost is added (fails at 409), and the service starts with both names."""
    model = start_scripted_model("sql-then-answer", "--sql-turns", "1")
    a = start_refenv("--pool", "2")
    port = a.url.rsplit(":", 1)[1]
    service = start_service([a.url], vllm=model.url, model="scripted")
    for alias in (f"http://localhost:{port}", f"http://127.1:{port}/"):
        added = httpx.post(f"{service.url}/envs", json={"url": alias}, timeout=30)
        assert added.status_code == 409 and added.json()["error"] == "env_present", (alias, added.text)
        assert "another name" in added.json()["message"] and a.url in added.json()["message"]
    secret = httpx.post(f"{service.url}/envs", json={"url": f"http://user:hunter2@127.0.0.1:{port}"}, timeout=30)
    assert secret.status_code == 422 and "credentials" in secret.text and "hunter2" not in secret.text
    assert [e["url"] for e in httpx.get(f"{service.url}/envs").json()] == [a.url]
    group = httpx.post(f"{service.url}/groups", json={"task_id": "t001", "n": 4, "sampling": SAMPLING}, timeout=60)
    assert group.json()["counts"]["scored"] == 4 and a.health()["max_leased"] <= 2

    twice = start_service([a.url, f"http://localhost:{port}"], vllm=model.url, model="scripted", wait=False)
    twice.proc.proc.wait(60)
    log = twice.proc.log_path.read_text()
    assert twice.proc.proc.returncode != 0 and "under another name" in log and "Traceback" not in log, log


def stats(model) -> dict:
    return httpx.get(f"{model.url}/stats", timeout=10).json()


def test_a_replica_added_serves_once_on_the_current_version_and_a_removed_one_finishes_its_turns(
    start_refenv, start_service, start_scripted_model, tmp_path
):
    """The scripted replicas' own logs are the oracle: which adapter each loaded, which chats each
    got. Breaks tried: PolicyManager.join routing the replica at once (no `joining` exclusion) -> a
    group started while the new replica is being checked sends it a chat on v1 before the adapter
    is loaded (fails at `loaded before any chat`); ReplicaPool.exclude ignoring `draining` -> the
    monitor's next probe routes the drained replica again (fails at `stays out of routing`)."""
    slow = start_scripted_model("sql-then-answer", "--sql-turns", "1", "--delay", "3")
    env = start_refenv("--pool", "4")
    service = start_service([env.url], "--inference-timeout", "30", vllm=slow.url, model="scripted")
    adapter = tmp_path / "adapter-v1"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    (adapter / "adapter_model.safetensors").write_text("")  # the scripted replicas load nothing
    body = {"task_id": "t001", "n": 2, "retries": 0, "sampling": SAMPLING}
    answers: list[httpx.Response] = []

    def post_group() -> None:
        answers.append(httpx.post(f"{service.url}/groups", json=body, timeout=120))

    with RolloutClient(service.url, timeout_s=120) as client:
        assert client.update_policy("v1", lora=str(adapter)).version == "v1"
        # The new replica lists its models 1.5 s late: a group that starts while the service checks
        # what it serves must not be routed there (the running group keeps the slow one the busier).
        fast = start_scripted_model("sql-then-answer", "--sql-turns", "1", "--listing-delay", "1.5")
        groups = [threading.Thread(target=post_group)]
        groups[0].start()
        assert wait_until(lambda: stats(slow)["requests"] > 0, 30)

        def during_the_check() -> None:
            # The add's first question is one listing, asking again what it serves the next.
            if wait_until(lambda: stats(fast)["listings"] >= launched + 2, 30):
                post_group()

        launched = stats(fast)["listings"]  # its launch waited on /v1/models too
        groups.append(threading.Thread(target=during_the_check))
        groups[1].start()
        added = client.add_replica(fast.url, timeout_s=60)
        assert added.routed and added.version == "v1" and not added.draining, added
        log = stats(fast)["events"]
        assert log[0] == "load:scripted@v1", f"loaded before any chat: {log}"
        assert {r.url: r.routed for r in client.policy().replicas} == {slow.url: True, fast.url: True}
        for thread in groups:
            thread.join(120)
        assert len(answers) == 2 and all(a.status_code == 200 for a in answers), answers

        # Wrong model: refused with the reason, never routed.
        other = start_scripted_model("answer", "--name", "another-model")
        with pytest.raises(RequestRejected) as refused:
            client.add_replica(other.url, timeout_s=30)
        assert refused.value.status == 422 and refused.value.error == "replica_refused"
        # The reason names the model wanted and how many it lists, not their names (the backend's words).
        message = refused.value.message
        assert "'scripted'" in message and "1 other model" in message and "another-model" not in message, message
        assert len(client.policy().replicas) == 2

        # Remove the slow replica while a group's turn runs on it: the turn finishes, the group's
        # next turns move to the other replica, no new turn reaches the removed one. Two groups at
        # once: tied replicas take new groups in turn, so one of them lands on the slow replica.
        answers.clear()
        slow_groups = [threading.Thread(target=post_group) for _ in range(2)]
        seen = stats(slow)["requests"]
        for thread in slow_groups:
            thread.start()
        try:
            assert wait_until(lambda: stats(slow)["requests"] > seen, 30), "a turn in flight on the slow replica"
            with pytest.raises(RequestRejected) as busy:  # its turn (3 s) is still running: do not wait
                client.remove_replica(slow.url, timeout_s=0)
            assert busy.value.status == 409 and busy.value.error == "replica_busy"
            drained_at, drained_time = stats(slow)["requests"], time.time()
            with pytest.raises(RequestRejected) as last:
                client.drain_replica(fast.url)
            assert last.value.status == 409 and last.value.error == "last_replica"

            def probed_since_drain() -> bool:
                (state,) = [m for m in client.health_detail()["models"] if m["url"] == slow.url]
                return state.get("checked_at", 0) > drained_time

            assert wait_until(probed_since_drain, 10)
            (replica,) = [r for r in client.policy().replicas if r.url == slow.url]
            assert replica.draining and not replica.routed, f"stays out of routing: {replica}"
            removed = client.remove_replica(slow.url, timeout_s=60)  # waits for the turn in flight
            assert removed.url == slow.url and removed.draining
        finally:
            for thread in slow_groups:
                thread.join(120)
        assert len(answers) == 2 and all(a.status_code == 200 for a in answers), answers
        for answer in answers:
            attempts = answer.json()["attempts"]
            assert [a["status"] for a in attempts] == ["scored", "scored"], attempts  # the turn in flight finished
            assert all(t["policy_version"] == "v1" for a in attempts for t in a["turns"])
        assert [r.url for r in client.policy().replicas] == [fast.url]
        assert client.group(body).counts.scored == 2
        assert stats(slow)["requests"] == drained_at, "no new turn on a drained replica"
        detail = client.health_detail()
        assert [m["url"] for m in detail["models"]] == [fast.url] and detail["status"] == "ok", detail


# -- what refenv cannot be made to answer: a discovery stand-in, in process ------------------------


def _service_with(tasks: list[tuple[str, str]]):
    """A service (not started: no servers) with env http://a:1 serving `tasks` (id, slug)."""
    from rollout_service.backends.env_client import EnvClient, EnvHealth, EnvTask
    from rollout_service.server.config import ServiceConfig
    from rollout_service.server.membership import envs as module
    from rollout_service.server.service import RolloutService

    # b and c are added later: names allowed, as an operator allows a host by its name.
    config = ServiceConfig(env=["http://a:1"], vllm=["http://m:1"], model="m", allow_backends=["b", "c"])
    svc = RolloutService(config)
    health = EnvHealth(
        status="ready", workers=2, dataset={"catalog_hash": "h"}, reward_version="r", reward_profile="rl"
    )
    found = module.Discovered("http://a:1", health, [EnvTask(task_id=t, slug=s) for t, s in tasks])
    env = module.checked_env(found, EnvClient("http://a:1"))
    svc.envs.envs[env.url] = env
    svc.envs.index_tasks(env, found.tasks)
    svc.scheduler.add_env(env.slots)

    def discovers(answer: list[tuple[str, str]]) -> None:
        async def ask(url: str, client: EnvClient) -> module.Discovered:
            return module.Discovered(url, health, [EnvTask(task_id=t, slug=s) for t, s in answer])

        module.ask_env = ask  # type: ignore[assignment]

    return svc, discovers


def test_an_env_whose_slug_names_another_task_is_refused_and_a_task_listed_twice_is_removed_once(monkeypatch):
    """Breaks tried: no slug check -> the slug silently points at the new env's task; appending the env
    once per listing -> the removed env stays in the task's list and its groups 500."""
    import asyncio

    from rollout_service.protocol import EnvAdd, EnvRemove, GroupRequest
    from rollout_service.server.errors import Conflict, NotFound, RequestRefused
    from rollout_service.server.membership import envs as module

    monkeypatch.setattr(module, "ask_env", module.ask_env)  # restored after the test
    svc, discovers = _service_with([("t1", "s1")])
    svc.lifecycle.refuse_unless_ready = lambda: None  # type: ignore[method-assign]

    async def scenario() -> None:
        discovers([("t3", "s1")])
        with pytest.raises(RequestRefused) as refused:
            await svc.envs.add(EnvAdd(url="http://c:1"))
        assert isinstance(refused.value, Conflict) and "slug" in refused.value.message
        assert svc.envs.by_slug["s1"] == "t1" and "http://c:1" not in svc.envs.envs
        discovers([("t2", "s2"), ("t2", "s2")])
        await svc.envs.add(EnvAdd(url="http://b:1"))
        assert [e.url for e in svc.envs.targets["t2"].envs] == ["http://b:1"]
        removed = await svc.envs.remove(EnvRemove(url="http://b:1"))
        assert removed.tasks_no_longer_served == ["t2"] and "t2" not in svc.envs.targets
        with pytest.raises(RequestRefused) as unknown:
            svc.admission.resolve(GroupRequest(task_id="t2", n=1))
        assert isinstance(unknown.value, NotFound)

    asyncio.run(scenario())


def test_groups_go_around_an_env_that_is_down(start_refenv, start_service, start_scripted_model):
    """An env that stopped answering looks idle (no world held), and is listed first: its attempts
    would fail at once, every retry too. The scheduler prefers envs that answer. The scripted model
    answers at once (one turn an episode): what is under test is where episodes go. Break tried:
    WorldScheduler.acquire ignoring `down` -> attempts go to the dead env and fail (env_unreachable)."""
    model = start_scripted_model("answer")
    dead, alive = start_refenv("--pool", "2"), start_refenv("--pool", "2")
    service = start_service([dead.url, alive.url], vllm=model.url, model="scripted")
    dead.proc.stop()

    def probed_down() -> bool:
        envs = detail(service)["envs"]
        return [e["ok"] for e in envs] == [False, True]

    assert wait_until(probed_down, 10)
    body = {"task_id": "t001", "n": 2, "retries": 0, "sampling": SAMPLING}
    for _ in range(3):
        group = httpx.post(f"{service.url}/groups", json=body, timeout=60).json()
        assert group["counts"]["scored"] == 2, group["attempts"]
        assert group["env"]["urls"] == [alive.url]
    assert alive.health()["episodes"]["started"] == 6


def test_support_replicas_come_and_go_too(start_refenv, start_service, start_scripted_model):
    """refenv --responder adds a stage the support model answers. A support replica added takes the
    responder turns once the first is removed; the replicas' own request counts are the oracle."""
    policy = start_scripted_model("answer")
    first = start_scripted_model("answer", "--name", "support")
    env = start_refenv("--pool", "2", "--responder")
    service = start_service(
        [env.url], "--support-vllm", first.url, "--support-model", "support", vllm=policy.url, model="scripted"
    )
    body = {"task_id": "t005", "n": 2, "retries": 0, "sampling": SAMPLING}
    with RolloutClient(service.url, timeout_s=60) as client:
        second = start_scripted_model("answer", "--name", "support")
        added = client.add_replica(second.url, role="support", timeout_s=30)
        assert added.routed and added.version is None
        with pytest.raises(RequestRejected) as wrong:  # the policy's replica is not a support one
            client.add_replica(policy.url, role="support", timeout_s=30)
        assert wrong.value.status == 422 and "support" in wrong.value.message
        removed = client.remove_replica(first.url, role="support", timeout_s=30)
        assert removed.url == first.url
        before = stats(first)["requests"]
        group = client.group(body)
        assert group.counts.scored == 2
        responder = [t for a in group.attempts for t in a.turns if t.stage == "responder"]
        assert responder and all(t.endpoint == second.url for t in responder)
        assert stats(second)["requests"] == len(responder) and stats(first)["requests"] == before
        roles = {(m["role"], m["url"]) for m in client.health_detail()["models"]}
        assert roles == {("policy", policy.url), ("support", second.url)}


def test_a_replica_added_during_a_long_update_is_answered_at_its_timeout(
    start_refenv, start_service, start_scripted_model, tmp_path
):
    """A replica joins between updates. One added while an update still loads an adapter (the
    scripted replica takes 20 s to load it) is answered 409 policy_busy at its own timeout_s, while the update
    still runs, and is not added; once the update is done it joins. Break tried: join waiting for
    the update lock without a bound -> the add waits for the update and succeeds (DID NOT RAISE)."""
    loading = start_scripted_model("answer", "--load-delay", "20")
    joining = start_scripted_model("answer")  # started now: its start-up must not eat the update's 20 s
    env = start_refenv("--pool", "2")
    service = start_service([env.url], vllm=loading.url, model="scripted")
    adapter = tmp_path / "adapter-v1"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    (adapter / "adapter_model.safetensors").write_text("")  # the scripted replicas load nothing
    updates: list[object] = []
    with RolloutClient(service.url, timeout_s=120) as client:
        update = threading.Thread(target=lambda: updates.append(client.update_policy("v1", lora=str(adapter))))
        update.start()
        assert wait_until(lambda: stats(loading)["loads_started"] == 1, 30)
        with pytest.raises(RequestRejected) as late:
            client.add_replica(joining.url, timeout_s=2)
        assert update.is_alive(), "update still running when the add was answered"
        assert late.value.status == 409 and late.value.error == "policy_busy", late.value
        assert "update" in late.value.message
        assert [r.url for r in client.policy().replicas] == [loading.url]
        update.join(60)
        assert [u.version for u in updates] == ["v1"]  # type: ignore[attr-defined]
        added = client.add_replica(joining.url, timeout_s=30)
        assert added.routed and added.version == "v1", added
        assert stats(joining)["events"][0] == "load:scripted@v1"


def test_health_names_tasks_whose_every_env_drains_on_the_training_side_too():
    """A task served by a training env and an eval-side one is stranded for training groups (all a
    group without allow_eval_side may use) once the training env drains: /health must say so, as when
    every env of a task drains. Break tried: only `every env drains` checked -> t1 goes unnamed."""
    from rollout_service.backends.env_client import EnvClient, EnvHealth, EnvTask
    from rollout_service.server.membership import envs as module

    svc, _ = _service_with([("t1", "s1"), ("t2", "s2")])
    health = EnvHealth(
        status="ready",
        workers=1,
        dataset={"catalog_hash": "h"},
        reward_version="r",
        reward_profile="rl",
        capabilities={"side": "eval"},
    )
    found = module.Discovered("http://e:1", health, [EnvTask(task_id="t1", slug="s1")])
    evaluator = module.checked_env(found, EnvClient("http://e:1"))
    svc.envs.envs[evaluator.url] = evaluator
    svc.envs.index_tasks(evaluator, found.tasks)
    assert svc.envs.unserved() == []
    svc.envs.envs["http://a:1"].slots.draining = True
    [reason] = svc.envs.unserved()
    assert "draining envs (all, or all on the training side): t1, t2." in reason, reason
    [first] = svc.envs.unserved(first_only=True)
    assert ": t1." in first, first  # what status() asks: one is enough
    svc.envs.envs.clear()
    assert svc.envs.unserved() == ["no env: every env was removed (POST /envs adds one)"]


def test_one_server_under_two_names_shares_a_key_and_a_proxys_names_do_not(monkeypatch):
    """The same-server check's keys (envs.server_addresses). This host's loopback and IP
    addresses, however spelled, are keyed by address; other names by themselves, since two names on
    one address may be two servers behind one proxy (virtual hosts, an ingress). Break tried: keying
    every name by its addresses -> the proxy's two names share a key, fails."""
    import asyncio
    import socket

    from rollout_service.server.membership import envs as module

    def key(url: str) -> frozenset:
        return asyncio.run(module.server_addresses(url))

    first = key("http://127.0.0.1:8090")
    for alias in ("http://localhost:8090", "http://127.1:8090/", "http://0x7f.0.0.1:8090", "http://0.0.0.0:8090"):
        assert key(alias) & first, alias
    for other in ("http://127.0.0.1:8091", "http://127.0.0.1:8090/other", "http://127.0.0.2:8090"):
        assert not key(other) & first, other

    async def one_address(self, host, port, **kwargs):  # every name on one public address
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("203.0.113.7", port))]

    monkeypatch.setattr(asyncio.base_events.BaseEventLoop, "getaddrinfo", one_address)
    assert not key("https://env-a.example") & key("https://env-b.example")
    assert key("https://203.0.113.7") & key("https://0xcb.0.113.7:443/")
    assert key("https://env-a.example") == key("https://ENV-A.example/")
