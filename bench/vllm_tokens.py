"""Completion tokens/s of a running model server at a given concurrency: the same chat prompts, each
request generating exactly `--tokens` tokens (ignore_eos), timed over `--rounds` rounds after one
warm-up round. For comparing ways of running the same server (dtype, threads, executor): start it
one way, measure, stop, start it the other way, measure; docs/benchmarks.md. With `--pid` (the
server's process: `rollout-service vllm` becomes it) each round also says how much CPU time the
server and its child processes used, and the last line how much they used idle for 3 s after.

    .venv/bin/python bench/vllm_tokens.py --vllm http://127.0.0.1:8000 --concurrency 8 --tokens 64 \
        --pid "$(pgrep -f vllm.entrypoints.openai.api_server)"
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time

import httpx
import psutil

from rollout_service.launch.embedded_model import MODEL_NAME


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


def cpu_seconds(pid: int | None) -> float:
    """User + system CPU time of `pid` and its descendants now alive (0 without a pid)."""
    if pid is None:
        return 0.0
    server = psutil.Process(pid)
    total = 0.0
    for proc in (server, *server.children(recursive=True)):
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


async def _main(args: argparse.Namespace) -> None:
    async with httpx.AsyncClient() as http:
        await _round(http, args)
        for r in range(args.rounds):
            started, cpu = time.monotonic(), cpu_seconds(args.pid)
            tokens = await _round(http, args)
            wall = time.monotonic() - started
            line = f"concurrency {args.concurrency}, {args.tokens} tokens, round {r}: {tokens / wall:.1f} tokens/s"
            if args.pid:
                line += f", server CPU {cpu_seconds(args.pid) - cpu:.1f} s in {wall:.1f} s"
            print(line, flush=True)
        if args.pid:
            cpu = cpu_seconds(args.pid)
            await asyncio.sleep(3)
            print(f"idle for 3 s after: server CPU {cpu_seconds(args.pid) - cpu:.2f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=MODEL_NAME)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--pid", type=int, help="the server's process: report its CPU time")
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
