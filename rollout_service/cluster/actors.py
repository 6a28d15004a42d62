"""The Ray actor that runs one server process (a vLLM replica, an env, the service) on its node.

The actor is the process's keeper: it starts the server on its node's IP and its configured port,
waits until it answers, and exits if the server dies, so that Ray restarts the actor (up to
`max_restarts`), which starts the server again on the same port: the service finds it where it
was. The server is tied to the actor (killed with it), and a server a killed actor left behind is
stopped before its successor starts (its pid, start time and command line are kept in the logs
folder, a folder of the node's user that nobody else can write: what it names is what gets killed).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from ..keys import VLLM_KEY_VAR
from ..launch.stack import ManagedProcess

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
        logs_dir: str | None,
        env: dict[str, str],
        cmd: list[str] | None = None,
        builtin: dict[str, Any] | None = None,
    ) -> None:
        import ray

        self.name = name
        self.host = ray.util.get_node_ip_address()
        self.node_id = ray.get_runtime_context().get_node_id()
        self.url = f"http://{self.host}:{port}"
        logs = private_folder(Path(logs_dir) if logs_dir else default_logs_dir())
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
        if self.proc.pid is not None:  # None: the guard died first, and wait_http says why
            _write_pidfile(self._pidfile, self.proc.pid)
        try:
            # A replica's ready_path (/v1/models) asks for the key it was started with.
            self.proc.wait_http(f"{self.url}{ready_path}", timeout_s=startup_timeout_s, api_key=env.get(VLLM_KEY_VAR))
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
            "pid": self.proc.pid,  # the server itself, not its guard
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
        from ..launch import embedded_model, vllm_server

        cmd = vllm_server.vllm_command(embedded_model.prepare(), served_name=builtin["model"], host=host, port=port)
        # The piece's own `env` counts (an operator's thread settings); Ray has set OMP_NUM_THREADS to the
        # actor's num_cpus, so a CPU replica computes on the CPUs it reserved.
        base = {**os.environ, **env}
        return cmd, vllm_server.vllm_environment(
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


def default_logs_dir() -> Path:
    """This node's logs folder for this user: in the system's temporary folder, one per user id."""
    return Path(tempfile.gettempdir()) / f"rollout-service-ray-{os.geteuid()}"


def private_folder(folder: Path) -> Path:
    """`folder`, created 0700 if missing; refused unless it is a real folder of this user that nobody
    else can write or read. Its pid files say what `_stop_leftover` kills: in a folder others can
    write (the shared temporary folder), whoever writes there would choose."""
    folder.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        folder.mkdir(mode=0o700)
    info = folder.lstat()
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        raise PermissionError(f"logs folder {folder}: a symlink or not a folder; give logs_dir a folder of your own")
    if info.st_uid != os.geteuid():
        raise PermissionError(
            f"logs folder {folder}: owned by uid {info.st_uid}, not by this user ({os.geteuid()}); "
            "someone else made it: remove it, or give logs_dir a folder of your own"
        )
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise PermissionError(
            f"logs folder {folder}: others may use it (mode {stat.S_IMODE(info.st_mode):o}); chmod 700 it, "
            "or give logs_dir a folder of your own"
        )
    return folder


def _command_line(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0")[:-1]]


def _write_pidfile(pidfile: Path, pid: int) -> None:
    record = {"pid": pid, "started": _start_time(pid), "cmdline": _command_line(pid)}
    fd = os.open(pidfile, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)


def _stop_leftover(pidfile: Path) -> None:
    """A server that an earlier incarnation of this actor left running (the actor was killed hard)
    holds the port: stop its process group first, if that pid is still that process (its start time
    and its command line as recorded: a pid reused since, or a file naming another process, kills
    nothing)."""
    try:
        fd = os.open(pidfile, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd) as f:
            record = json.load(f)
        pid, started, cmdline = int(record["pid"]), str(record["started"]), record["cmdline"]
    except (OSError, ValueError, KeyError, TypeError):
        pidfile.unlink(missing_ok=True)
        return
    if started != "?" and _start_time(pid) == started and cmdline and _command_line(pid) == cmdline:
        # The server's group (its guard's, which a killed guard leaves to the server alone): all it started.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(os.getpgid(pid), signal.SIGKILL)
    pidfile.unlink(missing_ok=True)
