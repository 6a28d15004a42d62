"""`rollout-service view RUNLOG`: the viewer over a run log, after the service is gone. Read-only,
on loopback unless told otherwise; off loopback only with a key (--api-key-env)."""

from __future__ import annotations

import argparse
import os
import sys

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import RedirectResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..server.http.app import _http_error, _validation_error
from ..server.http.auth import Keys, LoopbackHostOnly, Plane, PlaneAuth, attach_routes, loopback_listen, on_plane
from .routes import PREFIX, SecurityHeaders, router
from .runlog_book import RunLogBook


def create_view_app(book: RunLogBook, key: str | None) -> FastAPI:
    app = FastAPI(title="rollout-service view", redirect_slashes=False, openapi_url=None, docs_url=None)
    app.state.viewer = book
    attach_routes(app, router)

    @app.get("/", openapi_extra=on_plane(Plane.PUBLIC), include_in_schema=False)
    async def home() -> Response:
        return RedirectResponse(PREFIX)

    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    if key is not None:
        app.add_middleware(PlaneAuth, keys=Keys(key, key), routes=app.router.routes)
    else:
        app.add_middleware(LoopbackHostOnly, unkeyed="without --api-key-env, `rollout-service view`")
    app.add_middleware(SecurityHeaders, prefix="")
    return app


def run(args: argparse.Namespace) -> int:
    import asyncio

    import uvicorn

    from ..flags import parse_listen
    from ..listening import ReportingServer
    from ..runs import find_run

    def refuse(message: str) -> int:
        print(f"rollout-service view: {message}", file=sys.stderr)
        return 2

    try:
        path = find_run(args.run, args.runs_dir)
        host, port = parse_listen(args.listen)
    except (FileNotFoundError, ValueError) as exc:
        return refuse(str(exc))
    key = None
    if args.api_key_env:
        key = os.environ.get(args.api_key_env)
        if not key:
            return refuse(f"--api-key-env {args.api_key_env}: that environment variable is empty or unset")
    elif not loopback_listen(args.listen):
        return refuse(f"--listen {args.listen} is not loopback: name a key with --api-key-env VAR")
    book = RunLogBook(path)
    try:
        asyncio.run(book.refresh())
    except OSError as exc:
        return refuse(f"cannot read {path}: {exc.strerror or exc}")
    print(f"viewing {path}: {len(book.summaries)} groups at http://{args.listen}{PREFIX}", file=sys.stderr)
    server = ReportingServer(
        uvicorn.Config(create_view_app(book, key), host=host, port=port, log_level="warning"), args.port_file
    )
    server.run()
    return 0 if server.started else 1
