"""`rollout-service ray up | scale | status | down`: the pieces as named, detached Ray actors.

Names are `replica-<i>`, `env-<i>` and `service-0` in the config's namespace, so every command
finds what an earlier one placed. `up` starts what is missing (replicas and envs first, then the
service wired to them); `scale` starts or stops replicas or envs and tells the service through its
membership API (an env is drained before its actor stops: no episode is cut short); `down` stops
the service first (it abandons its episodes while the envs still answer), then everything else.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from ..keys import ADMIN_KEY_VAR, API_KEY_VAR, VLLM_KEY_VAR, ensure_key_file, read_key_file
from .actors import ServerProcess, ServiceProcess, actor_name, piece_of
from .config import ClusterConfig, ConfigError, Kind, with_count

Say = Callable[[str], None]


class ClusterError(Exception):
    """A cluster command cannot go on; the message says why and what to do. `error`: the service's
    error code when it refused a request."""

    def __init__(self, message: str, error: str | None = None) -> None:
        super().__init__(message)
        self.error = error


def connect(config: ClusterConfig, address: str | None) -> None:
    import ray

    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    try:
        ray.init(address=address, namespace=config.namespace, log_to_driver=False, logging_level=logging.ERROR)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise ClusterError(
            f"no Ray cluster at {address!r} ({exc}): start one (`ray start --head`) and pass --address or RAY_ADDRESS"
        ) from None


def up(config: ClusterConfig, say: Say = print) -> dict[str, Any]:
    """Start every piece that is not running; the service last, wired to the others."""
    for kind in ("replica", "env"):
        spec = config.spec(kind)
        handles = [_start(config, kind, i) for i in range(spec.count)]
        for i, handle in enumerate(handles):
            info = _ready(handle, kind, spec.startup_timeout_s)
            say(f"{actor_name(kind, i)}: {info['url']} on node {info['host']} ({info['node_id'][:12]})")
    info = _ready(_start(config, "service", 0), "service", config.service.startup_timeout_s)
    say(f"service-0: {info['url']} on node {info['host']} ({info['node_id'][:12]})")
    if not (config.service.api_key_env or config.service.admin_key_env):
        say(f"service keys: {keys_file(config)} (RolloutClient(url, key_file=...) reads it)")
    sync(config, say)  # a service that was running already learns of the pieces started now
    return status(config)


def scale(config: ClusterConfig, kind: Kind, count: int, say: Say = print, timeout_s: float = 600.0) -> None:
    """Run `count` pieces of `kind` (replica or env): new ones join the service, the last ones
    leave it (drained, their episodes or turns finished) before their actors stop."""
    import ray

    if kind == "service":
        raise ClusterError("there is one service per deployment: scale replicas or envs")
    try:
        config = with_count(config, kind, count)
    except ConfigError as exc:
        raise ClusterError(str(exc)) from None
    running = sorted(_indices(kind))
    free = (i for i in range(count + len(running)) if i not in running)
    starting = [next(free) for _ in range(count - len(running))]
    stopping = running[count:][::-1] if len(running) > count else []
    with _service_client(config, _service_url()) as http:
        for i in starting:
            handle = _start(config, kind, i)
            info = _ready(handle, kind, config.spec(kind).startup_timeout_s)
            try:
                _join(http, kind, info["url"], timeout_s)
            except ClusterError:
                _stop(handle)  # not left running outside the service
                raise
            say(f"{actor_name(kind, i)}: {info['url']} on node {info['host']} joined the service")
        for i in stopping:
            name = actor_name(kind, i)
            handle = ray.get_actor(name)
            try:
                url = _get(handle.info.remote(), timeout=60)["url"]
            except Exception as exc:
                raise ClusterError(f"{name} does not answer ({type(exc).__name__}): try again once it is up") from None
            _leave(http, kind, url, timeout_s)
            _stop(handle)
            say(f"{name}: left the service and stopped")
    sync(config, say)


def sync(config: ClusterConfig, say: Say = print, timeout_s: float = 120.0) -> None:
    """Make the service's membership the running pieces: add those it does not know (a piece Ray
    restarted on another node has a new URL; one started while the service restarted), remove the
    URLs no piece answers at any more (a piece gone for good)."""
    with _service_client(config, _service_url()) as http:
        for kind, listed in (("env", _call(http, "GET", "/envs")), ("replica", _call(http, "GET", "/policy"))):
            known = {e["url"] for e in (listed if kind == "env" else listed["replicas"])}
            running = {info["url"] for info in _running(kind)}
            for url in sorted(running - known):
                _join(http, kind, url, timeout_s)
                say(f"{kind} {url}: joined the service")
            for url in sorted(known - running):
                _leave(http, kind, url, timeout_s)
                say(f"{kind} {url}: no piece answers there any more; left the service")


def status(config: ClusterConfig) -> dict[str, Any]:
    """Each piece with its node, its process and whether it answers now; the service's own view."""
    import ray

    pieces = []
    for kind in ("replica", "env", "service"):
        spec = config.spec(kind)
        for i in sorted(_indices(kind)):
            name = actor_name(kind, i)
            entry: dict[str, Any] = {"name": name, "kind": kind}
            try:
                entry.update(_get(ray.get_actor(name).info.remote(), timeout=10))
            except Exception as exc:  # restarting, or gone for good: say so with Ray's words
                entry.update(alive=False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
            if entry.get("url"):
                key = _secret(config, _VLLM_KEY_KEY) if kind == "replica" else None
                entry["healthy"] = _answers(entry["url"] + spec.ready_path, key)
            pieces.append(entry)
    return {"namespace": config.namespace, "pieces": pieces}


def down(config: ClusterConfig, say: Say = print) -> int:
    """Stop every piece, the service first; how many were stopped."""
    import ray

    stopped = 0
    for kind in ("service", "env", "replica"):
        for i in sorted(_indices(kind)):
            try:
                handle = ray.get_actor(actor_name(kind, i))
            except ValueError:  # gone meanwhile
                continue
            _stop(handle)
            say(f"{actor_name(kind, i)}: stopped")
            stopped += 1
    from ray.experimental import internal_kv

    for name in (_ENV_TOKEN_KEY, _VLLM_KEY_KEY):  # the next `up` makes new ones
        internal_kv._internal_kv_del(name, namespace=config.namespace)
    return stopped


# -- helpers ---------------------------------------------------------------------------------------


def _start(config: ClusterConfig, kind: Kind, index: int) -> Any:
    """The actor for piece `index` of `kind`: the running one, or a new one placed by Ray."""
    import ray

    spec = config.spec(kind)
    options: dict[str, Any] = {
        "name": actor_name(kind, index),
        "namespace": config.namespace,
        "lifetime": "detached",
        "get_if_exists": True,
        "max_restarts": spec.max_restarts,
        "num_cpus": spec.num_cpus,
        "num_gpus": spec.num_gpus,
        "resources": dict(spec.resources),
    }
    env = dict(spec.env)
    common = {
        "name": actor_name(kind, index),
        "port": spec.port + index,
        "ready_path": spec.ready_path,
        "startup_timeout_s": spec.startup_timeout_s,
        "logs_dir": config.logs_dir,
        "env": env,
    }
    if kind != "replica":
        # The envs answer only the service (refenv's --token, as REFENV_TOKEN; other envs ignore it).
        env[ENV_TOKEN_VAR] = _env_token(config)
    if kind != "env":
        # The replicas listen on their node's routable address: their completions answer only the service
        # (vLLM reads $VLLM_API_KEY, a `command` replica's `vllm serve` too; other servers ignore it).
        env[VLLM_KEY_VAR] = _secret(config, _VLLM_KEY_KEY)
    if kind == "service":
        args = [
            *config.service.args,
            "--env-token-env",
            ENV_TOKEN_VAR,
            "--vllm-api-key-env",
            VLLM_KEY_VAR,
            *_key_flags(config, env),
        ]
        actor = ray.remote(ServiceProcess).options(**options)
        return actor.remote(model=config.model, args=args, **common)
    builtin = None
    if spec.command is None:
        if kind == "replica":
            builtin = {"kind": "vllm", "model": config.model, "kv_cache_gib": config.replicas.kv_cache_gib}
        else:
            builtin = {"kind": "refenv", "pool": config.envs.pool, "args": list(config.envs.args)}
    return ray.remote(ServerProcess).options(**options).remote(cmd=spec.command, builtin=builtin, **common)


ENV_TOKEN_VAR = "REFENV_TOKEN"
_ENV_TOKEN_KEY = b"rollout-service/env-token"
_VLLM_KEY_KEY = b"rollout-service/vllm-key"


def _env_token(config: ClusterConfig) -> str:
    return _secret(config, _ENV_TOKEN_KEY)


def _secret(config: ClusterConfig, name: bytes) -> str:
    """One of the deployment's secrets (the env token, the replicas' key): made by the first `up`, kept in
    the cluster (Ray's key-value store, per namespace) so that later commands and restarted pieces use
    the same one."""
    from ray.experimental import internal_kv

    internal_kv._internal_kv_put(name, secrets.token_urlsafe(32).encode(), overwrite=False, namespace=config.namespace)
    value = internal_kv._internal_kv_get(name, namespace=config.namespace)
    assert isinstance(value, bytes)
    return value.decode()


def _ready(handle: Any, kind: str, timeout_s: float) -> dict[str, Any]:

    try:
        return _get(handle.info.remote(), timeout=timeout_s + 60)
    except Exception as exc:
        raise ClusterError(f"a {kind} did not start: {type(exc).__name__}: {str(exc)[-1500:]}") from None


def _stop(handle: Any) -> None:
    import ray

    try:
        _get(handle.stop.remote(), timeout=60)
    except Exception:  # dead or restarting: killing the actor takes its server with it
        pass
    ray.kill(handle, no_restart=True)


def _running(kind: str) -> list[dict[str, Any]]:
    """The info of each piece of `kind` that answers now."""
    import ray

    found = []
    for i in _indices(kind):
        try:
            found.append(_get(ray.get_actor(actor_name(kind, i)).info.remote(), timeout=30))
        except Exception:  # restarting, or gone meanwhile: the next sync sees it
            continue
    return found


def _join(http: httpx.Client, kind: str, url: str, timeout_s: float) -> None:
    """Add the piece; a replica is asked again while a policy update holds the service's replica
    list (409 policy_busy: it joins between updates), until `timeout_s`."""
    path = "/envs" if kind == "env" else "/replicas"
    deadline = time.monotonic() + timeout_s
    while True:
        left = max(1.0, deadline - time.monotonic())
        try:
            _call(http, "POST", path, {"url": url, "timeout_s": min(left, 3600)})
            return
        except ClusterError as exc:
            if exc.error != "policy_busy" or time.monotonic() >= deadline:
                raise


def _leave(http: httpx.Client, kind: str, url: str, timeout_s: float) -> None:
    path = "/envs/remove" if kind == "env" else "/replicas/remove"
    _call(http, "POST", path, {"url": url, "timeout_s": timeout_s})


def _indices(kind: str) -> list[int]:
    import ray

    pieces = [piece_of(name) for name in ray.util.list_named_actors(all_namespaces=False)]
    return [piece[1] for piece in pieces if piece is not None and piece[0] == kind]


def _service_url() -> str:
    import ray

    try:
        return _get(ray.get_actor(actor_name("service", 0)).info.remote(), timeout=60)["url"]
    except Exception as exc:
        raise ClusterError(f"the service is not running ({type(exc).__name__}): run `ray up` first") from None


def keys_file(config: ClusterConfig) -> Path:
    return Path(config.service.keys_file.replace("{namespace}", config.namespace)).expanduser()


def _key_flags(config: ClusterConfig, env: dict[str, str]) -> list[str]:
    """The service's key flags. The service listens on its node's address: with no key named in the
    config, both are generated once into keys_file (kept across `up`s) and handed to the service in
    its environment."""
    spec = config.service
    if spec.api_key_env or spec.admin_key_env:
        flags = ["--api-key-env", spec.api_key_env] if spec.api_key_env else []
        return flags + (["--admin-key-env", spec.admin_key_env] if spec.admin_key_env else [])
    try:
        keys = read_key_file(ensure_key_file(keys_file(config)))
    except (OSError, ValueError) as exc:
        raise ClusterError(f"service.keys_file {keys_file(config)}: {exc}") from None
    env.update({API_KEY_VAR: keys[API_KEY_VAR], ADMIN_KEY_VAR: keys[ADMIN_KEY_VAR]})
    return ["--api-key-env", API_KEY_VAR, "--admin-key-env", ADMIN_KEY_VAR]


def _admin_key(config: ClusterConfig) -> str | None:
    """The key ray commands send the service: its admin key, by the config's variable or keys_file."""
    spec = config.service
    var = spec.admin_key_env or spec.api_key_env
    if var:
        key = os.environ.get(var)
        if not key:
            raise ClusterError(f"${var} (service.{'admin' if spec.admin_key_env else 'api'}_key_env) is not set here")
        return key
    try:
        return read_key_file(keys_file(config)).get(ADMIN_KEY_VAR)
    except OSError:
        raise ClusterError(f"no keys at {keys_file(config)} (service.keys_file): run `ray up` here first") from None


def _service_client(config: ClusterConfig, url: str) -> httpx.Client:
    key = _admin_key(config)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=url, headers=headers, timeout=None)


def _call(http: httpx.Client, method: str, path: str, body: dict | None = None) -> Any:
    try:
        response = http.request(method, path, json=body)
    except httpx.HTTPError as exc:
        raise ClusterError(f"the service does not answer {method} {path}: {exc}") from None
    if response.status_code >= 400:
        try:
            error = response.json().get("error")
        except (ValueError, AttributeError):
            error = None
        raise ClusterError(
            f"the service answered {method} {path} with {response.status_code}: {response.text[:500]}", error
        )
    return response.json()


def _get(ref: Any, timeout: float) -> Any:
    import ray

    return ray.get(ref, timeout=timeout)


def _answers(url: str, api_key: str | None = None) -> bool:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        return httpx.get(url, timeout=3, headers=headers).status_code == 200
    except httpx.HTTPError:
        return False
