"""Where turns go (issue #12): model replicas, several envs behind one task, a support model, the
request-rate cap, and the env's 410/504 reaching the service, with real processes.

The model servers here are `tests/scripted_model.py`, a stand-in: what these tests check is which
server got which request and when, and only a server that counts its own requests (per task
prompt, per model name, with arrival times) can say so; real vLLM cannot be told to be slow for a
set time either. The envs are the real refenv over HTTP, and its own counters are the oracle.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest
from helpers import assert_accounted, wait_until
from scripted_model import command as scripted_command

SAMPLING = {"temperature": 0.8, "max_tokens": 24}


@pytest.fixture
def scripted(launch):
    """scripted(script, *flags) -> Running: the stand-in model server with its options
    (--name, --delay, --sql-turns); stopped after the test."""

    def start(script: str, *flags: str):
        return launch("model", None, scripted_command(0, script, *flags), ready_path="/v1/models")

    return start


def stats(model) -> dict:
    return httpx.get(f"{model.url}/stats", timeout=10).json()


def detail(service) -> dict:
    return httpx.get(f"{service.url}/health/detail", timeout=10).json()


def post_group(service, body: dict, timeout: float = 60) -> dict:
    r = httpx.post(f"{service.url}/groups", json=body, timeout=timeout)
    assert r.status_code == 200, r.text
    group = r.json()
    assert_accounted(group)
    return group


def turns_of(group: dict) -> list[dict]:
    return [t for a in group["attempts"] for t in a["turns"]]


def prompt_of(group: dict) -> str:
    """The task's prompt as the env sent it: the first user message of the group's turns."""
    first = group["attempts"][0]["turns"][0]["messages"]
    return next(m["content"] for m in first if m["role"] == "user")


def model_entry(service, url: str) -> dict:
    return next(m for m in detail(service)["models"] if m["url"] == url)


# -- 1. replicas of the policy ----------------------------------------------------------------------


def test_a_group_stays_on_one_replica_and_concurrent_groups_spread(start_refenv, start_service, scripted):
    """#12.1: two groups at once (one batch) on two replicas: every turn of a group went to one
    replica, the two groups to different ones; each replica's own per-task count says the same."""
    replicas = [scripted("sql-then-answer", "--delay", "0.3") for _ in range(2)]
    env = start_refenv("--pool", "4")
    service = start_service([env.url], "--vllm", replicas[1].url, vllm=replicas[0].url, model="scripted")
    groups_sent = [{"task_id": task, "n": 2, "retries": 0, "sampling": SAMPLING} for task in ("t005", "t006")]
    r = httpx.post(f"{service.url}/groups/batch", json={"groups": groups_sent}, timeout=60)
    assert r.status_code == 200, r.text
    lines = [json.loads(line) for line in r.text.splitlines() if line.strip()]
    groups = [line["group"] for line in sorted(lines, key=lambda line: line["index"])]
    served_by = []
    for group in groups:
        assert_accounted(group)
        assert group["counts"]["scored"] == 2
        turns = turns_of(group)
        assert len(turns) == 2 * 3  # --sql-turns 2, then the answer
        endpoints = {t["endpoint"] for t in turns}
        assert len(endpoints) == 1, f"one group's turns went to {endpoints}"
        served_by.append(endpoints.pop())
    assert sorted(served_by) == sorted(m.url for m in replicas), "two concurrent groups shared a replica"
    # The replicas' own view: each task's requests all landed on the replica its turns name.
    for group, url in zip(groups, served_by, strict=True):
        for model in replicas:
            seen = stats(model)["by_prompt"].get(prompt_of(group), 0)
            assert seen == (len(turns_of(group)) if model.url == url else 0), (model.url, seen)
    assert wait_until(lambda: env.health()["leased"] == 0, 10)


def test_a_replica_that_dies_mid_run_is_routed_around_and_reported(start_refenv, start_service, scripted):
    """#12.1: the replica serving a group is killed while its completion is in flight. /health/detail
    says it is down and /health degraded within a few seconds (probe every 2 s); the later groups
    are all scored, every turn by the survivor, which counts them itself."""
    replicas = [scripted("sql-then-answer", "--delay", "0.5") for _ in range(2)]
    env = start_refenv("--pool", "2")
    service = start_service([env.url], "--vllm", replicas[1].url, vllm=replicas[0].url, model="scripted")
    assert wait_until(lambda: httpx.get(f"{service.url}/health").json()["status"] == "ok", 10)
    result: dict = {}

    def run_first() -> None:
        try:
            result["group"] = post_group(service, {"task_id": "t005", "n": 2, "retries": 0, "sampling": SAMPLING})
        except BaseException as exc:  # handed to the test's thread below
            result["error"] = exc

    first = threading.Thread(target=run_first, daemon=True)
    first.start()
    # The replica that got the group's first request (its own count) is the one to kill, mid-request.
    assert wait_until(lambda: any(stats(m)["requests"] > 0 for m in replicas), 10)
    dead, survivor = sorted(replicas, key=lambda m: -stats(m)["requests"])
    assert stats(survivor)["requests"] == 0
    dead.proc.stop(grace_s=0)  # SIGKILL now: the in-flight request is dropped
    first.join(60)
    assert not first.is_alive() and "error" not in result, result.get("error")
    # The first group may have lost attempts to the death (the promise is about the groups after
    # it); it answered 200 with every attempt accounted for (post_group).

    assert wait_until(lambda: model_entry(service, dead.url)["ok"] is False, 8)
    assert httpx.get(f"{service.url}/health").json()["status"] == "degraded"
    assert model_entry(service, survivor.url)["ok"] is True

    before = stats(survivor)["by_prompt"]
    for task in ("t006", "t007", "t008"):
        group = post_group(service, {"task_id": task, "n": 2, "retries": 0, "sampling": SAMPLING})
        assert [a["status"] for a in group["attempts"]] == ["scored"] * 2, group["attempts"]
        turns = turns_of(group)
        assert {t["endpoint"] for t in turns} == {survivor.url}
        assert stats(survivor)["by_prompt"].get(prompt_of(group), 0) - before.get(prompt_of(group), 0) == len(turns)
    assert wait_until(lambda: env.health()["leased"] == 0, 10)


def test_a_replica_that_hangs_is_avoided_after_its_first_timeouts(start_refenv, start_service, scripted):
    """#12.1, a replica that stops answering (SIGSTOP) instead of refusing connections: the groups
    that meet it first fail on --inference-timeout; the groups after them are all served by the
    other replica and scored."""
    replicas = [scripted("answer") for _ in range(2)]
    env = start_refenv("--pool", "2")
    service = start_service(
        [env.url], "--vllm", replicas[1].url, "--inference-timeout", "1", vllm=replicas[0].url, model="scripted"
    )
    warm = post_group(service, {"task_id": "t001", "n": 1, "retries": 0, "sampling": SAMPLING})
    hung_url = turns_of(warm)[0]["endpoint"]
    hung = next(m for m in replicas if m.url == hung_url)
    survivor = next(m for m in replicas if m.url != hung_url)
    os.kill(hung.proc.proc.pid, signal.SIGSTOP)
    try:
        # Idle again, the replicas are tied and take new groups in turn: one of the next two meets the
        # hung one (the other is served by the survivor).
        for task in ("t002", "t005"):
            met = post_group(service, {"task_id": task, "n": 2, "retries": 0, "sampling": SAMPLING})
            for attempt in met["attempts"]:
                assert attempt["status"] == "scored" or attempt["failure"]["kind"] == "inference_timeout", attempt
        before = stats(survivor)["requests"]
        for task in ("t003", "t004"):
            group = post_group(service, {"task_id": task, "n": 2, "retries": 0, "sampling": SAMPLING})
            assert [a["status"] for a in group["attempts"]] == ["scored"] * 2, group["attempts"]
            assert {t["endpoint"] for t in turns_of(group)} == {survivor.url}
        assert stats(survivor)["requests"] - before == 4  # one answer turn per attempt, all on the survivor
        assert wait_until(lambda: model_entry(service, hung.url)["ok"] is False, 8)
        assert httpx.get(f"{service.url}/health").json()["status"] == "degraded"
    finally:
        os.kill(hung.proc.proc.pid, signal.SIGCONT)
    assert wait_until(lambda: env.health()["leased"] == 0, 10)


# -- 2. several envs behind one task ---------------------------------------------------------------


def test_two_compatible_envs_share_one_groups_attempts(start_refenv, start_service, scripted):
    """#12.2: two refenv with the same seed, a pool of 1 each, one group of 4: the attempts ran on
    both, neither env ever held more than its one world or had a reset waiting for one, and each
    env's own count of started episodes matches the attempts that name it."""
    model = scripted("sql-then-answer", "--delay", "0.1")
    envs = [start_refenv("--pool", "1", "--seed", "0") for _ in range(2)]
    service = start_service([e.url for e in envs], vllm=model.url, model="scripted")
    group = post_group(service, {"task_id": "t005", "n": 4, "retries": 0, "sampling": SAMPLING})
    assert group["counts"]["scored"] == 4
    urls = sorted(e.url for e in envs)
    assert sorted({a["env"] for a in group["attempts"]}) == urls
    assert group["env"]["urls"] == urls
    assert wait_until(lambda: all(e.health()["leased"] == 0 for e in envs), 10)
    healths = [e.health() for e in envs]
    for env, health in zip(envs, healths, strict=True):
        assert health["max_leased"] <= 1 and health["max_waiting"] == 0, health
        ran_here = sum(a["tries"] for a in group["attempts"] if a["env"] == env.url)
        assert health["episodes"]["started"] == ran_here == health["episodes"]["finished"]
    assert sum(h["episodes"]["started"] for h in healths) == sum(a["tries"] for a in group["attempts"]) == 4


# -- 3. a support model for the other stages ------------------------------------------------------


def test_non_policy_stages_go_to_the_support_model(start_refenv, start_service, scripted):
    """#12.3: refenv --responder adds a `responder` stage after the answer. Its turns go to the
    support server (a second stand-in serving "support"), marked not trainable with the support
    model's name; executor turns go to the policy server. Each server counts its own requests."""
    policy = scripted("answer")
    support = scripted("answer", "--name", "support")
    env = start_refenv("--pool", "3", "--responder")
    service = start_service(
        [env.url], "--support-vllm", support.url, "--support-model", "support", vllm=policy.url, model="scripted"
    )
    group = post_group(service, {"task_id": "t005", "n": 3, "retries": 0, "sampling": SAMPLING})
    assert group["counts"]["scored"] == 3
    turns = turns_of(group)
    executor = [t for t in turns if t["stage"] == "executor"]
    responder = [t for t in turns if t["stage"] == "responder"]
    assert len(executor) + len(responder) == len(turns)
    assert all(sum(t["stage"] == "responder" for t in a["turns"]) == 1 for a in group["attempts"])
    for t in executor:
        assert t["trainable"] is True and t["model"] == "scripted" and t["endpoint"] == policy.url, t
    for t in responder:
        assert t["trainable"] is False and t["model"] == "support" and t["endpoint"] == support.url, t
    s, p = stats(support), stats(policy)
    assert s["requests"] == len(responder) and s["by_model"] == {"support": len(responder)}
    assert all(prompt.startswith("Question:") for prompt in s["by_prompt"])  # the responder's prompt
    assert p["requests"] == len(executor) and p["by_model"] == {"scripted": len(executor)}
    assert wait_until(lambda: env.health()["leased"] == 0, 10)


# -- 4. the request-rate cap ------------------------------------------------------------------------


def most_within(arrivals: list[float], window_s: float, skip_first_s: float = 0.0) -> int:
    """The most requests that arrived within any `window_s` window starting at an arrival, windows
    that start in the first `skip_first_s` seconds left out."""
    start = arrivals[0] + skip_first_s
    return max((sum(1 for u in arrivals if t <= u < t + window_s) for t in arrivals if t >= start), default=0)


@pytest.mark.alone  # the rate is timed where requests arrive: another test's load would bunch them
def test_max_requests_per_second_caps_the_rate_to_the_model(start_refenv, start_service, scripted):
    """#12.4: the same group through a service with --max-requests-per-second 6 and one without,
    each on its own stand-in that records when each request arrived. The capped one never gets more
    than 6/s (+20%) after its first second, over the run and over any 2 s window (2 s, not 1 s: the
    cap lets requests out in bunches at second boundaries, and a bunch that arrives late on a busy
    machine would land in the next second); the other gets more (so the check can see a rate at all)."""
    rate = 6
    capped_model, free_model = scripted("sql-forever"), scripted("sql-forever")
    env = start_refenv("--pool", "6")
    capped = start_service([env.url], "--max-requests-per-second", str(rate), vllm=capped_model.url, model="scripted")
    free = start_service([env.url], vllm=free_model.url, model="scripted")
    body = {"task_id": "t005", "n": 6, "retries": 0, "sampling": SAMPLING}
    groups = [post_group(capped, body), post_group(free, body)]
    arrivals = [stats(capped_model)["arrivals"], stats(free_model)["arrivals"]]
    for group, seen in zip(groups, arrivals, strict=True):
        assert group["counts"]["scored"] == 6
        assert len(seen) == len(turns_of(group)) >= 24  # 4 queries and a finalize turn per attempt
    capped_arrivals, free_arrivals = arrivals
    # Over the run: what came after the first second's share took at least (N - R) / (1.2 R) seconds.
    span = capped_arrivals[-1] - capped_arrivals[0]
    assert span >= (len(capped_arrivals) - rate) / (rate * 1.2), (span, capped_arrivals)
    assert most_within(capped_arrivals, 2.0, skip_first_s=1.0) <= 2 * rate * 1.2, capped_arrivals
    # Without the cap the same work goes faster than the cap allows.
    assert most_within(free_arrivals, 1.0) > rate * 1.2, free_arrivals
    assert free_arrivals[-1] - free_arrivals[0] < span
    assert wait_until(lambda: env.health()["leased"] == 0, 10)


# -- 5. the env ends the episode: 410 and 504 ---------------------------------------------------------


@pytest.mark.parametrize(
    ("model_flags", "env_flags", "kind", "counter"),
    [
        # The model takes 2 s, the env reclaims an idle episode after 1 s: the /step gets 410.
        pytest.param(("--delay", "2"), ("--step-timeout", "1s"), "env_gone", "reclaimed", id="410-idle-reclaim"),
        # The step itself runs 3 s, the env waits 1 s for its next observation: the /step gets 504.
        pytest.param(
            (),
            ("--latency-ms", "3000", "--step-timeout", "1s"),
            "env_episode_timeout",
            "timed_out",
            id="504-stuck-step",
        ),
    ],
)
def test_the_env_ending_an_episode_is_an_env_failure_and_retried(
    start_refenv, start_service, scripted, model_flags, env_flags, kind, counter
):
    """#12.5: an episode the env ends itself (410 idle reclaim, 504 stuck step) fails its attempt as
    env_failure of that kind, on the infrastructure, and is retried; the env's own counters say it
    ended every episode that way, and nothing is left leased or abandoned (nothing to give back)."""
    model = scripted("answer", *model_flags)
    env = start_refenv("--pool", "2", *env_flags)
    service = start_service([env.url], vllm=model.url, model="scripted")
    group = post_group(service, {"task_id": "t001", "n": 2, "retries": 1, "sampling": SAMPLING})
    for attempt in group["attempts"]:
        assert attempt["status"] == "env_failure", attempt
        assert attempt["failure"]["kind"] == kind and attempt["failure"]["attribution"] == "infrastructure"
        assert attempt["tries"] == 2 and [f["kind"] for f in attempt["earlier_failures"]] == [kind]
    assert wait_until(lambda: env.health()["leased"] == 0, 10)
    episodes = env.health()["episodes"]
    assert episodes["started"] == episodes[counter] == 4, episodes  # n * (retries + 1)
    assert episodes["abandoned"] == episodes["finished"] == 0, episodes
    assert stats(model)["requests"] == 4  # one completion per try, each before the env ended it
