"""The hot path's HTTP transport (rollout_service/backends/transport.py) against real sockets, and a smoke run of the
ceiling benchmark so that it does not rot (its numbers are measured by hand: docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from rollout_service.backends.env_client import EnvClient, EnvDown, EnvUnreachable
from rollout_service.backends.errors import InferenceTimeout, InferenceUnreachable
from rollout_service.backends.json_body import JsonList, dumps, loads
from rollout_service.backends.replica_pool import ReplicaPool
from rollout_service.backends.transport import AiohttpTransport, ConnectRefused, TransportError, TransportTimeout

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


def test_a_json_list_writes_what_the_standard_library_would_after_any_growth_and_copies():
    """JsonList keeps its JSON as it grows, and copies share it: whatever is done to a list and its
    snapshots, each is written as orjson writes a plain list of its items byte for byte, and reads
    back as those items with the standard library (the oracles), also when nested or changed with
    plain list methods. Breaks tried: no comma between what was written and
    what is appended -> fails; a snapshot appending into the body it shares with its list (no check
    that it owns the end) -> the list's JSON holds the snapshot's items, fails; no length check ->
    a list changed with append is written without the item, fails; item assignment not marking the
    list changed -> fails; another JsonList's JSON taken though it was changed -> fails."""
    import random

    rng = random.Random(7)
    import orjson

    def written_as_a_list(value) -> None:
        assert dumps(value) == orjson.dumps(json.loads(json.dumps(value)))
        assert json.loads(dumps(value)) == json.loads(json.dumps(value))

    lists = [JsonList(), JsonList([1, 2, 3])]
    for _ in range(600):
        target = rng.choice(lists)
        op = rng.randrange(7)
        if op == 0:
            target.grow([rng.randrange(50_000) for _ in range(rng.randrange(4))])
        elif op == 1:
            target.repeat(rng.choice([0, 1, None]), rng.randrange(4))
        elif op == 2:
            target.grow([rng.choice([-0.5, -1e-9, -12.25, 0.0])])
        elif op == 3 and len(lists) < 12:
            lists.append(target.snapshot())
        elif op == 4 and rng.random() < 0.2:
            # A plain list method, the length kept or not: written as a plain list from here.
            change = rng.choice(["append", "set", "sort", "pop_append", "iadd"])
            if change == "append":
                target.append(rng.randrange(9))
            elif change == "set" and target:
                target[0] = -7
            elif change == "sort":
                target.sort(key=str)
            elif change == "pop_append" and target:
                target.pop()
                target.append(-8)
            elif change == "iadd":
                target += [5]
        elif op == 5 and len(target) < 2000:
            target.grow(rng.choice(lists))  # taking the other's JSON where it still holds
        for each in lists:
            written_as_a_list(each)
    written_as_a_list({"a": lists, "n": [lists[0]]})
    assert all(type(each.snapshot()) is JsonList and each.snapshot() == each for each in lists)


# The service's HTTP stack (docs/benchmarks-http.md).
TRANSPORTS = pytest.mark.parametrize("transport_class", [AiohttpTransport])


@TRANSPORTS
def test_nothing_listening_is_a_refused_connection_env_down_and_inference_unreachable(transport_class):
    async def go():
        port = _closed_port()
        transport = transport_class(timeout_s=5.0)
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
        chat = ReplicaPool([f"http://127.0.0.1:{port}"], timeout_s=5.0)
        try:
            with pytest.raises(InferenceUnreachable):
                await chat.complete(model="m", prompt_token_ids=[1], sampling={})
        finally:
            await chat.aclose()

    asyncio.run(go())


@TRANSPORTS
def test_a_server_that_never_answers_times_out_as_no_answer(transport_class):
    async def go():
        accepted = asyncio.Event()

        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            accepted.set()
            await reader.read()  # reads the request, answers nothing, until the client hangs up
            writer.close()

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server:
            transport = transport_class(timeout_s=0.5)
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
            chat = ReplicaPool([url], timeout_s=0.5)
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
    out, kept = tmp_path / "ceiling.json", tmp_path / "record.json"
    subprocess.run(
        [sys.executable, "bench/ceiling.py", "--in-flight", "16", "--completion-tokens", "16", "--prompt-tokens",
         "200", "--seconds", "3", "--warmup", "2", "--out", str(out), "--record", str(kept)],
        cwd=ROOT, check=True, timeout=240,
    )  # fmt: skip
    (row,) = json.loads(out.read_text())["rows"]
    assert row["refused_resets"] == 0  # never asked for a world the env did not have
    assert row["max_open"] == row["pool"] == 16
    assert row["turns_per_s"] > 0 and row["groups_per_s"] > 0
    # The same run as a record for the benchmarks page: its provenance and the same figures.
    record = json.loads(kept.read_text())
    assert record["benchmark"] == "ceiling" and record["command"].startswith("bench/ceiling.py --in-flight 16")
    assert record["commit"] and record["date"] and record["machine"]["cpus"] == os.cpu_count()
    (shown,) = record["figures"]["rows"]
    assert shown["turns/s"] == row["turns_per_s"] and shown["in flight"] == 16


@TRANSPORTS
def test_a_backend_back_on_a_new_address_is_found_at_once_and_bad_hosts_are_no_connection(monkeypatch, transport_class):
    """No DNS cache: a restarted env or replica (a new pod, a new container) is reached on its new
    address by the next request. A host name that cannot exist is a failed connection, not a crash."""
    import aiohttp.resolver

    async def go():
        server = await asyncio.start_server(_answer_ok, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        where = {"addr": "127.0.0.2"}  # first "envhost" lives where nothing listens
        asked = []

        async def resolve(self, host, port_=0, family=socket.AF_INET):  # aiohttp's resolver
            asked.append(host)
            return [{"hostname": host, "host": where["addr"], "port": port_, "family": family, "proto": 0,
                     "flags": socket.AI_NUMERICHOST}]  # fmt: skip

        loop = asyncio.get_running_loop()
        getaddrinfo = loop.getaddrinfo

        async def loop_getaddrinfo(host, port_, **kwargs):  # type: ignore[no-untyped-def]  # the loop's
            if host != "envhost":
                return await getaddrinfo(host, port_, **kwargs)
            asked.append(host)
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (where["addr"], port_))]

        monkeypatch.setattr(aiohttp.resolver.ThreadedResolver, "resolve", resolve)
        monkeypatch.setattr(loop, "getaddrinfo", loop_getaddrinfo)
        transport = transport_class(timeout_s=5.0)
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
        transport = AiohttpTransport(timeout_s=5.0)  # a proxied request goes through its aiohttp
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
                await transport.request("GET", "HTTP://envhost.invalid:8123/health")  # a scheme in capitals
                assert b"Proxy-Authorization: Basic " in seen[1]
        finally:
            await transport.aclose()

    asyncio.run(go())


def test_no_proxy_names_ipv6_hosts_either_way_and_a_proxy_that_is_not_a_url_is_no_proxy(monkeypatch):
    """NO_PROXY=::1 (the usual spelling) and [::1] both cover http://[::1]:port; a proxy variable that
    cannot be parsed is warned about and not used, rather than failing the service's start. Breaks
    tried: only the host:port form checked -> [::1] proxied, fails; no try around the parse -> raises."""
    from rollout_service.backends.proxies import EnvProxies

    monkeypatch.setenv("HTTP_PROXY", "http://proxy.invalid:3128")
    for no_proxy in ("localhost,::1", "[::1]"):
        monkeypatch.setenv("NO_PROXY", no_proxy)
        proxies = EnvProxies()
        assert proxies("http://[::1]:8000/x") is None and proxies("http://[::1]/x") is None
        assert proxies("http://[::2]:8000/x") == ("http://proxy.invalid:3128", {})
    monkeypatch.setenv("HTTP_PROXY", "http://[proxy.invalid:3128")
    assert EnvProxies()("http://envhost/x") is None


@TRANSPORTS
def test_a_request_on_a_kept_alive_connection_runs_nothing_on_the_thread_pool(transport_class):
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
        transport = transport_class(timeout_s=5.0)
        try:
            async with server:
                for _ in range(5):
                    assert (await transport.request("GET", url)).status == 200
        finally:
            await transport.aclose()
        assert jobs == []

    asyncio.run(go())


@contextlib.asynccontextmanager
async def _scripted() -> AsyncIterator[tuple[_ScriptedServer, str, AiohttpTransport]]:
    server = _ScriptedServer()
    url = await server.start()
    transport = AiohttpTransport(timeout_s=5.0)
    try:
        yield server, url, transport
    finally:
        await transport.aclose()
        server.server.close()


class _ScriptedServer:
    """A raw HTTP/1.1 server on loopback whose answer depends on the path, for what the client
    must get right; its counts (connections, requests, EOFs seen) are the oracle."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[tuple[int, bytes, bytes]] = []  # (connection, request line, body)
        self.eofs = 0
        self.heads: list[bytes] = []
        self.eof_seen: asyncio.Queue[int] = asyncio.Queue()
        self.release = asyncio.Event()
        self.got: asyncio.Queue[bytes] = asyncio.Queue()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number, nth = self.connections, 0
        try:
            while True:
                nth += 1
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except asyncio.IncompleteReadError:
                    self._eof()
                    return
                line, *fields = head.decode().split("\r\n")
                length = next((int(f.split(":")[1]) for f in fields if f.lower().startswith("content-length")), 0)
                body = await reader.readexactly(length)
                self.requests.append((number, line.encode(), body))
                self.heads.append(head)
                path = line.split()[1]
                self.got.put_nowait(path.encode())
                if not await self._answer(path, body, nth, reader, writer):
                    return
        except ConnectionError:
            self._eof()
        finally:
            writer.close()

    def _eof(self) -> None:
        self.eofs += 1
        self.eof_seen.put_nowait(self.eofs)

    async def _answer(
        self, path: str, body: bytes, nth: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Write the answer `path` asks for (`nth` request on its connection); False to end the connection."""
        if path == "/drop-on-reuse" and nth > 1:
            return False  # read, never answered: as an idle close racing the request looks
        if path == "/drop":
            return False
        if path == "/partial":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\n{}")
            await writer.drain()
            return False
        if path == "/unframed-slow":  # the start of an answer ended by the close, then nothing
            writer.write(b"HTTP/1.1 200 OK\r\n\r\npartial")
            await writer.drain()
            path = "/slow"
        if path == "/slow":  # answered when released, unless the client hangs up first
            released, hung_up = asyncio.ensure_future(self.release.wait()), asyncio.ensure_future(reader.read())
            await asyncio.wait([released, hung_up], return_when=asyncio.FIRST_COMPLETED)
            released.cancel()
            if hung_up.done():
                self._eof()
                return False
            hung_up.cancel()
        if path == "/chunked":
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        elif path == "/split":  # the head and part of the body, the rest later: read whole, not as it lay
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 10\r\n\r\nfirst")
            await writer.drain()
            await asyncio.sleep(0.1)  # a slow server, not a wait: the client has the head by then
            writer.write(b"-rest")
        elif path == "/close":
            writer.write(b"HTTP/1.1 201 Created\r\ncontent-length: 5\r\nconnection: close\r\n\r\nclose")
        elif path == "/eof":
            writer.write(b"HTTP/1.1 200 OK\r\n\r\nuntil the end")
            await writer.drain()
            return False
        elif path == "/huge-headers":
            writer.write(b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * 70_000 + b"\r\ncontent-length: 2\r\n\r\n{}")
        elif path == "/twice":  # a server's bug: two answers to one request
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 3\r\n\r\none" * 2)
        elif path == "/endless-header":  # a header line that never ends, until the client hangs up
            writer.write(b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * 300_000)
            await writer.drain()
            await reader.read()
            self._eof()
            return False
        elif path == "/interim":
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nfinal")
        else:
            answer = path.encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(answer), answer))
        await writer.drain()
        return path != "/close"


def test_the_client_keeps_connections_alive_and_reads_every_framing():
    """Kept-alive connections are reused (the server's own connection count); chunked answers, answers
    ended by the close, interim 100s and `connection: close` are read as HTTP says, and a body that
    comes after its head is read whole; headers past the limit are no answer. Break tried: a body
    taken as it lies when the head came (not only once it is whole): /split reads b"first", fails."""

    async def go():
        async with _scripted() as (server, url, transport):
            assert (await transport.request("GET", f"{url}/a")).body == b"/a"
            answer = await transport.request("POST", f"{url}/chunked", json={"x": [1, 2]})
            assert (answer.status, answer.json()) == (200, {"x": [1, 2]})
            assert server.requests[-1][2] == b'{"x":[1,2]}'
            assert (await transport.request("GET", f"{url}/interim")).body == b"final"
            assert (await transport.request("GET", f"{url}/split")).body == b"first-rest"
            assert server.connections == 1  # one connection so far
            answer = await transport.request("DELETE", f"{url}/close")
            assert (answer.status, answer.body) == (201, b"close")
            assert (await transport.request("GET", f"{url}/b?q=1")).body == b"/b?q=1"
            assert server.connections == 2  # the closing answer's connection was not reused
            assert (await transport.request("GET", f"{url}/eof")).body == b"until the end"
            assert (await transport.request("GET", f"{url}/c")).body == b"/c"
            assert server.connections == 3
            with pytest.raises(TransportError):
                await transport.request("GET", f"{url}/huge-headers")
            with pytest.raises(TransportError) as caught:  # cut off at once, not buffered until the deadline
                await transport.request("GET", f"{url}/endless-header")
            assert not isinstance(caught.value, TransportTimeout)
            assert (await transport.request("GET", f"{url}/d")).body == b"/d"
            assert server.connections == 5

    asyncio.run(go())


def test_each_request_names_the_service_once_and_types_its_json_body_once():
    """What the server reads in each request's head (its log is the oracle): one User-Agent, the
    service's (not the HTTP library's), identity asked for, and a JSON body's type once, a caller's
    own header kept; and the URLs the transport keeps parsed stay bounded as new ones come (an
    episode's DELETE is a URL of its own). Breaks tried: aiohttp's skip_auto_headers back instead of
    the service's User-Agent (none sent: fails), the bound's clear() removed (fails)."""

    def fields(head: bytes) -> list[tuple[str, str]]:
        lines = head.decode().split("\r\n")[1:]
        return [(k.strip().lower(), v.strip()) for k, _, v in (line.partition(":") for line in lines if line)]

    async def go():
        async with _scripted() as (server, url, transport):
            await transport.request("POST", f"{url}/a", json={"x": 1}, headers={"Authorization": "Bearer k"})
            await transport.request("GET", f"{url}/b")
            post, get = fields(server.heads[0]), fields(server.heads[1])
            for head in (post, get):
                assert [v for k, v in head if k == "user-agent"] == ["rollout-service"]
                assert [v for k, v in head if k == "accept-encoding"] == ["identity"]
            assert [v for k, v in post if k == "content-type"] == ["application/json"]
            assert [v for k, v in post if k == "authorization"] == ["Bearer k"]
            assert server.requests[0][2] == b'{"x":1}'
            assert not any(k == "content-type" for k, _ in get)
            for n in range(1100):
                await transport.request("DELETE", f"{url}/episode-{n}")
            assert server.requests[-1][1] == b"DELETE /episode-1099 HTTP/1.1"
            assert len(transport._urls) <= 1024

    asyncio.run(go())


def test_a_post_is_never_sent_twice_after_a_kept_alive_connection_dropped():
    """A kept-alive connection that ends with no byte of an answer was most likely closed by the server
    (its idle timeout) as the request went out: a GET may go once more (RFC 9110 lets an idempotent
    request be retried), but a POST (an env's step, a completion) may have run, so it is never sent
    twice, nor anything once an answer had begun. The server's log of requests is the oracle."""

    async def go():
        async with _scripted() as (server, url, transport):
            assert (await transport.request("GET", f"{url}/a")).body == b"/a"
            assert (await transport.request("GET", f"{url}/drop-on-reuse")).body == b"/drop-on-reuse"
            with pytest.raises(TransportError):
                await transport.request("POST", f"{url}/drop-on-reuse", json={})
            assert sum(line.startswith(b"POST /drop-on-reuse ") for _, line, _ in server.requests) == 1
            assert (await transport.request("GET", f"{url}/b")).body == b"/b"
            with pytest.raises(TransportError):  # on a kept-alive connection, answered in part
                await transport.request("POST", f"{url}/partial", json={})
            assert sum(line.startswith(b"POST /partial ") for _, line, _ in server.requests) == 1

    asyncio.run(go())


def test_a_target_or_header_is_sent_escaped_and_once_and_another_event_loop_is_refused():
    """A target that needs escaping is escaped, a caller's Host is the one Host sent, a host name that
    cannot be one is no connection, and another event loop is the caller's bug, said at once."""

    async def go():
        async with _scripted() as (server, url, transport):
            for _ in range(2):  # the second from the transport's parsed URLs
                assert (await transport.request("GET", f"{url}/p%zz", headers={"Host": "env.internal"})).status == 200
                assert server.requests[-1][1] == b"GET /p%25zz HTTP/1.1"
                assert server.heads[-1].lower().count(b"\r\nhost:") == 1 and b"Host: env.internal" in server.heads[-1]
            with pytest.raises(ConnectRefused):
                await transport.request("GET", "http://h\u00f6st.invalid/x")

    asyncio.run(go())

    first, second = asyncio.new_event_loop(), asyncio.new_event_loop()
    transport = AiohttpTransport(timeout_s=5.0)
    try:
        server = _ScriptedServer()
        url = first.run_until_complete(server.start())
        assert first.run_until_complete(transport.request("GET", f"{url}/a")).status == 200
        with pytest.raises(RuntimeError):
            second.run_until_complete(transport.request("GET", f"{url}/a"))
    finally:
        first.run_until_complete(transport.aclose())
        first.run_until_complete(asyncio.wait_for(server.eof_seen.get(), 5))  # its handler is done
        server.server.close()
        first.close()
        second.close()


def test_a_request_cancelled_or_timed_out_closes_its_connection():
    """A request that ends before its answer leaves a connection whose next bytes are that answer:
    it is closed (the server sees the EOF), never reused. A request's deadline is TransportTimeout and
    leaves its task as it was; a caller's own cancellation or deadline stays the caller's. Breaks
    tried: the deadline's cancellation not taken back (task.uncancel() removed: fails), every
    cancellation of a request read as its deadline (fails)."""

    async def go():
        server = _ScriptedServer()
        url = await server.start()
        transport = AiohttpTransport(timeout_s=5.0)
        try:
            assert (await transport.request("GET", f"{url}/a")).body == b"/a"
            await server.got.get()
            slow = asyncio.ensure_future(transport.request("GET", f"{url}/slow"))
            assert await server.got.get() == b"/slow"
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow
            assert await asyncio.wait_for(server.eof_seen.get(), 5) == 1
            assert (await transport.request("GET", f"{url}/b")).body == b"/b"
            assert server.requests[-1][0] == 2  # on a new connection
            await server.got.get()
            with pytest.raises(TransportTimeout):
                await transport.request("GET", f"{url}/slow", timeout=0.2)
            task = asyncio.current_task()
            assert task is not None and task.cancelling() == 0  # the deadline's cancellation was taken back
            assert await asyncio.wait_for(server.eof_seen.get(), 5) == 2
            assert (await transport.request("GET", f"{url}/c")).body == b"/c"
            await server.got.get()
            # The caller's own deadline, shorter than the request's, is the caller's: not TransportTimeout.
            with pytest.raises(TimeoutError) as caught:
                async with asyncio.timeout(0.2):
                    await transport.request("GET", f"{url}/slow", timeout=30.0)
            assert not isinstance(caught.value, TransportError)
            assert await asyncio.wait_for(server.eof_seen.get(), 5) == 3
        finally:
            await transport.aclose()
            server.release.set()
            server.server.close()

    asyncio.run(go())


def test_a_request_made_while_its_task_is_being_cancelled_still_times_out_as_no_answer():
    """Cleanup after a cancellation (a DELETE in an `except CancelledError:` before the re-raise)
    runs in a task whose cancellation is still counted. Its request's own deadline is still
    TransportTimeout, which such cleanup retries on, not a CancelledError that would end it; a
    cancellation that arrives during the request stays the caller's. Break tried: the caller's
    cancellation judged by task.cancelling() alone, not against its count when the request began
    (fails: CancelledError)."""

    async def go():
        server = _ScriptedServer()
        url = await server.start()
        transport = AiohttpTransport(timeout_s=5.0)
        outcomes: list[str] = []

        async def cleanup_after_cancel() -> None:
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                task = asyncio.current_task()
                assert task is not None and task.cancelling() == 1
                try:
                    await transport.request("DELETE", f"{url}/slow", timeout=0.2)
                except TransportTimeout:
                    outcomes.append("timeout")
                assert task.cancelling() == 1  # the caller's cancellation, still counted
                # A second cancellation during the cleanup's request is the caller's again.
                during = asyncio.ensure_future(transport.request("DELETE", f"{url}/slow", timeout=30.0))
                await asyncio.sleep(0)
                during.cancel()
                try:
                    await during
                except asyncio.CancelledError:
                    outcomes.append("cancelled")
                raise

        try:
            cleaner = asyncio.ensure_future(cleanup_after_cancel())
            await asyncio.sleep(0)
            cleaner.cancel()
            with pytest.raises(asyncio.CancelledError):
                await cleaner
            assert outcomes == ["timeout", "cancelled"]
        finally:
            await transport.aclose()
            server.release.set()
            server.server.close()

    asyncio.run(go())


def test_an_interrupt_at_a_requests_deadline_is_the_processs_not_a_timeout():
    """A KeyboardInterrupt (or SystemExit) raised where the deadline's cancellation landed is the
    process's to handle, not an answer that did not come. A stand-in `_exchange`: an interrupt cannot
    be made to land inside aiohttp's read on demand. Break tried: every exception past the deadline
    made TransportTimeout (fails: TransportTimeout raised)."""

    async def go():
        transport = AiohttpTransport(timeout_s=5.0)

        async def interrupted(*_args, **_kwargs):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                raise KeyboardInterrupt from None

        transport._exchange = interrupted  # type: ignore[method-assign]
        try:
            with pytest.raises(KeyboardInterrupt):
                await transport.request("GET", "http://127.0.0.1:9/x", timeout=0.1)
            assert asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
        finally:
            await transport.aclose()

    asyncio.run(go())
