"""What a sampler stream counts, and what it does with a group it could not hand out: a stale group's
cost, each group counted once (kept or dropped), a pull's summary scoped to the pull with the stream's
totals beside it, dropped lines past what a stream keeps for its next pull.

Oracles: the run log (--runs-dir: every finished group as it finished, its turns' token ids from the
model server), the test's own count of the lines it read, refenv's own counters, /health/detail's
queued attempts.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
from helpers import wait_until
from test_policy import make_adapter, metric, post_policy
from test_sampler import env_health, pull


def run_log_groups(runs: Path) -> dict[str, dict]:
    """group_id -> the group as the run log wrote it."""
    groups = {}
    for path in runs.glob("*.jsonl"):
        for line in path.read_text().splitlines():
            if line.strip():
                group = json.loads(line)
                groups[group["group_id"]] = group
    return groups


def tokens_generated(group: dict) -> int:
    """Completion tokens the model server sent for the group: its turns' token ids, counted."""
    return sum(len(t["completion_token_ids"] or ()) for a in group["attempts"] for t in a["turns"])


def stream_state(service: str, stream: str) -> dict:
    return httpx.get(f"{service}/samplers/{stream}", timeout=10).json()


def test_a_stale_group_is_counted_once_with_its_cost_and_each_pull_says_its_own(start_refenv, start_service, tmp_path):
    """Real model, a real LoRA update. A stream (buffer 2, max_staleness 0, budget 5 groups) hands out
    one group, buffers two, then an update makes both stale: the next pull drops them and hands out
    two fresh ones; a third pull, after production stopped, gets nothing new.
    - A stale line says what its group cost: its completion tokens equal the run log's count of the
      token ids its turns got from vLLM (> 0).
    - Each group is counted once: rollout_sampler_kept_groups_total is the groups the test read, and
      kept + dropped is the groups run.
    - A pull's summary counts that pull alone (its `dropped`, `kept`, `groups_run`); `stream` holds the
      stream's totals, which agree with every line read across the pulls.
    Breaks tried (old code): the stale line built without completion_tokens -> 0 tokens; kept counted
    when a group is buffered (the stale ones as kept and dropped) -> kept_groups_total 5; the pull's
    summary from the stream's life-long tally -> the third pull says dropped {"stale": 2}."""
    env = start_refenv("--pool", "4")
    runs = tmp_path / "runs"
    service = start_service([env.url], "--runs-dir", str(runs)).url
    body = {
        "buffer": 2,
        "max_staleness": 0,
        "pacing": False,  # drop-and-replace: a stale group's accounting is what is tested
        "max_groups": 5,
        "filter": "none",
        "tasks": {"task_ids": ["t001", "t002", "t003", "t004"]},
        "group": {"n": 2, "max_turns": 2, "retries": 0, "sampling": {"temperature": 1.0, "max_tokens": 24}},
    }
    created = httpx.post(f"{service}/samplers", json=body, timeout=30)
    assert created.status_code == 201, created.text
    stream = created.json()["id"]

    handed, dropped, first = pull(service, stream, 1)
    assert len(handed) == 1 and dropped == []
    assert first["kept"] == 1 and first["groups_run"] == 1 and first["dropped"] == {}, first
    assert first["stream"]["handed_out"] == 1 and first["stream"]["buffer_bound"] == 2, first
    # Two more groups run and wait in the buffer under the base weights; then an update lands.
    assert wait_until(lambda: stream_state(service, stream)["buffered"] == 2, timeout_s=600)
    version = f"{uuid.uuid4().hex[:8]}-v1"  # adapters are per name on the shared vLLM: this run's own
    post_policy(service, version=version, lora={"path": make_adapter(tmp_path / "v1", 0.0)}).raise_for_status()

    handed2, dropped2, second = pull(service, stream, 2)
    assert len(handed2) == 2 and all(line["lag"] == 0 for line in handed2), [line["lag"] for line in handed2]
    assert [d["reason"] for d in dropped2] == ["stale", "stale"], dropped2
    assert wait_until(lambda: stream_state(service, stream)["stopped"] is not None, timeout_s=60)
    _, dropped3, third = pull(service, stream, 1)
    assert dropped3 == [] and third["kept"] == 0 and "budget spent" in third["stopped"], third

    # 1. A stale group's cost, against the run log's own token ids.
    logged = {}
    assert wait_until(lambda: len(logged.update(run_log_groups(runs)) or logged) >= 5, timeout_s=30), logged.keys()
    for line in dropped2:
        assert line["completion_tokens"] == tokens_generated(logged[line["group_id"]]) > 0, line
        assert line["attempts"] == 2
    assert second["completion_tokens_dropped"] == sum(d["completion_tokens"] for d in dropped2)
    assert second["attempts_dropped"] == 4

    # 2. Each group counted once: kept = the groups read, kept + dropped = groups run.
    read = len(handed) + len(handed2)
    assert metric(service, "rollout_sampler_kept_groups_total") == read == 3
    assert metric(service, "rollout_sampler_dropped_groups_total", reason="stale") == 2
    state = stream_state(service, stream)
    assert state["groups_run"] == 5 == read + sum(state["dropped"].values()) + state["buffered"], state

    # 3. Each pull's own counts; the stream's totals beside them.
    assert second["kept"] == 2 and second["dropped"] == {"stale": 2} and second["groups_run"] == 4, second
    assert second["dropped_lines_lost"] == 0
    assert third["dropped"] == {} and third["groups_run"] == 0 and third["completion_tokens_dropped"] == 0, third
    totals = third["stream"]
    assert totals["handed_out"] == 3 and totals["dropped"] == {"stale": 2} and totals["groups_run"] == 5, totals
    assert totals["completion_tokens_dropped"] == second["completion_tokens_dropped"]
    assert totals["lag_histogram"] == {"0": 3} and totals["budget"] == 5
    for summary in (first, second, third):  # the stream's fields are in `stream` alone
        assert "budget" not in summary and "skipped_tasks" not in summary, summary

    assert httpx.delete(f"{service}/samplers/{stream}", timeout=60).status_code == 200
    assert wait_until(lambda: env_health(env.url)["leased"] == 0, timeout_s=10)
    assert httpx.get(f"{service}/health/detail", timeout=10).json()["attempts_queued"] == 0


def test_dropped_lines_past_what_a_stream_keeps_are_counted_not_lost_silently(
    start_refenv, start_service, start_scripted_model
):
    """A stream keeps at most 256 dropped lines for its next pull. The scripted model answers every
    attempt alike, so every group is dropped (no_signal): 270 of them before the first pull. That pull
    writes 256 lines and says the other 14 were lost (`dropped_lines_lost`), its `dropped` counting all
    270: lines + lost = dropped, in the pull and in the stream's totals. The stand-in because every
    group must be dropped, at once.
    Break tried (old code, a deque that evicts silently): 256 lines, nothing says 14 are missing."""
    model = start_scripted_model("answer")
    env = start_refenv("--pool", "8")
    service = start_service([env.url], vllm=model.url, model="scripted").url
    budget = 270
    body = {"buffer": 8, "max_groups": budget, "group": {"n": 2, "retries": 0, "sampling": {"max_tokens": 8}}}
    created = httpx.post(f"{service}/samplers", json=body, timeout=30)
    assert created.status_code == 201, created.text
    stream = created.json()["id"]
    assert wait_until(lambda: stream_state(service, stream)["stopped"] is not None, timeout_s=600)
    assert stream_state(service, stream)["groups_run"] == budget
    handed, dropped, summary = pull(service, stream, 1)
    assert handed == [] and "budget spent" in summary["stopped"], summary
    assert len(dropped) == 256 and all(d["reason"] == "no_signal" for d in dropped)
    assert summary["dropped"] == {"no_signal": budget} and summary["dropped_lines_lost"] == budget - 256, summary
    assert summary["stream"]["dropped_lines_lost"] == budget - 256 and summary["stream"]["dropped"] == {
        "no_signal": budget
    }
    assert env_health(env.url)["episodes"]["started"] == 2 * budget
