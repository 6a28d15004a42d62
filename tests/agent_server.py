"""A small agent server for the agent lane's tests (docs/agents.md): real HTTP, the `openai` client
against the per-attempt base_url the service lends each run.

    python tests/agent_server.py --port P --mode MODE [--pool N] [--turns K]

MODE, one of:
  chat      a conversation of --turns calls: the task's prompt, then "Go on." after each reply, the
            history kept as the client returned it (every other call streamed, its reply put together
            from the chunks); reward = number of replies that hold a digit
  rewrite   as chat, but from the third call on the history is condensed (the first exchange
            dropped): the service must start a new, labelled segment
  tools     tools list_tables and submit: the first call's tool_calls are run (list_tables answers
            "users, orders") and sent back with their results; the run's answer records the
            tool_calls it got (their names, ids and arguments) and the text of each reply
  loop      calls the model until it refuses; the answer records the refusal's status and code
  slow      never answers /run (until DELETE /run/{id} or the service hangs up)
  huge      answers /run with a 10 MB body after one call
  hostile   before a good call: its own attempt with a wrong token, another running attempt's id with
            its own token, max_tokens/temperature/n over the group's, a 10 MB history, a body over
            the cap declared unread; the answer records each status, then the run ends graded
  crash     answers /run with 500 episode_failed after one call

GET /counters: the server's own view, an oracle: runs started, running now, answered, deleted (ids of
runs a DELETE /run/{id} ended while running), the tokens each run was given by attempt id (for a
test's late call), and each run's request (limits, sampling).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path

import httpx
import openai
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollout_service.listening import ReportingServer

MODES = ["chat", "rewrite", "tools", "loop", "slow", "huge", "hostile", "crash"]
TASKS = [
    {"task_id": "count-1", "slug": "count", "prompt": "Count from 1 to 5, separated by commas."},
    {"task_id": "name-2", "slug": "name", "prompt": "Name three colours."},
]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "list_tables",
            "description": "The tables of the database.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "submit",
            "description": "Submit the answer.",
            "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
        },
    },
]


def command(mode: str, *flags: str) -> list[str]:
    """The command line that serves this agent server on a port the system picks (with --port-file)."""
    return [sys.executable, os.path.abspath(__file__), "--port", "0", "--mode", mode, *flags]


def build(mode: str, pool: int, turns: int) -> Starlette:
    counters: dict = {"runs": 0, "running": 0, "answered": 0, "deleted": [], "tokens": {}, "requests": []}
    tasks: dict[str, asyncio.Task] = {}

    async def health(request: Request) -> JSONResponse:
        return JSONResponse(
            {
                "status": "ready",
                "workers": pool,
                "tasks": len(TASKS),
                "dataset": {"catalog_hash": "agent-test-1"},
                "reward_version": "agent-test-r1",
                "reward_profile": "rl",
                "capabilities": {"drive_modes": ["agent"], "pool": pool},
            }
        )

    async def task_list(request: Request) -> JSONResponse:
        return JSONResponse({"tasks": TASKS})

    async def run(request: Request) -> Response:
        body = await request.json()
        attempt_id = body["attempt_id"]
        counters["runs"] += 1
        counters["running"] += 1
        counters["tokens"][attempt_id] = (body["base_url"], body["api_key"])
        counters["requests"].append({k: body[k] for k in ("attempt_id", "limits", "sampling", "model")})
        task = asyncio.ensure_future(episode(body))
        tasks[attempt_id] = task
        try:
            return await task
        except asyncio.CancelledError:
            if task.cancelled():  # ended by DELETE /run/{id}
                return JSONResponse({"attempt_id": attempt_id, "done": True, "status": "abandoned"})
            task.cancel()  # the service hung up
            raise
        finally:
            tasks.pop(attempt_id, None)
            counters["running"] -= 1

    async def episode(body: dict) -> Response:
        client = openai.AsyncOpenAI(base_url=body["base_url"], api_key=body["api_key"], max_retries=0, timeout=120)
        try:
            return await EPISODES[mode](client, body, turns, counters)
        finally:
            await client.close()

    async def end_run(request: Request) -> JSONResponse:
        attempt_id = request.path_params["attempt_id"]
        task = tasks.get(attempt_id)
        if task is None:
            return JSONResponse({"error": "episode_gone", "message": f"no run {attempt_id}"}, status_code=410)
        counters["deleted"].append(attempt_id)
        task.cancel()
        return JSONResponse({"attempt_id": attempt_id, "done": True, "status": "abandoned"})

    async def counters_route(request: Request) -> JSONResponse:
        return JSONResponse(counters)

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/tasks", task_list),
            Route("/run", run, methods=["POST"]),
            Route("/run/{attempt_id}", end_run, methods=["DELETE"]),
            Route("/counters", counters_route),
        ]
    )


def final(body: dict, counters: dict, reward: float, answer: object = None) -> JSONResponse:
    counters["answered"] += 1
    return JSONResponse(
        {
            "attempt_id": body["attempt_id"],
            "task_id": body["task_id"],
            "slug": body["slug"],
            "done": True,
            "status": "completed",
            "answer": answer,
            "pass": reward > 0,
            "reward": reward,
            "score": {"failure_category": None},
        }
    )


def opening(body: dict) -> list[dict]:
    prompt = next(t["prompt"] for t in TASKS if t["task_id"] == body["task_id"])
    return [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": prompt}]


async def chat(client: openai.AsyncOpenAI, body: dict, turns: int, counters: dict, rewrite: bool = False) -> Response:
    messages = opening(body)
    replies = []
    for i in range(turns):
        if rewrite and i == 2:  # the context condensed: the first exchange dropped
            messages = [messages[0], {"role": "user", "content": "So far: " + replies[0][:40]}, *messages[4:]]
        if i % 2:  # every other call streamed, its reply put together from the chunks
            stream = await client.chat.completions.create(model=body["model"], messages=messages, stream=True)
            reply = "".join([chunk.choices[0].delta.content or "" async for chunk in stream if chunk.choices])
            message = {"role": "assistant", "content": reply}
        else:
            got = await client.chat.completions.create(model=body["model"], messages=messages)
            reply = got.choices[0].message.content or ""
            message = got.choices[0].message.model_dump(exclude_none=True)
        replies.append(reply)
        messages += [message, {"role": "user", "content": "Go on."}]
    return final(body, counters, float(sum(any(c.isdigit() for c in r) for r in replies)), replies)


async def rewrite(client: openai.AsyncOpenAI, body: dict, turns: int, counters: dict) -> Response:
    return await chat(client, body, max(turns, 3), counters, rewrite=True)


async def tools(client: openai.AsyncOpenAI, body: dict, turns: int, counters: dict) -> Response:
    messages = opening(body)
    got_calls, texts = [], []
    for _ in range(2):
        got = await client.chat.completions.create(model=body["model"], messages=messages, tools=TOOLS)
        message = got.choices[0].message
        texts.append(message.content)
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            got_calls.append({"id": call.id, "name": call.function.name, "arguments": call.function.arguments})
            result = "users, orders" if call.function.name == "list_tables" else "submitted"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        if not message.tool_calls:
            break
    return final(body, counters, 1.0 if got_calls else 0.0, {"tool_calls": got_calls, "texts": texts})


async def loop(client: openai.AsyncOpenAI, body: dict, turns: int, counters: dict) -> Response:
    messages = opening(body)
    calls = 0
    while True:
        try:
            await client.chat.completions.create(model=body["model"], messages=messages, max_tokens=4)
        except openai.APIStatusError as exc:
            error = exc.body.get("code") if isinstance(exc.body, dict) else None
            return final(body, counters, 0.0, {"calls": calls, "status": exc.status_code, "code": error})
        calls += 1


async def slow(client: openai.AsyncOpenAI, body: dict, turns: int, counters: dict) -> Response:
    await asyncio.Event().wait()
    raise AssertionError("unreachable")


async def huge(client: openai.AsyncOpenAI, body: dict, turns: int, counters: dict) -> Response:
    await client.chat.completions.create(model=body["model"], messages=opening(body))
    return Response(b'{"done": true, "pad": "' + b"x" * (10 << 20) + b'"}', media_type="application/json")


async def crash(client: openai.AsyncOpenAI, body: dict, turns: int, counters: dict) -> Response:
    await client.chat.completions.create(model=body["model"], messages=opening(body))
    return JSONResponse({"error": "episode_failed", "message": "the agent crashed"}, status_code=500)


async def hostile(client: openai.AsyncOpenAI, body: dict, turns: int, counters: dict) -> Response:
    url, token = body["base_url"] + "/chat/completions", body["api_key"]
    good = {"model": body["model"], "messages": opening(body)}
    seen: dict[str, object] = {}
    async with httpx.AsyncClient(timeout=60) as http:

        async def ask(name: str, payload: bytes | dict, key: str = token, at: str = url, **headers: str) -> None:
            content = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            answer = await http.post(
                at, content=content, headers={"authorization": f"Bearer {key}", "content-type": "application/json"}
            )
            code = answer.json().get("error", {}).get("code") if answer.status_code >= 400 else None
            seen[name] = [answer.status_code, code]

        await ask("wrong_token", good, key="not-" + token)
        for _ in range(400):  # until a sibling attempt's run has started too (the group runs side by side)
            if len(counters["tokens"]) >= 2:
                break
            await asyncio.sleep(0.05)
        others = [a for a, (u, _) in counters["tokens"].items() if a != body["attempt_id"] and u != body["base_url"]]
        if others:  # another attempt's endpoint, with this attempt's token
            other_url = counters["tokens"][others[-1]][0] + "/chat/completions"
            await ask("other_attempt", good, at=other_url)
        group = body["sampling"]
        await ask("max_tokens", {**good, "max_tokens": group["max_tokens"] + 1})
        await ask("temperature", {**good, "temperature": group["temperature"] + 0.5})
        await ask("n", {**good, "n": 2})
        history = [*opening(body), {"role": "user", "content": "x" * (10 << 20)}]
        await ask("history_10mb", {**good, "messages": history})
        await ask("good", good)
    return final(body, counters, 1.0, seen)


EPISODES = {
    "chat": chat,
    "rewrite": rewrite,
    "tools": tools,
    "loop": loop,
    "slow": slow,
    "huge": huge,
    "hostile": hostile,
    "crash": crash,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--port-file")
    parser.add_argument("--mode", required=True, choices=MODES)
    parser.add_argument("--pool", type=int, default=4)
    parser.add_argument("--turns", type=int, default=2)
    args = parser.parse_args()
    app = build(args.mode, args.pool, args.turns)
    config = uvicorn.Config(app, host="127.0.0.1", port=args.port, log_level="warning")
    with contextlib.suppress(KeyboardInterrupt):
        ReportingServer(config, Path(args.port_file) if args.port_file else None).run()


if __name__ == "__main__":
    main()
