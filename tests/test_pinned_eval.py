"""Evaluation on a pinned version (GroupRequest.pin_version), on the real CPU vLLM with LoRA
adapters per name (no full-weight swap: the shared vLLM's base weights stay as they are).

Oracles: the test's own log of the updates it made, and vLLM's own list of loaded adapters
(/v1/models) for "the pinned adapter stays loaded while updates land, and goes when unused"."""

from __future__ import annotations

import json
import threading
import uuid

import httpx
from helpers import assert_accounted, wait_until
from test_policy import make_adapter, metric, post_policy, served_models

from rollout_service.launch import embedded_model

MODEL = embedded_model.MODEL_NAME


def test_a_pinned_evaluation_runs_on_its_version_while_updates_land(start_refenv, start_service, vllm_url, tmp_path):
    """Groups pinned to version a run while b and c land. Every policy turn of theirs carries a, the
    adapter of a stays loaded at vLLM while they run (although no longer current), and once they are
    done it is unloaded: a new pin on a is then refused as not served; a pin on a version never
    served is 404. Breaks tried: lease() ignoring the pin -> turns carry c; pins not counted in
    _unused_adapter -> a's adapter is unloaded under the pinned groups (gone from /v1/models)."""
    # One world and slow env steps: between a pinned attempt's turns no turn of "a" is in flight, so
    # only the pin keeps its adapter loaded there.
    # Labels of this run alone: adapters are per name on the shared vLLM, and other tests load theirs.
    a, b, c = (f"{uuid.uuid4().hex[:8]}-{x}" for x in "abc")
    env = start_refenv("--pool", "1", "--latency-ms", "1000")
    service = start_service([env.url]).url
    post_policy(service, version=a, lora={"path": make_adapter(tmp_path / "a", 0.0)}).raise_for_status()
    later = {label: make_adapter(tmp_path / label, 0.0, seed=seed) for seed, label in enumerate((b, c), 1)}
    sampling = {"temperature": 1.0, "max_tokens": 24}
    groups = [
        {"task_id": f"t00{i % 4 + 1}", "n": 1, "max_turns": 3, "retries": 0, "sampling": sampling, "pin_version": a}
        for i in range(6)  # 6 attempts, one at a time: the batch outlasts the two updates
    ]
    lines: list[dict] = []

    def run() -> None:
        with httpx.stream("POST", f"{service}/groups/batch", json={"groups": groups}, timeout=900) as response:
            lines.extend(json.loads(line) for line in response.iter_lines() if line.strip())

    thread = threading.Thread(target=run)
    thread.start()
    assert wait_until(lambda: metric(service, "rollout_turns_total", version=a) >= 2, timeout_s=300)
    post_policy(service, version=b, lora={"path": later[b]}).raise_for_status()
    post_policy(service, version=c, lora={"path": later[c]}).raise_for_status()
    # The premise: pinned groups still run after both updates landed. "b" is unloaded once unused;
    # "a", pinned, stays.
    assert thread.is_alive(), "the pinned batch ended before the updates landed: nothing was tested"
    assert f"{MODEL}@{a}" in served_models(vllm_url)
    thread.join(900)
    assert len(lines) == 6 and all("group" in line for line in lines), lines[:1]
    turns_after_updates = 0
    for line in lines:
        group = line["group"]
        assert_accounted(group)
        for attempt in group["attempts"]:
            # Not failed for want of its adapter (unloaded under it: an internal_error on the next turn).
            assert attempt["failure"] is None or attempt["failure"]["kind"] != "internal_error", attempt["failure"]
            for turn in attempt["turns"]:
                assert turn["policy_version"] == a, turn["policy_version"]
                assert turn["model"] == MODEL
        turns_after_updates += sum(len(a["turns"]) for a in group["attempts"])
    assert metric(service, "rollout_turns_total", version=a) == turns_after_updates
    assert metric(service, "rollout_turns_total", version=b) == 0
    # Unused now: unloaded, and a pin on it is refused plainly.
    assert wait_until(lambda: f"{MODEL}@{a}" not in served_models(vllm_url), timeout_s=30)
    refused = httpx.post(f"{service}/groups", json={**groups[0], "pin_version": a}, timeout=30)
    assert refused.status_code == 409 and refused.json()["error"] == "version_not_served", refused.text
    assert "unloaded" in refused.json()["message"]
    unknown = httpx.post(f"{service}/groups", json={**groups[0], "pin_version": "zz"}, timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"] == "unknown_version", unknown.text
    # The current version can always be pinned.
    current = httpx.post(f"{service}/groups", json={**groups[0], "pin_version": c, "max_turns": 1}, timeout=120)
    assert current.status_code == 200, current.text
    assert {t["policy_version"] for a in current.json()["attempts"] for t in a["turns"]} <= {c}


def test_a_pinned_sample_keeps_its_version_between_its_groups(start_refenv, start_service, vllm_url, tmp_path):
    """POST /groups/sample pinned to version a, one group at a time, while b lands after its first
    group started. Between two groups none of the sample's runs, yet the sample is not over: a must stay
    loaded and pinnable until the sample ends, then go. Oracles: every turn's recorded version, vLLM's own
    list of loaded adapters (/v1/models), the sample's count met.
    Break tried (old code, the pin held only by each running group): once the first group ends a is
    unloaded (no longer current, nothing pinned) and the next group is refused -> the sample stops after
    one group with "the service refused a group (version_not_served)"; the same gap let another pin take
    the room under --max-loras (429 too_many_pins), which stopped the sample for good."""
    a, b = (f"{uuid.uuid4().hex[:8]}-{x}" for x in "ab")
    env = start_refenv("--pool", "1", "--latency-ms", "500")
    service = start_service([env.url]).url
    post_policy(service, version=a, lora={"path": make_adapter(tmp_path / "a", 0.0)}).raise_for_status()
    later = make_adapter(tmp_path / "b", 0.0, seed=1)
    body = {
        "count": 6,  # outlasts b's update: some of its groups start after b landed
        "filter": "none",
        "groups_at_once": 1,
        "tasks": {"task_ids": ["t001", "t002", "t003", "t004"]},
        "group": {
            "n": 1,
            "max_turns": 2,
            "retries": 0,
            "sampling": {"temperature": 1.0, "max_tokens": 24},
            "pin_version": a,
        },
    }
    lines: list[dict] = []

    def run() -> None:
        with httpx.stream("POST", f"{service}/groups/sample", json=body, timeout=900) as response:
            assert response.status_code == 200, response.read()
            lines.extend(json.loads(line) for line in response.iter_lines() if line.strip())

    thread = threading.Thread(target=run)
    thread.start()
    assert wait_until(lambda: metric(service, "rollout_turns_total", version=a) >= 1, timeout_s=300)
    post_policy(service, version=b, lora={"path": later}).raise_for_status()
    assert thread.is_alive(), "the sample ended before b landed: nothing was tested"
    thread.join(900)
    summary = lines[-1]["summary"]
    assert summary["complete"] and summary["kept"] == 6 and summary["stopped"] == "count reached", summary
    groups = [line["group"] for line in lines if "group" in line]
    assert len(groups) == 6
    for group in groups:
        assert_accounted(group)
        for attempt in group["attempts"]:
            assert attempt["failure"] is None or attempt["failure"]["kind"] != "internal_error", attempt["failure"]
            assert {t["policy_version"] for t in attempt["turns"]} <= {a}
    # The sample is over: nothing holds a any more, so it goes.
    assert wait_until(lambda: f"{MODEL}@{a}" not in served_models(vllm_url), timeout_s=30)
