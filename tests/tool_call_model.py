"""A stand-in model that calls a tool: the real vLLM behind a proxy that makes a turn sample a
Hermes `<tool_call>` block, which the small embedded model would not write on its own.

    python tests/tool_call_model.py --port P --upstream URL

Everything is passed to the upstream vLLM as it came, and its answers back as they came. One change:
a token-prompt completion (POST /v1/completions with a list of ids) whose prompt holds no
`<tool_response>` yet (the conversation has run no tool) is sent with a structured-output regex that
makes the model sample CALL below: real tokens, sampled by the real model under the constraint, with
their logprobs. GET /stats: the token ids of every answer so constrained (the oracle: what was sampled).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from rollout_service.listening import ReportingServer

CALL = '<tool_call>{"name": "list_tables", "arguments": {}}</tool_call>'
_REGEX = re.sub(r"([{}\[\]()])", r"\\\1", CALL)


def build(upstream: str) -> Starlette:
    http = httpx.AsyncClient(base_url=upstream, timeout=300)
    stats: dict = {"forced": []}
    marker: list[int] = []  # the ids of "<tool_response>", asked of the upstream once

    async def tool_response_ids(model: str) -> list[int]:
        if not marker:
            answer = await http.post("/tokenize", json={"model": model, "prompt": "<tool_response>"})
            marker.extend(answer.json()["tokens"])
        return marker

    def holds(ids: list[int], part: list[int]) -> bool:
        return any(ids[i : i + len(part)] == part for i in range(len(ids) - len(part) + 1))

    async def proxy(request: Request) -> Response:
        body = await request.body()
        forced = False
        if request.url.path == "/v1/completions":
            data = json.loads(body)
            prompt = data.get("prompt")
            if isinstance(prompt, list) and not holds(prompt, await tool_response_ids(data["model"])):
                data["structured_outputs"] = {"regex": _REGEX}
                body, forced = json.dumps(data).encode(), True
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}
        answer = await http.request(request.method, request.url.path, content=body, headers=headers)
        if forced and answer.status_code == 200:
            choice = answer.json()["choices"][0]
            stats["forced"].append([int(t.split(":", 1)[1]) for t in choice["logprobs"]["tokens"]])
        return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))

    async def stats_route(request: Request) -> JSONResponse:
        return JSONResponse(stats)

    methods = ["GET", "POST"]
    return Starlette(routes=[Route("/stats", stats_route), Route("/{path:path}", proxy, methods=methods)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--port-file")
    parser.add_argument("--upstream", required=True)
    args = parser.parse_args()
    config = uvicorn.Config(build(args.upstream), host="127.0.0.1", port=args.port, log_level="warning")
    with contextlib.suppress(KeyboardInterrupt):
        ReportingServer(config, Path(args.port_file) if args.port_file else None).run()


if __name__ == "__main__":
    main()
