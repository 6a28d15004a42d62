"""Every answer read from an env or a model server is bounded (--max-answer-bytes), while it is read:
against hostile stand-in servers on real sockets (a real env or vLLM cannot be made to answer
400 MB or to drip), each counting what it managed to send, which is the oracle.
Breaks tried: aiohttp's body read whole with response.read() -> every framing read to the end (the
server got its whole 64 MiB out), fails; EnvClient without its AnswerTooLarge mapping ->
BadEnvAnswer, fails."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

import pytest

from rollout_service.backends.env_client import BadEnvAnswer, EnvAnswerTooLarge, EnvClient
from rollout_service.backends.errors import BadInferenceResponse, InferenceAnswerTooLarge, WeightUpdateError
from rollout_service.backends.replica_pool import ReplicaPool, engine_of
from rollout_service.backends.transport import AiohttpTransport, AnswerTooLarge, EncodedAnswer, TransportTimeout
from rollout_service.server.config import ServiceConfig

CAP = 1 << 20
HUGE = 64 << 20  # what the hostile server tries to send: far past the cap and every socket buffer
PIECE = b"x" * 65536


class _Hostile:
    """Answers every request with the shape its path names; `sent`: the most body bytes it got written
    in one answer."""

    def __init__(self) -> None:
        self.sent = 0
        self.done: asyncio.Queue[str] = asyncio.Queue()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                line, *fields = head.decode().split("\r\n")
                length = next((int(f.split(":")[1]) for f in fields if f.lower().startswith("content-length")), 0)
                await reader.readexactly(length)
                path = line.split()[1].split("?")[0]
                if path.startswith("/x-"):  # a base URL naming the shape: "/x-huge-length/step" -> "/huge-length"
                    path = "/" + path.split("/")[1].removeprefix("x-")
                if not await self._answer(path, writer):
                    break
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            self.done.put_nowait("closed")
            writer.close()

    async def _answer(self, path: str, writer: asyncio.StreamWriter) -> bool:
        if path == "/drip":  # headers, then a byte a tenth of a second, for ever
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1000000\r\n\r\n")
            while True:
                writer.write(b" ")
                await writer.drain()
                self.sent += 1
                await asyncio.sleep(0.1)
        framing = path.rsplit("-", 1)[-1]
        if framing == "length":
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % HUGE)
        elif framing == "chunked":
            writer.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        else:  # ended by the close
            writer.write(b"HTTP/1.1 200 OK\r\n\r\n")
        sent = 0
        while sent < HUGE:
            writer.write(b"%x\r\n%s\r\n" % (len(PIECE), PIECE) if framing == "chunked" else PIECE)
            await writer.drain()
            sent += len(PIECE)
            self.sent = max(self.sent, sent)
        return False


@contextlib.asynccontextmanager
async def _hostile() -> AsyncIterator[tuple[_Hostile, str]]:
    server = _Hostile()
    url = await server.start()
    try:
        yield server, url
    finally:
        server.server.close()


# What the server can get written before the client stops reading: the cap, plus what the two
# sockets' buffers hold on loopback (a few MiB at most), never the whole answer.
def _cut_off(server: _Hostile) -> bool:
    return server.sent < 16 * CAP


@pytest.mark.parametrize("transport_class", [AiohttpTransport])
@pytest.mark.parametrize("framing", ["length", "chunked", "close"])
def test_an_answer_past_the_cap_is_cut_off_as_it_comes_whatever_its_framing(transport_class, framing):
    async def go():
        async with _hostile() as (server, url):
            transport = transport_class(timeout_s=60.0, max_answer_bytes=CAP)
            try:
                with pytest.raises(AnswerTooLarge):
                    await transport.request("GET", f"{url}/huge-{framing}")
                await asyncio.wait_for(server.done.get(), 30)  # the client hung up: the server stopped
                assert _cut_off(server), server.sent
            finally:
                await transport.aclose()

    asyncio.run(go())


@pytest.mark.parametrize("transport_class", [AiohttpTransport])
def test_a_slow_drip_is_bounded_by_the_request_deadline_not_by_each_byte(transport_class):
    async def go():
        async with _hostile() as (server, url):
            transport = transport_class(timeout_s=60.0, max_answer_bytes=CAP)
            loop = asyncio.get_running_loop()
            started = loop.time()
            try:
                with pytest.raises(TransportTimeout):
                    await transport.request("GET", f"{url}/drip", timeout=1.0)
                assert loop.time() - started < 10  # the deadline holds though a byte comes every 0.1 s
                assert server.sent >= 1
            finally:
                await transport.aclose()

    asyncio.run(go())


def test_env_model_server_and_admin_answers_past_the_cap_fail_with_their_own_kind():
    """The env's and the model server's huge answers fail as infrastructure failures with a kind
    that says so; the POST /envs probe (EnvClient.health) and the weight calls are capped too."""

    async def go():
        async with _hostile() as (server, url):
            env = EnvClient(f"{url}/x-huge-length", max_answer_bytes=CAP)
            pool = ReplicaPool([f"{url}/x-huge-chunked"], max_answer_bytes=CAP, timeout_s=60.0)
            admin = ReplicaPool([f"{url}/x-huge-close"], max_answer_bytes=CAP, timeout_s=60.0)
            try:
                with pytest.raises(EnvAnswerTooLarge) as env_failure:
                    await env.step("e1", "a completion", 10, 2)
                assert env_failure.value.kind == "env_answer_too_large"
                with pytest.raises(EnvAnswerTooLarge):
                    await env.health()
                with pytest.raises(InferenceAnswerTooLarge) as model_failure:
                    await pool.complete(model="m", prompt_token_ids=[1, 2], sampling={"max_tokens": 4})
                assert model_failure.value.kind == "inference_answer_too_large"
                with pytest.raises(WeightUpdateError, match="longer than"):
                    await engine_of(admin.endpoints[0]).weight_version()
                assert _cut_off(server)
            finally:
                await env.aclose()
                await pool.aclose()
                await admin.aclose()

    asyncio.run(go())


def test_the_cap_is_a_service_setting_with_a_generated_flag():
    import argparse

    from rollout_service.flags import add_flags
    from rollout_service.server.config import ENV_PREFIX

    parser = argparse.ArgumentParser()
    add_flags(parser, ServiceConfig, ENV_PREFIX)
    given = parser.parse_args(["--max-answer-bytes", str(CAP)]).max_answer_bytes
    assert ServiceConfig(env=["http://e"], vllm=["http://v"], model="m", max_answer_bytes=given).max_answer_bytes == CAP
    assert ServiceConfig(env=["http://e"], vllm=["http://v"], model="m").max_answer_bytes >= 32768 * 16 * 64


def _gzip_bomb(unpacked: int) -> bytes:
    """`unpacked` zero bytes, gzipped (about a thousandth of that), made a piece at a time."""
    import zlib

    packer = zlib.compressobj(9, zlib.DEFLATED, 31)  # wbits 31: the gzip format
    zeros = bytes(1 << 20)
    packed = [packer.compress(zeros) for _ in range(unpacked >> 20)]
    return b"".join(packed) + packer.flush()


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_gzip_bomb_under_the_cap_on_the_wire_is_refused_not_unpacked():
    """A stand-in (a real server does not send a bomb) answers ~300 KB of gzip, announced by its
    Content-Length, that unpacks to 300 MB. The transport asks for identity and refuses any other
    encoding: the answer is not unpacked (RSS does not grow by hundreds of MB), and the env and the
    model server fail as a bad answer, and a weight call says its answer was refused (not that the
    server is unreachable). Breaks tried: the session unpacking (auto_decompress on, no
    Accept-Encoding) -> the 300 MB body came back whole, fails; VllmServer's weight calls reading EncodedAnswer as
    any other TransportError -> "unreachable: the answer is encoded", fails."""
    bomb = _gzip_bomb(300 << 20)
    assert len(bomb) < CAP  # under the cap as sent: only what it unpacks to is huge
    asked: list[str] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            fields = dict(
                (name.strip().lower(), value.strip())
                for name, _, value in (f.partition(":") for f in head.decode().split("\r\n")[1:] if f)
            )
            await reader.readexactly(int(fields.get("content-length", 0)))
            asked.append(fields.get("accept-encoding", ""))
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-encoding: gzip\r\n"
                b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(bomb), bomb)
            )
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def go():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        transport = AiohttpTransport(timeout_s=60.0, max_answer_bytes=CAP)
        env = EnvClient(url, max_answer_bytes=CAP)
        pool = ReplicaPool([url], max_answer_bytes=CAP, timeout_s=60.0)
        before = _rss_bytes()
        try:
            with pytest.raises(EncodedAnswer):
                await transport.request("GET", f"{url}/anything")
            assert _rss_bytes() - before < 100 << 20
            with pytest.raises(BadEnvAnswer):
                await env.health()
            with pytest.raises(BadInferenceResponse):
                await pool.complete(model="m", prompt_token_ids=[1, 2], sampling={"max_tokens": 4})
            with pytest.raises(WeightUpdateError) as refused:
                await engine_of(pool.endpoints[0]).weight_version()
            assert "refused" in refused.value.detail and "unreachable" not in refused.value.detail, refused.value
            assert _rss_bytes() - before < 100 << 20
            assert asked and all(a == "identity" for a in asked), asked  # the oracle: what the server was asked
        finally:
            await transport.aclose()
            await env.aclose()
            await pool.aclose()
            server.close()

    asyncio.run(go())
