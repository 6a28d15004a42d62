"""The Ray actor that runs one server process (a vLLM replica, an env, the service) on its node.

The actor is the process's keeper: it starts the server on its node's IP and its configured port,
waits until it answers, and exits if the server dies, so that Ray restarts the actor (up to
`max_restarts`), which starts the server again on the same port: the service finds it where it
was. The server is tied to the actor (killed with it), and a server a killed actor left behind is
stopped before its successor starts (its pid is kept in the logs folder).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

from ..tools.stack import ManagedProcess

# Actor names: f"{kind}-{index}" in the deployment's namespace.
KINDS = ("replica", "env", "service")


def actor_name(kind: str, index: int) -> str:
    return f"{kind}-{index}"


def piece_of(name: str) -> tuple[str, int] | None:
    """(kind, index) of a piece's actor name; None for any other named actor."""
    kind, _, index = name.rpartition("-")
    return (kind, int(index)) if kind in KINDS and index.isdigit() else None


class ServerProcess:
    """One server on this node. `cmd` may hold {host} and {port}; `builtin` ("vllm" or "refenv")
    builds the command here instead (the embedded model is prepared on this node)."""

    def __init__(
        self,
        name: str,
        port: int,
        ready_path: str,
        startup_timeout_s: float,
        logs_dir: str,
        env: dict[str, str],
        cmd: list[str] | None = None,
        builtin: dict[str, Any] | None = None,
    ) -> None:
        import ray

        self.name = name
        self.host = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.url = f"http://{self.host}:{port}"
        logs = Path(logs_dir)
        logs.mkdir(parents=True, exist_ok=True)
        stem = f"{ray.get_runtime_context().namespace}.{name}"  # deployments may share logs_dir
        self._pidfile = logs / f"{stem}.pid"
        _stop_leftover(self._pidfile)
        if builtin is not None:  # concrete already (it may hold JSON braces of its own)
            argv, base_env = _builtin_command(builtin, self.host, port, env)
        else:
            assert cmd is not None
            argv, base_env = [part.format(host=self.host, port=port) for part in cmd], dict(os.environ)
        process_env = {**base_env, **env}
        self._stopping = False
        self.proc = ManagedProcess(name, argv, logs / f"{stem}.log", process_env, die_with_parent=True)
        self.proc.start()
        assert self.proc.proc is not None
        self._pidfile.write_text(f"{self.proc.proc.pid} {_start_time(self.proc.proc.pid)}")
        try:
            self.proc.wait_http(f"{self.url}{ready_path}", timeout_s=startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        threading.Thread(target=self._watch, name=f"watch-{name}", daemon=True).start()

    def _watch(self) -> None:
        assert self.proc.proc is not None
        self.proc.proc.wait()
        if not self._stopping:
            # The server died: end the actor so that Ray restarts it, and the server with it.
            print(f"{self.name}: the server exited with code {self.proc.proc.returncode}", file=sys.stderr, flush=True)
            os._exit(1)

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            "host": self.host,
            "node_id": self.node_id,
            "pid": self.proc.proc.pid if self.proc.proc else None,
            "actor_pid": os.getpid(),
            "alive": self.proc.alive(),
            "log": str(self.proc.log_path),
        }

    def stop(self) -> None:
        self._stopping = True
        self.proc.stop()
        self._pidfile.unlink(missing_ok=True)


class ServiceProcess(ServerProcess):
    """The rollout service, wired at each start to the replicas and envs running now (found by
    their actor names), so that a restarted service comes back with the current membership."""

    def __init__(self, model: str, args: list[str], **common: Any) -> None:
        """`common`: ServerProcess's arguments but the command."""
        import ray

        urls: dict[str, list[str]] = {"replica": [], "env": []}
        for entry in sorted(ray.util.list_named_actors(all_namespaces=False)):
            piece = piece_of(entry)
            if piece is not None and piece[0] in urls:
                with contextlib.suppress(Exception):  # one restarting now is added back by `ray sync`
                    info: Any = ray.get(ray.get_actor(entry).info.remote(), timeout=30)
                    urls[piece[0]].append(info["url"])
        cmd = [
            sys.executable,
            "-m",
            "rollout_service.tools.cli",
            "serve",
            "--listen",
            "{host}:{port}",
            "--model",
            model,
        ]
        for url in urls["replica"]:
            cmd += ["--vllm", url]
        for url in urls["env"]:
            cmd += ["--env", url]
        # Pieces `ray scale` adds later run on the cluster's nodes: the service may reach those.
        for node in ray.nodes():
            if node.get("Alive") and node.get("NodeManagerAddress"):
                cmd += ["--allow-backends", node["NodeManagerAddress"]]
        super().__init__(cmd=cmd + args, **common)


def _builtin_command(
    builtin: dict[str, Any], host: str, port: int, env: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    if builtin["kind"] == "vllm":
        from inference import embedded_model, local_server

        cmd = local_server.vllm_command(embedded_model.prepare(), served_name=builtin["model"], host=host, port=port)
        # The piece's own `env` counts (an operator's thread settings); Ray has set OMP_NUM_THREADS to the
        # actor's num_cpus, so a CPU replica computes on the CPUs it reserved.
        base = {**os.environ, **env}
        return cmd, local_server.vllm_environment(
            kv_cache_gib=builtin["kv_cache_gib"], dev_mode=host == "127.0.0.1", base=base
        )
    if builtin["kind"] == "refenv":
        cmd = [sys.executable, "-m", "refenv.cli", "serve", "--step", "--listen", f"{host}:{port}"]
        return cmd + ["--pool", str(builtin["pool"]), *builtin["args"]], dict(os.environ)
    raise ValueError(f"unknown built-in server {builtin['kind']!r}")


def _start_time(pid: int) -> str:
    """When the process started (clock ticks since boot, /proc/PID/stat field 22): with the pid, it
    names one process; a pid reused later has another start time."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "?"


def _stop_leftover(pidfile: Path) -> None:
    """A server that an earlier incarnation of this actor left running (the actor was killed hard)
    holds the port: stop its process group first, if that pid is still that process."""
    try:
        pid_text, started = pidfile.read_text().split()
        pid = int(pid_text)
    except (OSError, ValueError):
        return
    if started != "?" and _start_time(pid) == started:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
    pidfile.unlink(missing_ok=True)
