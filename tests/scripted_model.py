"""A scripted OpenAI-compatible model server, for what the real vLLM cannot be made to do.

A stand-in, used only where a test needs a model that answers badly or takes a path on purpose:
an empty `choices` list, a context overflow (vLLM's 400), no token ids (a non-vLLM teacher), or a
completion that never answers (to force max_turns); or where the model server's own view is the
oracle (which replica or support server got which requests, when they arrived) or its timing must be
certain (a model slower than a deadline). Everything else in the tests uses real vLLM.

    python tests/scripted_model.py --port P --script SCRIPT [--name NAME] [--delay SECONDS] [--sql-turns K]
                                   [--listing-delay SECONDS] [--load-delay SECONDS] [--odd-seed-delay SECONDS]

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
  answer-breaks   answers as `answer`, with U+2028, U+2029 and U+0085 raw in the answer's text: JSON
                  carries them raw in a string, and many line readers split lines at them

Options:
  --name NAME       the served model name (default "scripted"), listed at /v1/models and echoed in answers
  --delay SECONDS   sleep this long before answering each chat request (default 0): a slow model
  --odd-seed-delay SECONDS
                    sleep this long (instead of --delay) before answering a chat request with an odd seed:
                    a group with an even seed s and one turn per attempt has its odd attempts slow (a tail)
  --sql-turns K     turns of `sql-then-answer` that run a query before it answers
  --first-delay SECONDS
                    sleep this long (instead of --delay) before answering the first chat request it gets:
                    one slow episode among fast ones, whichever comes first
  --listing-delay SECONDS
                    sleep this long before answering each GET /v1/models (default 0, counted on arrival):
                    a health probe that learns late what the server serves, so a request can reach a
                    restarted server before its prober does
  --load-delay SECONDS
                    sleep this long in each POST /v1/load_lora_adapter (default 0): a policy update
                    that holds the service's replica list for a known time

The models it serves, as vLLM started with `--enable-lora` and runtime LoRA updating:
  GET /v1/models    lists the served name, then every adapter loaded, as {"id": NAME} entries in `data`
  POST /v1/load_lora_adapter {"lora_name", "lora_path", "load_inplace"?}
                    `lora_path` must be an existing directory (nothing in it is read): else 404, vLLM's
                    {"error": {"message": "Loading lora X failed: No adapter found for PATH",
                    "type": "NotFoundError", ...}}. A name already loaded is 400 unless `load_inplace`;
                    the served name is 400. Else the name is served and the answer is 200 text
                    "Success: LoRA adapter 'X' added successfully." (vLLM's words, not JSON)
  POST /v1/unload_lora_adapter {"lora_name"}
                    forgets the adapter (200 text), or 404 when it is not loaded
  POST /v1/chat/completions
                    a `model` that is neither the served name nor a loaded adapter gets vLLM's 404
                    {"error": {"message": "The model `X` does not exist. ...", "type": "NotFoundError",
                    "param": "model", "code": 404}} at once (no delay); no `model` is the served name.
                    An adapter answers as the served name does, echoing the adapter's name.
Adapters live in the process: a restarted process serves the base name alone, as a restarted vLLM does.
A process started on the port a stopped one held binds it at once (asyncio's listening sockets set
SO_REUSEADDR), so a test can restart the model server where the service looks for it.

GET /stats: the server's own view, an oracle for the tests (per process: a restarted one starts empty):
  requests          chat requests received (counted on arrival, before any delay; refused ones too)
  listings          GET /v1/models calls
  by_prompt         chat requests per first user message (the task's prompt: one key per task)
  by_seed           chat requests per `seed` sent ("none" without one)
  by_model          chat requests per `model` asked for
  arrivals          each chat request's arrival time (time.monotonic(), seconds), in order
  adapters          the adapters loaded now, by name: the path each was loaded from
  events            what changed or asked for the served models, in the order it arrived:
                    "load:NAME" and "unload:NAME" for each adapter loaded or unloaded (refused ones
                    are not events), "chat:MODEL:STATUS" for each chat request on arrival, with the
                    status it is answered with (200; 404 for an unknown model; 400 for `overflow`)
  loads_started     POST /v1/load_lora_adapter calls received (counted on arrival, before --load-delay)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from rollout_service.listening import ReportingServer

ANSWER = json.dumps({"action": "answer", "input": "1"})
SQL = json.dumps({"action": "sql", "input": "SELECT 1"})
ANSWER_BREAKS = json.dumps({"action": "answer", "input": "1\u2028two\u2029three\u0085four"}, ensure_ascii=False)
OVERFLOW = (
    "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens "
    "(4900 in the messages, 100 in the completion). Please reduce the length of the messages or completion."
)


SCRIPTS = ["answer", "sql-forever", "empty-choices", "overflow", "no-ids", "sql-then-answer", "answer-breaks"]


def command(port: int, script: str, *flags: str) -> list[str]:
    """The command line that serves this stand-in on loopback `port` (flags: --name, --delay, --sql-turns,
    --listing-delay, --load-delay)."""
    return [sys.executable, os.path.abspath(__file__), "--port", str(port), "--script", script, *flags]


def _error(message: str, kind: str, status: int, param: str | None = None) -> JSONResponse:
    """vLLM's error body (`ErrorResponse`)."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status)


def _count(counts: dict, key: object) -> None:
    key = "none" if key is None else str(key)
    counts[key] = counts.get(key, 0) + 1


def build(
    script: str,
    name: str = "scripted",
    delay: float = 0.0,
    sql_turns: int = 2,
    listing_delay: float = 0.0,
    load_delay: float = 0.0,
    odd_seed_delay: float | None = None,
    first_delay: float | None = None,
) -> Starlette:
    adapters: dict[str, str] = {}  # loaded LoRA adapter name -> the path it was loaded from
    stats: dict = {
        "requests": 0,
        "listings": 0,
        "by_prompt": {},
        "by_seed": {},
        "by_model": {},
        "arrivals": [],
        "adapters": adapters,
        "events": [],
        "loads_started": 0,
    }

    async def models(request: Request) -> JSONResponse:
        stats["listings"] += 1
        if listing_delay:
            await asyncio.sleep(listing_delay)
        data = [{"id": served, "object": "model"} for served in [name, *adapters]]
        return JSONResponse({"object": "list", "data": data})

    async def load_adapter(request: Request) -> Response:
        body = await request.json()
        stats["loads_started"] += 1
        if load_delay:
            await asyncio.sleep(load_delay)
        lora_name, lora_path = body.get("lora_name"), body.get("lora_path")
        if not lora_name or not lora_path:
            return _error("Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400)
        if lora_name == name:
            return _error(
                f"The lora adapter '{lora_name}' conflicts with a served base model.", "InvalidUserInput", 400
            )
        if lora_name in adapters and not body.get("load_inplace"):
            return _error(
                f"The lora adapter '{lora_name}' has already been loaded. If you want to load the adapter in "
                "place, set 'load_inplace' to True.",
                "InvalidUserInput",
                400,
            )
        if not await asyncio.to_thread(os.path.isdir, lora_path):
            return _error(f"Loading lora {lora_name} failed: No adapter found for {lora_path}", "NotFoundError", 404)
        adapters[lora_name] = lora_path
        stats["events"].append(f"load:{lora_name}")
        return PlainTextResponse(f"Success: LoRA adapter '{lora_name}' added successfully.")

    async def unload_adapter(request: Request) -> Response:
        lora_name = (await request.json()).get("lora_name")
        if not lora_name:
            return _error("'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput", 400)
        if lora_name not in adapters:
            return _error(f"The lora adapter '{lora_name}' cannot be found.", "NotFoundError", 404)
        del adapters[lora_name]
        stats["events"].append(f"unload:{lora_name}")
        return PlainTextResponse(f"Success: LoRA adapter '{lora_name}' removed successfully.")

    async def chat(request: Request) -> JSONResponse:
        stats["arrivals"].append(time.monotonic())
        body = await request.json()
        stats["requests"] += 1
        first_user = next((m.get("content") for m in body["messages"] if m["role"] == "user"), None)
        _count(stats["by_prompt"], first_user)
        _count(stats["by_seed"], body.get("seed"))
        _count(stats["by_model"], body.get("model"))
        model = body.get("model") or name
        if model != name and model not in adapters:
            stats["events"].append(f"chat:{model}:404")
            return _error(
                f"The model `{model}` does not exist. Valid aliases: {name}.", "NotFoundError", 404, param="model"
            )
        stats["events"].append(f"chat:{model}:{400 if script == 'overflow' else 200}")
        wait = delay if odd_seed_delay is None or int(body.get("seed") or 0) % 2 == 0 else odd_seed_delay
        if first_delay is not None and stats["requests"] == 1:
            wait = first_delay
        if wait:
            await asyncio.sleep(wait)
        turns_so_far = sum(1 for m in body["messages"] if m["role"] == "assistant")
        if script == "overflow":
            return JSONResponse({"object": "error", "message": OVERFLOW, "type": "BadRequestError", "code": 400}, 400)
        if script == "empty-choices" and turns_so_far == 1 and int(body.get("seed") or 0) % 2 == 1:
            return JSONResponse(
                {
                    "id": "x",
                    "object": "chat.completion",
                    "model": model,
                    "choices": [],
                    "usage": {"prompt_tokens": 10, "completion_tokens": 0, "total_tokens": 10},
                }
            )
        text = SQL if script == "sql-forever" or (script == "empty-choices" and turns_so_far == 0) else ANSWER
        if script == "sql-then-answer":
            text = SQL if turns_so_far < sql_turns else ANSWER
        if script == "answer-breaks":
            text = ANSWER_BREAKS
        ids = list(range(100, 100 + len(text) // 4 + 1))
        choice: dict = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
        answer: dict = {
            "id": "x",
            "object": "chat.completion",
            "model": model,
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
            Route("/v1/load_lora_adapter", load_adapter, methods=["POST"]),
            Route("/v1/unload_lora_adapter", unload_adapter, methods=["POST"]),
            Route("/stats", stats_route),
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True, help="0: one the system picks (see --port-file)")
    parser.add_argument("--port-file", help="once listening, write the port here (as the service and refenv do)")
    parser.add_argument("--host", default="127.0.0.1", help="the address to listen on")
    parser.add_argument("--script", required=True, choices=SCRIPTS)
    parser.add_argument("--name", default="scripted", help="served model name")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds to sleep before each chat answer")
    parser.add_argument("--sql-turns", type=int, default=2, help="queries before answering (sql-then-answer)")
    parser.add_argument("--listing-delay", type=float, default=0.0, help="seconds to sleep before each /v1/models")
    parser.add_argument("--load-delay", type=float, default=0.0, help="seconds to sleep in each adapter load")
    parser.add_argument("--odd-seed-delay", type=float, default=None, help="seconds to sleep for an odd seed")
    parser.add_argument("--first-delay", type=float, default=None, help="seconds to sleep for the first chat request")
    args = parser.parse_args()
    app = build(
        args.script,
        name=args.name,
        delay=args.delay,
        sql_turns=args.sql_turns,
        listing_delay=args.listing_delay,
        load_delay=args.load_delay,
        odd_seed_delay=args.odd_seed_delay,
        first_delay=args.first_delay,
    )
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
    ReportingServer(config, Path(args.port_file) if args.port_file else None).run()


if __name__ == "__main__":
    main()
