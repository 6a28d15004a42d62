"""The GPU-shaped model server of the GPU-regime benchmark (bench/gpusim.py) obeys its own engine's
rules, and the service runs groups against it and the tails env (bench/tailenv.py).

The engine is stepped by hand here (Engine.step, no clock), so nothing is timed: each rule is
checked after every step from the engine's own state. The sim is a stand-in by design: no real GPU
engine is at hand, and this is what the benchmark's figures rest on (see docs/gpu-regime.md)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import gpusim  # noqa: E402
import tailenv  # noqa: E402

SMALL = dataclasses.replace(
    gpusim.H100_LLAMA8B, max_num_seqs=4, kv_capacity_tokens=2_000, prefix_cache_tokens=4_000, max_batched_tokens=256
)


def _run_by_hand(params: gpusim.Params, jobs: list[tuple[list[int], int]], *, max_steps: int = 100_000):
    """Submit `jobs` (prompt, reply length) and step the engine until all finish, checking the rules
    after every step. Returns the engine and the step times."""

    async def go():
        engine = gpusim.Engine(params, time_scale=1.0)
        seqs = []
        for prompt, target in jobs:
            seq = gpusim.Seq(prompt, target, asyncio.get_running_loop().create_future())
            seqs.append(seq)
            engine.waiting.append(seq)
        preempt = engine._preempt_for

        def preempt_only_when_full(growth: int) -> None:
            fits = engine.kv_used + growth <= params.kv_capacity_tokens
            before = engine.stats.preemptions
            preempt(growth)
            assert not (fits and engine.stats.preemptions > before), "preempted with room in the KV cache"

        engine._preempt_for = preempt_only_when_full
        times = []
        for _ in range(max_steps):
            if not (engine.running or engine.waiting):
                break
            times.append(engine.step())
            assert len(engine.running) <= params.max_num_seqs
            assert engine.kv_used <= params.kv_capacity_tokens
            assert engine.kv_used == sum(s.computed for s in engine.running)
        assert all(s.done.done() for s in seqs), "the engine stopped with sequences unfinished"
        return engine, times, seqs

    return asyncio.run(go())


def test_the_engine_never_runs_more_than_max_num_seqs_and_its_counters_add_up():
    """Break tried: _admit without its max_num_seqs bound -> 10 running of 4, fails."""
    jobs = [([7] * 40 + [i], 30) for i in range(10)]
    engine, times, seqs = _run_by_hand(dataclasses.replace(SMALL, kv_capacity_tokens=100_000), jobs)
    st = engine.stats
    assert st.max_running == 4
    assert st.preemptions == 0  # room for all of them: nothing preempted
    assert st.generated == sum(target for _, target in jobs) == sum(s.generated for s in seqs)
    assert st.finished == len(jobs) and st.steps == len(times)
    assert st.busy_s == pytest.approx(sum(times))
    assert 0 < st.batch_s / st.busy_s <= 4  # mean batch, time-weighted
    assert engine.kv_used == 0 and not engine.running


def test_a_full_kv_cache_preempts_and_every_sequence_still_finishes_its_reply():
    """Four sequences whose replies together outgrow the KV cache: some are preempted (recomputed),
    none loses tokens. Break tried: _preempt_for never preempting -> kv_used 2002 over the 2000 capacity, fails;
    preempting one sequence every 7th step while others wait -> "preempted with room in the KV cache", fails."""
    jobs = [([i] * 300, 300) for i in range(4)]  # 4 x 600 tokens at the end > 2000
    engine, _, seqs = _run_by_hand(SMALL, jobs)
    assert engine.stats.preemptions > 0
    assert all(s.generated == 300 for s in seqs)
    assert engine.stats.max_kv <= SMALL.kv_capacity_tokens


def test_a_repeated_prefix_is_charged_less_and_the_cache_is_bounded():
    """The same 512-token prompt twice: the second prefills one token, not 512, and its steps cost
    less. Break tried: _cached_prefix never finding a block -> the second prefills 512, not 1, fails;
    the LRU bound removed -> the cache holds 352 blocks over its 4,000-token bound, fails."""
    prompt = list(range(1000, 1512))
    engine, first_times, _ = _run_by_hand(SMALL, [(prompt, 4)])

    async def again(engine):
        seq = gpusim.Seq(prompt, 4, asyncio.get_running_loop().create_future())
        engine.waiting.append(seq)
        before = engine.stats.prefilled
        times = []
        while engine.running or engine.waiting:
            times.append(engine.step())
        return engine.stats.prefilled - before, times

    prefilled, second_times = asyncio.run(again(engine))
    assert engine.stats.prefilled - prefilled == 512  # the first prefilled all of it
    assert prefilled == 1
    assert sum(second_times) < sum(first_times)
    assert engine.stats.cache_hit == 511
    # Other prompts push it out of a bounded cache: then it is prefilled in full again.
    for k in range(10):
        engine.cache_probe = engine._cached_prefix([k] * 512)
    assert len(engine.cache) * SMALL.block_tokens <= SMALL.prefix_cache_tokens
    assert engine._cached_prefix(prompt) == 0


def test_reply_length_comes_from_the_last_marker_and_text_tokenizes_back_to_the_ids():
    tok = gpusim.Tokenizer()
    prompt = tok.render([{"role": "user", "content": "abcd <len=40> efgh <len=12>"}], True)
    assert gpusim.reply_length(prompt, 100) == 12
    assert gpusim.reply_length(prompt, 5) == 5
    assert gpusim.reply_length([1, 2, 3], 64) == 64
    ids = [100, 4242, 99_999]
    assert tok.ids(gpusim.Server.text(ids)) == ids


@pytest.mark.timeout(300)
def test_the_service_runs_a_group_on_the_simulated_gpu_and_the_tails_env(launch, start_service):
    """The service's start-up probes and a group's turns go through the sim and the tails env; the
    sim's own counts are the oracle: it generated exactly the tokens the group reports, one request a
    turn, and its /metrics carries vLLM's names. Break tried: the sim's completions answering one
    token fewer than asked (ids and logprobs) -> the group's completion_tokens differ from the sim's
    count, fails."""
    sim = launch("sim", None, [sys.executable, str(ROOT / "bench/gpusim.py"), "--port", "0", "--time-scale", "1000"],
                 ready_path="/v1/models")  # fmt: skip
    env = launch("tails", None, [sys.executable, str(ROOT / "bench/tailenv.py"), "--port", "0", "--pool", "4",
                                 "--time-scale", "1000"])  # fmt: skip
    service = start_service([env.url], vllm=sim.url, model=gpusim.MODEL)
    task = next(t for t, family in tailenv.task_ids() if family == "short")
    httpx.post(f"{sim.url}/sim/stats", timeout=10)  # the window starts here: the start-up probes are not counted
    answer = httpx.post(
        f"{service.url}/groups",
        json={"task_id": task, "n": 2, "sampling": {"max_tokens": 512}},
        timeout=120,
    )
    assert answer.status_code == 200, answer.text
    group = answer.json()
    assert [a["status"] for a in group["attempts"]] == ["scored", "scored"]
    stats = httpx.get(f"{sim.url}/sim/stats", timeout=10).json()
    turns = sum(a["score"]["actor_turns"] for a in group["attempts"])
    assert stats["generated_tokens"] == group["completion_tokens"] > 0
    assert stats["requests"] == stats["finished"] == turns
    assert stats["preemptions"] == 0 and 0 < stats["busy_fraction"] <= 1
    metrics = httpx.get(f"{sim.url}/metrics", timeout=10).text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:num_preemptions_total"):  # fmt: skip
        assert name in metrics


def test_the_tails_env_draws_the_same_episodes_for_every_driver_and_its_families_differ():
    """The k-th episode of a task is the same in every run (each driver meets the same work), and the
    long family is longer and passed less often than the short one. Break tried: seeding the draws
    by the env's global episode count instead of (task, k) -> the second env, reset in another
    order, draws other episodes, fails."""

    async def episodes(order: list[str]) -> dict[tuple[str, int], tuple[int, bool, str]]:
        env = tailenv.TailEnv(pool=len(order), time_scale=1e6, seed=0)
        seen: dict[str, int] = {}
        out = {}
        for task in order:
            request = type(
                "R", (), {"can_read_body": True, "json": staticmethod(lambda t=task: _async({"task_id": t}))}
            )
            answer = json.loads((await env.reset(request)).text)
            ep = env.episodes[answer["episode_id"]]
            k = seen.get(task, 0)
            seen[task] = k + 1
            out[(task, k)] = (ep.turns, ep.passed, answer["observation"]["messages"][-1]["content"][-12:])
        return out

    tasks = [t for t, _ in tailenv.task_ids()][:40]
    forward = asyncio.run(episodes(tasks + tasks))
    backward = asyncio.run(episodes(list(reversed(tasks)) * 2))
    assert forward == backward
    by_family: dict[str, list[tuple[int, bool, str]]] = {"short": [], "long": []}
    for (task, _), drawn in forward.items():
        by_family[tailenv.family_of(task)].append(drawn)
    mean_turns = {f: sum(d[0] for d in v) / len(v) for f, v in by_family.items()}
    assert mean_turns["long"] > 2 * mean_turns["short"]
    pass_rate = {f: sum(d[1] for d in v) / len(v) for f, v in by_family.items()}
    assert pass_rate["long"] < pass_rate["short"]


async def _async(value):
    return value


def test_a_prompt_is_cached_by_whole_blocks_of_the_engines_block_size():
    """A turn re-sends its prompt grown by 50 tokens: what is prefilled again is everything after the
    last whole block cached, so 128-token blocks (vLLM's CPU backend, which the calibration fits)
    recompute more than 16-token ones (CUDA's). Oracle: the block arithmetic, 350 - 256 and 350 - 288.
    Break tried: the cache hashing 16-token blocks whatever block_tokens says -> 1 prefilled for
    128-token blocks, not 94, fails."""
    prompt = list(range(2000, 2300))
    for block, again in ((128, 350 - 256), (16, 350 - 288)):
        params = dataclasses.replace(SMALL, block_tokens=block, kv_capacity_tokens=4_000)
        engine, _, _ = _run_by_hand(params, [(prompt, 1)])

        async def extend(engine=engine):
            seq = gpusim.Seq(prompt + list(range(5000, 5050)), 1, asyncio.get_running_loop().create_future())
            engine.waiting.append(seq)
            before = engine.stats.prefilled
            while engine.running or engine.waiting:
                engine.step()
            return engine.stats.prefilled - before

        assert asyncio.run(extend()) == again, block


def test_the_calibration_prompts_are_the_same_length_to_the_sim_and_to_the_real_tokenizer():
    """The calibration (bench/calibrate_gpusim.py) runs the tails env on the CPU vLLM and on the fitted
    sim and compares the two: both must be given the same work. Oracle: the embedded model's own
    tokenizer and chat template, on a first turn and a tool turn of each calibration family. Break
    tried: the env's filler back to three-digit numbers (four tokens a word to SmolLM2, one to the
    sim) -> the real prompt 3.9 x the sim's, fails."""
    from transformers import AutoTokenizer

    from rollout_service.launch import embedded_model

    real = AutoTokenizer.from_pretrained(str(embedded_model.cache_dir()))
    sim = gpusim.Tokenizer()
    for family in tailenv.CALIBRATION.values():
        for task in tailenv.tasks_of(family.name)[:4]:
            messages = tailenv.first_messages(family, task, 32)
            messages += [
                {"role": "assistant", "content": "a reply of a few words"},
                tailenv.tool_message(f"{task}-1", round(family.tool_median), 32),
            ]
            for turn in (messages[:2], messages):
                text = real.apply_chat_template(turn, add_generation_prompt=True, tokenize=False)
                real_count = len(real(text, add_special_tokens=False)["input_ids"])
                sim_count = len(sim.render(turn, True))
                assert abs(real_count - sim_count) <= 0.05 * real_count, (family.name, real_count, sim_count)
