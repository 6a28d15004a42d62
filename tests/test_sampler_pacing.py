"""Pacing a sampler stream to max_staleness (instead of dropping and replacing stale groups), handing
out the oldest first, and the bias audit every pull's summary carries.

The scripted stand-in model (tests/scripted_model.py) because each check needs the model's timing to
be certain: answers at once (the pacing bound is then the only thing that holds groups back), or after
a fixed delay (groups are surely running when the stream is deleted). LoRA updates land on it as
vLLM's would (it loads any adapter folder). Oracles: refenv's own counters (episodes started, live,
abandoned), the run log (--runs-dir: every finished group as it finished), the test's own record of
its updates and pulls, and its own nearest-rank percentiles.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import httpx
from fake_vllm import adapter
from helpers import wait_until
from test_policy import post_policy
from test_sampler import env_health, pull

from rollout_service.server.sampler.pacing import take_oldest
from rollout_service.server.sampler.sampler import Finished

TASKS = {"task_ids": ["t001", "t002", "t003", "t004", "t005", "t006"]}


def open_stream(service: str, body: dict) -> dict:
    created = httpx.post(f"{service}/samplers", json=body, timeout=30)
    assert created.status_code == 201, created.text
    return created.json()


def stream_state(service: str, stream: str) -> dict:
    return httpx.get(f"{service}/samplers/{stream}", timeout=10).json()


def test_a_paced_stream_starts_only_what_max_staleness_allows_and_drops_nothing_stale(
    start_refenv, start_service, start_scripted_model, tmp_path
):
    """A stream with max_staleness 1 and a trainer taking 2 groups a step may hold 2 groups running or
    buffered between pulls, however big its buffer (16 here). Four steps: pull 2, land an update. Every
    group handed out is at most 1 update old and none is dropped as stale, and between pulls refenv has
    started exactly the episodes of the groups handed out plus the 2 waiting, nothing more.
    Break tried: pacing off (`_room` bounded by `buffer` alone, the old code) -> 16 groups start at
    once and the buffer fills to 16: the stream never settles at 2."""
    model = start_scripted_model("answer")
    env = start_refenv("--pool", "8")
    service = start_service([env.url], vllm=model.url, model="scripted").url
    body = {
        "buffer": 16,
        "max_staleness": 1,
        "step_groups": 2,
        "filter": "none",
        "tasks": TASKS,
        "group": {"n": 2, "retries": 0, "sampling": {"max_tokens": 8}},
    }
    created = open_stream(service, body)
    stream = created["id"]
    assert created["paced_ahead"] == 2, created

    def settled(handed: int) -> None:
        # The stream fills up to its paced bound (2 groups) and starts nothing past it.
        assert wait_until(lambda: stream_state(service, stream)["buffered"] == 2, timeout_s=60), stream_state(
            service, stream
        )
        state = stream_state(service, stream)
        assert state["running"] == 0 and state["groups_run"] == handed + 2, state
        assert env_health(env.url)["episodes"]["started"] == 2 * (handed + 2)

    settled(0)
    handed = 0
    for step in range(1, 5):
        lines, dropped, summary = pull(service, stream, 2)
        assert len(lines) == 2 and dropped == [], (step, dropped)
        assert all(line["lag"] <= 1 for line in lines), [line["lag"] for line in lines]
        handed += 2
        post_policy(service, version=f"v{step}", lora={"path": adapter(tmp_path, f"v{step}")}).raise_for_status()
        settled(handed)
    state = stream_state(service, stream)
    assert state["dropped"] == {} and state["handed_out"] == 8, state
    assert state["lag_histogram"] == {"0": 2, "1": 6}, state["lag_histogram"]
    assert httpx.delete(f"{service}/samplers/{stream}", timeout=60).status_code == 200


def test_the_oldest_buffered_group_goes_first():
    """Of the buffered groups, the one furthest behind goes first, the earliest started among equals,
    whatever order they finished in (a long episode finishes after younger ones).
    Breaks tried: the buffer taken in the order groups finished (popleft) -> seq 5 first; ties to the
    latest started -> seq 3 before seq 1."""
    from collections import deque

    finished = [(5, "v2"), (3, "v1"), (1, "v1"), (4, "v2")]  # (start order, oldest turn's version), as they finished
    behind = {"v1": 1, "v2": 0}
    buffer = deque(Finished(f"t{seq}", 2, seq=seq, oldest_version=version) for seq, version in finished)
    order = []
    while buffer:
        order.append(take_oldest(buffer, lambda item: behind[item.oldest_version or "v2"]).seq)
    assert order == [1, 3, 4, 5]


def nearest_rank(values: list[float], q: float) -> float:
    ranked = sorted(values)
    return ranked[math.ceil(q * len(ranked)) - 1]


def expected_part(groups: list[dict]) -> dict:
    """The audit's figures for `groups`, from the run log's own groups."""
    figures: dict[str, list[float]] = {"completion_tokens": [], "turns": [], "pass_rate": [], "wall_s": []}
    for group in groups:
        attempts = len(group["attempts"])
        figures["completion_tokens"].append(group["completion_tokens"] / attempts)
        figures["turns"].append(sum(len(a["turns"]) for a in group["attempts"]) / attempts)
        if group["pass_rate"] is not None:
            figures["pass_rate"].append(group["pass_rate"])
        figures["wall_s"].append(group["wall_s"])
    return {
        name: {"mean": sum(v) / len(v), "p50": nearest_rank(v, 0.5), "p90": nearest_rank(v, 0.9)}
        for name, v in figures.items()
        if v
    }


def assert_part(part: dict, groups: list[dict]) -> None:
    assert part["groups"] == len(groups), part
    for name, want in expected_part(groups).items():
        for figure, value in want.items():
            assert math.isclose(part[name][figure], value, rel_tol=1e-4, abs_tol=1e-4), (name, figure, part, want)


def test_every_pull_audits_kept_dropped_and_cancelled_groups(
    start_refenv, start_service, start_scripted_model, tmp_path
):
    """Drop-and-replace (pacing off, max_staleness 0), a model that answers after 2 s. Four groups fill
    the buffer, an update makes them stale; a pull of 2 drops the 4 and hands out 2 fresh ones. Its
    summary's audit: kept = the 2 handed out and dropped = the 4 stale ones, their tokens, turns, pass
    rates and wall times as the run log has those very groups (mean, p50, p90 computed here). Then the
    refilled buffer is pulled, 4 groups run (refenv: 8 live episodes) and the stream is deleted: the
    audit counts 4 cancelled.
    Breaks tried: the stale drop not added to the audit -> dropped.groups 0; the cancelled groups not
    added on close -> cancelled.groups 0; the nearest rank off by one (ceil(q*n) without -1) -> the kept
    groups' wall_s p50 differs."""
    model = start_scripted_model("answer", "--delay", "2")
    env = start_refenv("--pool", "8")
    runs = tmp_path / "runs"
    service = start_service([env.url], "--runs-dir", str(runs), vllm=model.url, model="scripted").url
    body = {
        "buffer": 4,
        "max_staleness": 0,
        "pacing": False,
        "filter": "none",
        "tasks": TASKS,
        "group": {"n": 2, "retries": 0, "sampling": {"max_tokens": 8}},
    }
    stream = open_stream(service, body)["id"]
    assert wait_until(lambda: stream_state(service, stream)["buffered"] == 4, timeout_s=60)
    post_policy(service, version="v1", lora={"path": adapter(tmp_path, "v1")}).raise_for_status()
    lines, dropped, summary = pull(service, stream, 2, timeout=120)
    assert len(lines) == 2 and [d["reason"] for d in dropped] == ["stale"] * 4, dropped

    logged: dict[str, dict] = {}

    def read_log() -> bool:
        for path in Path(runs).glob("*.jsonl"):
            for line in path.read_text().splitlines():
                if line.strip():
                    group = json.loads(line)
                    logged[group["group_id"]] = group
        return all(d["group_id"] in logged for d in dropped)

    assert wait_until(read_log, timeout_s=30)
    audit = summary["stream"]["audit"]
    assert_part(audit["kept"], [line["group"] for line in lines])
    assert_part(audit["dropped"], [logged[d["group_id"]] for d in dropped])
    assert audit["cancelled"] == {"groups": 0}, audit["cancelled"]

    # The buffer refilled; a pull takes it all, 4 groups start (8 episodes live at refenv, each turn 2 s),
    # and the stream is deleted while they run.
    assert wait_until(lambda: stream_state(service, stream)["buffered"] == 4, timeout_s=60)
    assert len(pull(service, stream, 4)[0]) == 4
    assert wait_until(lambda: env_health(env.url)["live_episodes"] == 8, timeout_s=30)
    state = httpx.delete(f"{service}/samplers/{stream}", timeout=60).json()
    cancelled = state["audit"]["cancelled"]
    assert cancelled["groups"] == 4 and cancelled["completion_tokens"] is None, cancelled
    assert 0 < cancelled["wall_s"]["p90"] < 60, cancelled
    assert wait_until(lambda: env_health(env.url)["leased"] == 0, timeout_s=30)
    assert env_health(env.url)["episodes"]["abandoned"] == 8


def test_a_pull_waits_for_an_older_group_that_would_go_stale_rather_than_hand_out_a_younger_one(
    start_refenv, start_service, start_scripted_model, tmp_path
):
    """max_staleness 1, one group a step. The model's first answer takes 8 s: the first group started
    (under base) is still running when the first pull hands out the second, fast one, and when the
    update lands and the next pull begins. That pull starts a third group (under v1), which finishes at
    once, but the old group would be 2 updates behind at the pull after this one: the pull waits for
    it and hands it out (lag 1), oldest first. After one more update and pull, nothing was dropped.
    Break tried: `_kept_for_older` returning False (the younger buffered group takes the place) ->
    the second pull hands out the v1 group, and the old one is dropped as stale at the third pull."""
    model = start_scripted_model("answer", "--first-delay", "8")
    env = start_refenv("--pool", "4")
    service = start_service([env.url], vllm=model.url, model="scripted").url
    body = {
        "buffer": 8,
        "max_staleness": 1,
        "step_groups": 1,
        "filter": "none",
        "tasks": TASKS,
        "group": {"n": 1, "retries": 0, "sampling": {"max_tokens": 8}},
    }
    stream = open_stream(service, body)["id"]
    first, _, _ = pull(service, stream, 1, timeout=60)
    assert [line["lag"] for line in first] == [0]
    assert stream_state(service, stream)["running"] == 1  # the slow one, under base
    post_policy(service, version="v1", lora={"path": adapter(tmp_path, "v1")}).raise_for_status()
    second, dropped, _ = pull(service, stream, 1, timeout=60)
    assert dropped == [] and [line["lag"] for line in second] == [1], second
    assert second[0]["group"]["oldest_policy_version"] == "base"
    post_policy(service, version="v2", lora={"path": adapter(tmp_path, "v2")}).raise_for_status()
    third, dropped, summary = pull(service, stream, 1, timeout=60)
    assert dropped == [] and summary["stream"]["dropped"] == {}, summary
    assert [line["group"]["oldest_policy_version"] for line in third] == ["v1"]
