"""The reference trainer's mechanics (examples/reference_trainer.py --smoke) on the real stack: CPU
vLLM, refenv's train and eval sides, its scripted oracle teacher, the service. Seconds of training:
this checks that the pieces connect, not that the policy learns (the README's table is the full run).

Oracles: vLLM itself (the adapters the trainer pushed are served, and answer differently from the
base model), the losses the trainer logged on a fixed batch, and its logprob agreement check, which
recomputes the service's logprobs with transformers.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from inference import embedded_model

ROOT = Path(__file__).resolve().parent.parent
MODEL = embedded_model.MODEL_NAME


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


@pytest.mark.timeout(1800)
@pytest.mark.early  # the longest test (326 s at f242315): sent last, the alone tests waited 158 s for it
def test_smoke_run_connects_every_stage(vllm_url, train_out):
    vllm, out = vllm_url, train_out
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "reference_trainer.py"), "--smoke", "--vllm", vllm, "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1700,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    records = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in records]
    # Measured at the base, after each stage and after GRPO; an update after each SFT and GRPO step.
    assert [r["stage"] for r in records if r["kind"] == "eval"] == ["base", "distil", "rs", "grpo 1"]
    assert kinds.count("update") == 3

    distil = next(r for r in records if r["kind"] == "sft" and r["stage"] == "distil")
    assert distil["records"] > 0, "the teacher's passing attempts gave no SFT record"
    losses = distil["losses"]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses) and losses[1] < losses[0], losses

    grpo = next(r for r in records if r["kind"] == "grpo")
    assert grpo["rows"] > 0 and math.isfinite(grpo["loss"])

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
