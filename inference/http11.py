"""A bare HTTP/1.1 client for the hot path: kept-alive connections on asyncio protocols, answers
parsed by httptools (the C parser uvicorn serves with).

An exact turn is four requests (two /tokenize, the completion, the env's step), so what one costs
the service's CPU bounds the turns/s one process drives. Against bench/standins.py's model server,
64 requests at once, aiohttp spent ~0.08 ms of CPU a request and this ~0.03 (2026-12-02).

It speaks only what the env and model servers need: plain http:// straight to the server, a
body with a Content-Length, answers with a Content-Length, chunked or ended by the close. Anything
else (https, a proxy, credentials in the URL, a path or header that would need escaping, HEAD)
goes through aiohttp, which `Http11Transport` holds for that.
"""

from __future__ import annotations

import asyncio
import urllib.parse

import httptools

from .transport import (
    MAX_HEADER_BYTES,
    AiohttpTransport,
    ConnectRefused,
    HttpAnswer,
    HttpTransport,
    TransportError,
    TransportTimeout,
)

_METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH"})
_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})


class _Dropped(TransportError):
    """The connection ended before the answer was whole."""

    def __init__(self, message: str, answered: bool) -> None:
        super().__init__(message)
        self.answered = answered  # any byte of an answer had come


class _Connection(asyncio.Protocol):
    """One kept-alive connection: one request at a time, its answer parsed as it comes."""

    def __init__(self, idle: dict[_Connection, None], live: set[_Connection]) -> None:
        self.idle_set = idle  # the pool's idle connections to this server
        self.live = live  # the pool's open connections (aclose aborts them)
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[HttpAnswer] | None = None
        self.closed = False
        self._reset()

    def _reset(self) -> None:
        self.body: list[bytes] = []
        self.header_bytes = 0
        self.answered = False
        self.headers_done = False
        self.framed = False  # Content-Length or chunked: the parser knows where the answer ends

    # -- the request ---------------------------------------------------------------------------

    async def exchange(self, request: bytes) -> HttpAnswer:
        assert self.transport is not None and self.waiter is None
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(request)
        try:
            answer = await self.waiter
        except BaseException:
            # Cancelled or timed out mid-answer: the rest of it could be read as the next request's.
            self.abort()
            raise
        if not self.closed:
            self.idle_set[self] = None
        return answer

    def abort(self) -> None:
        self.closed = True
        self.idle_set.pop(self, None)
        if self.transport is not None:
            self.transport.abort()

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.live.add(self)

    def data_received(self, data: bytes) -> None:
        if self.waiter is None:  # bytes nobody asked for: the connection cannot be trusted
            self.abort()
            return
        self.answered = True
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(TransportError(f"not an HTTP answer: {exc}"))
            self.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.idle_set.pop(self, None)
        self.live.discard(self)
        if self.waiter is not None and self.headers_done and not self.framed and exc is None:
            self.on_message_complete()  # an answer that ends with its connection (closed, not reset)
        else:
            self._fail(_Dropped(f"the server closed the connection ({exc or 'EOF'})", self.answered))

    # -- httptools callbacks -----------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_bytes += len(name) + len(value)
        if self.header_bytes > MAX_HEADER_BYTES:
            raise ValueError("the answer's headers are too long")
        lowered = name.lower()
        if lowered == b"content-length" or (lowered == b"transfer-encoding" and b"chunked" in value.lower()):
            self.framed = True

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
            self._reset()
            return
        answer = HttpAnswer(status, b"".join(self.body))
        if not self.parser.should_keep_alive():
            self.closed = True
            if self.transport is not None:
                self.transport.close()
        waiter, self.waiter = self.waiter, None
        self._reset()
        if waiter is not None and not waiter.done():
            waiter.set_result(answer)

    def _fail(self, exc: Exception) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)


class Http11Transport(HttpTransport):
    """Kept-alive connections per server, made as needed (no cap: the scheduler and the envs' pools
    bound what is in flight), newest idle one first; aiohttp for what this does not speak."""

    def __init__(self, timeout_s: float, connect_timeout_s: float = 10.0) -> None:
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._fallback = AiohttpTransport(timeout_s, connect_timeout_s)
        self._idle: dict[tuple[str, int], dict[_Connection, None]] = {}
        self._live: set[_Connection] = set()
        self._closed = False

    async def _send(
        self, method: str, url: str, body: bytes | None, headers: dict[str, str], deadline_s: float | None
    ) -> HttpAnswer:
        if self._closed:
            raise TransportError("the client is closed")
        request = self._request(method, url, body, headers)
        if request is None:
            return await self._fallback._send(method, url, body, headers, deadline_s)
        server, data = request
        deadline = self._timeout_s if deadline_s is None else deadline_s
        if deadline <= 0:
            raise TransportTimeout("no time left for the request")
        try:
            async with asyncio.timeout(deadline):
                return await self._exchange(server, data)
        except TimeoutError:
            raise TransportTimeout("no answer in time") from None

    def _request(
        self, method: str, url: str, body: bytes | None, headers: dict[str, str]
    ) -> tuple[tuple[str, int], bytes] | None:
        """The server and the request's bytes, or None where aiohttp must send it."""
        if method not in _METHODS or not url.startswith("http://") or self._fallback.proxy_for(url) is not None:
            return None
        parts = urllib.parse.urlsplit(url)
        try:
            host, port = parts.hostname, parts.port or 80
        except ValueError:  # a port that is not one: aiohttp says so
            return None
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        if not host or "@" in parts.netloc or not _plain(target) or " " in target:
            return None
        lines = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}"]
        for name, value in headers.items():
            if not _plain(name) or not _plain(value, spaces=True):
                return None
            lines.append(f"{name}: {value}")
        if body is not None or method in _WITH_BODY:
            lines.append(f"Content-Length: {len(body or b'')}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("ascii")
        return (host, port), head + body if body else head

    async def _exchange(self, server: tuple[str, int], request: bytes) -> HttpAnswer:
        idle = self._idle.setdefault(server, {})
        reused = bool(idle)
        connection = idle.popitem()[0] if idle else await self._connect(server, idle)
        try:
            return await connection.exchange(request)
        except _Dropped as exc:
            if not reused or exc.answered or self._closed:
                raise
        # A kept-alive connection the server closed (its idle timeout) as this request went out: it
        # was not read, so it goes once more on a new connection, as Go's net/http does.
        return await (await self._connect(server, idle)).exchange(request)

    async def _connect(self, server: tuple[str, int], idle: dict[_Connection, None]) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, connection = await loop.create_connection(lambda: _Connection(idle, self._live), *server)
        except TimeoutError:
            raise TransportTimeout(f"no connection to {server[0]}:{server[1]} in time") from None
        except (OSError, ValueError) as exc:  # refused, no such host (ValueError: a name that cannot be one)
            raise ConnectRefused(f"{type(exc).__name__}: {exc}") from None
        if self._closed:  # closed while this connection was being made
            connection.abort()
            raise TransportError("the client is closed")
        return connection

    async def aclose(self) -> None:
        self._closed = True
        for connection in list(self._live):
            connection.abort()  # a request still waiting gets TransportError
        self._idle.clear()
        await self._fallback.aclose()


def _plain(text: str, spaces: bool = False) -> bool:
    """Printable ASCII that needs no escaping in a request line or header (no CR, LF, controls)."""
    return text.isascii() and text.isprintable() and (spaces or " " not in text)
