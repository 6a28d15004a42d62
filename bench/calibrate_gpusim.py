"""Calibrate the GPU-shaped model server (bench/gpusim.py) against the CPU vLLM, and check it once.

    .venv/bin/python bench/calibrate_gpusim.py --record bench/results/gpusim-calibration.json
    .venv/bin/python bench/calibrate_gpusim.py --vllm http://127.0.0.1:8000   # a vLLM already running

1. Step time by batch on the real engine: b requests at once, each `ignore_eos` for T tokens, at
   two values of T; the difference over the difference in T is one decode step at batch b (the
   prefill and the HTTP cost cancel). Prefill per token: the slope of a one-token request's time over
   its prompt's length (cold prompts, 50 to 1,200 tokens), the request's cost outside the engine
   what that line leaves at no prompt beyond one step. The KV term: a decode step at batch 8 with
   long contexts against one with short ones. Reply lengths: the real model's at max_tokens 32 on
   the env's own prompts. Each timing the median of three, interleaved.
2. Fit `step = base + per_token x tokens in the step + per_kv_token x KV tokens` (least squares over
   the batches) and write the fitted engine as gpusim Params (with the CPU vLLM's max_num_seqs, KV
   capacity and max_model_len from its start-up log) to --params-out.
3. In one run, on the real vLLM and on the fitted sim (time scale 1), the service against the naive
   driver (compare.py's pattern: one group at a time, its n attempts at once) at pool 8 (n=4) and
   pool 32 (n=8), on the tails env's calibration mix with reply lengths drawn from those the real
   model gave in step 1. The sim must predict each ratio within +-15 %. The env's filler is one token
   a word to both tokenizers, so both engines see the same prompts (the record says their counts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpusim
import record
from gpu_regime import LOGS, Config, Stack, _direct_group, _from_result, _group_body, _ndjson, _session
from tailenv import CALIBRATION, first_messages, task_ids, tasks_of, tool_message

from rollout_service.launch.embedded_model import MODEL_NAME
from rollout_service.launch.stack import start_embedded_vllm


async def _timed_completions(url: str, model: str, prompts: list[str], tokens: int) -> tuple[float, list[int]]:
    async with _session() as http:

        async def one(prompt: str) -> int:
            body = {"model": model, "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 1.0}
            async with http.post(f"{url}/v1/completions", json=body) as r:
                answer = await r.json()
                if r.status != 200:
                    raise RuntimeError(f"{url}: {r.status} {answer}")
                return answer["usage"]["completion_tokens"]

        started = time.monotonic()
        got = await asyncio.gather(*(one(p) for p in prompts))
        return time.monotonic() - started, list(got)


def _prompt(i: int, words: int) -> str:
    return f"request {i} at {time.monotonic_ns()}: " + " ".join(f"w{(i * 31 + k) % 997}" for k in range(words))


async def _decode_step(url: str, model: str, batch: int, words: int, short: int, long: int) -> float:
    """One decode step at `batch` sequences of `words`-word prompts: b requests at once for `short` and
    then `long` tokens (fresh prompts each time); the prefill and the HTTP cost cancel in the difference."""
    walls = []
    for tokens in (short, long):
        walls.append((await _timed_completions(url, model, [_prompt(i, words) for i in range(batch)], tokens))[0])
    return (walls[1] - walls[0]) / (long - short)


async def measure(url: str, model: str, batches: list[int], short: int, long: int) -> dict:
    tries: dict[int, list[float]] = {b: [] for b in batches}
    for _ in range(3):  # interleaved, the median kept: the machine's load moves under a measurement
        for b in batches:
            tries[b].append(max(1e-6, await _decode_step(url, model, b, 20, short, long)))
    steps = {b: statistics.median(t) for b, t in tries.items()}
    print("step s by batch:", {b: round(s, 4) for b, s in steps.items()}, flush=True)
    # Prefill: one request of 1 token, cold (distinct prompts: no prefix-cache hit), at prompt lengths
    # spanning the env's (50 to 1,200 tokens); the slope is a prefill token, what the line leaves at
    # no prompt beyond one step is the request's cost outside the engine.
    words = [10, 50, 100, 200, 300]
    counts = await _count(url, model, [_prompt(1, w) for w in words])
    cold: dict[int, list[float]] = {w: [] for w in words}
    for k in range(3):
        for w in words:
            cold[w].append((await _timed_completions(url, model, [_prompt(100 * k + w, w)], 1))[0])
    prefill_per_token, at_zero = statistics.linear_regression(counts, [statistics.median(cold[w]) for w in words])
    overhead = max(0.0, at_zero - steps[min(steps)])
    # The KV term: a decode step at batch 8 with long contexts against one with short ones.
    kv: dict[int, list[float]] = {w: [] for w in (20, 200)}
    for _ in range(3):
        for w in kv:
            kv[w].append(await _decode_step(url, model, 8, w, short, long))
    context = await _count(url, model, [_prompt(1, 20), _prompt(1, 200)])
    kv_per_token = max(0.0, (statistics.median(kv[200]) - statistics.median(kv[20])) / (8 * (context[1] - context[0])))
    # What the model replies at max_tokens 32 on the env's own prompts, a first turn and the next
    # (it stops at EOS too): the sim generates lengths drawn from these.
    lengths = []
    async with _session() as http:
        for fam in CALIBRATION.values():
            for task in tasks_of(fam.name)[:12]:
                messages = first_messages(fam, task, 32)
                for _ in range(2):
                    body = {"model": model, "messages": messages, "max_tokens": 32, "temperature": 1.0}
                    async with http.post(f"{url}/v1/chat/completions", json=body) as r:
                        answer = await r.json()
                    lengths.append(answer["usage"]["completion_tokens"])
                    tool = tool_message(f"{task}-tool", round(fam.tool_median), 32)
                    messages = [*messages, answer["choices"][0]["message"], tool]
    return {"step_s_by_batch": steps, "prefill_per_token_s": prefill_per_token, "kv_per_token_s": kv_per_token,
            "request_overhead_s": overhead, "reply_lengths": lengths,
            "decode_context_tokens": context[0] + (short + long) / 2}  # fmt: skip


async def _count(url: str, model: str, prompts: list[str]) -> list[int]:
    async with _session() as http:
        out = []
        for p in prompts:
            async with http.post(f"{url}/tokenize", json={"model": model, "prompt": p}) as r:
                out.append((await r.json())["count"])
        return out


# The CPU backend's KV block (the prefix cache's unit) where no block size is given: 128 tokens, where
# CUDA's is 16. A sim with 16-token blocks would find more of a multi-turn prompt cached than the
# real engine does.
CPU_BLOCK_TOKENS = 128


async def same_prompts(url: str, model: str) -> list[dict]:
    """Each calibration family's first prompt, counted by the real engine and by the sim: the two must
    see the same work (the tails env's filler is one token a word to both tokenizers)."""
    sim = gpusim.Tokenizer()
    out = []
    async with _session() as http:
        for fam in CALIBRATION.values():
            task = tasks_of(fam.name)[0]
            messages = first_messages(fam, task, 32)
            body = {"model": model, "messages": messages, "add_generation_prompt": True}
            async with http.post(f"{url}/tokenize", json=body) as r:
                real = (await r.json())["count"]
            out.append({"family": fam.name, "real": real, "sim": len(sim.render(messages, True))})
    return out


def fit(measured: dict, log: Path | None) -> gpusim.Params:
    xs = [int(b) for b in measured["step_s_by_batch"]]
    # The sim charges the KV term on top of a step, so it comes out of the steps measured: b sequences
    # of decode_context_tokens each were in the KV cache.
    kv_in_step = measured["kv_per_token_s"] * measured["decode_context_tokens"]
    ys = [measured["step_s_by_batch"][b] - int(b) * kv_in_step for b in measured["step_s_by_batch"]]
    slope, intercept = statistics.linear_regression(xs, ys)
    limits = {"max_num_seqs": 128, "kv_capacity_tokens": 186_368, "max_model_len": 4096}
    if log is not None and log.exists():
        text = log.read_text(errors="replace")
        import re

        if m := re.search(r"KV cache size: ([\d,]+) tokens", text):
            limits["kv_capacity_tokens"] = int(m.group(1).replace(",", ""))
        if m := re.search(r"'max_num_seqs': (\d+)", text):
            limits["max_num_seqs"] = int(m.group(1))
        if m := re.search(r"'max_model_len': (\d+)", text):
            limits["max_model_len"] = int(m.group(1))
    return replace(
        gpusim.H100_LLAMA8B,
        setup="cpu-vllm-fit",
        step_base_s=max(1e-4, intercept),
        # A decoding sequence's token at the batch slope; a prefill token as measured (its own slope).
        per_token_s=max(1e-6, slope),
        prefill_token_s=measured["prefill_per_token_s"],
        request_overhead_s=measured["request_overhead_s"],
        per_kv_token_s=measured["kv_per_token_s"],
        max_batched_tokens=4096,
        prefix_cache_tokens=limits["kv_capacity_tokens"],
        block_tokens=CPU_BLOCK_TOKENS,
        sources={
            "fit": "bench/calibrate_gpusim.py on this machine's CPU vLLM (see the calibration record)",
            "block_tokens": "vLLM's CPU platform default block size (vllm/platforms/cpu.py), which its "
            "start-up log does not print",
        },  # fmt: skip
        **limits,
    )


async def ratio(servers: list[str] | None, params_file: Path | None, model: str, pool: int, n: int, groups: int,
                lengths: list[int]) -> dict:  # fmt: skip
    """Service vs naive on one engine: wall of the same groups, naive (one group at a time) and through
    /groups/batch (all at once)."""
    cfg = Config(pool, 1, "batch", n=n, time_scale=1.0, max_tokens=32, params=params_file, model=model,
                 servers=servers, env_flags=["--mix", "calibration", "--reply-tokens", *map(str, lengths)])  # fmt: skip
    tasks = [t for t, _ in task_ids()][:groups]
    where = "real" if servers else "sim"
    load_before = os.getloadavg()[0]
    with Stack(cfg, LOGS / f"calibrate-{where}-p{pool}", with_service=True) as stack:
        async with _session() as http:
            # Each sim starts cold; the real engine has served the measurements and the runs before this
            # one (the same tasks), so its prefix cache is emptied to start it cold as well.
            for url in servers or []:
                async with http.post(f"{url}/reset_prefix_cache") as r:
                    if r.status != 200:
                        raise RuntimeError(
                            f"{url}/reset_prefix_cache answered {r.status} (needs VLLM_SERVER_DEV_MODE=1)"
                        )
            started = time.monotonic()
            for t in tasks:
                await _direct_group(http, stack, t, stack.sims, cfg)
            naive = time.monotonic() - started
            body = {"groups": [_group_body(t, cfg) for t in tasks]}
            started = time.monotonic()
            done = []
            async with http.post(f"{stack.service}/groups/batch", json=body) as r:
                async for item in _ndjson(r):
                    if "group" in item:
                        done.append(_from_result(item["group"], cfg))
            service = time.monotonic() - started
    assert len(done) == groups, f"{where}: {len(done)} of {groups} groups came back"
    load = f"{load_before:.1f} -> {os.getloadavg()[0]:.1f}"
    return {
        "naive_s": round(naive, 1),
        "service_s": round(service, 1),
        "ratio": round(naive / service, 3),
        "load": load,
    }


async def run(args: argparse.Namespace, url: str, log: Path | None) -> dict:
    measured = await measure(url, MODEL_NAME, args.batches, 8, 40)
    measured["first_prompt_tokens"] = await same_prompts(url, MODEL_NAME)
    print("first prompt tokens, real and sim:", measured["first_prompt_tokens"], flush=True)
    params = fit(measured, log)
    args.params_out.parent.mkdir(parents=True, exist_ok=True)
    args.params_out.write_text(json.dumps({"params": asdict(params), "measured": measured}, indent=1) + "\n")
    rows = []
    for pool, n in ((8, 4), (32, 8)):
        real = await ratio([url], None, MODEL_NAME, pool, n, args.groups, measured["reply_lengths"])
        sim = await ratio(None, args.params_out, gpusim.MODEL, pool, n, args.groups, measured["reply_lengths"])
        rows.append({"pool": pool, "n": n, "groups": args.groups,
                     "real naive s": real["naive_s"], "real service s": real["service_s"], "real ratio": real["ratio"],
                     "sim naive s": sim["naive_s"], "sim service s": sim["service_s"], "sim ratio": sim["ratio"],
                     "sim / real": round(sim["ratio"] / real["ratio"], 3),
                     "machine load (1 min) real / sim": f"{real['load']} / {sim['load']}",
                     "within 15 %": abs(sim["ratio"] / real["ratio"] - 1) <= 0.15})  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    return {"measured": measured, "params": asdict(params), "rows": rows}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", help="a CPU vLLM already serving the embedded model (default: start one)")
    parser.add_argument("--vllm-log", type=Path, help="its log (for max_num_seqs and the KV capacity)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--groups", type=int, default=8)
    parser.add_argument("--params-out", type=Path, default=Path("bench/results/gpusim-cpu-fit.json"))
    parser.add_argument("--record", type=Path)
    args = parser.parse_args()
    proc = None
    if args.vllm:
        url, log = args.vllm.rstrip("/"), args.vllm_log
    else:
        log = LOGS / "calibrate-vllm.log"
        proc = start_embedded_vllm(None, log)
        url = proc.url
    try:
        out = asyncio.run(run(args, url, log))
    finally:
        if proc is not None:
            proc.stop()
    print(json.dumps({k: out[k] for k in ("measured", "params")}, indent=1))
    if args.record:
        m = out["measured"]
        notes = (
            "Ratios are the naive driver's wall over the service's for the same groups (compare.py's pattern), "
            "on the tails env's calibration mix (1-3 and 4-6 turns, 32-token replies, no tool latency). Fitted "
            f"engine: step = {out['params']['step_base_s'] * 1000:.2f} ms + {out['params']['per_token_s'] * 1000:.3f} "
            f"ms x tokens + {out['params']['per_kv_token_s'] * 1e6:.3f} us x KV tokens; step time by batch "
            f"(s): {json.dumps({k: round(v, 4) for k, v in m['step_s_by_batch'].items()})}; prefill "
            f"{m['prefill_per_token_s'] * 1000:.3f} ms/token measured; the model's replies at max_tokens 32: mean "
            f"{statistics.mean(m['reply_lengths']):.1f} tokens; a first prompt, real / sim tokens: "
            + ", ".join(f"{p['family']} {p['real']} / {p['sim']}" for p in m["first_prompt_tokens"])
            + f"; KV blocks of {out['params']['block_tokens']} tokens (the CPU backend's). The service and the "
            "drivers share the machine's 2 cores with the real engine, not with the sim."
        )
        rec = record.make("gpusim-calibration", "The GPU-shaped sim against the CPU vLLM: service vs naive",
                          out["rows"], notes=notes)  # fmt: skip
        record.write(rec, args.record)


if __name__ == "__main__":
    main()
