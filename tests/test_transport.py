"""The hot path's HTTP transport (inference/transport.py) against real sockets, and a smoke run of the
ceiling benchmark so that it does not rot (its numbers are measured by hand: README, Benchmarks)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from inference.client import ChatClient, InferenceTimeout, InferenceUnreachable
from inference.transport import AiohttpTransport, ConnectRefused, TransportTimeout, dumps, loads
from rollout_service.server.env_client import EnvClient, EnvDown, EnvUnreachable

ROOT = Path(__file__).resolve().parents[1]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_json_with_a_lone_surrogate_goes_both_ways_as_the_standard_library_would():
    # orjson refuses lone surrogates both ways; the standard library takes them (escaped): so must we.
    body = json.dumps({"text": "a \ud83d b"}).encode()
    assert loads(body) == json.loads(body)
    assert json.loads(dumps({"text": "a \ud83d b"})) == {"text": "a \ud83d b"}
    with pytest.raises(ValueError):
        loads(b"not json")


def test_nothing_listening_is_a_refused_connection_env_down_and_inference_unreachable():
    async def go():
        port = _closed_port()
        transport = AiohttpTransport(timeout_s=5.0)
        try:
            with pytest.raises(ConnectRefused):
                await transport.request("GET", f"http://127.0.0.1:{port}/health")
        finally:
            await transport.aclose()
        env = EnvClient(f"http://127.0.0.1:{port}", timeout_s=5.0)
        try:
            with pytest.raises(EnvDown):  # its episodes went with the process: nothing to abandon
                await env.step("e1", "x", 1, 1)
        finally:
            await env.aclose()
        chat = ChatClient([f"http://127.0.0.1:{port}"], timeout_s=5.0)
        try:
            with pytest.raises(InferenceUnreachable):
                await chat.complete(model="m", prompt_token_ids=[1], sampling={})
        finally:
            await chat.aclose()

    asyncio.run(go())


def test_a_server_that_never_answers_times_out_as_no_answer():
    async def go():
        accepted = asyncio.Event()

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.set()
            await reader.read()  # reads the request, answers nothing, until the client hangs up
            writer.close()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server:
            transport = AiohttpTransport(timeout_s=0.5)
            try:
                with pytest.raises(TransportTimeout):
                    await transport.request("POST", f"{url}/step", json={"a": 1})
                assert accepted.is_set()
            finally:
                await transport.aclose()
            env = EnvClient(url, timeout_s=0.5)
            try:
                with pytest.raises(EnvUnreachable) as caught:
                    await env.reset("t1")
                assert not isinstance(caught.value, EnvDown)  # a live env may hold the episode: abandon it
            finally:
                await env.aclose()
            chat = ChatClient([url], timeout_s=0.5)
            try:
                with pytest.raises(InferenceTimeout):
                    await chat.complete(model="m", prompt_token_ids=[1], sampling={})
            finally:
                await chat.aclose()

    asyncio.run(go())


def test_the_ceiling_benchmark_runs_and_keeps_the_pool_full_but_never_over(tmp_path):
    """A few seconds of bench/ceiling.py with small turns: it must start its stand-ins and the service,
    drive them, and report; the env's own counts (episodes open at once, resets refused for want of a
    world) are the oracle for the pool. Break tried: EnvSlots.free reporting one slot more and its assertion removed ->
    88 resets refused, fails."""
    out = tmp_path / "ceiling.json"
    subprocess.run(
        [sys.executable, "bench/ceiling.py", "--in-flight", "16", "--completion-tokens", "16", "--prompt-tokens",
         "200", "--seconds", "3", "--warmup", "2", "--out", str(out)],
        cwd=ROOT, check=True, timeout=240,
    )  # fmt: skip
    (row,) = json.loads(out.read_text())["rows"]
    assert row["refused_resets"] == 0  # never asked for a world the env did not have
    assert row["max_open"] == row["pool"] == 16
    assert row["turns_per_s"] > 0 and row["groups_per_s"] > 0


def test_a_backend_back_on_a_new_address_is_found_at_once_and_bad_hosts_are_no_connection(monkeypatch):
    """No DNS cache: a restarted env or replica (a new pod, a new container) is reached on its new
    address by the next request. A host name that cannot exist is a failed connection, not a crash."""
    import aiohttp.resolver

    async def go():
        server = await asyncio.start_server(_answer_ok, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        where = {"addr": "127.0.0.2"}  # first "envhost" lives where nothing listens
        asked = []

        async def resolve(self, host, port_=0, family=socket.AF_INET):
            asked.append(host)
            return [{"hostname": host, "host": where["addr"], "port": port_, "family": family, "proto": 0,
                     "flags": socket.AI_NUMERICHOST}]  # fmt: skip

        monkeypatch.setattr(aiohttp.resolver.ThreadedResolver, "resolve", resolve)
        transport = AiohttpTransport(timeout_s=5.0)
        try:
            async with server:
                with pytest.raises(ConnectRefused):
                    await transport.request("GET", f"http://envhost:{port}/health")
                where["addr"] = "127.0.0.1"  # the env came back elsewhere
                answer = await transport.request("GET", f"http://envhost:{port}/health")
                assert answer.status == 200 and len(asked) == 2
            with pytest.raises(ConnectRefused):
                await transport.request("GET", "http://a..b/health")
        finally:
            await transport.aclose()

    asyncio.run(go())


async def _answer_ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await reader.readuntil(b"\r\n\r\n")
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")
    await writer.drain()
    writer.close()


def test_requests_go_through_the_environments_proxy_read_once_and_no_proxy_is_honoured(monkeypatch):
    """HTTP_PROXY (with its credentials) and NO_PROXY as httpx honoured them; the oracle is what a
    stand-in proxy was asked. Breaks tried: no proxy passed -> the proxy sees nothing; credentials
    left in the URL and no Proxy-Authorization sent -> fails."""

    async def go():
        seen: list[bytes] = []

        async def proxy(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(await reader.readuntil(b"\r\n\r\n"))
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\n{}")
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(proxy, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        monkeypatch.setenv("HTTP_PROXY", f"http://trainer:s%40cret@127.0.0.1:{port}")
        monkeypatch.setenv("NO_PROXY", "direct.invalid")
        transport = AiohttpTransport(timeout_s=5.0)
        monkeypatch.delenv("HTTP_PROXY")  # read when the transport was made, not per request
        try:
            async with server:
                answer = await transport.request("GET", "http://envhost.invalid:8123/health")
                assert answer.status == 200
                (head,) = seen
                assert head.startswith(b"GET http://envhost.invalid:8123/health HTTP/1.1\r\n")
                fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:] if line)
                fields = {name.lower(): value for name, value in fields.items()}
                assert fields[b"proxy-authorization"] == b"Basic " + base64.b64encode(b"trainer:s@cret")
                with pytest.raises(ConnectRefused):  # NO_PROXY: straight to a host that does not exist
                    await transport.request("GET", "http://direct.invalid/health")
                assert len(seen) == 1
        finally:
            await transport.aclose()

    asyncio.run(go())


def test_a_request_on_a_kept_alive_connection_runs_nothing_on_the_thread_pool():
    """aiohttp's trust_env ran two thread-pool jobs per request (the proxy variables and ~/.netrc),
    half the service's CPU at the ceiling. Counted, not timed: the loop's executor is asked for
    nothing while requests reuse a connection to an address. Break tried: trust_env=True -> 2 jobs
    a request, fails."""

    async def go():
        async def keep_alive(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
                while True:
                    await reader.readuntil(b"\r\n\r\n")
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
                    await writer.drain()
            writer.close()

        server = await asyncio.start_server(keep_alive, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/health"
        loop = asyncio.get_running_loop()
        jobs = []
        run_in_executor = loop.run_in_executor

        def counted(executor, func, *args):  # type: ignore[no-untyped-def]
            jobs.append(func)
            return run_in_executor(executor, func, *args)

        loop.run_in_executor = counted  # type: ignore[method-assign]
        transport = AiohttpTransport(timeout_s=5.0)
        try:
            async with server:
                for _ in range(5):
                    assert (await transport.request("GET", url)).status == 200
        finally:
            await transport.aclose()
        assert jobs == []

    asyncio.run(go())
