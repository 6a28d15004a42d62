"""Exact trajectories with chat templates that render history otherwise than the model saw it, on a real
CPU vLLM (the embedded model, served with the template) and the real refenv.

Two templates of this project's own (tests/templates/): `reasoning.jinja` behaves as Qwen3's and
DeepSeek-R1's do (the generation prompt opens a reasoning block, the last reply is rendered inside one,
an earlier reply loses its reasoning), so a fresh render of a later turn's messages is not what the model
saw; `plain_turns.jinja` ends an assistant turn with no special token, so a turn the model ended on its
EOS holds a token the template never renders.

Oracles outside the code under test: the text each prompt must decode to, written here from the
template's rules (the conversation as the model saw it: each reply as sampled, after the generation
prompt that opened it); transformers' own render of the template (the scenario is real: it differs);
and the model in transformers (float32), which recomputes each sampled token's logprob from the
segment's ids, bounded as test_trajectory.py bounds the default template's.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from helpers import assert_accounted, assert_logprobs_are_the_policys

from rollout_service.launch import embedded_model
from rollout_service.launch.stack import start_embedded_vllm
from rollout_service.protocol import Attempt
from rollout_service.trainer import token_batch, trl_rollout

TEMPLATES = Path(__file__).with_name("templates")
SAMPLING = {"temperature": 1.0, "max_tokens": 40, "seed": 5}


def _as_seen(template: str, messages: list[dict], opened: str) -> str:
    """The text the model saw for `messages`: each earlier reply as sampled (`opened`, the generation
    prompt's text, before it), then the generation prompt."""
    if template == "reasoning":
        parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
        for i, m in enumerate(messages):
            if m["role"] == "assistant":
                parts[i] = f"<|im_start|>assistant\n{opened}{m['content']}<|im_end|>\n"
        return "".join(parts) + "<|im_start|>assistant\n" + opened
    return "".join(f"{m['role'].capitalize()}:\n{m['content']}\n\n" for m in messages) + "Assistant:\n"


_RUNS: dict[str, tuple] = {}


@pytest.fixture(params=["reasoning", "plain_turns"])
def templated_run(request, start_refenv, start_service, logs_dir):
    """(template name, constrained groups, unconstrained groups, the tokenizer, the template's text, what
    /health/detail says of its token prompts): a
    vLLM of its own serving the embedded model with the template, refenv and the service. Run once per
    template, by the first test that asks (the processes are per test, the results are not)."""
    name = request.param
    if name not in _RUNS:
        _RUNS[name] = _templated_run(name, start_refenv, start_service, logs_dir)
    return _RUNS[name]


def _templated_run(name: str, start_refenv, start_service, logs_dir: Path) -> tuple:
    from transformers import AutoTokenizer

    vllm = start_embedded_vllm(
        None, logs_dir / f"vllm-{name}.log", name=f"vllm-{name}", kv_cache_gib=1, eager=True,
        extra=["--chat-template", str(TEMPLATES / f"{name}.jinja")],
    )  # fmt: skip
    try:
        env = start_refenv("--pool", "6")
        service = start_service([env.url], vllm=vllm.url, model=embedded_model.MODEL_NAME).url
        tasks = [t["task_id"] for t in httpx.get(f"{env.url}/tasks", timeout=10).json()["tasks"]]
        groups = [{"task_id": t, "n": 3, "sampling": SAMPLING, "max_turns": 4, "tokens": "exact"} for t in tasks[:2]]
        free = [{"task_id": tasks[2], "n": 3, "sampling": SAMPLING, "max_turns": 3, "constrained": False,
                 "tokens": "exact"}]  # fmt: skip
        constrained, unconstrained = _run(service, groups), _run(service, free)
        [model] = httpx.get(f"{service}/health/detail", timeout=10).json()["models"]
    finally:
        vllm.stop()
    template = (TEMPLATES / f"{name}.jinja").read_text()
    tokenizer = AutoTokenizer.from_pretrained(str(embedded_model.cache_dir()))
    return name, constrained, unconstrained, tokenizer, template, model["token_prompts"]


def _run(service: str, groups: list[dict]) -> list[dict]:
    answer = httpx.post(f"{service}/groups/batch", json={"groups": groups}, timeout=1200)
    assert answer.status_code == 200, answer.text
    items = sorted((json.loads(line) for line in answer.text.splitlines() if line.strip()), key=lambda i: i["index"])
    assert all("group" in i for i in items), items
    for item in items:
        assert_accounted(item["group"])
    return [i["group"] for i in items]


def _attempts(groups: list[dict]) -> list[dict]:
    return [a for g in groups for a in g["attempts"] if a["turns"]]


def test_every_prompt_is_what_the_model_saw_with_its_samples_kept(templated_run):
    """Every attempt has a trajectory (no fall-back to chat); each turn's prompt, read from its segment,
    decodes to the conversation as the model saw it: each earlier reply as sampled, reasoning block
    opening included, and the template's render of the env's messages; with the reasoning template that
    is not what a fresh render gives, and the segment says `appended`.
    Breaks tried: the probe's append mode off (`appends` never set) -> 422/"cannot take token prompts",
    the run fails; the end of turn appended even where sampled -> `<|im_end|><|im_end|>`, fails."""
    name, constrained, unconstrained, tokenizer, template, token_prompts = templated_run
    assert token_prompts.startswith("yes"), token_prompts
    if name == "reasoning":  # /health/detail says how its segments go on
        assert "appended" in token_prompts, token_prompts
    opened = "<think>\n" if name == "reasoning" else ""
    pairs = differs = 0
    for attempt in _attempts(constrained + unconstrained):
        assert attempt["tokens"] == "exact" and attempt["trajectory"], attempt.get("failure")
        model = Attempt.model_validate(attempt)
        for turn in attempt["turns"]:
            segment = attempt["trajectory"][turn["segment"]]
            (span,) = [s for s in segment["turns"] if s["turn"] == turn["index"]]
            prompt = model.turn_prompt_ids(turn["index"])
            assert segment["token_ids"][span["start"] : span["end"]] == turn["completion_token_ids"]
            text = tokenizer.decode(prompt)
            # A turn the model ended on its EOS keeps it; the plain template renders none.
            seen = text.replace("<|im_end|>", "") if name == "plain_turns" else text
            assert seen == _as_seen(name, turn["messages"], opened), (attempt["index"], turn["index"], text)
            fresh = tokenizer.apply_chat_template(
                turn["messages"], chat_template=template, tokenize=False, add_generation_prompt=True
            )
            differs += text != fresh
        for before, after in zip(attempt["turns"], attempt["turns"][1:], strict=False):
            pairs += before["segment"] == after["segment"]
        if name == "reasoning":
            assert all(s["prompts"] == "appended" for s in attempt["trajectory"] if len(s["turns"]) > 1)
    assert pairs >= 5, f"only {pairs} turns went on in their segment: the run checked too little"
    if name == "reasoning":
        assert differs >= pairs, (differs, pairs)  # a fresh render is not what the model saw


def test_logprobs_agree_with_transformers_as_closely_as_the_default_templates(templated_run):
    """Unconstrained turns' logprobs, recomputed in float32 from the segment's ids: the default template's
    bounds (helpers.assert_logprobs_are_the_policys, as test_trajectory.py uses them)."""
    assert_logprobs_are_the_policys(_attempts(templated_run[2]))


def test_token_batch_and_the_trl_path_take_the_groups(templated_run):
    """Before, a reasoning template fell back to chat turns with no trajectory and both raised NoTrajectory."""
    _, constrained, unconstrained, tokenizer, *_ = templated_run
    attempts = [Attempt.model_validate(a) for a in _attempts(constrained + unconstrained)]
    batch = token_batch(attempts, pad_token_id=tokenizer.pad_token_id)
    rows = [s for a in attempts if a.advantage is not None for s in a.trajectory if any(s.loss_mask)]
    assert batch["input_ids"].shape[0] == len(rows) > 0
    out = trl_rollout([a for a in attempts if a.advantage is not None], eos_token_id=tokenizer.eos_token_id)
    for a, prompt, completion in zip(attempts, out["prompt_ids"], out["completion_ids"], strict=False):
        assert prompt + completion == a.trajectory[0].token_ids
