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
from collections.abc import Callable
from typing import Any

import httpx

from .actors import ServerProcess, ServiceProcess, actor_name
from .config import ClusterConfig, Kind

Say = Callable[[str], None]


class ClusterError(Exception):
    """A cluster command cannot go on; the message says why and what to do."""


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
    return status(config)


def scale(config: ClusterConfig, kind: Kind, count: int, say: Say = print, timeout_s: float = 600.0) -> None:
    """Run `count` pieces of `kind` (replica or env): new ones join the service, the last ones
    leave it (drained, their episodes or turns finished) before their actors stop."""
    import ray

    if kind == "service":
        raise ClusterError("there is one service per deployment: scale replicas or envs")
    running = _indices(kind)
    service = _service_url()
    with _service_client(config, service) as http:
        for i in range(max(running, default=-1) + 1, count):
            info = _ready(_start(config, kind, i), kind, config.spec(kind).startup_timeout_s)
            path = "/envs" if kind == "env" else "/replicas"
            _call(http, "POST", path, {"url": info["url"], "timeout_s": min(timeout_s, 3600)})
            say(f"{actor_name(kind, i)}: {info['url']} on node {info['host']} joined the service")
        for i in sorted((i for i in running if i >= count), reverse=True):
            name = actor_name(kind, i)
            handle = ray.get_actor(name)
            url = _get(handle.info.remote(), timeout=30)["url"]
            path = "/envs/remove" if kind == "env" else "/replicas/remove"
            _call(http, "POST", path, {"url": url, "timeout_s": timeout_s})
            _stop(handle)
            say(f"{name}: left the service and stopped")


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
                entry["healthy"] = _answers(entry["url"] + spec.ready_path)
            pieces.append(entry)
    return {"namespace": config.namespace, "pieces": pieces}


def down(config: ClusterConfig, say: Say = print) -> int:
    """Stop every piece, the service first; how many were stopped."""
    import ray

    stopped = 0
    for kind in ("service", "env", "replica"):
        for i in sorted(_indices(kind)):
            _stop(ray.get_actor(actor_name(kind, i)))
            say(f"{actor_name(kind, i)}: stopped")
            stopped += 1
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
    common = {
        "name": actor_name(kind, index),
        "port": spec.port + index,
        "ready_path": spec.ready_path,
        "startup_timeout_s": spec.startup_timeout_s,
        "logs_dir": config.logs_dir,
        "env": dict(spec.env),
    }
    if kind == "service":
        args = list(config.service.args)
        if config.service.api_key_env:
            args += ["--api-key-env", config.service.api_key_env]
        actor = ray.remote(ServiceProcess).options(**options)
        return actor.remote(model=config.model, args=args, **common)
    builtin = None
    if spec.command is None:
        if kind == "replica":
            builtin = {"kind": "vllm", "model": config.model, "kv_cache_gib": config.replicas.kv_cache_gib}
        else:
            builtin = {"kind": "refenv", "pool": config.envs.pool, "args": list(config.envs.args)}
    return ray.remote(ServerProcess).options(**options).remote(cmd=spec.command, builtin=builtin, **common)


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


def _indices(kind: str) -> list[int]:
    import ray

    found = []
    for name in ray.util.list_named_actors(all_namespaces=False):
        prefix, _, index = name.rpartition("-")
        if prefix == kind and index.isdigit():
            found.append(int(index))
    return found


def _service_url() -> str:
    import ray

    try:
        return _get(ray.get_actor(actor_name("service", 0)).info.remote(), timeout=60)["url"]
    except Exception as exc:
        raise ClusterError(f"the service is not running ({type(exc).__name__}): run `ray up` first") from None


def _service_client(config: ClusterConfig, url: str) -> httpx.Client:
    headers = {}
    if config.service.api_key_env:
        key = os.environ.get(config.service.api_key_env)
        if not key:
            raise ClusterError(f"${config.service.api_key_env} (service.api_key_env) is not set here")
        headers["Authorization"] = f"Bearer {key}"
    return httpx.Client(base_url=url, headers=headers, timeout=None)


def _call(http: httpx.Client, method: str, path: str, body: dict) -> dict:
    response = http.request(method, path, json=body)
    if response.status_code >= 400:
        raise ClusterError(f"the service answered {method} {path} with {response.status_code}: {response.text[:500]}")
    return response.json()


def _get(ref: Any, timeout: float) -> Any:
    import ray

    return ray.get(ref, timeout=timeout)


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=3).status_code == 200
    except httpx.HTTPError:
        return False
