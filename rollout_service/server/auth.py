"""Two planes, two keys: who may ask what of the service.

The data plane (groups, tasks, the policy's state) is the trainers'; the admin plane (which envs and
model replicas the service uses, which policy it serves, pausing it) is the operators': whoever
holds it decides what completions and rewards a run learns from. Each plane has its own bearer key,
named by the variable holding it (`--api-key-env`, `--admin-key-env`; one key may serve both). Off
loopback the service starts only with both planes keyed, unless told `--insecure-no-auth`.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from ..flags import parse_listen
from .config import ServiceConfig
from .middleware import error_response

log = logging.getLogger("rollout_service.auth")

# Paths anyone may ask: a probe needs no key.
PUBLIC_PATHS = frozenset({"/health"})


def admin_plane(method: str, path: str) -> bool:
    """Whether a request changes what the service runs on or serves (membership, policy updates)."""
    if path == "/envs" or path.startswith("/envs/") or path == "/replicas" or path.startswith("/replicas/"):
        return True
    return path.startswith("/policy") and not (method in ("GET", "HEAD") and path == "/policy")


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
    """Every path but the public ones needs `Authorization: Bearer <key>`: the admin key on the admin
    plane, the data key (or the admin key: an operator may read what trainers read) elsewhere.
    Checked before anything is parsed; keys compared in constant time."""

    def __init__(self, app: ASGIApp, keys: Keys) -> None:
        self.app = app
        self.data = keys.data.encode() if keys.data is not None else None
        self.admin = keys.admin.encode() if keys.admin is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            admin = admin_plane(scope["method"], scope["path"])
            wanted = [self.admin] if admin else [self.data, self.admin]
            if None not in wanted[:1]:  # the plane has a key
                header = dict(scope.get("headers") or ()).get(b"authorization", b"")
                scheme, _, token = header.partition(b" ")
                token = token.strip()
                # Every key compared, whatever matches first: the time taken says nothing.
                matches = [hmac.compare_digest(token, key) for key in wanted if key is not None]
                if scheme.lower() != b"bearer" or not any(matches):
                    plane = "admin key (--admin-key-env)" if admin else "API key (--api-key-env)"
                    response = error_response(
                        401,
                        "unauthorized",
                        f"send Authorization: Bearer <the service's {plane}>",
                        headers={"WWW-Authenticate": "Bearer"},
                    )
                    await response(scope, receive, send)
                    return
        await self.app(scope, receive, send)
