"""A scripted OpenAI-compatible model server, for what the real vLLM cannot be made to do.

A stand-in, used only where a test needs a model that answers badly or takes a path on purpose:
an empty `choices` list, a context overflow (vLLM's 400), no token ids (a non-vLLM teacher), or a
completion that never answers (to force max_turns); or where the model server's own view is the
oracle (which replica or support server got which requests, when they arrived) or its timing must be
certain (a model slower than a deadline). Everything else in the tests uses real vLLM.

    python tests/scripted_model.py --port P --script SCRIPT [--name NAME] [--delay SECONDS] [--sql-turns K]

SCRIPT, one of:
  answer          every completion is {"action": "answer", "input": "1"}, with ids and logprobs
  sql-forever     every completion runs a query, so an episode only ends at its turn budget
  empty-choices   every completion runs a query, but the 2nd of an episode sampled with an odd seed
                  is an answer with "choices": [] (attempt i of a group with an even seed s samples
                  turn t with seed s + 7919 i + t, so attempts 0, 2, ... get it)
  overflow        every completion is refused with vLLM's context-length 400
  no-ids          answers as `answer`, but without token ids or logprobs (usage counts only)
  sql-then-answer runs a query on the first --sql-turns turns of an episode (default 2), then answers,
                  so every episode takes a known number of turns and is scored

Options:
  --name NAME       the served model name (default "scripted"), listed at /v1/models and echoed in answers
  --delay SECONDS   sleep this long before answering each chat request (default 0): a slow model
  --sql-turns K     turns of `sql-then-answer` that run a query before it answers

GET /stats: the server's own view, an oracle for the tests:
  requests          chat requests received (counted on arrival, before any delay)
  listings          GET /v1/models calls
  by_prompt         chat requests per first user message (the task's prompt: one key per task)
  by_seed           chat requests per `seed` sent ("none" without one)
  by_model          chat requests per `model` asked for
  arrivals          each chat request's arrival time (time.monotonic(), seconds), in order
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

ANSWER = json.dumps({"action": "answer", "input": "1"})
SQL = json.dumps({"action": "sql", "input": "SELECT 1"})
OVERFLOW = (
    "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens "
    "(4900 in the messages, 100 in the completion). Please reduce the length of the messages or completion."
)


SCRIPTS = ["answer", "sql-forever", "empty-choices", "overflow", "no-ids", "sql-then-answer"]


def command(port: int, script: str, *flags: str) -> list[str]:
    """The command line that serves this stand-in on loopback `port` (flags: --name, --delay, --sql-turns)."""
    return [sys.executable, os.path.abspath(__file__), "--port", str(port), "--script", script, *flags]


def _count(counts: dict, key: object) -> None:
    key = "none" if key is None else str(key)
    counts[key] = counts.get(key, 0) + 1


def build(script: str, name: str = "scripted", delay: float = 0.0, sql_turns: int = 2) -> Starlette:
    stats: dict = {"requests": 0, "listings": 0, "by_prompt": {}, "by_seed": {}, "by_model": {}, "arrivals": []}

    async def models(request: Request) -> JSONResponse:
        stats["listings"] += 1
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model"}]})

    async def chat(request: Request) -> JSONResponse:
        stats["arrivals"].append(time.monotonic())
        body = await request.json()
        stats["requests"] += 1
        first_user = next((m.get("content") for m in body["messages"] if m["role"] == "user"), None)
        _count(stats["by_prompt"], first_user)
        _count(stats["by_seed"], body.get("seed"))
        _count(stats["by_model"], body.get("model"))
        if delay:
            await asyncio.sleep(delay)
        turns_so_far = sum(1 for m in body["messages"] if m["role"] == "assistant")
        if script == "overflow":
            return JSONResponse({"object": "error", "message": OVERFLOW, "type": "BadRequestError", "code": 400}, 400)
        if script == "empty-choices" and turns_so_far == 1 and int(body.get("seed") or 0) % 2 == 1:
            return JSONResponse(
                {
                    "id": "x",
                    "object": "chat.completion",
                    "model": name,
                    "choices": [],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 0, "total_tokens": 10},
                }
            )
        text = SQL if script == "sql-forever" or (script == "empty-choices" and turns_so_far == 0) else ANSWER
        if script == "sql-then-answer":
            text = SQL if turns_so_far < sql_turns else ANSWER
        ids = list(range(100, 100 + len(text) // 4 + 1))
        choice: dict = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        answer: dict = {
            "id": "x",
            "object": "chat.completion",
            "model": name,
            "choices": [choice],
            "usage": {"prompt_tokens": 321, "completion_tokens": len(ids), "total_tokens": 321 + len(ids)},
        }
        if script != "no-ids":
            choice["token_ids"] = ids
            choice["logprobs"] = {"content": [{"token": str(i), "logprob": -0.5} for i in ids]}
            answer["prompt_token_ids"] = list(range(321))
        return JSONResponse(answer)

    async def stats_route(request: Request) -> JSONResponse:
        return JSONResponse(stats)

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/stats", stats_route),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--script", required=True, choices=SCRIPTS)
    parser.add_argument("--name", default="scripted", help="served model name")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds to sleep before each chat answer")
    parser.add_argument("--sql-turns", type=int, default=2, help="queries before answering (sql-then-answer)")
    args = parser.parse_args()
    app = build(args.script, name=args.name, delay=args.delay, sql_turns=args.sql_turns)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
