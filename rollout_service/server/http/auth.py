"""Two planes, two keys: who may ask what of the service.

The data plane (groups, tasks, the policy's state) is the trainers'; the admin plane (which envs and
model replicas the service uses, which policy it serves, pausing it) is the operators': whoever
holds it decides what completions and rewards a run learns from. Each plane has its own bearer key,
named by the variable holding it (`--api-key-env`, `--admin-key-env`; one key may serve both). Off
loopback the service starts only with both planes keyed, unless told `--insecure-no-auth`.

Each route names its plane where it is declared (`on_plane`), and a request's plane is the plane of
the route that will serve it, found the way the router finds it: never a second reading of the path,
which the router's own matching could disagree with (its `$` also matches before a final newline).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any
from urllib.parse import urlsplit

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send

from ...flags import parse_listen
from ..config import ServiceConfig
from .middleware import error_response

log = logging.getLogger("rollout_service.auth")


class Plane(StrEnum):
    PUBLIC = "public"  # anyone: a probe needs no key
    DATA = "data"  # the trainers' key (or the operators')
    ADMIN = "admin"  # the operators' key alone
    # An attempt's model endpoint (agent servers): no plane's key is taken, the route checks the token
    # of its attempt itself (server/agents/sessions.py).
    AGENT = "agent"


_PLANE_FIELD = "x-plane"  # where a route carries its plane: its OpenAPI operation, so the schema says it too


def on_plane(plane: Plane) -> dict[str, Any]:
    """A route's `openapi_extra`, naming the plane it is on: `@router.post(..., openapi_extra=on_plane(...))`."""
    return {_PLANE_FIELD: plane.value}


def route_plane(route: BaseRoute) -> Plane:
    """The plane a route was declared on. The framework's own pages (the OpenAPI schema, /docs) are data."""
    if isinstance(route, APIRoute):
        return Plane(route.openapi_extra[_PLANE_FIELD]) if route.openapi_extra else Plane.DATA
    return Plane.DATA


def attach_routes(app: FastAPI, router: APIRouter) -> None:
    """Put `router`'s routes themselves on `app`, not the router: PlaneAuth matches each route as the
    app's router does, and FastAPI 0.137+ keeps an included router as one opaque entry of app.routes."""
    app.router.routes.extend(router.routes)


def unmarked_routes(routes: Sequence[BaseRoute]) -> list[str]:
    """The service's routes declared without a plane (create_app refuses to build with any)."""
    return [
        f"{sorted(r.methods or ())} {r.path}"
        for r in routes
        if isinstance(r, APIRoute) and _PLANE_FIELD not in (r.openapi_extra or {})
    ]


def request_plane(routes: Sequence[BaseRoute], scope: Scope) -> Plane:
    """The plane of the route the router will give `scope` to, matched as the router matches: the first
    full match; else (the path matches, the method does not: a 405) the strictest plane among the routes
    matching the path; else (a 404) the data plane."""
    partial: list[Plane] = []
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            return route_plane(route)
        if match is Match.PARTIAL:
            partial.append(route_plane(route))
    if not partial:
        return Plane.DATA
    return max(partial, key=[Plane.PUBLIC, Plane.AGENT, Plane.DATA, Plane.ADMIN].index)


@dataclass(frozen=True)
class Keys:
    """The key each plane needs; None: that plane is open."""

    data: str | None
    admin: str | None
    # Set when the service listens off loopback with a plane open (--insecure-no-auth): said at
    # start and in /health/detail.
    warning: str | None = None

    def open_planes(self) -> list[str]:
        return [name for name, key in (("data", self.data), ("admin", self.admin)) if key is None]


def loopback_url(url: str) -> bool:
    """Whether `url` (or `//HOST[:PORT]`, a Host header) names this machine's loopback by its host alone,
    resolving nothing: localhost or a loopback address."""
    try:
        host = urlsplit(url).hostname or ""
    except ValueError:
        return False  # not a URL at all (an unclosed [ ...)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def loopback_listen(listen: str) -> bool:
    """Whether `HOST:PORT` listens on this machine's loopback only (every address the host names)."""
    host, _ = parse_listen(listen)
    host = host.strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    try:
        found = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return False  # uvicorn will fail to bind it anyway; never taken for loopback
    return bool(found) and all(ipaddress.ip_address(str(f[4][0]).split("%", 1)[0]).is_loopback for f in found)


def _key(flag: str, var: str | None, environ: Mapping[str, str]) -> str | None:
    if not var:
        return None
    key = environ.get(var)
    if not key:
        raise ValueError(f"{flag} {var}: that environment variable is empty or unset")
    return key


def service_keys(config: ServiceConfig, environ: Mapping[str, str] | None = None) -> Keys:
    """Each plane's key, or ValueError (the CLI prints it and exits 2) when a key is named but unset,
    or when the service would listen off loopback with a plane open and was not told it may."""
    environ = os.environ if environ is None else environ
    data = _key("--api-key-env", config.api_key_env, environ)
    admin = _key("--admin-key-env", config.admin_key_env, environ) or data  # one key may serve both
    keys = Keys(data, admin)
    if keys.open_planes() and not loopback_listen(config.listen):
        if not config.insecure_no_auth:
            raise ValueError(
                f"--listen {config.listen} is not loopback and the {' and '.join(keys.open_planes())} plane "
                "has no key: anyone who reaches the port could "
                + ("add envs and model servers or change the policy" if keys.admin is None else "run groups")
                + ". Put a key in an environment variable and name it: "
                "--api-key-env VAR (trainers: /groups, /tasks, GET /policy) and --admin-key-env VAR "
                "(operators: /envs, /replicas, POST /policy, /policy/pause; may be the same VAR); "
                "or pass --insecure-no-auth on a network where nobody else can reach the port"
            )
        keys = Keys(
            data,
            admin,
            f"--insecure-no-auth: listening on {config.listen} with the {' and '.join(keys.open_planes())} "
            "plane open to anyone who reaches the port",
        )
        log.warning(keys.warning)
    return keys


class PlaneAuth:
    """Every route but the public ones needs `Authorization: Bearer <key>`: the admin key on the admin
    plane, the data key (or the admin key: an operator may read what trainers read) elsewhere.
    Checked before anything is parsed; keys compared in constant time. Sets `scope["caller"]` to the
    key the request was let in with ("data", "admin"; "open" on a plane with no key): caps per key
    (sampler streams) read it."""

    def __init__(self, app: ASGIApp, keys: Keys, routes: Sequence[BaseRoute]) -> None:
        self.app = app
        self.routes = routes  # the app's route list itself: routes included later are seen
        self.data = keys.data.encode() if keys.data is not None else None
        self.admin = keys.admin.encode() if keys.admin is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        plane = request_plane(self.routes, scope)
        caller = "agent" if plane is Plane.AGENT else "open"
        if plane not in (Plane.PUBLIC, Plane.AGENT):
            admin = plane is Plane.ADMIN
            wanted = [("admin", self.admin)] if admin else [("data", self.data), ("admin", self.admin)]
            if wanted[0][1] is not None:  # the plane has a key
                header = dict(scope.get("headers") or ()).get(b"authorization", b"")
                scheme, _, token = header.partition(b" ")
                token = token.strip()
                # Every key compared, whatever matches first: the time taken says nothing.
                matches = [name for name, key in wanted if key is not None and hmac.compare_digest(token, key)]
                if scheme.lower() != b"bearer" or not matches:
                    what = "admin key (--admin-key-env)" if admin else "API key (--api-key-env)"
                    response = error_response(
                        401,
                        "unauthorized",
                        f"send Authorization: Bearer <the service's {what}>",
                        headers={"WWW-Authenticate": "Bearer"},
                    )
                    await response(scope, receive, send)
                    return
                caller = matches[0]
        scope["caller"] = caller
        await self.app(scope, receive, send)


class LoopbackHostOnly:
    """With no key, answer only requests addressed to a loopback name: a web page whose own host name
    was made to resolve to 127.0.0.1 (DNS rebinding) is same-origin with this server in the browser's
    eyes, and could otherwise use it with the browser's user's reach. Its requests carry that name as
    Host. `unkeyed` names who is answering unkeyed, for the refusal's message."""

    def __init__(self, app: ASGIApp, unkeyed: str) -> None:
        self.app = app
        self.unkeyed = unkeyed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "")
            if not loopback_url(f"//{host}"):
                message = (
                    f"Host {host!r} is not a loopback name: {self.unkeyed} answers "
                    "http://127.0.0.1, http://[::1] or http://localhost only"
                )
                await error_response(403, "forbidden", message)(scope, receive, send)
                return
        await self.app(scope, receive, send)
