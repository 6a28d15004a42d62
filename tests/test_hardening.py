"""The guarantees under races, malformed answers and faults (issue #11), with real processes.

The model server here is `tests/scripted_model.py` where a test needs a model that answers badly
or takes one path on purpose (a stand-in: real vLLM cannot be made to send `"choices": []`);
the env is always the real refenv over HTTP, and its own counters are the oracle.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import threading
import time

import httpx
import pytest
from helpers import assert_accounted, cli, wait_until
from httpx_stand_in import stand_in

from rollout_service.server.config import ServiceConfig

SAMPLING = {"temperature": 0.8, "max_tokens": 24}


def detail(service) -> dict:
    return httpx.get(f"{service.url}/health/detail", timeout=10).json()


def post_then_hang_up(url: str, body: dict) -> socket.socket:
    """Send POST /groups on a raw socket and keep it open; close it to disconnect the trainer."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    payload = json.dumps(body).encode()
    sock.sendall(
        b"POST /groups HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return sock


def test_a_second_cancellation_during_cleanup_still_frees_the_slot(start_refenv, start_service, start_scripted_model):
    """#11.1: the env is stopped so the abandon after a deadline hangs; the trainer then disconnects
    (a second cancellation, during cleanup). Once the env runs again the world and the slot are back."""
    model = start_scripted_model("sql-forever")
    env = start_refenv("--pool", "1", "--latency-ms", "4000")
    service = start_service([env.url], vllm=model.url, model="scripted")
    sock = post_then_hang_up(
        service.url, {"task_id": "t005", "n": 1, "retries": 0, "timeout_s": 1.0, "sampling": SAMPLING}
    )
    try:
        assert wait_until(lambda: env.health()["leased"] == 1, 10)
        os.kill(env.proc.proc.pid, signal.SIGSTOP)  # the DELETE sent at the deadline will hang
        # Nothing outside the service can see the DELETE go out to a stopped env, so wait past the 1 s
        # deadline by the clock (the service's own `episodes_ending` would be the code under test).
        time.sleep(2.0)
    finally:
        sock.close()  # the trainer goes away while the abandon is in flight
        assert wait_until(lambda: detail(service)["groups_in_flight"] == 0, 10)
        os.kill(env.proc.proc.pid, signal.SIGCONT)
    assert wait_until(lambda: env.health()["leased"] == 0, 30)
    assert wait_until(lambda: detail(service)["envs"][0]["held"] == 0, 30)
    assert env.health()["episodes"]["abandoned"] == 1
    # The slot is usable: the next group gets an answer.
    again = httpx.post(f"{service.url}/groups", timeout=60, json={"task_id": "t001", "n": 1, "sampling": SAMPLING})
    assert again.status_code == 200 and again.json()["counts"]["scheduled"] == 1


def test_a_malformed_completion_fails_its_attempt_not_the_group(start_refenv, start_service, start_scripted_model):
    """#11.2: `"choices": []` for attempts 0 and 2 (their second turn): those attempts fail with
    `bad_response`; the group answers 200 and attempts 1 and 3 are scored; nothing is leaked."""
    model = start_scripted_model("empty-choices")
    env = start_refenv("--pool", "4")
    service = start_service([env.url], vllm=model.url, model="scripted")
    r = httpx.post(
        f"{service.url}/groups",
        timeout=60,
        json={"task_id": "t005", "n": 4, "retries": 0, "sampling": {**SAMPLING, "seed": 10}},
    )
    assert r.status_code == 200, r.text
    group = r.json()
    assert_accounted(group)
    statuses = [(a["status"], (a["failure"] or {}).get("kind")) for a in group["attempts"]]
    assert statuses == [("inference_failure", "bad_response"), ("scored", None)] * 2, statuses
    assert wait_until(lambda: env.health()["leased"] == 0, 10)
    h = env.health()["episodes"]
    assert h["started"] == 4 and h["abandoned"] == 2 and h["finished"] == 2


def test_an_env_answer_that_breaks_the_contract_is_a_typed_failure():
    """#11.2, the env's side: an answer that does not fit the contract raises BadEnvAnswer (a stand-in
    transport: refenv cannot be made to send it)."""
    import asyncio

    from rollout_service.backends.env_client import BadEnvAnswer, EnvClient

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"episode_id": 5, "done": "maybe"})

    async def reset() -> None:
        client = EnvClient("http://env", http=stand_in(httpx.MockTransport(answer)))
        try:
            await client.reset("t001")
        finally:
            await client.aclose()

    with pytest.raises(BadEnvAnswer) as err:
        asyncio.run(reset())
    assert err.value.kind == "env_bad_answer" and err.value.retryable


@pytest.mark.parametrize("leased, kept", [(3, 3), ("many", None), (True, None), ([1], None)])
def test_an_envs_leased_count_is_kept_only_as_a_count(leased, kept):
    """/health/detail types `leased` as a count: whatever else an env's /health puts there is left out
    rather than failing the detail (a stand-in env: refenv always sends a count).
    Break tried: the int check removed -> "many" reaches EnvDetail and validation fails."""
    import asyncio
    from types import SimpleNamespace

    from rollout_service.backends.env_client import EnvClient
    from rollout_service.server.membership.monitor import BackendMonitor
    from rollout_service.server.status import EnvDetail

    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"status": "ready", "workers": 2, "leased": leased})

    async def probe() -> dict:
        client = EnvClient("http://env", http=stand_in(httpx.MockTransport(answer)))
        env = SimpleNamespace(url="http://env", client=client, slots=SimpleNamespace(down=False))
        monitor = BackendMonitor({"http://env": env}, [])  # type: ignore[dict-item]
        try:
            await monitor.probe()
        finally:
            await client.aclose()
        return monitor.env_state("http://env")

    state = asyncio.run(probe())
    assert state["ok"] and state["leased"] == kept, state
    detail = EnvDetail(
        url="http://env", pool=2, held=0, max_held=0, draining=False, side=None, busy_world_seconds=0.0, **state
    )
    assert detail.leased == kept


def test_a_token_prompt_completion_sends_the_turns_sampling_seed_included():
    """Exact turns' side of test_a_seed_sends_the_documented_seed_per_attempt_and_turn (tests/
    test_service.py, which sees chat requests: the scripted model has no /tokenize): the runner works
    out a turn's sampling once for both paths, and `complete` must send it as given, with the prompt
    ids and vLLM's flags for ids and logprobs (a stand-in transport: vLLM does not echo a seed).
    Break tried: the sampling left out of complete's body -> no seed sent, fails."""
    import asyncio

    from rollout_service.backends.replica_pool import ReplicaPool

    bodies: list[dict] = []

    def handle(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        choice = {"index": 0, "text": "ok", "finish_reason": "stop",
                  "logprobs": {"tokens": ["token_id:7"], "token_logprobs": [-0.1]}}  # fmt: skip
        return httpx.Response(200, json={"choices": [choice], "usage": {"prompt_tokens": 3}})

    async def complete() -> None:
        client = ReplicaPool(["http://model"], http=stand_in(httpx.MockTransport(handle)))
        try:
            sampling = {"temperature": 0.7, "top_p": 0.9, "max_tokens": 5, "seed": 8241, "stop": None}
            await client.complete(model="m", prompt_token_ids=[1, 2, 3], sampling=sampling)
        finally:
            await client.aclose()

    asyncio.run(complete())
    [body] = bodies
    assert body["prompt"] == [1, 2, 3] and body["model"] == "m"
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["seed"]) == (0.7, 0.9, 5, 8241)
    assert "stop" not in body  # None is not sent: the server's default holds
    assert body["return_tokens_as_token_ids"] is True and body["logprobs"] == 0


def test_a_token_prompt_completion_for_another_prompt_is_a_bad_answer():
    """The model's side: a /v1/completions answer must be for the prompt ids sent (the server's count of
    them, and any echo of them, agree), and its tokens must be the ids asked for ("token_id:<id>"),
    else the turn's ids would not be the model's (a stand-in transport: vLLM cannot be made to answer
    for another prompt). An answer that agrees holds the very list sent. Breaks tried: the echo
    check in _parse removed -> the wrong echo passes, fails; the count check removed -> a shorter
    prompt counted passes, fails; the prefix count removed -> "5" read as an id, fails; each token's
    prefix not required at its start -> "token_id:1token_id:" read as 1, fails."""
    import asyncio

    from rollout_service.backends.errors import BadInferenceResponse
    from rollout_service.backends.replica_pool import ReplicaPool

    sent = list(range(100, 140))
    ids = ["token_id:7", "token_id:8"]

    def answer(echo: list | None, counted: int, tokens: list, finish_reason: object):  # type: ignore[no-untyped-def]
        def handle(request: httpx.Request) -> httpx.Response:
            choice = {"index": 0, "text": "ok", "finish_reason": finish_reason,
                      "logprobs": {"tokens": tokens, "token_logprobs": [-0.1, -0.2]}}  # fmt: skip
            if echo is not None:
                choice["prompt_token_ids"] = echo
            usage = {} if counted is None else {"prompt_tokens": counted}
            return httpx.Response(200, json={"choices": [choice], "usage": usage})

        return httpx.MockTransport(handle)

    async def complete(echo=None, counted=len(sent), tokens=ids, finish_reason="stop"):  # type: ignore[no-untyped-def]
        client = ReplicaPool(["http://model"], http=stand_in(answer(echo, counted, tokens, finish_reason)))
        try:
            return await client.complete(model="m", prompt_token_ids=sent, sampling={})
        finally:
            await client.aclose()

    result = asyncio.run(complete())
    assert result.prompt_token_ids is sent and result.choices[0].completion_token_ids == [7, 8]
    assert asyncio.run(complete(echo=list(sent))).prompt_token_ids is sent
    wrong = [
        {"echo": [*sent[:-1], 1]},  # an echo of another prompt
        {"echo": [float(t) for t in sent[:-1]] + ["x"]},
        {"counted": len(sent) - 1},  # a prompt cut short (the server's count)
        {"tokens": ["5", "token_id:8"]},  # tokens as text, not ids
        {"tokens": ["token_id:7", "token_id:x"]},
        {"tokens": ["token_id:7,8"]},  # one token, two ids
        {"tokens": ["token_id:1token_id:", "2"]},  # ids a decoder of each token would not give
        {"tokens": ["token_id:token_id:7", "8"]},
        {"tokens": ["token_id:1token_id:2", "token_id:8"]},
        {"tokens": "token_id:7"},
        {"counted": None},  # no count: nothing would say the server generated from the ids sent
        {"finish_reason": 7},  # not text: a bad answer here, not a result the trainer cannot read
    ]
    for case in wrong:
        with pytest.raises(BadInferenceResponse):
            asyncio.run(complete(**case))


@pytest.mark.env_may_wait  # the test holds the only world itself, so the service's reset waits
def test_a_reset_waiting_for_a_world_is_bounded_by_timeout_s_and_still_abandoned(
    start_refenv, start_service, start_scripted_model
):
    """#11.3: the env's only world is held behind the service's back, so the service's reset blocks.
    The try ends at timeout_s, not when the reset returns; the slot stays held (the env really has
    that episode coming) until the reset returns and its episode is abandoned."""
    model = start_scripted_model("answer")
    env = start_refenv("--pool", "1")
    service = start_service([env.url], vllm=model.url, model="scripted")
    held = httpx.post(f"{env.url}/step/reset", json={"task_id": "t001"}).json()["episode_id"]
    r = httpx.post(
        f"{service.url}/groups",
        timeout=60,
        json={"task_id": "t005", "n": 1, "retries": 0, "timeout_s": 0.3, "sampling": SAMPLING},
    )
    attempt = r.json()["attempts"][0]
    # No episode was started within timeout_s: the env's failure (it gave no world), not the policy's.
    assert attempt["failure"]["kind"] == "env_no_world" and attempt["failure"]["attribution"] == "infrastructure"
    assert attempt["reward"] is None and attempt["timings"]["total_s"] < 10.0, attempt  # unbounded when broken
    # The service still counts the world as held: its reset is parked on the env.
    svc = detail(service)
    assert svc["envs"][0]["held"] == 1 and svc["episodes_ending"] == 1
    httpx.delete(f"{env.url}/step/{held}")
    assert wait_until(lambda: env.health()["episodes"]["abandoned"] == 2, 10)  # ours and the service's
    assert wait_until(lambda: detail(service)["envs"][0]["held"] == 0, 10)
    assert env.health()["leased"] == 0

    # The same with the trainer disconnecting while the reset is parked (a cancellation, not a deadline).
    held = httpx.post(f"{env.url}/step/reset", json={"task_id": "t001"}).json()["episode_id"]
    sock = post_then_hang_up(service.url, {"task_id": "t005", "n": 1, "sampling": SAMPLING})
    assert wait_until(lambda: detail(service)["envs"][0]["held"] == 1, 10)
    sock.close()
    assert wait_until(lambda: detail(service)["groups_in_flight"] == 0, 10)
    httpx.delete(f"{env.url}/step/{held}")
    assert wait_until(lambda: env.health()["episodes"]["abandoned"] == 4, 10)
    assert wait_until(lambda: detail(service)["envs"][0]["held"] == 0 and env.health()["leased"] == 0, 10)


def test_run_log_write_errors_show_in_health_and_groups_go_on(
    start_refenv, start_service, start_scripted_model, tmp_path
):
    """#11.6: the disk refuses every write to the run log: groups are still answered, /health says
    degraded, the detail names the error and counts the groups lost from the log.

    The refusal is the kernel's, as root too (where file permissions refuse nothing; a symlink to
    /dev/full is refused by the service itself): once the service is up, its file size limit
    (RLIMIT_FSIZE) is set to the size its run log already has, so every append to it fails with EFBIG
    (Python ignores SIGXFSZ). The log is a sparse file far larger than the service's own output, which
    goes on being written, and it ends in a newline, so the writer has no torn line to cut first."""
    model = start_scripted_model("answer")
    env = start_refenv("--pool", "2")
    runs = tmp_path / "runs"
    runs.mkdir(mode=0o700)
    full = runs / "full.jsonl"
    size = 64 * 1024 * 1024
    with open(full, "wb") as f:
        f.truncate(size - 1)
        f.seek(size - 1)
        f.write(b"\n")
    full.chmod(0o600)
    service = start_service([env.url], "--runs-dir", str(runs), "--run-id", "full", vllm=model.url, model="scripted")
    _, hard = resource.prlimit(service.proc.proc.pid, resource.RLIMIT_FSIZE)
    resource.prlimit(service.proc.proc.pid, resource.RLIMIT_FSIZE, (size, hard))
    for _ in range(2):
        r = httpx.post(f"{service.url}/groups", timeout=60, json={"task_id": "t001", "n": 2, "sampling": SAMPLING})
        assert r.status_code == 200, r.text
        assert_accounted(r.json())
    assert wait_until(lambda: httpx.get(f"{service.url}/health").json()["status"] == "degraded", 10)
    # Groups reach the log after their answers, off the event loop: the second loss is counted when its
    # write fails, which may be after /health already says degraded for the first.
    assert wait_until(lambda: detail(service)["run_log"]["groups_lost"] == 2, 10), detail(service)["run_log"]
    run_log = detail(service)["run_log"]
    assert "File too large" in run_log["error"] and str(full) in run_log["error"], run_log
    assert run_log["groups_written"] == 0, run_log
    assert "run log" in " ".join(detail(service)["reasons"])
    assert full.stat().st_size == size  # the kernel's count: not a byte of either group reached the file


def test_admission_cap_answers_429_with_retry_after(start_refenv, start_service, start_scripted_model):
    """#11.7: past --max-queued-attempts a request is refused with 429 and Retry-After, nothing started;
    one larger than the cap itself with 422 and no Retry-After (waiting would never help), as the
    flag's description (the README's configuration table) says. Break tried: admit() without the 422
    branch -> the larger request gets 429, fails; the description back to "past it a request gets
    429" -> fails."""
    model = start_scripted_model("answer")
    env = start_refenv("--pool", "2", "--latency-ms", "3000")
    service = start_service([env.url], "--max-queued-attempts", "4", vllm=model.url, model="scripted")
    first = threading.Thread(
        target=httpx.post,
        args=(f"{service.url}/groups",),
        kwargs={"json": {"task_id": "t001", "n": 4, "sampling": SAMPLING}, "timeout": 60},
    )
    first.start()
    assert wait_until(lambda: detail(service)["attempts_queued"] == 4, 10)
    r = httpx.post(f"{service.url}/groups", json={"task_id": "t001", "n": 1, "sampling": SAMPLING})
    assert r.status_code == 429 and r.json()["error"] == "too_many_queued_attempts"
    assert int(r.headers["retry-after"]) > 0 and "--max-queued-attempts" in r.json()["message"]
    r = httpx.post(f"{service.url}/groups", json={"task_id": "t001", "n": 5, "sampling": SAMPLING})
    assert r.status_code == 422 and r.json()["error"] == "too_many_attempts", r.text
    assert "retry-after" not in r.headers and "split it" in r.json()["message"]
    described = ServiceConfig.model_fields["max_queued_attempts"].description or ""
    assert "429 with Retry-After" in described and "422 too_many_attempts" in described, described
    first.join(60)
    started = env.health()["episodes"]["started"]
    assert started == 4  # the refused request started nothing


def test_a_chunked_body_over_the_cap_gets_413(start_refenv, start_service, start_scripted_model):
    """#11.8: the same 413 for a streamed (chunked) body as for one with Content-Length."""
    model = start_scripted_model("answer")
    env = start_refenv("--pool", "1")
    service = start_service([env.url], "--max-body-bytes", "4096", vllm=model.url, model="scripted")

    def chunks():
        for _ in range(10):
            yield b" " * 1024

    r = httpx.post(f"{service.url}/groups", content=chunks(), headers={"content-type": "application/json"})
    assert "content-length" not in {k.lower() for k in r.request.headers}
    assert r.status_code == 413 and r.json()["error"] == "body_too_large"
    r = httpx.post(f"{service.url}/groups", content=b" " * 5000, headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_teacher_without_token_ids_reports_the_servers_counts(start_refenv, start_service, start_scripted_model):
    """#11.9: a teacher that returns no token ids: the turn and the env get the server's usage counts
    (the env's own score.tokens is the oracle)."""
    model = start_scripted_model("no-ids")
    env = start_refenv("--pool", "2")
    service = start_service(
        [env.url],
        "--model-endpoint",
        f"teacher={model.url},model=scripted,token-ids=false",
        vllm=model.url,
        model="scripted",
    )
    g = httpx.post(
        f"{service.url}/groups", timeout=60, json={"task_id": "t001", "n": 2, "model": "teacher", "sampling": SAMPLING}
    ).json()
    for attempt in g["attempts"]:
        assert attempt["status"] == "scored"
        turns = attempt["turns"]
        assert turns and all(t["token_source"] == "absent" and t["completion_tokens"] > 0 for t in turns)
        assert attempt["score"]["tokens"]["completion"] == sum(t["completion_tokens"] for t in turns)
        assert attempt["score"]["tokens"]["prompt"] == sum(t["prompt_tokens"] for t in turns)


@pytest.mark.parametrize("reward", [0.0, None])
def test_a_context_overflow_is_the_policys_failure(start_refenv, start_service, start_scripted_model, reward):
    """#11.11: vLLM's context-length 400 is attributed to the policy; it earns policy_failure_reward
    (entering rewards and advantages, flagged) or, with null, is excluded."""
    model = start_scripted_model("overflow")
    env = start_refenv("--pool", "2")
    service = start_service([env.url], vllm=model.url, model="scripted")
    g = httpx.post(
        f"{service.url}/groups",
        timeout=60,
        json={"task_id": "t001", "n": 2, "policy_failure_reward": reward, "sampling": SAMPLING},
    ).json()
    assert_accounted(g)
    for attempt in g["attempts"]:
        assert attempt["status"] == "policy_failure" and attempt["failure"]["kind"] == "context_overflow"
        assert attempt["failure"]["attribution"] == "policy" and attempt["reward"] == reward
    assert g["counts"]["policy_failed"] == 2 and g["counts"]["rewarded"] == (2 if reward is not None else 0)
    assert g["all_equal"] is True and "no gradient" in g["diagnosis"]
    assert wait_until(lambda: env.health()["leased"] == 0, 10)
    assert env.health()["episodes"]["abandoned"] == 2


def test_measure_counts_policy_failures_as_not_passed(start_refenv, start_scripted_model):
    """#11.11: `measure` keeps the policy's own failures in its denominator and says how many."""
    model = start_scripted_model("overflow")
    env = start_refenv("--pool", "2", "--split", "auto:0.8", "--side", "eval")
    done = cli(
        "measure",
        "--env",
        env.url,
        "--vllm",
        model.url,
        "--model",
        "scripted",
        "--repeats",
        "2",
        "--limit",
        "2",
        "--json",
    )
    assert done.returncode == 0, done.stderr
    m = json.loads(done.stdout)
    assert m["graded"] == 4 and m["policy_failures"] == 4 and m["passes"] == 0 and m["pass_rate"] == 0.0
    text = cli(
        "measure", "--env", env.url, "--vllm", model.url, "--model", "scripted", "--repeats", "1", "--limit", "1"
    )
    assert text.returncode == 0 and "1 failed by the policy itself (counted as not passed)" in text.stdout


def test_health_is_cheap_and_public_detail_is_behind_the_key(start_refenv, start_service, start_scripted_model):
    """#11.12: /health answers the status alone and asks no backend; /health/detail needs the key."""
    model = start_scripted_model("answer")
    env = start_refenv("--pool", "1")
    service = start_service([env.url], "--api-key-env", "K", env={"K": "s3cret"}, vllm=model.url, model="scripted")
    listings = httpx.get(f"{model.url}/stats").json()["listings"]
    for _ in range(30):
        health = httpx.get(f"{service.url}/health")
        assert health.status_code == 200 and health.json() == {"status": "ok"}
    # The background probe lists models every 2 s; 30 /health calls must not have added 30 listings.
    assert httpx.get(f"{model.url}/stats").json()["listings"] - listings < 10
    assert httpx.get(f"{service.url}/health/detail").status_code == 401
    full = httpx.get(f"{service.url}/health/detail", headers={"Authorization": "Bearer s3cret"}).json()
    assert full["envs"][0]["url"] == env.url and full["models"][0]["ok"] is True
