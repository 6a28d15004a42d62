"""A GPU-shaped model server: vLLM's HTTP surface over a continuous-batching model of one GPU engine.

    python bench/gpusim.py --port 0 --port-file sim.port --setup h100-llama8b --time-scale 20
    python bench/gpusim.py --port 0 --params bench/results/gpusim-cpu-fit.json   # a fitted engine

No model runs: token ids are drawn (deterministic per seed and prompt) and each "token" costs what
the engine model says. The engine steps like vLLM's scheduler: every step advances every running
sequence by one token and gives the rest of the step's token budget to prefills (chunked); a step
takes `base + per_token x (tokens in the step) + per_kv_token x (tokens in the KV cache)` seconds
of simulated GPU time. A new sequence is admitted while fewer than `max_num_seqs` run and its prompt
fits in the KV cache; a prompt's leading blocks found in the prefix cache (LRU over blocks of
`block_tokens`, 16 as on CUDA; bounded) are not prefilled again. When a decode step would overflow
the KV cache the newest running sequence is preempted (recompute: back to the head of the queue,
its KV freed). `--time-scale S` runs S simulated seconds per wall second, so an hour of GPU time
takes 60/S minutes.

How long a reply is: a prompt may carry `<len=N>` (the tails env, bench/tailenv.py, writes one in
each observation): the reply is N tokens (at most max_tokens, finish_reason "stop" below it);
without one it is max_tokens long (as vLLM with ignore_eos).

Routes (what the service and the drivers use of vLLM): /v1/models, /tokenize, /v1/completions (token
prompts, logprobs as "token_id:<id>"), /v1/chat/completions, /metrics (vLLM's metric names), the
weight routes a "pushed" policy update uses (/pause, /resume, /is_paused, /update_weight_version,
/weight_info, /reset_prefix_cache), and the oracle: GET /sim/stats (simulated time, busy fraction,
mean batch, preemptions, prefix-cache hit rate, tokens; POST resets the window).

The tokenizer is a bijection on what it emits: a sampled token renders as its five-digit id and a
space, so the text of a reply tokenizes back to the ids sampled (exact trajectories work); other
text costs one token per 4 characters.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import random
import re
import time
import zlib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from aiohttp import web
from aioserve import serve

MODEL = "sim-model"
START, END, NL, LEN_MARK = 1, 2, 3, 5
ROLE = {"system": 10, "user": 11, "assistant": 12, "tool": 13}
FIRST_ID, LAST_ID = 100, 99_999


@dataclass
class Params:
    """One engine's model. Times in simulated seconds."""

    setup: str
    step_base_s: float  # a decode step's fixed cost (weights read once per step)
    per_token_s: float  # each decoding sequence's token in the step
    prefill_token_s: float  # each prompt token prefilled in the step (chunked prefill)
    per_kv_token_s: float  # each token held in the KV cache, read once per step (attention)
    max_num_seqs: int
    kv_capacity_tokens: int
    max_batched_tokens: int  # token budget of one step (chunked prefill)
    prefix_cache_tokens: int  # the LRU prefix cache's bound
    max_model_len: int
    # Wall time a request spends outside the engine (the API server's tokenizing and detokenizing):
    # next to nothing on a GPU host, tens of ms on a loaded CPU one.
    request_overhead_s: float = 0.0
    block_tokens: int = 16  # tokens per KV block: the prefix cache's unit
    sources: dict[str, str] = field(default_factory=dict)


# Llama-3.1-8B-Instruct in bf16 on one H100 SXM (80 GB HBM3) under vLLM. Each figure's source is
# in `sources`; the derived ones say how they were derived.
H100_LLAMA8B = Params(
    setup="h100-llama8b",
    step_base_s=0.0065,
    per_token_s=32e-6,
    prefill_token_s=32e-6,
    per_kv_token_s=3.9e-8,
    max_num_seqs=256,
    kv_capacity_tokens=440_000,
    max_batched_tokens=8192,
    prefix_cache_tokens=440_000,
    max_model_len=131_072,
    sources={
        "step_base_s": "16.1 GB of bf16 weights (Llama-3.1-8B, 8.03 B parameters, HF model card) read once per "
        "step at H100 SXM's 3.35 TB/s HBM3 (NVIDIA H100 datasheet) = 4.8 ms, plus ~1.7 ms launch/sampling "
        "overhead (vLLM's single-stream Llama-8B decode on H100 is reported at ~150 tok/s, i.e. ~6.5 ms/token)",
        "per_token_s": "2 x 8.03 GFLOP per token at ~50% of H100 SXM's 989 dense bf16 TFLOPS (NVIDIA datasheet)",
        "prefill_token_s": "as per_token_s: the same FLOPs per token, compute-bound",
        "per_kv_token_s": "128 KiB of KV per token (32 layers x 8 KV heads x 128 dims x K,V x 2 bytes: the model's "
        "config.json) read per step at 3.35 TB/s",
        "max_num_seqs": "vLLM's long-standing default max_num_seqs (EngineArgs) of 256",
        "kv_capacity_tokens": "(0.9 x 80 GB - 16.1 GB weights - ~2 GB activations) / 128 KiB per token ~ 440k "
        "tokens (vLLM's gpu_memory_utilization default 0.9)",
        "max_batched_tokens": "vLLM's chunked-prefill default max_num_batched_tokens of 8192 for online serving",
        "prefix_cache_tokens": "the free KV blocks: the whole KV capacity at most",
        "block_tokens": "vLLM's default block size on CUDA (CacheConfig.block_size 16)",
    },
)
SETUPS = {H100_LLAMA8B.setup: H100_LLAMA8B}


def load_params(setup: str, params_file: Path | None) -> Params:
    if params_file is None:
        return SETUPS[setup]
    data = json.loads(params_file.read_text())
    data = data.get("params", data)
    names = {f.name for f in fields(Params)}
    return Params(**{k: v for k, v in data.items() if k in names})


# -- the tokenizer ------------------------------------------------------------------------------

_PIECE = re.compile(r"<len=(\d+)>|(\d{5}) ")


class Tokenizer:
    def __init__(self) -> None:
        self._cache: dict[str, list[int]] = {}

    def ids(self, text: str) -> list[int]:
        cached = self._cache.get(text)
        if cached is not None:
            return cached
        out: list[int] = []
        at = 0
        for m in _PIECE.finditer(text):
            out += self._plain(text[at : m.start()])
            out += [LEN_MARK, int(m.group(1))] if m.group(1) else [int(m.group(2))]
            at = m.end()
        out += self._plain(text[at:])
        if len(self._cache) > 50_000:
            self._cache.clear()
        self._cache[text] = out
        return out

    @staticmethod
    def _plain(text: str) -> list[int]:
        if not text:
            return []
        seed = zlib.crc32(text.encode())
        return [FIRST_ID + (seed + i * 7919) % 30_000 for i in range(max(1, len(text) // 4))]

    def render(self, messages: list[dict], generation_prompt: bool) -> list[int]:
        out: list[int] = []
        for m in messages:
            out += (START, ROLE.get(m.get("role", ""), 14))
            out += self.ids(m.get("content") or "")
            out += (END, NL)
        if generation_prompt:
            out += (START, ROLE["assistant"])
        return out


def reply_length(prompt: list[int], max_tokens: int) -> int:
    """The last `<len=N>` in the prompt, at most max_tokens; max_tokens without one."""
    for i in range(len(prompt) - 2, -1, -1):
        if prompt[i] == LEN_MARK:
            return max(1, min(prompt[i + 1], max_tokens))
    return max_tokens


# -- the engine ---------------------------------------------------------------------------------


@dataclass
class Seq:
    prompt: list[int]
    target: int  # tokens to generate
    done: asyncio.Future
    prefill_left: int = 0
    computed: int = 0  # tokens whose KV it holds
    generated: int = 0
    preempted: int = 0


class Stats:
    def __init__(self) -> None:
        self.sim_s = self.busy_s = self.batch_s = self.lag_s = 0.0
        self.steps = self.preemptions = self.requests = self.finished = 0
        self.generated = self.prompt_tokens = self.prefilled = self.cache_queried = self.cache_hit = 0
        self.max_running = self.max_kv = 0


class Engine:
    def __init__(self, params: Params, time_scale: float) -> None:
        self.p, self.scale = params, time_scale
        self.waiting: collections.deque[Seq] = collections.deque()
        self.running: list[Seq] = []
        self.kv_used = 0
        self.cache: collections.OrderedDict[int, None] = collections.OrderedDict()  # block hash -> LRU
        self.wake = asyncio.Event()
        self.paused = False
        self.weight_version = "default"
        self.stats = Stats()
        self.t0 = time.monotonic()
        self.sim_clock = 0.0  # simulated seconds since t0
        self.preemptions_total = 0

    def now(self) -> float:
        """Simulated time: the engine's clock, or the wall clock scaled while idle."""
        return max(self.sim_clock, (time.monotonic() - self.t0) * self.scale)

    async def generate(self, prompt: list[int], target: int) -> None:
        seq = Seq(prompt, target, asyncio.get_running_loop().create_future())
        self.stats.requests += 1
        self.stats.prompt_tokens += len(prompt)
        self.waiting.append(seq)
        self.wake.set()
        await seq.done

    def _blocks(self, prompt: list[int]) -> list[int]:
        out, h = [], 0
        block = self.p.block_tokens
        for i in range(len(prompt) // block):
            h = zlib.crc32(bytes(str(prompt[i * block : (i + 1) * block]), "ascii"), h)
            out.append(h)
        return out

    def _cached_prefix(self, prompt: list[int]) -> int:
        """Tokens of `prompt`'s leading full blocks found in the prefix cache; its blocks are put in."""
        blocks = self._blocks(prompt)
        hit = 0
        for h in blocks:
            if h not in self.cache:
                break
            self.cache.move_to_end(h)
            hit += 1
        for h in blocks[hit:]:
            self.cache[h] = None
        while len(self.cache) * self.p.block_tokens > self.p.prefix_cache_tokens:
            self.cache.popitem(last=False)
        # At least one token is computed: vLLM recomputes the last one to sample from it.
        tokens = min(hit * self.p.block_tokens, len(prompt) - 1)
        self.stats.cache_queried += len(prompt)
        self.stats.cache_hit += tokens
        return tokens

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.p.max_num_seqs:
            seq = self.waiting[0]
            need = len(seq.prompt) + seq.generated + 1
            if self.kv_used + need > self.p.kv_capacity_tokens:
                return
            self.waiting.popleft()
            # A preempted sequence recomputes its prompt and what it had generated (vLLM's recompute);
            # only the prompt's blocks can be in the prefix cache.
            seq.computed = self._cached_prefix(seq.prompt)
            seq.prefill_left = len(seq.prompt) + seq.generated - seq.computed
            self.running.append(seq)
            self.kv_used += seq.computed

    def _preempt_for(self, growth: int) -> None:
        while self.running and self.kv_used + growth > self.p.kv_capacity_tokens:
            victim = self.running.pop()  # the newest, as vLLM picks
            self.kv_used -= victim.computed
            victim.computed = 0
            growth -= 0 if victim.prefill_left else 1
            victim.preempted += 1
            self.stats.preemptions += 1
            self.preemptions_total += 1
            self.waiting.appendleft(victim)

    def step(self) -> float:
        """One engine step on the sequences running: its simulated duration."""
        self._admit()
        decoding = [s for s in self.running if not s.prefill_left]
        self._preempt_for(len(decoding))
        decoding = [s for s in self.running if not s.prefill_left]
        budget = self.p.max_batched_tokens - len(decoding)
        prefilled = 0
        for s in self.running:
            if s.prefill_left and budget > 0:
                chunk = min(s.prefill_left, budget)
                s.prefill_left -= chunk
                s.computed += chunk
                self.kv_used += chunk
                budget -= chunk
                prefilled += chunk
        kv_read = self.kv_used
        for s in decoding:
            s.generated += 1
            s.computed += 1
        self.kv_used += len(decoding)
        finished = [s for s in decoding if s.generated >= s.target]
        if finished:
            self.running = [s for s in self.running if s.generated < s.target or s.prefill_left]
            for s in finished:
                self.kv_used -= s.computed
                if not s.done.done():
                    s.done.set_result(None)
        took = (
            self.p.step_base_s
            + self.p.per_token_s * len(decoding)
            + self.p.prefill_token_s * prefilled
            + self.p.per_kv_token_s * kv_read
        )
        st = self.stats
        st.steps += 1
        st.generated += len(decoding)
        st.prefilled += prefilled
        st.finished += len(finished)
        st.busy_s += took
        st.batch_s += len(decoding) * took
        st.max_running = max(st.max_running, len(self.running))
        st.max_kv = max(st.max_kv, self.kv_used)
        return took

    async def run(self) -> None:
        while True:
            if self.paused or not (self.running or self.waiting):
                self.wake.clear()
                await self.wake.wait()
                self.sim_clock = self.now()
                continue
            took = self.step()
            self.sim_clock += took
            ahead = self.t0 + self.sim_clock / self.scale - time.monotonic()
            if ahead > 0:
                await asyncio.sleep(ahead)
            else:
                # The loop runs behind its clock (this process short of CPU): the most it fell
                # behind, in simulated seconds, is in the oracle's lag_s.
                self.stats.lag_s = max(self.stats.lag_s, -ahead * self.scale)
                await asyncio.sleep(0)

    def snapshot(self, reset: bool) -> dict[str, Any]:
        st, now = self.stats, self.now()
        window = max(now - st.sim_s, 1e-9)
        out = {
            "setup": self.p.setup,
            "time_scale": self.scale,
            "sim_s": round(window, 3),
            "busy_s": round(st.busy_s, 3),
            "busy_fraction": round(min(1.0, st.busy_s / window), 4),
            "mean_batch": round(st.batch_s / st.busy_s, 2) if st.busy_s else 0.0,
            "steps": st.steps,
            "preemptions": st.preemptions,
            "requests": st.requests,
            "finished": st.finished,
            "generated_tokens": st.generated,
            "prompt_tokens": st.prompt_tokens,
            "prefilled_tokens": st.prefilled,
            "prefix_hit_rate": round(st.cache_hit / st.cache_queried, 4) if st.cache_queried else 0.0,
            "max_running": st.max_running,
            "max_kv_tokens": st.max_kv,
            "running": len(self.running),
            "waiting": len(self.waiting),
            "kv_used_tokens": self.kv_used,
            "lag_s": round(st.lag_s, 3),
        }
        if reset:
            self.stats = Stats()
            self.stats.sim_s = now
        return out


# -- the HTTP surface ---------------------------------------------------------------------------


class Server:
    def __init__(self, engine: Engine, seed: int) -> None:
        self.engine, self.seed = engine, seed
        self.tok = Tokenizer()
        self.calls = 0

    def _sample(self, prompt: list[int], length: int) -> tuple[list[int], list[float]]:
        self.calls += 1
        rng = random.Random(zlib.crc32(bytes(str(prompt[-32:]), "ascii"), self.seed) + self.calls)
        ids = [rng.randint(FIRST_ID, LAST_ID) for _ in range(length)]
        return ids, [round(-rng.expovariate(2.0), 4) for _ in range(length)]

    @staticmethod
    def text(ids: list[int]) -> str:
        return "".join(f"{i:05d} " for i in ids)

    async def _complete(self, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float], str]:
        length = reply_length(prompt, max_tokens)
        if self.engine.p.request_overhead_s:
            await asyncio.sleep(self.engine.p.request_overhead_s / self.engine.scale)
        await self.engine.generate(prompt, length)
        ids, logprobs = self._sample(prompt, length)
        return ids, logprobs, "stop" if length < max_tokens else "length"

    def _too_long(self, prompt: list[int], max_tokens: int) -> web.Response | None:
        limit = self.engine.p.max_model_len
        if len(prompt) + max_tokens > limit:
            message = (
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the messages, {max_tokens} in the completion)."
            )
            return web.json_response(
                {"error": {"message": message, "type": "BadRequestError", "code": 400}}, status=400
            )
        return None

    async def completions(self, request: web.Request) -> web.Response:
        body = await request.json()
        prompt = body["prompt"]
        if isinstance(prompt, str):
            prompt = self.tok.ids(prompt)
        max_tokens = int(body.get("max_tokens") or 16)
        refused = self._too_long(prompt, max_tokens)
        if refused is not None:
            return refused
        choices = []
        for index in range(int(body.get("n") or 1)):
            ids, logprobs, finish = await self._complete(prompt, max_tokens)
            tokens = (
                [f"token_id:{i}" for i in ids] if body.get("return_tokens_as_token_ids") else [f"{i:05d} " for i in ids]
            )
            choice: dict[str, Any] = {
                "index": index,
                "text": self.text(ids),
                "logprobs": {"tokens": tokens, "token_logprobs": logprobs},
                "finish_reason": finish,
                "stop_reason": None,
            }
            if body.get("return_token_ids"):
                choice.update(token_ids=ids, prompt_token_ids=prompt)
            choices.append(choice)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": sum(len(c["logprobs"]["tokens"]) for c in choices)}
        return web.json_response({"id": "c", "object": "text_completion", "model": body.get("model", MODEL),
                                  "choices": choices, "usage": usage})  # fmt: skip

    async def chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        prompt = self.tok.render(body["messages"], True)
        max_tokens = int(body.get("max_tokens") or 256)
        refused = self._too_long(prompt, max_tokens)
        if refused is not None:
            return refused
        n = int(body.get("n") or 1)
        outs = await asyncio.gather(*(self._complete(prompt, max_tokens) for _ in range(n)))
        choices = [
            {
                "index": i,
                "message": {"role": "assistant", "content": self.text(ids)},
                "token_ids": ids,
                "logprobs": {
                    "content": [{"token": f"{t:05d} ", "logprob": lp} for t, lp in zip(ids, lps, strict=True)]
                },
                "finish_reason": finish,
                "stop_reason": None,
            }
            for i, (ids, lps, finish) in enumerate(outs)
        ]
        usage = {"prompt_tokens": len(prompt), "completion_tokens": sum(len(o[0]) for o in outs)}
        return web.json_response({"id": "c", "object": "chat.completion", "model": body.get("model", MODEL),
                                  "prompt_token_ids": prompt, "choices": choices, "usage": usage})  # fmt: skip

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        if "messages" in body:
            tokens = self.tok.render(body["messages"], body.get("add_generation_prompt", True))
        else:
            tokens = self.tok.ids(body.get("prompt") or "")
        return web.json_response({"count": len(tokens), "max_model_len": self.engine.p.max_model_len, "tokens": tokens})

    async def models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def metrics(self, _: web.Request) -> web.Response:
        e = self.engine
        usage = e.kv_used / e.p.kv_capacity_tokens
        st = e.stats
        label = f'{{model_name="{MODEL}"}}'
        lines = [
            f"vllm:num_requests_running{label} {len(e.running)}",
            f"vllm:num_requests_waiting{label} {len(e.waiting)}",
            f"vllm:kv_cache_usage_perc{label} {usage:.6f}",
            f"vllm:gpu_cache_usage_perc{label} {usage:.6f}",
            f"vllm:num_preemptions_total{label} {e.preemptions_total}",
            f"vllm:prefix_cache_queries_total{label} {st.cache_queried}",
            f"vllm:prefix_cache_hits_total{label} {st.cache_hit}",
            f"vllm:generation_tokens_total{label} {st.generated}",
            f"vllm:prompt_tokens_total{label} {st.prompt_tokens}",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def sim_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.engine.snapshot(reset=request.method == "POST"))

    async def pause(self, _: web.Request) -> web.Response:
        self.engine.paused = True
        return web.json_response({"status": "paused"})

    async def resume(self, _: web.Request) -> web.Response:
        self.engine.paused = False
        self.engine.wake.set()
        return web.json_response({"status": "resumed"})

    async def is_paused(self, _: web.Request) -> web.Response:
        return web.json_response({"is_paused": self.engine.paused})

    async def set_version(self, request: web.Request) -> web.Response:
        self.engine.weight_version = str((await request.json())["new_version"])
        return web.json_response({"weight_version": self.engine.weight_version})

    async def weight_info(self, _: web.Request) -> web.Response:
        return web.json_response({"weight_version": self.engine.weight_version})

    async def reset_prefix_cache(self, _: web.Request) -> web.Response:
        self.engine.cache.clear()
        return web.json_response({"success": True})

    async def health(self, _: web.Request) -> web.Response:
        return web.json_response({})

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 << 20)
        app.on_startup.append(self._start)
        app.add_routes(
            [
                web.post("/v1/completions", self.completions),
                web.post("/v1/chat/completions", self.chat),
                web.post("/tokenize", self.tokenize),
                web.get("/v1/models", self.models),
                web.get("/metrics", self.metrics),
                web.get("/sim/stats", self.sim_stats),
                web.post("/sim/stats", self.sim_stats),
                web.post("/pause", self.pause),
                web.post("/resume", self.resume),
                web.get("/is_paused", self.is_paused),
                web.post("/update_weight_version", self.set_version),
                web.get("/weight_info", self.weight_info),
                web.post("/reset_prefix_cache", self.reset_prefix_cache),
                web.get("/health", self.health),
            ]
        )
        return app

    async def _start(self, app: web.Application) -> None:
        self.engine.t0 = time.monotonic()
        app["engine"] = asyncio.create_task(self.engine.run())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=0, help="0: one the system picks (see --port-file)")
    parser.add_argument("--port-file", type=Path, help="once listening, write the port here")
    parser.add_argument("--setup", choices=sorted(SETUPS), default=H100_LLAMA8B.setup)
    parser.add_argument("--params", type=Path, help="a JSON file of Params (a fitted engine) instead of --setup")
    parser.add_argument("--time-scale", type=float, default=1.0, help="simulated seconds per wall second")
    parser.add_argument("--max-num-seqs", type=int, help="override the setup's")
    parser.add_argument("--kv-capacity", type=int, help="override the setup's KV capacity (tokens)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    params = load_params(args.setup, args.params)
    if args.max_num_seqs:
        params.max_num_seqs = args.max_num_seqs
    if args.kv_capacity:
        params.kv_capacity_tokens = args.kv_capacity
    serve(lambda: Server(Engine(params, args.time_scale), args.seed).app(), args.port, args.port_file)


if __name__ == "__main__":
    main()
