"""Policy versions on the real CPU vLLM: LoRA adapters and checkpoints made in the test.

The oracle for "this greedy turn came from version V" is the model server itself: the same chat
request (the turn's messages and response format, temperature 0) sent straight to vLLM under V's
weights gives the turn's tokens, and under other weights it does not. Log-probabilities cannot
serve here: vLLM reports them after the JSON grammar's mask, and `prompt_logprobs` before it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import threading
from pathlib import Path

import httpx
import pytest
from helpers import assert_accounted, prompt_ids, wait_until

from rollout_service.backends.answers import structured_output
from rollout_service.launch import embedded_model

MODEL = embedded_model.MODEL_NAME
GREEDY = {"temperature": 0.0, "max_tokens": 24, "seed": 1}
SAMPLED = {"temperature": 1.0, "max_tokens": 40}


def make_adapter(folder: Path, scale: float, seed: int = 0, rank: int = 8) -> str:
    """A PEFT-layout LoRA adapter for SmolLM2-135M (30 layers, hidden 576, kv 192) on q_proj and
    v_proj. scale 0 gives B = 0: the adapter adds nothing and answers as the base model."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(30):
        for proj, out in (("q_proj", 576), ("v_proj", 192)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, 576, generator=generator) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * scale
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": ["q_proj", "v_proj"],
        "base_model_name_or_path": MODEL,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)


def served_models(vllm: str) -> list[str]:
    return [m["id"] for m in httpx.get(f"{vllm}/v1/models", timeout=10).json()["data"]]


def regenerate(vllm: str, model: str, attempt: dict, turn: dict) -> list[int]:
    """The completion `model` gives greedily for the turn's prompt tokens, sent straight to vLLM."""
    body = {
        "model": model,
        "prompt": prompt_ids(attempt, turn["index"]),
        "temperature": 0,
        "max_tokens": GREEDY["max_tokens"],
        "seed": turn["seed"],
        "return_token_ids": True,
    }
    if turn["constrained"]:
        body["structured_outputs"] = structured_output(turn["response_format"])
    answer = httpx.post(f"{vllm}/v1/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["token_ids"]


def assert_fresh_kv(vllm: str, attempt: dict) -> None:
    """The attempt's first turn's logprobs are those of its prompt computed afresh on the weights served now."""
    turn = attempt["turns"][0]
    body = {
        "model": MODEL,
        "prompt": prompt_ids(attempt),
        "max_tokens": len(turn["completion_token_ids"]),
        "temperature": 0,
        "logprobs": 0,
        "return_token_ids": True,
        "cache_salt": f"fresh-{turn['policy_version']}",
    }
    if turn["constrained"]:
        body["structured_outputs"] = structured_output(turn["response_format"])
    fresh = httpx.post(f"{vllm}/v1/completions", json=body, timeout=120).json()["choices"][0]
    assert fresh["token_ids"] == turn["completion_token_ids"]
    gap = max(abs(a - b) for a, b in zip(fresh["logprobs"]["token_logprobs"], turn["logprobs"], strict=True))
    assert gap < 0.02, f"the turn's logprobs are {gap:.3f} off a fresh computation: stale KV from other weights"


def shared_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def assert_made_by(vllm: str, attempt: dict, turn: dict, own: str, other: str) -> None:
    """The turn's tokens follow `own`'s greedy answer further than `other`'s. (Both share the tokens
    the JSON grammar forces; a near-tie in a batched bf16 step may end a replay early, even at its
    first token, so `own` gets three replays, each batched beside whatever else runs then.)"""
    ids = turn["completion_token_ids"]
    theirs = shared_prefix(regenerate(vllm, other, attempt, turn), ids)
    tries = []
    for _ in range(3):
        tries.append(shared_prefix(regenerate(vllm, own, attempt, turn), ids))
        if tries[-1] > theirs:
            return
    raise AssertionError((turn["policy_version"], tries, theirs, len(ids)))


def logprob_of(vllm: str, model: str, prompt: list[int], token: int) -> float:
    """`model`'s logprob of `token` after `prompt`, before any grammar or processing (vLLM reports the
    raw logprob of the token it was made to sample)."""
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 0}
    answer = httpx.post(f"{vllm}/v1/completions", json={**body, "allowed_token_ids": [token]}, timeout=120)
    assert answer.status_code == 200, answer.text
    return answer.json()["choices"][0]["logprobs"]["token_logprobs"][0]


def assert_same_greedy_answer(vllm: str, one: dict, other: dict) -> None:
    """Two greedy first turns at the same prompt agree token for token, or up to a near-tie: where
    they part, the base model's logprobs of the two tokens are within 0.5 nats. (bf16 kernels round
    differently as batch shapes change, so a near-tie may fall either way; under the JSON grammar the
    two may be far from the unconstrained favourites, so their own logprobs are compared.)"""
    prompt = prompt_ids(one["attempts"][0])
    assert prompt == prompt_ids(other["attempts"][0])
    a, b = first_turn_ids(one), first_turn_ids(other)
    if a == b:
        return
    k = shared_prefix(a, b)
    assert k < min(len(a), len(b)), (k, a, b)  # one answer is not the other's prefix
    lp_a, lp_b = (logprob_of(vllm, MODEL, prompt + a[:k], token) for token in (a[k], b[k]))
    assert abs(lp_a - lp_b) < 0.5, (k, a[k], lp_a, b[k], lp_b)


def post_policy(service: str, **body) -> httpx.Response:
    return httpx.post(f"{service}/policy", json=body, timeout=600)


def policy(service: str) -> dict:
    return httpx.get(f"{service}/policy", timeout=10).json()


def group(service: str, **fields) -> dict:
    """One attempt at t001. Two turns at most: the checks read the first turns, and on CPU each turn
    through an adapter costs seconds (episodes otherwise run to the env's turn budget)."""
    body = {"task_id": "t001", "n": 1, "max_turns": 2, **fields}
    answer = httpx.post(f"{service}/groups", json=body, timeout=600)
    assert answer.status_code == 200, answer.text
    assert_accounted(answer.json())
    return answer.json()


def first_turn_ids(g: dict) -> list[int]:
    return g["attempts"][0]["turns"][0]["completion_token_ids"]


def metric(service: str, name: str, **labels: str) -> float:
    """One sample's value from /metrics (0 when absent)."""
    wanted = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in httpx.get(f"{service}/metrics", timeout=10).text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.split()[-1])
    return 0.0


def test_adapter_versions_answer_as_their_weights(start_refenv, start_service, vllm_url, tmp_path):
    env = start_refenv("--pool", "2")
    service = start_service([env.url]).url
    assert policy(service)["version"] == "base"
    paths = httpx.get(f"{service}/openapi.json").json()["paths"]  # what /docs renders
    assert {"post", "get"} <= set(paths["/policy"]) and "post" in paths["/policy/pause"]
    base = group(service, sampling=GREEDY)
    assert {t["policy_version"] for t in base["attempts"][0]["turns"]} == {"base"}

    # B = 0: the adapter adds nothing, so greedy decoding gives the base model's tokens (up to a near-tie).
    update = post_policy(service, version="zero", lora={"path": make_adapter(tmp_path / "zero", 0.0)})
    assert update.status_code == 200, update.text
    assert [r["ok"] for r in update.json()["replicas"]] == [True] and update.json()["previous"] == "base"
    zero_name = policy(service)["served_model"]
    assert zero_name in served_models(vllm_url)  # the model server's own list
    zero = group(service, sampling=GREEDY)
    assert_same_greedy_answer(vllm_url, zero, base)
    assert {t["policy_version"] for t in zero["attempts"][0]["turns"]} == {"zero"}
    assert zero["oldest_policy_version"] == zero["newest_policy_version"] == "zero"

    # A strong random adapter answers otherwise; the zero adapter, no longer referenced, is unloaded.
    update = post_policy(service, version="strong", lora={"path": make_adapter(tmp_path / "strong", 5.0)})
    assert update.status_code == 200, update.text
    strong = group(service, sampling=GREEDY)
    assert first_turn_ids(strong) != first_turn_ids(base)
    assert {t["policy_version"] for t in strong["attempts"][0]["turns"]} == {"strong"}
    assert wait_until(lambda: zero_name not in served_models(vllm_url), timeout_s=20), served_models(vllm_url)
    assert policy(service)["served_model"] in served_models(vllm_url)

    # The model server itself, asked the same under each version, agrees with the labels.
    for made, own, other in (
        (strong, policy(service)["served_model"], MODEL),
        (base, MODEL, policy(service)["served_model"]),
    ):
        assert_made_by(vllm_url, made["attempts"][0], made["attempts"][0]["turns"][0], own, other)

    # A version is a new label; a bad path changes nothing and the service keeps serving.
    again = post_policy(service, version="strong", lora={"path": str(tmp_path / "strong")})
    assert again.status_code == 409 and again.json()["error"] == "version_exists"
    bad = post_policy(service, version="broken", lora={"path": str(tmp_path / "missing")})
    assert bad.status_code == 422 and bad.json()["error"] == "checkpoint_refused", bad.text
    state = policy(service)
    assert state["version"] == "strong" and [r["routed"] for r in state["replicas"]] == [True], state
    after = group(service, sampling=SAMPLED)
    assert {t["policy_version"] for a in after["attempts"] for t in a["turns"]} == {"strong"}
    assert after["counts"]["by_status"].get("inference_failure", 0) == 0, after["counts"]
    both = post_policy(service, version="x", lora={"path": "a"}, weights={"path": "b"})
    assert both.status_code == 422

    # /metrics counts turns by the version that generated them.
    turns = [t for g in (base, zero, strong, after) for a in g["attempts"] for t in a["turns"]]
    for version in ("base", "zero", "strong"):
        count = sum(t["policy_version"] == version for t in turns)
        assert metric(service, "rollout_turns_total", version=version) == count, version
    assert metric(service, "rollout_policy_update_seconds_count", kind="lora") == 2


def _stream_batch(service: str, groups: list[dict], lines: list[dict]) -> threading.Thread:
    def run() -> None:
        with httpx.stream("POST", f"{service}/groups/batch", json={"groups": groups}, timeout=900) as answer:
            for line in answer.iter_lines():
                if line.strip():
                    lines.append(json.loads(line))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_update_mid_batch_each_turn_names_the_weights_that_made_it(start_refenv, start_service, vllm_url, tmp_path):
    # Each env step takes a second, so that the batch outlasts the update by far on a loaded machine.
    env = start_refenv("--pool", "4", "--latency-ms", "1000")
    service = start_service([env.url]).url
    strong = make_adapter(tmp_path / "strong", 5.0)  # before the batch: a first torch import takes seconds
    batch = [{"task_id": f"t00{i % 4 + 1}", "n": 1, "sampling": GREEDY, "max_turns": 3} for i in range(8)]
    lines: list[dict] = []
    thread = _stream_batch(service, batch, lines)
    # Some turns done on the base weights, most of the batch still to run: update now.
    assert wait_until(lambda: metric(service, "rollout_turns_total", version="base") >= 3, timeout_s=300)
    update = post_policy(service, version="strong", lora={"path": strong})
    assert update.status_code == 200, update.text
    strong_name = policy(service)["served_model"]
    thread.join(900)
    assert len(lines) == len(batch) and all("group" in line for line in lines), lines[:1]
    turns = [(a, t) for line in lines for a in line["group"]["attempts"] for t in a["turns"]]
    versions = {t["policy_version"] for _, t in turns}
    assert versions == {"base", "strong"}, versions  # the update landed mid-batch
    weights = {"base": MODEL, "strong": strong_name}
    # A sample: replaying a turn on CPU takes seconds (its prompt is the whole episode so far).
    sample = [(a, t) for a, t in turns if t["policy_version"] == "base"][:2] + [
        (a, t) for a, t in turns if t["policy_version"] == "strong"
    ][:2]
    for attempt, turn in sample:
        other = ({"base", "strong"} - {turn["policy_version"]}).pop()
        assert_made_by(vllm_url, attempt, turn, weights[turn["policy_version"]], weights[other])
    for line in lines:
        g = line["group"]
        assert_accounted(g)
        span = {t["policy_version"] for a in g["attempts"] for t in a["turns"]}
        assert (g["oldest_policy_version"], g["newest_policy_version"]) == (
            ("base" if "base" in span else "strong"),
            ("strong" if "strong" in span else "base"),
        )


def test_max_staleness_reruns_attempts_that_fell_behind(start_refenv, start_service, tmp_path):
    env = start_refenv("--pool", "4")
    service = start_service([env.url]).url
    started_before = httpx.get(f"{env.url}/health").json()["episodes"]["started"]
    # Zero adapters: the policy behaves as the base model, so episodes take their usual turns.
    post_policy(service, version="a", lora={"path": make_adapter(tmp_path / "a", 0.0)}).raise_for_status()
    # Short turns: what matters is that attempts are in flight, a turn done, when the update lands.
    sampling = {"temperature": 1.0, "max_tokens": 24}
    batch = [
        {"task_id": f"t00{i % 4 + 1}", "n": 2, "sampling": sampling, "max_staleness": 0, "retries": 0, "max_turns": 4}
        for i in range(4)  # 8 attempts on 4 worlds: the first 4 are in flight when the update lands
    ]
    lines: list[dict] = []
    thread = _stream_batch(service, batch, lines)
    assert wait_until(lambda: metric(service, "rollout_turns_total", version="a") >= 4, timeout_s=300)
    post_policy(service, version="b", lora={"path": make_adapter(tmp_path / "b", 0.0, seed=1)}).raise_for_status()
    thread.join(900)
    assert len(lines) == len(batch) and all("group" in line for line in lines), lines[:1]
    attempts = [a for line in lines for a in line["group"]["attempts"]]
    for attempt in attempts:
        # max_staleness 0: no returned attempt mixes versions or holds one behind the current.
        assert len({t["policy_version"] for t in attempt["turns"]}) <= 1, attempt["turns"]
        assert attempt["oldest_policy_version"] == attempt["newest_policy_version"]
        assert all(f["kind"] == "stale" for f in attempt["earlier_failures"])
    reruns = sum(a["tries"] - 1 for a in attempts)
    assert reruns >= 1, "no attempt was in flight with a turn done when the update landed"
    # Every re-run is a new episode on the env: its own counter sees each try.
    started = httpx.get(f"{env.url}/health").json()["episodes"]["started"] - started_before
    assert started == sum(a["tries"] for a in attempts), (started, reruns)


@pytest.fixture
def restore_weights(vllm_url):
    """The session's vLLM must leave this test on the base weights, labelled as nobody relabelled them."""
    yield
    model_dir = str(embedded_model.cache_dir())
    httpx.post(f"{vllm_url}/resume", timeout=60)
    httpx.post(
        f"{vllm_url}/collective_rpc",
        json={"method": "reload_weights", "kwargs": {"weights_path": model_dir}},
        timeout=600,
    ).raise_for_status()
    httpx.post(f"{vllm_url}/update_weight_version", json={"new_version": "default"}, timeout=60).raise_for_status()
    # KV cached under the test's weights must not serve the tests after it.
    reset = httpx.post(f"{vllm_url}/reset_prefix_cache", params={"reset_running_requests": "true"}, timeout=60)
    assert reset.json()["success"] is True


@pytest.mark.alone  # it swaps, pauses and relabels the shared vLLM's base weights
def test_full_weights_from_disk_and_pushed_by_the_trainer(
    start_refenv, start_service, vllm_url, tmp_path, restore_weights
):
    env = start_refenv("--pool", "2")
    service = start_service([env.url]).url
    base = group(service, sampling=GREEDY)

    # A checkpoint with one matrix scaled: the replica pauses, reloads it, resumes; answers change.
    from safetensors.torch import load_file, save_file

    changed = tmp_path / "changed"
    shutil.copytree(embedded_model.cache_dir(), changed)
    weights_file = next(changed.glob("*.safetensors"))
    tensors = load_file(str(weights_file))
    for name in tensors:
        if "mlp.down_proj" in name:
            tensors[name] = tensors[name] * 1.5
    save_file(tensors, str(weights_file), metadata={"format": "pt"})
    update = post_policy(service, version="w1", weights={"path": str(changed)})
    assert update.status_code == 200, update.text
    assert httpx.get(f"{vllm_url}/weight_info").json()["weight_version"] == "w1"  # the replica's own label
    w1 = group(service, sampling=GREEDY)
    assert first_turn_ids(w1) != first_turn_ids(base)
    assert {t["policy_version"] for t in w1["attempts"][0]["turns"]} == {"w1"}
    # w1's first prompt is the one the base group's turns cached: vLLM computes it again on w1 (its
    # logprobs equal those of the same request with a cache salt, which shares no cached block).
    assert_fresh_kv(vllm_url, w1["attempts"][0])

    # The same checkpoint again is refused (nothing would change) where vLLM's checksums see every
    # weight. Its CPU build repacks the linear layers on CPUs with its bf16 kernels (AVX-512 BF16, AMX),
    # leaving empty tensors whose checksum is of zero bytes: there nobody can tell, so it is taken.
    sums = httpx.post(f"{vllm_url}/weight_checker", json={"action": "checksum"}, timeout=60).json()["checksums"]
    sees_every_weight = hashlib.sha256(b"").hexdigest() not in sums.values()
    same = post_policy(service, version="w1-again", weights={"path": str(changed)})
    if sees_every_weight:
        assert same.status_code in (422, 502) and "already served" in same.text, same.text
    else:
        assert same.status_code == 200, same.text
        assert first_turn_ids(group(service, sampling=GREEDY)) == first_turn_ids(w1)  # the same weights
    # A bad path leaves what was served served.
    # vLLM's in-place reload breaks a replica when it fails: the folder is checked before any pause.
    bad = post_policy(service, version="w-bad", weights={"path": str(tmp_path / "missing")})
    assert bad.status_code == 422 and bad.json()["error"] == "checkpoint_refused", bad.text
    (tmp_path / "empty").mkdir()
    empty = post_policy(service, version="w-empty", weights={"path": str(tmp_path / "empty")})
    assert empty.status_code == 422 and empty.json()["error"] == "checkpoint_refused", empty.text
    # Missing and incomplete are told apart by nobody: the same words, the path aside.
    assert bad.json()["message"].split(":", 1)[1] == empty.json()["message"].split(":", 1)[1]
    state = policy(service)
    served = "w1" if sees_every_weight else "w1-again"
    assert state["version"] == served and [r["routed"] for r in state["replicas"]] == [True], state
    assert first_turn_ids(group(service, sampling=GREEDY)) == first_turn_ids(w1)

    # Pushed by the trainer: the service holds the replicas paused; a turn waits; POST /policy resumes.
    assert post_policy(service, version="pushed").json()["error"] == "not_paused"
    paused = httpx.post(f"{service}/policy/pause", timeout=60)
    assert paused.status_code == 200 and paused.json()["paused"] is True
    assert httpx.get(f"{vllm_url}/is_paused").json()["is_paused"] is True
    results: list[dict] = []
    waiting = threading.Thread(target=lambda: results.append(group(service, sampling=GREEDY)), daemon=True)
    waiting.start()
    assert wait_until(lambda: httpx.get(f"{service}/health/detail").json()["groups_in_flight"] == 1)
    assert not results  # nothing is generated while the trainer holds the weights
    done = post_policy(service, version="pushed")
    assert done.status_code == 200 and done.json()["kind"] == "pushed", done.text
    waiting.join(300)
    assert httpx.get(f"{vllm_url}/is_paused").json()["is_paused"] is False
    assert {t["policy_version"] for t in results[0]["attempts"][0]["turns"]} == {"pushed"}
    assert httpx.get(f"{vllm_url}/weight_info").json()["weight_version"] == "pushed"
