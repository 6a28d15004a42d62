"""Is a group's identical first-turn prompt faster as one request with n=k, or as k requests?

    .venv/bin/python bench/first_turn_n.py --vllm http://127.0.0.1:8000 [--k 8] [--rounds 5]

Sends the same first observation refenv gives (system prompt + task, with its response_format)
to the same vLLM server both ways, alternating, and prints completion tokens/s of each and the
ratio. Run it against an otherwise idle server.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from refenv.agent import ACTION_SCHEMA, SYSTEM_PROMPT
from rollout_service.backends.replica_pool import ReplicaPool
from rollout_service.launch.embedded_model import MODEL_NAME
from rollout_service.protocol import SamplingParams

MESSAGES = [
    {"role": "system", "content": SYSTEM_PROMPT},
    {"role": "user", "content": "How many rows does the customers table have?"},
]
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "action", "schema": ACTION_SCHEMA}}


async def one_request(client: ReplicaPool, k: int, sampling: SamplingParams) -> int:
    result = await client.chat(
        model=MODEL_NAME, messages=MESSAGES, sampling=sampling.model_dump(), n=k, response_format=RESPONSE_FORMAT
    )
    return sum(len(c.completion_token_ids or ()) for c in result.choices)


async def k_requests(client: ReplicaPool, k: int, sampling: SamplingParams) -> int:
    results = await asyncio.gather(
        *(
            client.chat(
                model=MODEL_NAME, messages=MESSAGES, sampling=sampling.model_dump(), response_format=RESPONSE_FORMAT
            )
            for _ in range(k)
        )
    )
    return sum(len(r.choices[0].completion_token_ids or ()) for r in results)


async def run(url: str, k: int, rounds: int, max_tokens: int) -> None:
    client = ReplicaPool([url])
    sampling = SamplingParams(temperature=0.8, max_tokens=max_tokens)
    rates: dict[str, list[float]] = {"n=k": [], "k requests": []}
    await k_requests(client, k, sampling)  # warm the prefix cache and the grammar cache
    for _ in range(rounds):
        for name, fn in (("n=k", one_request), ("k requests", k_requests)):
            started = time.monotonic()
            tokens = await fn(client, k, sampling)
            rates[name].append(tokens / (time.monotonic() - started))
    await client.aclose()
    a, b = statistics.median(rates["n=k"]), statistics.median(rates["k requests"])
    print(
        f"k={k}, max_tokens={max_tokens}, {rounds} rounds (median completion tokens/s): "
        f"n=k {a:.0f}, k requests {b:.0f}, ratio n=k / k requests = {a / b:.2f}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm", default="http://127.0.0.1:8000")
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    asyncio.run(run(args.vllm, args.k, args.rounds, args.max_tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main())
