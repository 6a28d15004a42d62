"""The service end to end: real vLLM (CPU build, embedded model), real refenv, real HTTP."""

from __future__ import annotations

import asyncio
import json
import os
import time
from pathlib import Path

import httpx
import pytest
from helpers import assert_accounted, prompt_ids, unclaimed_ports, wait_until

from rollout_service.launch import embedded_model
from rollout_service.trainer import AsyncRolloutClient, RolloutClient, RolloutError, ServiceStarting

SAMPLING = {"temperature": 0.8, "max_tokens": 48}
VARIANCE_TASKS = ("t001", "t005", "t009", "t002")


def group(service_url: str, timeout: float = 300, **body) -> httpx.Response:
    return httpx.post(f"{service_url}/groups", json=body, timeout=timeout)


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(embedded_model.prepare()))


def test_group_of_8_has_variance_exact_tokens_and_contract(start_refenv, start_service, tokenizer):
    env = start_refenv("--pool", "8")
    service = start_service([env.url])
    groups = []
    for task in VARIANCE_TASKS:  # a small model's rewards differ on most of these; stop at the first that does
        r = group(service.url, task_id=task, n=8, sampling=SAMPLING)
        assert r.status_code == 200, r.text
        groups.append(r.json())
        if not groups[-1]["all_equal"]:
            break
    assert any(not g["all_equal"] and len(set(g["rewards"])) > 1 for g in groups), [g["rewards"] for g in groups]
    health = env.health()
    for g in groups:
        assert g["n"] == 8 and g["counts"]["scheduled"] == 8
        assert g["counts"]["scored"] + g["counts"]["failed"] == 8
        assert g["sampling"]["temperature"] == 0.8 and g["model"] == embedded_model.MODEL_NAME
        assert g["env"]["catalog_hash"] == health["dataset"]["catalog_hash"]
        assert g["env"]["reward_version"] == health["reward_version"] and g["env"]["reward_profile"] == "rl"
        scored = [a for a in g["attempts"] if a["status"] == "scored"]
        assert sum(a["advantage"] for a in scored) == pytest.approx(0.0, abs=1e-4)
        mean = sum(a["reward"] for a in scored) / len(scored)
        for a in scored:
            assert a["advantage"] == pytest.approx(a["reward"] - mean, abs=1e-4)
        for a in g["attempts"]:
            assert a["turns"], a
            assert a["timings"]["inference_s"] > 0 and a["timings"]["total_s"] >= a["timings"]["inference_s"]
            for turn in a["turns"]:
                ids, logprobs = turn["completion_token_ids"], turn["logprobs"]
                assert turn["token_source"] == "server" and ids and len(logprobs) == len(ids)
                assert all(lp <= 0.0 for lp in logprobs)
                assert tokenizer.decode(ids, skip_special_tokens=True) == turn["completion"]
                assert turn["completion_tokens"] == len(ids)
                prompt = tokenizer.decode(prompt_ids(a, turn["index"]))
                assert turn["messages"][-1]["content"] in prompt
                assert turn["trainable"] is (turn["stage"] == "executor")
            if a["status"] == "scored":  # the env's own tally of what the service reported on /step
                assert a["score"]["tokens"]["completion"] == sum(len(t["completion_token_ids"]) for t in a["turns"])
                assert a["score"]["tokens"]["prompt"] == sum(len(prompt_ids(a, t["index"])) for t in a["turns"])
    assert env.health()["leased"] == 0


def test_many_concurrent_groups_keep_the_pool_full_never_over(start_refenv, start_service):
    env = start_refenv("--pool", "3")
    service = start_service([env.url])
    body = {
        "groups": [
            # 12 attempts on a pool of 3: the pool must be refilled as episodes end, many times over.
            {"task_id": t, "n": 3, "sampling": {"temperature": 0.8, "max_tokens": 16}, "max_turns": 2}
            for t in ("t001", "t002", "t005", "t007")
        ]
    }
    lines = []
    with httpx.stream("POST", f"{service.url}/groups/batch", json=body, timeout=600) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/x-ndjson")
        for line in response.iter_lines():
            if line.strip():
                lines.append((time.monotonic(), json.loads(line)))
    assert sorted(item["index"] for _, item in lines) == list(range(4))
    assert all("group" in item for _, item in lines)
    assert lines[-1][0] - lines[0][0] > 0.05  # streamed as they finished, not all at once
    health = env.health()
    assert health["max_leased"] == 3  # the pool was kept full, and never exceeded
    assert health["leased"] == 0
    svc = httpx.get(f"{service.url}/health/detail").json()["envs"][0]
    assert svc["max_held"] == 3 and svc["held"] == 0
    assert sum(item["group"]["counts"]["scheduled"] for _, item in lines) == 12


def test_env_failures_are_marked_retried_and_leak_nothing(start_refenv, start_service):
    env = start_refenv("--pool", "4", "--fail-rate", "0.5", "--seed", "7")
    service = start_service([env.url])
    r = group(service.url, task_id="t005", n=8, retries=2, sampling={"temperature": 0.8, "max_tokens": 24})
    assert r.status_code == 200, r.text
    g = r.json()
    assert g["counts"]["scheduled"] == 8 == g["counts"]["scored"] + g["counts"]["failed"]
    retried = [a for a in g["attempts"] if a["tries"] > 1]
    assert retried, "with a 50% fail rate some attempt must have been retried"
    for a in retried:
        assert len(a["earlier_failures"]) == a["tries"] - 1
        # The contract's three ways an episode fails on the env's side (refenv's --fail-rate injects each).
        assert all(
            f["kind"] in ("transport_error", "environment_failure", "env_episode_failed")
            and f["attribution"] == "infrastructure"
            for f in a["earlier_failures"]
        )
    for a in g["attempts"]:
        if a["status"] == "scored":
            assert a["reward"] is not None and a["advantage"] is not None
        else:
            assert a["status"] == "env_failure" and a["reward"] is None and a["advantage"] is None
            assert a["failure"]["kind"] and a["tries"] == 3
    rewards = [x for x in g["rewards"] if x is not None]
    assert len(rewards) == g["counts"]["scored"]
    health = env.health()
    assert health["leased"] == 0 and health["max_leased"] <= 4


def test_attempt_timeout_and_max_turns_abandon_their_episodes(start_refenv, start_service):
    env = start_refenv("--pool", "2", "--latency-ms", "2000")
    service = start_service([env.url])
    g = group(service.url, task_id="t005", n=2, timeout_s=1.0, sampling={"temperature": 0.8, "max_tokens": 16}).json()
    assert_accounted(g)
    assert [a["status"] for a in g["attempts"]] == ["policy_failure", "policy_failure"]
    # A deadline is the policy's failure: it earns policy_failure_reward (0.0 by default).
    assert all(a["failure"]["kind"] == "deadline" and a["reward"] == 0.0 for a in g["attempts"])
    assert g["counts"]["scored"] == 0 and g["counts"]["policy_failed"] == 2 and g["mean"] == 0.0
    # Loose, so a loaded CI machine does not decide it: an episode left unabandoned stays leased for
    # refenv's idle deadline (300 s).
    assert wait_until(lambda: env.health()["leased"] == 0, 10)
    assert env.health()["episodes"]["abandoned"] == 2


def test_max_turns_ends_an_episode_that_never_answers(start_refenv, start_service, start_scripted_model):
    """A model that only ever queries (a scripted stand-in: the real one may answer at once) must be
    stopped at max_turns: a policy failure, its episode abandoned."""
    model = start_scripted_model("sql-forever")
    env = start_refenv("--pool", "2")
    service = start_service([env.url], vllm=model.url, model="scripted")
    g = group(service.url, task_id="t005", n=2, max_turns=2, sampling={"temperature": 0.8, "max_tokens": 16}).json()
    assert_accounted(g)
    for a in g["attempts"]:
        assert len(a["turns"]) == 2
        assert a["status"] == "policy_failure" and a["failure"]["kind"] == "max_turns" and a["reward"] == 0.0
    assert wait_until(lambda: env.health()["leased"] == 0, 10)
    assert env.health()["episodes"]["abandoned"] == 2


def test_client_disconnect_abandons_every_episode_at_once(start_refenv, start_service):
    env = start_refenv("--pool", "4", "--latency-ms", "20000")
    service = start_service([env.url])
    with pytest.raises(httpx.ReadTimeout):
        group(service.url, timeout=4, task_id="t005", n=4, sampling={"temperature": 0.8, "max_tokens": 16})
    assert env.health()["episodes"]["started"] == 4  # every attempt held a world when the trainer left
    # The bound is loose so a loaded CI machine does not decide it; a missed abandon holds the worlds
    # for the env's 20 s.
    assert wait_until(lambda: env.health()["leased"] == 0, 5.0)
    assert env.health()["episodes"]["abandoned"] == 4

    # The same through a batch stream: the trainer reads one line's worth of time, then leaves.
    with pytest.raises(httpx.ReadTimeout):
        with httpx.stream(
            "POST",
            f"{service.url}/groups/batch",
            timeout=4,
            json={"groups": [{"task_id": "t005", "n": 2, "sampling": SAMPLING}] * 3},
        ) as response:
            for _ in response.iter_lines():
                pass
    assert wait_until(lambda: env.health()["leased"] == 0, 5.0)
    assert httpx.get(f"{service.url}/health/detail").json()["envs"][0]["held"] == 0


@pytest.mark.parametrize(
    "body,status,words",
    [
        ({"task_id": "t001", "n": 0}, 422, "n: Input should be greater than or equal to 1"),
        ({"task_id": "t001", "n": 1000}, 422, "--max-n"),
        ({"task_id": "no-such-task", "n": 2}, 404, "no-such-task"),
        ({"slug": "no-such-slug", "n": 2}, 404, "no-such-slug"),
        ({"task_id": "t001", "n": 4, "sampling": {"temperature": 0}}, 422, "greedy group has no signal"),
        ({"task_id": "t001", "reward_profile": "fastest"}, 422, "reward_profile: Input should be 'rl' or 'benchmark'"),
        ({"task_id": "t001", "slug": "x"}, 422, "exactly one of task_id or slug"),
        ({"n": 2}, 422, "exactly one of task_id or slug"),
        ({"task_id": "t001", "colour": "blue"}, 422, "colour: Extra inputs are not permitted"),
        (
            {"task_id": "t001", "sampling": {"temperature": 3}},
            422,
            "sampling.temperature: Input should be less than or equal to 2",
        ),
        (
            {"task_id": "t001", "sampling": {"max_tokens": 0}},
            422,
            "sampling.max_tokens: Input should be greater than or equal to 1",
        ),
        ({"task_id": "t001", "sampling": {"top_p": 0}}, 422, "sampling.top_p: Input should be greater than 0"),
        ({"task_id": "t001", "timeout_s": -1}, 422, "timeout_s: Input should be greater than 0"),
        ({"task_id": "t001", "n": "eight"}, 422, "n: Input should be a valid integer"),
        ({"task_id": "t001", "model": "gpt-9"}, 422, "model 'gpt-9' is not served here"),
    ],
)
def test_bad_input_gets_a_4xx_that_says_what_to_change(shared_service, body, status, words):
    r = httpx.post(f"{shared_service}/groups", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"] and words in r.json()["message"]


def test_malformed_oversized_and_bad_batches(shared_service):
    r = httpx.post(f"{shared_service}/groups", content=b"{nope", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"] == "invalid_json"
    r = httpx.post(f"{shared_service}/groups", content=b"[" * 50_000, headers={"content-type": "application/json"})
    assert r.status_code in (400, 422)
    r = httpx.post(f"{shared_service}/groups", content=b" " * (9 << 20), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"] == "body_too_large"
    r = httpx.post(f"{shared_service}/groups/batch", json={"groups": [{"task_id": "t001"}, {"task_id": "zzz"}]})
    assert r.status_code == 404 and "groups[1]" in r.json()["message"]
    r = httpx.post(f"{shared_service}/groups/batch", json={"groups": []})
    assert r.status_code == 422
    # Greedy when the request says it means it.
    r = group(shared_service, task_id="t001", n=2, allow_greedy=True, sampling={"temperature": 0, "max_tokens": 16})
    assert r.status_code == 200 and r.json()["all_equal"] is True
    assert "temperature=0.0" in r.json()["diagnosis"]


@pytest.fixture
def shared_service(start_refenv, start_service):
    env = start_refenv("--pool", "2")
    return start_service([env.url]).url


def test_startup_refuses_bad_configuration(start_refenv, start_service, vllm_url):
    ok = start_refenv("--seed", "1")
    other = start_refenv("--seed", "2")
    for envs, flags, words in [
        # Waited for (it may be starting), then given up on, saying what it waited for.
        (
            ["http://127.0.0.1:9"],
            ["--startup-timeout", "2"],
            "still waiting after 2s (--startup-timeout) for env http://127.0.0.1:9",
        ),
        ([ok.url, other.url], [], "not comparable"),
        # At once, though the model server it would otherwise wait for does not answer.
        ([ok.url, other.url], ["--vllm", "http://127.0.0.1:9"], "not comparable"),
        ([ok.url], ["--model", "no-such-model"], "no-such-model"),
        (["127.0.0.1:9"], [], "not an http:// or https:// URL"),
        (["http://127.0.0.1:abc"], [], "not a valid URL: Invalid port"),
    ]:
        proc = start_service(envs, *flags, wait=False).proc
        proc.proc.wait(60)
        assert proc.proc.returncode != 0
        log = proc.log_path.read_text()
        assert words in log and "Traceback" not in log, log


def test_an_embedded_app_whose_start_failed_says_failed_not_starting(start_refenv, vllm_url):
    """create_app without the CLI, which would exit: after a refusal the app says why, not `starting`."""
    from starlette.testclient import TestClient

    from rollout_service.server.config import ServiceConfig
    from rollout_service.server.http.app import create_app

    env = start_refenv("--pool", "2")
    app = create_app(ServiceConfig(env=[env.url], vllm=[vllm_url], model="no-such-model"))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        assert wait_until(lambda: client.get("/health").json()["status"] != "starting", timeout_s=60)
        health = client.get("/health")
        assert (health.status_code, health.json()) == (503, {"status": "failed"})
        refused = client.get("/tasks")
        assert refused.status_code == 503 and refused.json()["error"] == "start_failed", refused.text
        assert "no-such-model" in refused.json()["message"]
        assert "no-such-model" in " ".join(client.get("/health/detail").json()["reasons"])
        # A trainer waiting for it is told at once, not after its whole timeout.
        rollout = RolloutClient("http://127.0.0.1")
        rollout._http = client  # TestClient is an httpx.Client over the in-process app
        started = time.monotonic()
        with pytest.raises(RolloutError, match="could not start"):
            rollout.wait_ready(timeout_s=300)
        assert time.monotonic() - started < 30


def test_service_waits_for_an_env_and_a_model_server_that_start_after_it(
    start_refenv, start_service, start_scripted_model
):
    """Pieces come up in any order (compose, Kubernetes, Ray): the service listens at once, says
    `starting` (503) with what it waits for, and serves once both have answered. The model server
    is the scripted stand-in: a real vLLM cannot be started late within a test's time."""
    env_port = unclaimed_ports(2)  # unbound until the env and model start, seconds later
    model_port = env_port + 1
    env_url, model_url = f"http://127.0.0.1:{env_port}", f"http://127.0.0.1:{model_port}"
    service = start_service([env_url], "--startup-timeout", "120", vllm=model_url, model="scripted", wait=False)
    client = RolloutClient(service.url)
    assert wait_until(lambda: httpx.get(f"{service.url}/health").status_code == 503, timeout_s=60)
    assert client.health() == {"status": "starting"}, client.health_detail()
    with pytest.raises(ServiceStarting) as refused:
        client.group(task_id="t001", n=2, sampling=SAMPLING)
    assert refused.value.status == 503 and env_url in refused.value.message and model_url in refused.value.message
    assert refused.value.retry_after_s == 5
    waiting = " ".join(client.health_detail()["waiting_for"])
    assert env_url in waiting and model_url in waiting, waiting

    # It says so in its log, naming both (the first report comes after a few seconds).
    log = service.proc.log_path
    assert wait_until(lambda: f"waiting for env {env_url}" in log.read_text(), timeout_s=30)
    assert f"model server {model_url}" in log.read_text()

    env = start_refenv("--pool", "2", port=env_port)
    # The env answered; the model server still does not: still starting, now waiting for it alone.
    assert wait_until(lambda: env_url not in " ".join(client.health_detail()["waiting_for"]), timeout_s=30)
    assert client.health() == {"status": "starting"}
    assert model_url in " ".join(client.health_detail()["waiting_for"])

    start_scripted_model("answer", port=model_port)
    assert client.wait_ready(timeout_s=60)["status"] == "ok"
    group = client.group(task_id="t001", n=2, sampling=SAMPLING)
    assert group.counts.scheduled == 2 and group.counts.scored == 2, group.counts
    assert env.health()["leased"] == 0


def test_trainer_client_auth_metrics_and_support_routing(start_refenv, start_service):
    env = start_refenv("--pool", "4", "--responder")
    service = start_service([env.url], "--api-key-env", "TEST_ROLLOUT_KEY", env={"TEST_ROLLOUT_KEY": "s3cret"})
    assert httpx.get(f"{service.url}/health").status_code == 200
    assert httpx.post(f"{service.url}/groups", json={"task_id": "t001"}).status_code == 401
    assert httpx.get(f"{service.url}/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
    with RolloutClient(service.url, api_key="s3cret") as client:
        g = client.group(task_id="t001", n=2, sampling={"temperature": 0.8, "max_tokens": 32})
        # No update yet: every turn came from the weights the replicas started with.
        assert (g.oldest_policy_version, g.newest_policy_version) == ("base", "base") and len(g.attempts) == 2
        assert {t.policy_version for a in g.attempts for t in a.turns} == {"base"}
        # A version label typed by the trainer is refused, with where versions come from now.
        typed = httpx.post(
            f"{service.url}/groups",
            json={"task_id": "t001", "policy_version": "step-42"},
            headers={"Authorization": "Bearer s3cret"},
        )
        assert typed.status_code == 422 and "POST /policy" in typed.json()["message"], typed.text
        # Answered episodes end with the responder stage: not the policy's, so not trainable.
        for attempt in g.attempts:
            for turn in attempt.turns:
                assert turn.trainable == (turn.stage == "executor")
        items = list(
            client.groups(
                [{"task_id": "t002", "n": 2, "sampling": SAMPLING}, {"task_id": "t003", "n": 2, "sampling": SAMPLING}]
            )
        )
        assert sorted(i.index for i in items) == [0, 1] and all(i.group for i in items)
        with pytest.raises(RolloutError) as err:
            client.group(task_id="nope", n=2)
        assert err.value.status == 404
    metrics = httpx.get(f"{service.url}/metrics", headers={"Authorization": "Bearer s3cret"}).text
    # Sample values, not just the HELP lines: 3 groups of n=2 ran (the refused one never started).
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line and not line.startswith("#")
    }
    assert sum(v for k, v in samples.items() if k.startswith("rollout_groups_total{")) == 3
    assert sum(v for k, v in samples.items() if k.startswith("rollout_attempts_total{")) == 6
    assert samples["rollout_groups_in_flight"] == 0
    assert env.health()["leased"] == 0


def test_async_client(start_refenv, start_service):
    env = start_refenv("--pool", "2")
    service = start_service([env.url])

    async def use():
        async with AsyncRolloutClient(service.url) as client:
            g = await client.group(task_id="t001", n=2, sampling={"temperature": 0.8, "max_tokens": 24})
            got = [item async for item in client.groups([{"task_id": "t002", "n": 2, "sampling": SAMPLING}])]
            return g, got

    g, got = asyncio.run(use())
    assert g.counts.scheduled == 2
    assert len(got) == 1 and got[0].group is not None


def test_refenv_support_model_answers_responder_and_hosted_mode(start_refenv, vllm_url):
    """refenv's own model calls (--support-model) against the real vLLM server."""
    support = f"{vllm_url},{embedded_model.MODEL_NAME}"
    env = start_refenv("--responder", "--support-model", support)
    reset = httpx.post(f"{env.url}/step/reset", json={"task_id": "t005"}).json()
    final = httpx.post(
        f"{env.url}/step",
        timeout=120,
        json={
            "episode_id": reset["episode_id"],
            "completion": json.dumps({"action": "answer", "input": "20"}),
            "prompt_tokens": 300,
            "completion_tokens": 12,
        },
    ).json()
    # The responder stage was answered by refenv itself: the driver never saw it.
    assert final["done"] is True and final["pass"] is True
    assert final["score"]["tokens"]["llm_calls"] == 2
    hosted = start_refenv("--support-model", support, step=False)
    r = httpx.post(f"{hosted.url}/episodes", json={"task_id": "t001", "include_trajectory": True}, timeout=300)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["task_id"] == "t001" and body["trajectory"] and body["trajectory"][0]["stage"] == "executor"
    assert 0.0 <= body["reward"] <= 1.0 and body["latency_ms"] > 0
    assert hosted.health()["leased"] == 0


def test_a_seeded_groups_attempts_sample_differently(start_refenv, start_service):
    """With a seed, the attempts of one group still differ (the real model: each attempt's turns get
    their own seeds). That a rerun samples the very same tokens is not asserted: vLLM online only
    reproduces tokens with batch invariance, which its CPU build does not have, and this server is
    shared with other tests' requests (README, "HTTP API"). The seeds sent are checked on
    the wire in test_a_seed_sends_the_documented_seed_per_attempt_and_turn."""
    env = start_refenv("--pool", "4")
    service = start_service([env.url])
    body = {"task_id": "t005", "n": 4, "sampling": {"temperature": 1.0, "max_tokens": 24, "seed": 321}}
    g = group(service.url, **body).json()
    assert_accounted(g)
    first_turns = [a["turns"][0]["completion_token_ids"] for a in g["attempts"]]
    assert len({tuple(x) for x in first_turns}) > 1, "every attempt sampled the same first turn"


def test_a_seed_sends_the_documented_seed_per_attempt_and_turn(start_refenv, start_service, start_scripted_model):
    """The seed a turn is sampled with is the README's `seed + 7919 i + t`, the same on a rerun, and it
    is what reaches the model server (the oracle: the scripted stand-in's own count of the seeds it was
    sent, since vLLM does not echo one). Every episode takes three turns (`sql-then-answer`). Breaks
    tried: the attempt's index left out of the seed -> the attempts share seeds, fails; the seed
    recorded but not sent -> the server counts "none", fails."""
    model = start_scripted_model("sql-then-answer", "--sql-turns", "2")
    env = start_refenv("--pool", "4")
    service = start_service([env.url], vllm=model.url, model="scripted")
    body = {"task_id": "t005", "n": 4, "retries": 0, "sampling": {**SAMPLING, "seed": 321}}
    documented = [[321 + 7919 * i + t for t in range(3)] for i in range(4)]
    for _ in range(2):
        g = group(service.url, **body).json()
        assert [a["status"] for a in g["attempts"]] == ["scored"] * 4, g
        assert [[t["seed"] for t in a["turns"]] for a in g["attempts"]] == documented
    sent = httpx.get(f"{model.url}/stats").json()["by_seed"]
    assert sent == {str(seed): 2 for seeds in documented for seed in seeds}


def test_the_session_vllm_computes_in_its_engine_process(vllm_url):
    """The shared server as the OS sees it: one engine process under the API server, no separate
    worker (whose busy-waiting with the engine's took a second core: README, "vLLM on two cores"),
    and its OpenMP threads as set. Break tried: `cpu_executor_environment` not applied -> a
    `VLLM::Worker` process is found."""
    from rollout_service.launch import vllm_server

    psutil = pytest.importorskip("psutil")
    asked = (
        os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto") != "auto"
        or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0"
    )
    if vllm_server.installed_vllm() != "vllm-cpu" or asked or os.environ.get("ROLLOUT_TEST_VLLM_URL"):
        pytest.skip("not the CPU build, vLLM's worker process asked for, or a server the session did not start")
    port = int(vllm_url.rsplit(":", 1)[1])
    listening = [c.pid for c in psutil.net_connections("tcp") if c.status == "LISTEN" and c.laddr.port == port]
    assert listening and listening[0] is not None, f"no process listens on {vllm_url}"
    children = psutil.Process(listening[0]).children(recursive=True)
    names = sorted(p.name() for p in children if p.name().startswith("VLLM::"))
    assert names == ["VLLM::EngineCore"], names
    # The engine inherits it (its own /proc environ is overwritten by its process title).
    threads = psutil.Process(listening[0]).environ().get("OMP_NUM_THREADS")
    # The oracle counts cores its own way: distinct sibling sets, not (package, core id) pairs.
    sets = set()
    for cpu in os.sched_getaffinity(0):
        siblings = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        sets.add(siblings.read_text().strip() if siblings.exists() else str(cpu))
    assert threads == os.environ.get("OMP_NUM_THREADS", str(max(1, len(sets) - 1)))
