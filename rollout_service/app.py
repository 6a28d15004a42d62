"""The HTTP API: POST /groups, POST /groups/batch (NDJSON stream), /health, /tasks, /metrics."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
from typing import AsyncIterator, Awaitable, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .config import ServiceConfig
from .schemas import BatchRequest, ErrorBody, GroupRequest, GroupResult
from .service import RequestError, RolloutService

T = TypeVar("T")
_ERRORS = {400: {"model": ErrorBody}, 404: {"model": ErrorBody}, 409: {"model": ErrorBody},
           413: {"model": ErrorBody}, 422: {"model": ErrorBody}}


def _error(status: int, error: str, message: str) -> JSONResponse:
    return JSONResponse({"error": error, "message": message}, status_code=status)


def _describe_validation(exc: RequestValidationError) -> tuple[int, str, str]:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return 400, "invalid_json", "the body is not valid JSON"
    parts = []
    for e in errors[:5]:
        loc = ".".join(str(p) for p in e.get("loc", ()) if p != "body") or "body"
        msg = str(e.get("msg", "invalid")).removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}")
    return 422, "invalid_request", "; ".join(parts)


class _BodyLimit:
    """Refuse bodies over the cap with 413 before FastAPI parses them (ASGI middleware)."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        length = headers.get(b"content-length")
        too_big = JSONResponse({"error": "body_too_large",
                                "message": f"request bodies are capped at {self.max_bytes} bytes"}, 413)
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await too_big(scope, receive, send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, counted, send)
        except _TooLarge:
            await too_big(scope, receive, send)


class _TooLarge(Exception):
    pass


class _BearerAuth:
    """With --api-key-env, every path but /health needs `Authorization: Bearer <key>`."""

    def __init__(self, app, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] != "/health":
            header = dict(scope.get("headers") or ()).get(b"authorization", b"")
            scheme, _, token = header.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                response = JSONResponse({"error": "unauthorized", "message": "send Authorization: Bearer <key>"},
                                        401, headers={"WWW-Authenticate": "Bearer"})
                return await response(scope, receive, send)
        return await self.app(scope, receive, send)


async def _watch_disconnect(request: Request) -> None:
    """Return when the client goes away (after the body is read, receive() waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; cancel it (and so abandon its episodes) if the client disconnects first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_watch_disconnect(request))
    try:
        await asyncio.wait([task, watcher], return_when=asyncio.FIRST_COMPLETED)
        if not task.done():
            task.cancel()
            await asyncio.wait([task])
            raise asyncio.CancelledError("client disconnected")
        if task.cancelled():
            raise RequestError(503, "shutting_down", "the service is shutting down; this group's episodes "
                               "were abandoned and its worlds given back. Send it again to a running service")
        return task.result()
    finally:
        watcher.cancel()
        if not task.done():  # we were cancelled ourselves (shutdown)
            task.cancel()
            await asyncio.wait([task])


def create_app(config: ServiceConfig, service: RolloutService | None = None) -> FastAPI:
    service = service or RolloutService(config)
    running: set[asyncio.Task] = set()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        loop = asyncio.get_running_loop()
        # Called from the server's signal handler: stop every group now, abandoning its episodes,
        # instead of waiting for groups that may run for minutes.
        app.state.cancel_running = lambda: loop.call_soon_threadsafe(_cancel_all)
        await service.start()
        try:
            yield
        finally:
            # Shutdown: cancel every running group; their episodes are abandoned on the way out.
            _cancel_all()
            if running:
                await asyncio.wait(running, timeout=30)
            await service.close()

    app = FastAPI(title="rollout-service", version="0.1.0", lifespan=lifespan,
                  description="Reward groups for RL post-training, generated on vLLM against step-driven "
                              "environments.")
    app.state.service = service

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(*_describe_validation(exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return _error(exc.status_code, code, str(exc.detail))

    @app.exception_handler(RequestError)
    async def request_error(request: Request, exc: RequestError) -> JSONResponse:
        return _error(exc.status, exc.error, exc.message)

    def _cancel_all() -> None:
        for task in list(running):
            task.cancel()

    def _track(coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        running.add(task)
        task.add_done_callback(running.discard)
        return task

    async def _run_one(request: GroupRequest, sequence: int | None = None) -> GroupResult:
        target, policy = service.resolve(request)
        service.metrics.groups_in_flight.inc()
        try:
            result = await service.runner.run_group(request, target, policy, sequence, service.run_id)
            service.record(result)
            return result
        finally:
            service.metrics.groups_in_flight.dec()

    @app.post("/groups", response_model=GroupResult, responses=_ERRORS, summary="Run one group")
    async def post_group(body: GroupRequest, request: Request) -> Response:
        service.resolve(body)  # refuse bad requests before any work starts
        result = await _unless_disconnected(request, _track(_run_one(body)))
        return Response(result.model_dump_json(by_alias=True), media_type="application/json")

    @app.post("/groups/batch", responses=_ERRORS, summary="Run many groups; stream each as it finishes",
              response_description="NDJSON: one line per group, {index, group} or {index, error}")
    async def post_batch(body: BatchRequest, request: Request) -> StreamingResponse:
        if len(body.groups) > config.max_batch:
            raise RequestError(422, "batch_too_large", f"{len(body.groups)} groups is over this service's "
                               f"maximum of {config.max_batch} per batch (--max-batch)")
        for i, group in enumerate(body.groups):
            try:
                service.resolve(group)
            except RequestError as exc:
                raise RequestError(exc.status, exc.error, f"groups[{i}]: {exc.message}") from None
        first = service.runner.next_sequence()
        # One sequence number per group, in batch order: earlier groups get worlds first.
        for _ in body.groups[1:]:
            service.runner.next_sequence()
        tasks = [_track(_run_one(g, first + i)) for i, g in enumerate(body.groups)]
        index_of = {t: i for i, t in enumerate(tasks)}
        return StreamingResponse(_stream(request, tasks, index_of), media_type="application/x-ndjson")

    async def _stream(request: Request, tasks: list[asyncio.Task], index_of: dict) -> AsyncIterator[bytes]:
        watcher = asyncio.ensure_future(_watch_disconnect(request))
        pending = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending | {watcher}, return_when=asyncio.FIRST_COMPLETED)
                if watcher in done:
                    return  # the trainer went away: the finally below abandons everything
                pending.discard(watcher)
                for task in done:
                    index = index_of[task]
                    if task.cancelled():
                        line = {"index": index, "error": {"error": "cancelled", "message": "group cancelled"}}
                    elif task.exception() is not None:
                        exc = task.exception()
                        line = {"index": index, "error": {"error": "group_failed", "message": str(exc)[:500]}}
                    else:
                        yield (json.dumps({"index": index, "group": task.result().model_dump(mode="json", by_alias=True)})
                               + "\n").encode()
                        continue
                    yield (json.dumps(line) + "\n").encode()
        finally:
            watcher.cancel()
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)

    @app.get("/health", summary="The service, each env and each model server, asked now")
    async def health() -> dict:
        return await service.health()

    @app.get("/tasks", summary="Tasks served by the envs")
    async def tasks() -> dict:
        listed = service.task_list()
        return {"tasks": listed, "count": len(listed)}

    @app.get("/metrics", summary="Prometheus metrics")
    async def metrics() -> Response:
        return Response(service.metrics.render(), media_type="text/plain; version=0.0.4")

    app.add_middleware(_BodyLimit, max_bytes=config.max_body_bytes)
    if config.api_key_env:
        key = os.environ.get(config.api_key_env)
        if not key:
            raise ValueError(f"--api-key-env {config.api_key_env}: that environment variable is empty or unset")
        app.add_middleware(_BearerAuth, key=key)  # outermost: nothing is parsed before the key is checked
    return app
