"""The FastAPI application: routes, error bodies, middlewares, and the service's lifetime."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from rollout_service import installed_version

from ...protocol import describe_errors
from ...viewer import SecurityHeaders, attach_viewer
from ..agents.sessions import AgentRefused
from ..config import ServiceConfig
from ..errors import (
    BackendFailed,
    BackendTimedOut,
    Conflict,
    Gone,
    Invalid,
    NotFound,
    RequestRefused,
    StartupError,
    TooBusy,
    Unavailable,
)
from ..service import RolloutService
from . import agent_routes, group_routes, membership_routes, policy_routes, sampler_routes, status_routes
from .auth import LoopbackHostOnly, PlaneAuth, attach_routes, service_keys, unmarked_routes
from .middleware import BodyLimit, RefuseControlPaths, error_response

log = logging.getLogger("rollout_service.app")


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI parses a body of this content type as JSON (application/json or */*+json)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _describe_validation(exc: RequestValidationError, content_type: str | None = None) -> tuple[int, str, str]:
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return 400, "invalid_json", "the body is not valid JSON"
    # The body as a whole is not an object (a field's error, or the object's own check, is not this).
    root = [e for e in errors if tuple(e.get("loc", ())) == ("body",) and not isinstance(e.get("input"), dict)]
    if root and not _is_json(content_type):
        # The body was never read as JSON, so "should be a valid dictionary" would be about bytes the
        # sender may well have written as JSON: `curl -d` alone labels them a form.
        sent = f"content-type: {content_type}" if content_type else "no content-type"
        return (
            422,
            "invalid_request",
            f"the body must be a JSON object sent with `content-type: application/json` (this request had {sent})",
        )
    if root and root[0].get("input") is not None:
        # JSON, but not an object: pydantic's "valid dictionary or object to extract fields from" names
        # a Python notion.
        kinds = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
        kind = kinds.get(type(root[0]["input"]), "something else")
        return 422, "invalid_request", f"the body must be a JSON object, not {kind}"
    return 422, "invalid_request", describe_errors(errors)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(*_describe_validation(exc, request.headers.get("content-type")))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    code = {400: "invalid_body", 404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    return error_response(exc.status_code, code, str(exc.detail))


# Each kind of refusal's HTTP status: the one place the rooms' errors meet HTTP.
HTTP_STATUS: dict[type[RequestRefused], int] = {
    NotFound: 404,
    Conflict: 409,
    Invalid: 422,
    Gone: 410,
    TooBusy: 429,
    BackendFailed: 502,
    Unavailable: 503,
    BackendTimedOut: 504,
}


def http_status(exc: RequestRefused) -> int:
    return next(HTTP_STATUS[kind] for kind in type(exc).__mro__ if kind in HTTP_STATUS)


async def _refused(request: Request, exc: RequestRefused) -> JSONResponse:
    headers = {} if exc.retry_after_s is None else {"Retry-After": str(exc.retry_after_s)}
    return error_response(http_status(exc), exc.error, exc.message, headers)


async def _bug(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(500, "internal_error", f"a bug in the service: {type(exc).__name__}: {exc}"[:500])


def _started(app: FastAPI, start: asyncio.Future) -> None:
    """Start-up gave up: keep why (the CLI logs it and exits 1) and stop the server."""
    if start.cancelled() or start.exception() is None:
        return
    failure = start.exception()
    if app.state.service.lifecycle.closing:  # a stop was asked for while it waited: not a failed start
        return
    if isinstance(failure, StartupError):
        app.state.service.lifecycle.startup_failure = str(failure)
    else:
        app.state.service.lifecycle.startup_failure = f"{type(failure).__name__}: {failure}"
        log.error("start-up failed", exc_info=failure)
    stop = getattr(app.state, "stop_server", None)
    if stop is not None:
        stop()


def create_app(config: ServiceConfig, service: RolloutService | None = None) -> FastAPI:
    keys = service_keys(config)  # first: a service that must not start builds nothing
    service = service or RolloutService(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loop = asyncio.get_running_loop()
        # For the server's signal handler: stop every group at once rather than wait for groups that
        # may run for minutes.
        app.state.cancel_running = lambda: loop.call_soon_threadsafe(service.cancel_running)
        # Listen at once and wait for the backends meanwhile (/health says `starting`): pieces that
        # come up in any order (compose, Kubernetes, Ray) need no readiness checks of their own.
        starting = asyncio.ensure_future(service.start())
        starting.add_done_callback(functools.partial(_started, app))
        try:
            yield
        finally:
            starting.cancel()
            await asyncio.wait([starting])
            await service.close()  # cancels running groups: their episodes are abandoned on the way out

    app = FastAPI(
        title="rollout-service",
        version=installed_version(),
        lifespan=lifespan,
        description="Reward groups for RL post-training, generated on vLLM against step-driven environments.",
        # A path one slash off names no route: a redirect would be an answer the keys were checked for
        # on another path than the one it sends the client to.
        redirect_slashes=False,
    )
    app.state.service = service
    for feature in (group_routes, policy_routes, membership_routes, sampler_routes, status_routes, agent_routes):
        attach_routes(app, feature.router)
    attach_viewer(app)  # the run viewer at /ui (rollout_service/viewer)
    unmarked = unmarked_routes(app.router.routes)
    if unmarked:  # a route on no plane would be served to whichever key the default let in
        raise RuntimeError(f"routes declared without a plane (auth.on_plane): {unmarked}")
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestRefused, _refused)  # type: ignore[arg-type]
    app.add_exception_handler(AgentRefused, agent_routes.refused)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _bug)
    app.add_middleware(BodyLimit, max_bytes=config.max_body_bytes)
    # Said in /health/detail for as long as it runs: an operator looking there sees it.
    app.state.warnings = [keys.warning] if keys.warning else []
    if config.env_token_env and not config.env_token():
        # Not fatal: an env that wants a token answers 401 at start, and the service says so then.
        missing = (
            f"--env-token-env {config.env_token_env}: that variable is empty or unset; no token is sent to the envs"
        )
        logging.getLogger("rollout_service").warning(missing)
        app.state.warnings.append(missing)
    if keys.data is not None or keys.admin is not None:
        # Outside the body cap: nothing is parsed before the key is checked.
        app.add_middleware(PlaneAuth, keys=keys, routes=app.router.routes)
    if keys.open_planes() and keys.warning is None:
        # A plane open on loopback trusts whoever can connect; a page rebound to 127.0.0.1 can.
        planes = " and ".join(keys.open_planes())
        app.add_middleware(LoopbackHostOnly, unkeyed=f"with the {planes} plane unkeyed, the service")
    app.add_middleware(RefuseControlPaths)  # before the keys, before routing
    app.add_middleware(SecurityHeaders)  # the viewer's CSP on its every answer, refusals included
    return app
