"""Ports bound by the server and read back (rollout_service/listening.py): a server of ours started on
port 0 writes the port it bound to --port-file once it accepts connections, and a launcher reads it
there instead of guessing a free port that another process may take first."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import pytest
import uvicorn
from helpers import wait_until
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from rollout_service.launch.stack import ManagedProcess, StackError, fresh_port_file, refenv_command, service_command
from rollout_service.listening import ReportingServer, read_port_file


def _accepts(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            return True
    except OSError:
        return False


def test_the_port_file_names_a_port_that_already_listens(tmp_path: Path):
    """A real uvicorn whose app's start-up is held until the test lets it go: while it is held, any port
    the file names must accept a connection, and once written the port answers at once, with no retry.
    Break tried: the socket bound and the file written before uvicorn's start-up (then passed to
    uvicorn, which listens only after the app's start-up) -> the file names a port that refuses."""
    entered, go = threading.Event(), threading.Event()

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        entered.set()
        await asyncio.to_thread(go.wait, 30)
        yield

    app = Starlette(routes=[Route("/", lambda _r: PlainTextResponse("up"))], lifespan=lifespan)
    port_file = tmp_path / "server.port"
    server = ReportingServer(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"), port_file)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        assert entered.wait(30), "the app's start-up never ran"
        early = read_port_file(port_file)
        assert early is None or _accepts(early), f"the port file names {early} before the server listens there"
        go.set()
        assert wait_until(lambda: read_port_file(port_file) is not None, 30)
        port = read_port_file(port_file)
        assert port is not None and port != 0
        assert httpx.get(f"http://127.0.0.1:{port}/", timeout=5).text == "up"  # at once: it listens
        assert port_file.read_text() == f"{port}\n" and not list(tmp_path.glob(".*partial"))
    finally:
        go.set()
        server.should_exit = True
        thread.join(30)


def test_refenv_and_the_service_on_port_0_report_the_ports_they_bound(tmp_path: Path, vllm_url: str):
    """The two servers the stack starts, each on port 0, each on its own port; a port file left by an
    earlier run is removed before the start, so it is never read as the new one. Oracle: each port answers
    its own /health (refenv's says `ready` with its pool; the service's names itself)."""
    env_file = fresh_port_file(tmp_path, "refenv")
    env_file.write_text("9\n")  # an earlier run's leftover, as fresh_port_file will find it
    env_file = fresh_port_file(tmp_path, "refenv")
    assert not env_file.exists()
    env = ManagedProcess(
        "refenv", [*refenv_command(0, "--pool", "3"), "--port-file", str(env_file)], tmp_path / "e.log"
    )
    service_file = fresh_port_file(tmp_path, "service")
    procs = [env]
    try:
        env.start()
        env_url = env.wait_listening(env_file)
        assert httpx.get(f"{env_url}/health", timeout=10).json()["workers"] == 3
        service = ManagedProcess(
            "service",
            [*service_command(0, [env_url], vllm_url), "--port-file", str(service_file)],
            tmp_path / "s.log",
        )
        procs.append(service)
        service.start()
        service_url = service.wait_listening(service_file)
        assert service.port != env.port and env.port is not None
        assert wait_until(lambda: httpx.get(f"{service_url}/health", timeout=10).json()["status"] == "ok", 60)
        assert [e["url"] for e in httpx.get(f"{service_url}/envs", timeout=10).json()] == [env_url]
    finally:
        for proc in reversed(procs):
            proc.stop()


def test_a_server_that_exits_before_listening_is_reported_not_waited_for(tmp_path: Path):
    """A bad flag: the process ends without a port file; wait_port says so at once, with its log."""
    port_file = fresh_port_file(tmp_path, "bad")
    proc = ManagedProcess("bad", [*refenv_command(0, "--pool", "0"), "--port-file", str(port_file)], tmp_path / "b.log")
    proc.start()
    try:
        with pytest.raises(StackError, match="exited") as refused:
            proc.wait_port(port_file, timeout_s=60)
        assert "pool" in str(refused.value), str(refused.value)  # the log's tail says why
    finally:
        proc.stop()


@pytest.mark.parametrize("server", ["refenv", "service"])
def test_a_port_file_in_no_folder_is_a_bad_flag_before_anything_starts(tmp_path: Path, server: str):
    """A --port-file whose folder does not exist is the user's mistake: exit 2 naming the flag, no
    traceback, before the server starts (not a FileNotFoundError once it listens). Break tried: the
    flag unchecked (fails: a traceback from write_port_file, exit 1)."""
    where = str(tmp_path / "no-such-folder" / "port")
    if server == "refenv":
        cmd = [*refenv_command(0, "--pool", "1"), "--port-file", where]
    else:
        cmd = [*service_command(0, ["http://127.0.0.1:9"], "http://127.0.0.1:9", model="m"), "--port-file", where]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, (done.returncode, done.stderr[-2000:])
    assert "--port-file" in done.stderr and "Traceback" not in done.stderr, done.stderr[-2000:]


# A stand-in for vLLM in the next test: a server on the port given, 200 to any GET, or a traceback
# with "Address already in use" where that port is taken, as vLLM's own start-up ends.
_STAND_IN = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

class Ok(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()

HTTPServer(("127.0.0.1", int(sys.argv[1])), Ok).serve_forever()
"""


def test_a_vllm_that_loses_its_free_port_is_started_again_on_another(tmp_path: Path, monkeypatch):
    """vLLM cannot bind port 0 and report it, so its port is found free and handed over: if another
    process binds it first, the launcher picks another. The race is staged (a real vLLM start cannot be
    made to lose it on demand): the first port offered is held by this test, and the stand-in server
    exits as vLLM does. Oracle: the process that answers is on the second port, and the first try's log
    says it lost the port. Break tried: _lost_port answering False -> StackError on the first try."""
    from rollout_service.launch import stack

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        offered = iter([taken, stack.free_port()])
        monkeypatch.setattr(stack, "free_port", lambda: next(offered))

        def launch(port, log_path, **_):
            proc = ManagedProcess("vllm", [sys.executable, "-c", _STAND_IN, str(port)], log_path, port=port)
            proc.start()
            return proc

        monkeypatch.setattr(stack, "launch_embedded_vllm", launch)
        proc = stack.start_embedded_vllm(None, tmp_path / "vllm.log", timeout_s=60)
        try:
            assert proc.port is not None and proc.port != taken
            assert httpx.get(f"http://127.0.0.1:{proc.port}/v1/models", timeout=5).status_code == 200
            assert "address already in use" in (tmp_path / "vllm.log").read_text().lower()
        finally:
            proc.stop()
