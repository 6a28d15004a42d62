"""Completion tokens/s of a running model server at a given concurrency: the same chat prompts, each
request generating exactly `--tokens` tokens (ignore_eos), timed over `--rounds` rounds after one
warm-up round. For comparing ways of running the same server (dtype, threads): start it one way,
measure, stop, start it the other way, measure; README, Benchmarks.

    .venv/bin/python bench/vllm_tokens.py --vllm http://127.0.0.1:8000 --concurrency 8 --tokens 64
"""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx

from inference.embedded_model import MODEL_NAME


async def _round(http: httpx.AsyncClient, args: argparse.Namespace) -> int:
    async def one(i: int) -> int:
        body = {
            "model": args.model,
            "messages": [{"role": "user", "content": f"Write a story about SQL number {i}."}],
            "max_tokens": args.tokens,
            "temperature": 0.8,
            "ignore_eos": True,
        }
        answer = await http.post(f"{args.vllm}/v1/chat/completions", json=body, timeout=600)
        answer.raise_for_status()
        return answer.json()["usage"]["completion_tokens"]

    return sum(await asyncio.gather(*(one(i) for i in range(args.concurrency))))


async def _main(args: argparse.Namespace) -> None:
    async with httpx.AsyncClient() as http:
        await _round(http, args)
        for r in range(args.rounds):
            started = time.monotonic()
            tokens = await _round(http, args)
            rate = tokens / (time.monotonic() - started)
            print(f"concurrency {args.concurrency}, {args.tokens} tokens, round {r}: {rate:.1f} tokens/s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=MODEL_NAME)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
