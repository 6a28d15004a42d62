"""The reference trainer's mechanics (examples/reference_trainer.py --smoke) on the real stack: CPU
vLLM, refenv's train and eval sides, its scripted oracle teacher, the service. Seconds of training:
this checks that the pieces connect, not that the policy learns (the README's table is the full run).

Oracles: vLLM itself (the adapters the trainer pushed are served, and answer differently from the
base model), the losses the trainer logged on a fixed batch, its logprob agreement check, which
recomputes the service's logprobs with transformers, and for the GRPO stage's lags and signal the
service's own records: its run log (each turn's policy version, each attempt's status and reward) and
its policy update log (GET /policy), not the trainer's counts.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from rollout_service.launch import embedded_model
from rollout_service.protocol import GRADED_STATUSES

ROOT = Path(__file__).resolve().parent.parent
MODEL = embedded_model.MODEL_NAME
GRADED = set(GRADED_STATUSES)


def served(vllm: str) -> list[str]:
    return [m["id"] for m in httpx.get(f"{vllm}/v1/models", timeout=10).json()["data"]]


def greedy(vllm: str, model: str, prompt: list[dict]) -> str:
    body = {"model": model, "messages": prompt, "max_tokens": 32, "temperature": 0}
    answer = httpx.post(f"{vllm}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["message"]["content"]


@pytest.fixture
def train_out(vllm_url, tmp_path):
    """The run's output folder; afterwards the adapters it pushed (its "update" records) are unloaded,
    and only those: another test may be serving adapters of its own on the shared server."""
    out = tmp_path / "train"
    yield out
    steps = out / "steps.jsonl"
    records = [json.loads(line) for line in steps.read_text().splitlines()] if steps.exists() else []
    for version in {r["version"] for r in records if r.get("kind") == "update"}:
        httpx.post(f"{vllm_url}/v1/unload_lora_adapter", json={"lora_name": f"{MODEL}@{version}"}, timeout=60)


@pytest.mark.timeout(3600)
@pytest.mark.early  # the longest test (326 s at f242315): sent last, the alone tests waited 158 s for it
def test_smoke_run_connects_every_stage(vllm_url, train_out):
    vllm, out = vllm_url, train_out
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "reference_trainer.py"), "--smoke", "--vllm", vllm, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3300,  # 33 min on a 2-core machine at load 9: the GRPO stage has four steps and a stream
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    # Measured at the base, after each stage and after GRPO; an update after each SFT and GRPO step.
    assert [r["stage"] for r in records if r["kind"] == "eval"] == ["base", "distil", "rs", "grpo 4"]
    assert kinds.count("update") == 6

    distil = next(r for r in records if r["kind"] == "sft" and r["stage"] == "distil")
    assert distil["records"] > 0, "the teacher's passing attempts gave no SFT record"
    losses = distil["losses"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses) and losses[1] < losses[0], losses

    steps = [r for r in records if r["kind"] == "grpo"]
    assert [s["mode"] for s in steps] == ["sync", "overlap", "overlap", "overlap"]
    assert all(s["rows"] > 0 and math.isfinite(s["loss"]) for s in steps)
    check_grpo_lags_and_signal(out, steps)

    # The adapter reached vLLM: the last version is served and answers otherwise than the base.
    last = [r for r in records if r["kind"] == "update"][-1]["version"]
    assert f"{MODEL}@{last}" in served(vllm)
    prompt = json.loads((out / "sft-distil.jsonl").read_text().splitlines()[0])["messages"][:-1]
    assert greedy(vllm, f"{MODEL}@{last}", prompt) != greedy(vllm, MODEL, prompt)

    # The service's logprobs, recomputed with transformers on the same weights before the GRPO step:
    # without a grammar constraint they agree to bf16 noise, with no offset.
    agreement = next(r for r in records if r["kind"] == "agreement")["unconstrained"]
    assert agreement["tokens"] > 0
    assert agreement["mean_abs"] < 0.1 and abs(agreement["mean_signed"]) < 0.05, agreement

    summary = json.loads((out / "summary.json").read_text())
    assert summary["training_tokens_per_s"] > 0 and summary["generation_tokens_per_s"] > 0
    assert (out / "progress.png").stat().st_size > 1000
    check_record_renders(out / "record.json")


def service_update_order(out: Path) -> list[str]:
    """The service's policy versions, oldest first, from its own update log (each update names the
    version it replaced)."""
    updates = json.loads((out / "summary.json").read_text())["policy"]["recent_updates"]
    order = [updates[0]["previous"]]
    for update in updates:
        assert update["previous"] == order[-1], updates  # one unbroken chain
        order.append(update["version"])
    return order


def check_grpo_lags_and_signal(out: Path, steps: list[dict]) -> None:
    """Every trained group's lag, counted from the service's run log (each turn's recorded version) and
    its update log (the version current when the step trained: the one its update replaced), is within
    the step's bound (0 for sync steps, max_staleness for pulled ones); every group the sampler handed
    out carries signal by the run log's graded rewards. The bound must have had work to do: some group the
    stream ran (handed out, dropped for lacking signal or dropped stale) ran across an update, by its
    turns' versions in the run log, or was handed out behind the policy, or was dropped stale. The smoke's
    stream keeps two groups running while each step trains (max_staleness 2, one group a step), so each
    update lands on running work."""
    order = service_update_order(out)
    previous = {
        u["version"]: u["previous"] for u in json.loads((out / "summary.json").read_text())["policy"]["recent_updates"]
    }
    pushed = {
        r["step"]: r["version"]
        for r in (json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines())
        if r["kind"] == "update"
    }
    logged = {}
    for line in (out / "runs" / "train.jsonl").read_text().splitlines():
        group = json.loads(line)
        logged[group["group_id"]] = group
    stream_versions = {v for s in steps if s["mode"] == "overlap" for v in (s["trained_on"], pushed[s["step"]])}
    exercised = sum(  # groups whose turns ran under two versions the stream lived through
        len({t["policy_version"] for a in g["attempts"] for t in a["turns"]} & stream_versions) > 1
        for g in logged.values()
    )
    for step in steps:
        current = previous[pushed[step["step"]]]  # the version served while the step trained
        bound = 0 if step["mode"] == "sync" else step["max_staleness"]
        if step["mode"] == "overlap":
            assert bound == 2  # the smoke's max_staleness
            exercised += step["generation"]["dropped"].get("stale", 0)
        for trained in step["trained"]:
            group = logged[trained["group_id"]]
            versions = {t["policy_version"] for a in group["attempts"] for t in a["turns"] if t.get("policy_version")}
            assert versions, group["group_id"]
            lag = order.index(current) - min(order.index(v) for v in versions)
            assert 0 <= lag <= bound, (step["grpo_step"], trained, versions, current)
            exercised += lag
            if step["mode"] == "overlap":
                graded = [a["reward"] for a in group["attempts"] if a["status"] in GRADED and a["reward"] is not None]
                assert len(graded) >= 2 and len(set(graded)) > 1, (group["group_id"], group["rewards"])
    assert exercised > 0, "no group ran across an update, none was handed out behind, none was dropped stale"


def check_record_renders(path: Path) -> None:
    """The run's bench record passes bench/record.py's check and bench/render.py renders its GRPO table."""
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import record
        import render
    finally:
        sys.path.remove(str(ROOT / "bench"))
    made = record.check(json.loads(path.read_text()))
    made["_file"] = path.name
    page = render.render_record(made)
    assert "share of generated groups with signal" in page and "lag of every trained group" in page, page
