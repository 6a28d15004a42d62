"""The sampler (POST /groups/sample), difficulty per policy version (GET /tasks/stats) and sampler
streams (POST /samplers ...), against the real refenv; the real vLLM where the model's own answers
are what is tested.

A scripted stand-in model (tests/scripted_model.py) only where an outcome must be certain and the
real model cannot be made to give it: every attempt of every group answering alike (so no group has
signal and the budget must run out), and pass rates known before the sample starts.

Oracles: the test's own reading of each group's attempts (is there signal?), refenv's own /health
counters (worlds held, episodes started and ended), GET /tasks/stats read before a sample (which
tasks the bounds must skip), and the test's own log of the policy updates it made (each turn's
recorded version against it).
"""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from helpers import assert_accounted, assert_env_accounted, send_unread_batch, wait_until

GRADED = ("scored", "policy_failure")
SHORT = {"temperature": 1.0, "max_tokens": 48}
SCRIPTED = {"temperature": 0.8, "max_tokens": 16}


def sample(service: str, body: dict, timeout: float = 900) -> tuple[list[dict], list[dict], dict]:
    """(kept groups, dropped lines, summary) of one POST /groups/sample, the summary last."""
    kept, dropped, summaries = [], [], []
    with httpx.stream("POST", f"{service}/groups/sample", json=body, timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.strip():
                continue
            assert not summaries, "a line came after the summary"
            item = json.loads(line)
            if "group" in item:
                kept.append(item["group"])
            elif "dropped" in item:
                dropped.append(item["dropped"])
            else:
                summaries.append(item["summary"])
    assert len(summaries) == 1, "the answer ended without its summary line"
    return kept, dropped, summaries[0]


def graded(group: dict) -> list[float]:
    return [a["reward"] for a in group["attempts"] if a["status"] in GRADED and a["reward"] is not None]


def env_health(url: str) -> dict:
    return httpx.get(f"{url}/health", timeout=10).json()


def test_sample_returns_count_groups_with_signal_and_cancels_the_rest(start_refenv, start_service):
    """Real model: exactly `count` groups come back, each with graded rewards that differ (read from
    its attempts, not from the service's flags), every dropped group is a line and counted, and once
    the count is reached what still runs is cancelled: the env gets every world back at once.
    Breaks tried: the filter keeping every group (signal check always true) -> a group without signal
    is kept; the groups still running not cancelled at the end -> the env still holds worlds after the
    summary; a dropped group not written as a line -> the summary's dropped count disagrees."""
    env = start_refenv("--pool", "4")
    service = start_service([env.url]).url
    body = {
        "count": 2,
        "max_groups": 16,
        "seed": 3,
        "group": {"n": 4, "max_turns": 2, "retries": 0, "sampling": SHORT},
    }
    kept, dropped, summary = sample(service, body)
    # Every line and count of the summary agrees with the lines themselves.
    assert summary["kept"] == len(kept)
    assert sum(summary["dropped"].values()) == len(dropped)
    assert summary["groups_run"] == len(kept) + len(dropped)
    assert summary["attempts_dropped"] == sum(d["attempts"] for d in dropped)
    assert summary["completion_tokens_dropped"] == sum(d["completion_tokens"] for d in dropped)
    for line in dropped:
        assert line["reason"] in ("no_signal", "too_few_graded", "group_failed") and line["detail"], line
    if summary["complete"]:
        assert len(kept) == 2 and summary["stopped"] == "count reached"
    else:  # the budget ran out first (the model rarely varies): said, never a silent short answer
        assert len(kept) < 2 and "budget spent" in summary["stopped"] and summary["groups_run"] == 16
    for group in kept:
        assert_accounted(group)
        rewards = graded(group)
        assert len(rewards) >= 2 and len(set(rewards)) > 1, rewards
    for line in dropped:
        if line["reason"] == "no_signal":
            assert len({r for r in line["rewards"] if r is not None}) <= 1, line
    # Cancelled at once, not left to finish: the env holds nothing a moment after the summary.
    assert wait_until(lambda: env_health(env.url)["leased"] == 0, timeout_s=5), env_health(env.url)
    health = env_health(env.url)
    assert_env_accounted(health)
    # Nothing the sampler held is still counted as queued.
    detail = httpx.get(f"{service}/health/detail", timeout=10).json()
    assert detail["attempts_queued"] == 0 and detail["groups_in_flight"] == 0, detail


def test_a_budget_that_runs_out_is_said_and_every_world_released(start_refenv, start_service, start_scripted_model):
    """Scripted model: every attempt answers alike, so no group has signal. The sampler runs exactly
    max_groups groups, writes each as a dropped line with its rewards, and its summary says the budget
    ran out, with what the dropped groups cost. Oracle: refenv's counters (episodes started = the
    budget's attempts, all ended, no world held). Breaks tried: the budget not enforced (started >=
    budget check removed) -> more episodes than the budget's; the summary's `complete` from the lines
    sent rather than the count kept -> complete is true."""
    model = start_scripted_model("answer")
    env = start_refenv("--pool", "4")
    service = start_service([env.url], vllm=model.url, model="scripted").url
    body = {
        "count": 3,
        "max_groups": 5,
        "tasks": {"task_ids": ["t001", "t002", "t003"]},
        "group": {"n": 3, "retries": 0, "sampling": SCRIPTED},
    }
    kept, dropped, summary = sample(service, body)
    assert kept == []
    assert summary["complete"] is False and summary["kept"] == 0
    assert "budget spent" in summary["stopped"] and "max_groups=5" in summary["stopped"], summary
    assert summary["groups_run"] == 5 and summary["dropped"] == {"no_signal": 5}
    assert [d["reason"] for d in dropped] == ["no_signal"] * 5
    assert summary["attempts_dropped"] == 15
    for line in dropped:
        assert len(line["rewards"]) == 3 and len(set(line["rewards"])) == 1, line
        assert line["task_id"] in ("t001", "t002", "t003")
    health = env_health(env.url)
    assert health["episodes"]["started"] == 15, health["episodes"]
    assert health["leased"] == 0
    assert_env_accounted(health)
    assert summary["completion_tokens_dropped"] == sum(d["completion_tokens"] for d in dropped) > 0


def test_difficulty_skips_follow_the_stats(start_refenv, start_service, start_scripted_model):
    """Scripted model (its answer, "1", fails these tasks: pass rate 0, known before the sample).
    t003 is run once first with POST /groups; GET /tasks/stats then says its pass rate; a sample over
    t003 and t004 with skip_pass_rate_below 0.5 after 1 group must skip t003 from the start and t004
    after its first group, then stop saying every task was skipped. Breaks tried: skip_reason always
    None -> t003 is run; the bound's comparison turned around (above for below) -> nothing skipped."""
    model = start_scripted_model("answer")
    env = start_refenv("--pool", "2")
    service = start_service([env.url], vllm=model.url, model="scripted").url
    first = httpx.post(f"{service}/groups", json={"task_id": "t003", "n": 2, "sampling": SCRIPTED}, timeout=120)
    assert first.status_code == 200, first.text
    stats = httpx.get(f"{service}/tasks/stats", params={"task_id": ["t003", "t004"]}, timeout=10).json()
    assert [s["task_id"] for s in stats] == ["t003"]
    [version] = stats[0]["versions"]
    assert version["version"] == "base" and version["groups"] == 1 and version["attempts"] == 2
    assert version["pass_rate"] == 0.0 and version["signal_share"] == 0.0
    body = {
        "count": 4,
        "max_groups": 10,
        "filter": "none",
        "groups_at_once": 1,
        "tasks": {"task_ids": ["t003", "t004"]},
        "difficulty": {"skip_pass_rate_below": 0.5, "after_groups": 1},
        "group": {"n": 2, "retries": 0, "sampling": SCRIPTED},
    }
    kept, dropped, summary = sample(service, body)
    assert [g["task_id"] for g in kept] == ["t004"] and dropped == []
    assert summary["skipped_tasks"] == {"pass_rate_below": ["t003", "t004"]}, summary
    assert summary["complete"] is False and "every one was skipped" in summary["stopped"], summary
    stats = {s["task_id"]: s for s in httpx.get(f"{service}/tasks/stats", timeout=10).json()}
    assert stats["t003"]["versions"][0]["groups"] == 1, "t003 was run although its stats said skip"
    assert stats["t004"]["versions"][0]["groups"] == 1
    metrics = httpx.get(f"{service}/metrics", timeout=10).text
    assert 'rollout_task_groups_total{version="base"} 2.0' in metrics
    # A bound nothing meets skips nothing: the same draw runs its count.
    body["difficulty"] = {"skip_pass_rate_above": 0.5, "after_groups": 1}
    body["count"] = 2
    kept, _, summary = sample(service, body)
    assert len(kept) == 2 and summary["complete"] and summary["skipped_tasks"] == {}


def test_bad_sample_requests_are_told_why(start_refenv, start_service, start_scripted_model):
    """Mistakes are 4xx with a message, before any line: a template naming its task, an unknown task,
    family or env, a budget below the count, an n over the service's maximum, weights whose sum
    overflows, a stream template that pins a version. Breaks tried: the finite-sum check removed ->
    200 with no summary line; the stream's pin check removed -> 201."""
    model = start_scripted_model("answer")
    env = start_refenv("--pool", "2")
    service = start_service([env.url], "--max-n", "8", vllm=model.url, model="scripted").url
    cases = [
        ({"count": 1, "group": {"task_id": "t001"}}, 422, "the sampler draws the task"),
        ({"count": 1, "tasks": {"task_ids": ["nope"]}}, 404, "nope"),
        ({"count": 1, "tasks": {"families": {"nope": 1}}}, 404, "family nope"),
        ({"count": 1, "tasks": {"envs": {"http://127.0.0.1:1": 1}}}, 404, "no env"),
        ({"count": 3, "max_groups": 2}, 422, "below count"),
        ({"count": 1, "group": {"n": 9}}, 422, "--max-n"),
        ({"count": 1, "group": {"sampling": {"temperature": 0}, "n": 2}}, 422, "greedy"),
        ({"count": 1, "tasks": {"task_ids": ["t001"], "families": {"x": 1}}}, 422, "not task_ids and families"),
        # Each weight finite, their sum not: random.choices would raise mid-answer (an empty 200).
        ({"count": 1, "tasks": {"families": {"x": 1e308, "y": 1e308}}}, 422, "sum must be finite"),
    ]
    for body, status, words in cases:
        answer = httpx.post(f"{service}/groups/sample", json=body, timeout=30)
        assert answer.status_code == status, (body, answer.text)
        assert words in answer.json()["message"], (body, answer.json())
    # A stream feeds training: its template may not pin a version (its buffered groups would outlive the pin).
    current = httpx.get(f"{service}/policy", timeout=10).json()["version"]
    answer = httpx.post(f"{service}/samplers", json={"group": {"pin_version": current}}, timeout=30)
    assert answer.status_code == 422 and "follows the current policy" in answer.json()["message"], answer.text
    assert env_health(env.url)["episodes"]["started"] == 0


def test_a_family_served_only_on_the_eval_side_is_a_409_saying_so(start_refenv, start_service, start_scripted_model):
    """Two envs split by family: a training sample naming a family that only the eval-side env serves is
    409 eval_side, saying the family is there on the eval side (not a 404 as if it did not exist); with
    allow_eval_side it is drawn; a family no env serves is still 404. Oracle: each env's own GET /tasks
    (which families it serves). Break tried (old code): unknown families all 404 unknown_family ->
    the eval family's answer is 404."""
    model = start_scripted_model("answer")
    train = start_refenv("--pool", "2", "--split", "auto:0.8", "--side", "train")
    held_out = start_refenv("--pool", "2", "--split", "auto:0.8", "--side", "eval")
    service = start_service([train.url, held_out.url], vllm=model.url, model="scripted").url

    def families(url: str) -> set[str]:
        return {t["family"] for t in httpx.get(f"{url}/tasks", timeout=10).json()["tasks"]}

    eval_only = sorted(families(held_out.url) - families(train.url))
    assert eval_only, "the split left no family to the eval side alone: nothing to test"
    family = eval_only[0]
    body = {"count": 1, "filter": "none", "tasks": {"families": {family: 1}}, "group": {"n": 2, "sampling": SCRIPTED}}
    refused = httpx.post(f"{service}/groups/sample", json=body, timeout=30)
    assert refused.status_code == 409 and refused.json()["error"] == "eval_side", refused.text
    message = refused.json()["message"]
    assert family in message and "eval-side" in message and "allow_eval_side" in message, message
    assert env_health(held_out.url)["episodes"]["started"] == 0
    allowed = {**body, "group": {**body["group"], "allow_eval_side": True}}
    kept, _, summary = sample(service, allowed)
    assert len(kept) == 1 and kept[0]["task_id"] in {
        t["task_id"] for t in httpx.get(f"{held_out.url}/tasks", timeout=10).json()["tasks"] if t["family"] == family
    }, kept
    unknown = httpx.post(f"{service}/groups/sample", json={**body, "tasks": {"families": {"no-such": 1}}}, timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"] == "unknown_family", unknown.text


def test_bad_sample_requests_with_huge_names_are_422_and_the_answer_stays_small(start_refenv, start_service):
    """A task id, family or env URL of 3 MB (under --max-body-bytes) is the request's mistake: 422 with a
    short answer, never a 500 or the name echoed back whole; an unknown name under the cap is cut short
    in the 404. Breaks tried: TaskDraw's items without max_length -> the 3 MB task id is a 500 (the
    template's ValidationError) and the 3 MB family comes back whole in a 404; the ValidationError not
    caught in draw_buckets (items capped at 300) -> a 500 for a 250-character task id; describe_errors
    with the path's parts not cut -> the 3 MB key is in the 422; the unknown family not cut short ->
    its 199 characters in the 404."""
    env = start_refenv("--pool", "2")
    service = start_service([env.url]).url
    huge = "x" * (3 << 20)
    for tasks in ({"task_ids": [huge]}, {"families": {huge: 1}}, {"envs": {huge: 1}}, {"task_ids": ["t" * 250]}):
        answer = httpx.post(f"{service}/groups/sample", json={"count": 1, "tasks": tasks}, timeout=60)
        assert answer.status_code == 422 and answer.json()["error"] == "invalid_request", answer.text[:2000]
        assert len(answer.content) < 2000 and "at most" in answer.json()["message"], answer.text[:2000]
    long_family = "f" * 199
    answer = httpx.post(
        f"{service}/groups/sample", json={"count": 1, "tasks": {"families": {long_family: 1}}}, timeout=30
    )
    assert answer.status_code == 404 and answer.json()["error"] == "unknown_family", answer.text
    assert long_family not in answer.text and "199 characters" in answer.text, answer.text
    assert env_health(env.url)["episodes"]["started"] == 0


# -- streams ---------------------------------------------------------------------------------


def pull(service: str, stream: str, count: int, timeout: float = 900) -> tuple[list[dict], list[dict], dict]:
    """(handed-out lines {lag, group}, dropped lines, summary) of one pull."""
    handed, dropped, summaries = [], [], []
    with httpx.stream("POST", f"{service}/samplers/{stream}/pull", json={"count": count}, timeout=timeout) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.strip():
                item = json.loads(line)
                if "group" in item:
                    handed.append(item)
                elif "dropped" in item:
                    dropped.append(item["dropped"])
                else:
                    summaries.append(item["summary"])
    assert len(summaries) == 1
    return handed, dropped, summaries[0]


def test_no_handed_out_group_exceeds_max_staleness_across_updates(start_refenv, start_service, tmp_path):
    """Real model, real LoRA updates (adapters per name on the shared vLLM). A stream with buffer 3
    and max_staleness 1 produces while the test pulls one group, then lands updates (one, then two)
    while the stream keeps producing. Oracle: the test's own log of versions (version -> its update
    count); for every turn of every handed-out group, the current version's count at the pull minus
    the turn's is at most 1, and equals the lag the line says for its oldest turn. Buffered groups
    that fell two behind must have been dropped as stale (counted) and replaced.
    Breaks tried: the hand-out check removed -> a group with lag 2 is handed out; the lag computed
    from the newest turn instead of the oldest -> the line's lag disagrees with the oracle."""
    from test_policy import make_adapter, post_policy

    env = start_refenv("--pool", "4")
    service = start_service([env.url]).url
    steps = {"base": 0}
    body = {
        "buffer": 3,
        "max_staleness": 1,
        "pacing": False,  # drop-and-replace: what this test checks is the hand-out bound behind pacing
        "filter": "none",
        "tasks": {"task_ids": ["t001", "t002", "t003", "t004"]},
        "group": {"n": 2, "max_turns": 2, "retries": 0, "sampling": {"temperature": 1.0, "max_tokens": 24}},
    }
    created = httpx.post(f"{service}/samplers", json=body, timeout=30)
    assert created.status_code == 201, created.text
    stream = created.json()["id"]
    assert created.json()["buffer_bound"] == 3

    run = uuid.uuid4().hex[:8]  # adapters are per name on the shared vLLM: names of this run alone

    def update(label: str) -> None:
        folder = make_adapter(tmp_path / label, 0.0, seed=len(steps))
        post_policy(service, version=f"{run}-{label}", lora={"path": folder}).raise_for_status()
        steps[f"{run}-{label}"] = len(steps)

    def check(handed: list[dict], current: str) -> None:
        for line in handed:
            turns = [t for a in line["group"]["attempts"] for t in a["turns"]]
            oldest = min((steps[t["policy_version"]] for t in turns), default=steps[current])
            assert steps[current] - oldest <= 1, (line["lag"], [t["policy_version"] for t in turns])
            assert line["lag"] == steps[current] - oldest

    handed, _, summary = pull(service, stream, 1)
    check(handed, "base")
    assert summary["lags"] == [0] and summary["stream"]["buffer_bound"] == 3
    # The stream refills its buffer under "base" while the trainer "trains"; then updates land.
    assert wait_until(lambda: httpx.get(f"{service}/samplers/{stream}").json()["buffered"] >= 2, 600)
    update("v1")
    handed, _, summary = pull(service, stream, 1)
    check(handed, f"{run}-v1")
    assert wait_until(lambda: httpx.get(f"{service}/samplers/{stream}").json()["buffered"] >= 2, 600)
    update("v2")
    update("v3")  # whatever was buffered under base or v1 is now 2 or 3 behind
    handed, dropped, summary = pull(service, stream, 2)
    check(handed, f"{run}-v3")
    assert len(handed) == 2 and all(line["lag"] <= 1 for line in handed)
    state = httpx.get(f"{service}/samplers/{stream}").json()
    assert state["dropped"].get("stale", 0) >= 2, state
    assert [d["reason"] for d in dropped].count("stale") >= 2
    assert sum(state["lag_histogram"].values()) == state["handed_out"] == 4
    metrics = httpx.get(f"{service}/metrics", timeout=10).text
    assert "rollout_sampler_handed_lag_count 4.0" in metrics
    assert 'rollout_sampler_dropped_groups_total{reason="stale"}' in metrics
    deleted = httpx.delete(f"{service}/samplers/{stream}", timeout=60)
    assert deleted.status_code == 200
    assert wait_until(lambda: env_health(env.url)["leased"] == 0, timeout_s=10)
    detail = httpx.get(f"{service}/health/detail", timeout=10).json()
    assert detail["attempts_queued"] == 0, detail


def test_a_stream_that_is_gone_is_said_plainly(start_refenv, start_service, start_scripted_model):
    """DELETE cancels what the stream runs (worlds back: refenv's counters) and a later pull is 410 with
    the reason; an idle stream expires the same way; an id this process never made is 404 naming a
    restart. Breaks tried: close() not cancelling the sampler's groups -> the env still holds worlds;
    the reaper never expiring -> the idle stream still answers."""
    model = start_scripted_model("sql-forever", "--delay", "0.5")
    env = start_refenv("--pool", "2")
    service = start_service([env.url], vllm=model.url, model="scripted").url
    body = {"buffer": 2, "filter": "none", "group": {"n": 1, "max_turns": 50, "sampling": SCRIPTED}}
    stream = httpx.post(f"{service}/samplers", json=body, timeout=30).json()["id"]
    assert wait_until(lambda: env_health(env.url)["leased"] == 2, timeout_s=30)
    assert httpx.delete(f"{service}/samplers/{stream}", timeout=60).status_code == 200
    assert wait_until(lambda: env_health(env.url)["leased"] == 0, timeout_s=10), env_health(env.url)
    gone = httpx.post(f"{service}/samplers/{stream}/pull", json={"count": 1}, timeout=10)
    assert gone.status_code == 410 and "deleted" in gone.json()["message"], gone.text
    unknown = httpx.post(f"{service}/samplers/s-0000/pull", json={"count": 1}, timeout=10)
    assert unknown.status_code == 404 and "restart" in unknown.json()["message"], unknown.text

    idle = httpx.post(f"{service}/samplers", json={**body, "idle_timeout_s": 1}, timeout=30).json()["id"]
    assert wait_until(lambda: httpx.get(f"{service}/samplers/{idle}", timeout=10).status_code == 410, timeout_s=15)
    answer = httpx.get(f"{service}/samplers/{idle}", timeout=10).json()
    assert answer["error"] == "sampler_gone" and "expired" in answer["message"]
    assert wait_until(lambda: env_health(env.url)["leased"] == 0, timeout_s=10)
    assert httpx.get(f"{service}/health/detail", timeout=10).json()["attempts_queued"] == 0


# -- a reader that stops reading (issue #39, item 4) -------------------------------------------


@pytest.mark.env_may_wait
def test_a_reader_that_stops_reading_is_cut_off_and_its_groups_cancelled(
    start_refenv, start_service, start_scripted_model
):
    """A batch stream whose client never reads: finished groups wait for it counted in the queued
    attempts (so other requests meet the cap, not unbounded memory), and after --stream-stall-timeout
    it is cut off, its queued and running groups cancelled: refenv's counters show every world back
    and every episode ended. The scripted model, answering at once with big completions, so the
    socket's buffers fill in seconds (the real one would take many minutes).
    Breaks tried: HeldResults.hold doing nothing -> attempts_queued falls to 0 while groups wait;
    the stall timeout not enforced (plain StreamingResponse) -> the env still holds worlds."""

    model = start_scripted_model("sql-forever")
    env = start_refenv("--pool", "4")
    service = start_service(
        [env.url], "--stream-stall-timeout", "3", "--max-queued-attempts", "4000", vllm=model.url, model="scripted"
    ).url
    groups = [{"task_id": "t005", "n": 4, "max_turns": 12, "retries": 0, "sampling": SCRIPTED} for _ in range(600)]
    client = send_unread_batch(service, groups)
    try:
        # Finished groups pile up behind the reader, each still counted.
        def detail() -> dict:
            return httpx.get(f"{service}/health/detail", timeout=10).json()

        seen = []
        assert wait_until(
            lambda: seen.append(detail()) or (seen[-1]["attempts_queued"] > 4 * seen[-1]["groups_in_flight"]),
            timeout_s=120,
            every_s=0.2,
        ), seen[-3:]
        # Cut off: every group cancelled, every world back, nothing counted any more.
        assert wait_until(lambda: detail()["attempts_queued"] == 0, timeout_s=120), detail()
        assert wait_until(lambda: env_health(env.url)["leased"] == 0, timeout_s=10)
        health = env_health(env.url)
        assert health["episodes"]["started"] < 2400, "the stream was not cut off: every group ran"
        assert_env_accounted(health)
        log = httpx.get(f"{service}/metrics", timeout=10).text
        assert "rollout_groups_in_flight 0.0" in log
    finally:
        client.close()
    # The service still serves.
    again = httpx.post(f"{service}/groups", json={**groups[0], "max_turns": 1}, timeout=60)
    assert again.status_code == 200


def test_client_methods_sample_and_stream(start_refenv, start_service, start_scripted_model):
    """The trainer client's sample(), open_stream(), pull() and close_stream() over the wire."""
    from rollout_service.trainer.client import RolloutClient, RolloutError

    model = start_scripted_model("answer")
    env = start_refenv("--pool", "2")
    service = start_service([env.url], vllm=model.url, model="scripted").url
    with RolloutClient(service) as client:
        result = client.sample(count=2, group={"n": 2, "sampling": SCRIPTED}, filter="none", max_groups=4)
        assert len(result.groups) == 2 and result.summary.complete and result.dropped == []
        stream = client.open_stream(buffer=2, filter="none", group={"n": 2, "sampling": SCRIPTED})
        pulled = client.pull(stream.id, 3)
        assert len(pulled.groups) == 3 and pulled.lags == [0, 0, 0] and pulled.summary.kept == 3
        client.close_stream(stream.id)
        with pytest.raises(RolloutError) as gone:
            client.pull(stream.id, 1)
        assert gone.value.status == 410
    assert wait_until(lambda: env_health(env.url)["leased"] == 0, timeout_s=10)


def test_a_client_that_goes_away_mid_answer_gets_its_worlds_and_queue_room_back(
    start_refenv, start_service, start_scripted_model
):
    """A trainer that disconnects while a sample or a pull waits for its next group: the groups it ran
    are cancelled (refenv's counters: every world back, every episode ended), their queue room is given
    back (/health/detail), the stream can be pulled again, and a DELETE ends a pull that waits at once.
    Breaks tried: the answer's cleanup unshielded, the pending step left running (Starlette cancels the
    response when it sees the disconnect first) -> the env still holds its worlds and the next pull is
    409 pull_in_progress; close() not waking a waiting pull -> the pull runs on to its timeout_s."""
    import threading

    model = start_scripted_model("sql-forever", "--delay", "0.5")
    env = start_refenv("--pool", "2")
    service = start_service([env.url], vllm=model.url, model="scripted").url
    group = {"n": 1, "max_turns": 50, "sampling": SCRIPTED}

    def settled() -> bool:
        detail = httpx.get(f"{service}/health/detail", timeout=10).json()
        return env_health(env.url)["leased"] == 0 and detail["attempts_queued"] == 0

    with httpx.stream(
        "POST", f"{service}/groups/sample", json={"count": 5, "filter": "none", "group": group}, timeout=60
    ) as answer:
        assert answer.status_code == 200
        assert wait_until(lambda: env_health(env.url)["leased"] == 2, timeout_s=30)
    assert wait_until(settled, timeout_s=10), (env_health(env.url), httpx.get(f"{service}/health/detail").json())
    assert_env_accounted(env_health(env.url))

    stream = httpx.post(f"{service}/samplers", json={"buffer": 2, "filter": "none", "group": group}, timeout=30)
    stream_id = stream.json()["id"]
    with httpx.stream("POST", f"{service}/samplers/{stream_id}/pull", json={"count": 5}, timeout=60) as answer:
        assert answer.status_code == 200
        assert wait_until(lambda: env_health(env.url)["leased"] == 2, timeout_s=30)
    again: list[int] = []
    ended = threading.Event()

    def pull_again() -> None:
        with httpx.stream(
            "POST", f"{service}/samplers/{stream_id}/pull", json={"count": 5, "timeout_s": 300}, timeout=600
        ) as answer:
            again.append(answer.status_code)
            answer.read()
        ended.set()

    threading.Thread(target=pull_again, daemon=True).start()
    assert wait_until(lambda: bool(again), timeout_s=30)
    assert again == [200], again
    # A 200 means the pull is registered (start_pull marks it before the route answers): DELETE now ends it,
    # whether it already waits for a group or has yet to look.
    assert httpx.delete(f"{service}/samplers/{stream_id}", timeout=60).status_code == 200
    assert ended.wait(20), "a pull waiting on a deleted stream did not end"
    assert wait_until(settled, timeout_s=10)
    assert_env_accounted(env_health(env.url))
