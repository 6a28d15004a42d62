"""A scripted OpenAI-compatible chat server that answers with OpenAI `tool_calls`, in this process.

A stand-in, for what the real model cannot be made to do: the embedded 135M model does not call
tools on demand, so an agent's tool loop (a call, its result, an error fed back, a hang to stop, a
failure mid-run) is driven from a script instead. It serves what an agent sees at its `base_url`:
POST /chat/completions (and /v1/chat/completions), GET /models.

    with ToolModel([call("run_sql", sql="SELECT 1"), text("42")]) as model:
        ... base_url=model.url ...
        model.requests   # the JSON bodies received, in order

Each request takes the next reply of the script (the last one repeats): `call(name, **args)` (one tool
call), `call_raw(name, arguments_text)` (arguments exactly as given, e.g. not JSON), `text(content)`,
`HANG` (answers only when the server stops) or `FAIL` (HTTP 500).
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

HANG = {"hang": True}
FAIL = {"fail": True}


def call_raw(name: str, arguments: str) -> dict:
    return {"tool_calls": [{"name": name, "arguments": arguments}]}


def call(name: str, **args: Any) -> dict:
    return call_raw(name, json.dumps(args))


def text(content: str) -> dict:
    return {"content": content}


class ToolModel:
    def __init__(self, script: list[dict], name: str = "scripted-tools") -> None:
        self.script = list(script)
        self.name = name
        self.requests: list[dict] = []
        self.authorizations: list[str] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        app = Starlette(
            routes=[
                Route("/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/models", self._models, methods=["GET"]),
                Route("/v1/models", self._models, methods=["GET"]),
            ]
        )
        self._server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=1)
        )
        self._thread = threading.Thread(target=self._serve, daemon=True)

    @property
    def url(self) -> str:
        port = self._server.servers[0].sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1"

    def __enter__(self) -> ToolModel:
        self._thread.start()
        ready = threading.Event()

        def wait() -> None:
            while not self._server.started and self._thread.is_alive():
                ready.wait(0.02)

        wait()
        if not self._server.started:
            raise RuntimeError("the scripted tool model did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._server.should_exit = True
        self._thread.join(timeout=10)

    def _serve(self) -> None:
        async def main() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = asyncio.Event()
            await self._server.serve()

        asyncio.run(main())

    async def _models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": self.name, "object": "model"}]})

    async def _chat(self, request: Request) -> JSONResponse:
        body = await request.json()
        self.requests.append(body)
        self.authorizations.append(request.headers.get("authorization", ""))
        reply = self.script[min(len(self.requests), len(self.script)) - 1]
        if reply is HANG:
            assert self._stop is not None
            await self._stop.wait()
            return JSONResponse({"error": {"message": "stopped"}}, status_code=503)
        if reply is FAIL:
            return JSONResponse({"error": {"message": "scripted failure", "type": "InternalServerError"}}, 500)
        message: dict[str, Any] = {"role": "assistant", "content": reply.get("content")}
        finish = "stop"
        if "tool_calls" in reply:
            message["tool_calls"] = [
                {"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function", "function": c} for c in reply["tool_calls"]
            ]
            finish = "tool_calls"
        return JSONResponse(
            {
                "id": f"chatcmpl-{uuid.uuid4().hex}",
                "object": "chat.completion",
                "created": 0,
                "model": body.get("model", self.name),
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110},
            }
        )
