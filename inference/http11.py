"""A bare HTTP/1.1 client for the hot path: kept-alive connections on asyncio protocols, answers
parsed by httptools (the C parser uvicorn serves with).

An exact turn is three requests (a /tokenize, the completion, the env's step), so what one costs
the service's CPU bounds the turns/s one process drives. Against bench/standins.py's model server,
64 requests at once, aiohttp spent ~0.08 ms of CPU a request and this ~0.03 (2026-12-02).

It speaks only what the env and model servers need: plain http:// straight to the server, a
body with a Content-Length, answers with a Content-Length, chunked or ended by the close. Anything
else (https, a proxy, credentials in the URL, a path or header that would need escaping, HEAD)
goes through aiohttp, which `Http11Transport` holds for that.
"""

from __future__ import annotations

import asyncio
import re
import time
import urllib.parse

import httptools

from .transport import (
    DEFAULT_MAX_ANSWER_BYTES,
    MAX_HEADER_BYTES,
    AiohttpTransport,
    AnswerTooLarge,
    ConnectRefused,
    HttpAnswer,
    HttpTransport,
    TransportError,
    TransportTimeout,
)

_METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "PATCH"})
_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})
# Sent again after a kept-alive connection dropped with no answer: the server may have run it (a
# handler that crashed, a write timeout), so only what RFC 9110 makes idempotent, as aiohttp does.
# A POST (an env's step, a completion) is never sent twice.
_IDEMPOTENT = frozenset({"GET", "PUT", "DELETE"})
# A connection idle longer than this is closed, not reused: servers close idle ones (uvicorn after
# 5 s), and a POST written as the server closes fails where a new connection costs ~0.1 ms.
MAX_IDLE_S = 2.0
# The request target as sent: RFC 3986 characters and well-formed escapes; anything else is escaped
# by aiohttp.
_PLAIN_TARGET = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@/?]|%[0-9A-Fa-f]{2})*")
# How often the requests in flight are checked against their deadlines: a deadline holds to within
# this. One timer per request (asyncio.timeout) cost ~2% of the service's CPU at bench/ceiling.py's
# ceiling; this check costs a pass over the open connections 20 times a second while any request waits.
SWEEP_S = 0.05
# Request heads kept (see Http11Transport._request): a URL is parsed and its headers checked once.
_MAX_HEADS = 1024
# Headers this client writes itself: a caller's own goes through aiohttp.
_OWN_HEADERS = frozenset({"host", "content-length", "transfer-encoding", "connection"})


class _Dropped(TransportError):
    """The connection ended before the answer was whole."""

    def __init__(self, message: str, answered: bool) -> None:
        super().__init__(message)
        self.answered = answered  # any byte of an answer had come


class _Connection(asyncio.Protocol):
    """One kept-alive connection: one request at a time, its answer parsed as it comes."""

    def __init__(self, idle: dict[_Connection, None], live: set[_Connection], max_body_bytes: int) -> None:
        self.max_body_bytes = max_body_bytes
        self.idle_set = idle  # the pool's idle connections to this server
        self.live = live  # the pool's open connections (aclose aborts them); added once connected
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.waiter: asyncio.Future[HttpAnswer] | None = None
        self.closed = False
        self.idle_since = 0.0
        self.expires = 0.0  # the loop's time by which the current request's answer must be whole
        self.answered = False  # any byte of an answer to the current request
        self.max_idle_s = float("inf")  # half the server's own `Keep-Alive: timeout=N`, where it sends one
        self._reset()

    def _reset(self) -> None:
        self.body: list[bytes] = []
        self.body_bytes = 0
        self.header_bytes = 0
        self.head_bytes = 0  # bytes received before the headers were whole
        self.headers_done = False
        self.framed = False  # Content-Length or chunked: the parser knows where the answer ends

    # -- the request ---------------------------------------------------------------------------

    async def exchange(self, request: bytes, expires: float) -> HttpAnswer:
        assert self.transport is not None and self.waiter is None
        self.waiter = asyncio.get_running_loop().create_future()
        self.expires = expires
        self.answered = False
        self.transport.write(request)
        try:
            answer = await self.waiter
        except BaseException:
            # Cancelled or out of time mid-answer: the rest of it could be read as the next request's.
            self.abort()
            raise
        if not self.closed:
            self.idle_since = time.monotonic()
            self.idle_set[self] = None
        return answer

    def abort(self) -> None:
        # An answer in flight ends as no answer (not, when unframed, as what had come of it).
        self._fail(TransportError("the connection was closed by this client"))
        self.closed = True
        self.idle_set.pop(self, None)
        self.live.discard(self)
        if self.transport is not None:
            self.transport.abort()

    # -- asyncio.Protocol --------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if self.waiter is None:  # bytes nobody asked for: the connection cannot be trusted
            self.abort()
            return
        self.answered = True
        if not self.headers_done:
            # httptools reports a header once its line ends: one that never ends is cut off here.
            self.head_bytes += len(data)
            if self.head_bytes > 2 * MAX_HEADER_BYTES:
                self._fail(TransportError("the answer's headers are too long"))
                self.abort()
                return
        try:
            self.parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:
            self._fail(TransportError(f"not an HTTP answer: {exc}"))
            self.abort()  # also after an answer already given: the connection is not reused

    def eof_received(self) -> None:
        # The server closed its side: not to be handed out in the loop pass before connection_lost.
        self.closed = True
        self.idle_set.pop(self, None)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.idle_set.pop(self, None)
        self.live.discard(self)
        if self.waiter is not None and self.headers_done and not self.framed and exc is None:
            self.on_message_complete()  # an answer that ends with its connection (closed, not reset)
        else:
            self._fail(_Dropped(f"the server closed the connection ({exc or 'EOF'})", self.answered))

    # -- httptools callbacks -----------------------------------------------------------------

    def on_message_begin(self) -> None:
        if self.waiter is None:  # a second answer to one request: what follows cannot be trusted
            raise ValueError("an answer nobody asked for")

    def on_header(self, name: bytes, value: bytes) -> None:
        self.header_bytes += len(name) + len(value)
        if self.header_bytes > MAX_HEADER_BYTES:
            raise ValueError("the answer's headers are too long")
        lowered = name.lower()
        if lowered == b"content-length":
            self.framed = True
            length = value.strip()
            if length.isdigit() and int(length) > self.max_body_bytes:  # refused before any of it comes
                self._fail(AnswerTooLarge(self.max_body_bytes))
                raise ValueError("the answer is too long")  # stops the parser; data_received aborts
        elif lowered == b"transfer-encoding":
            # RFC 9112 6.3: chunked framing only when chunked is the last coding; otherwise the close ends it.
            self.framed = value.rpartition(b",")[2].strip().lower() == b"chunked"
        elif lowered == b"keep-alive":
            self.max_idle_s = _keep_alive_timeout(value) / 2

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body_bytes += len(body)
        if self.body_bytes > self.max_body_bytes:  # cut off as it comes, never held whole
            self._fail(AnswerTooLarge(self.max_body_bytes))
            raise ValueError("the answer is too long")  # stops the parser; data_received aborts
        self.body.append(body)

    def on_message_complete(self) -> None:
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # an interim answer (100 Continue): the real one follows
            self._reset()  # `answered` stays: the server has the request
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

    def expire(self, now: float) -> bool:
        """Fail the request in flight if its deadline has passed; whether one is still in flight."""
        if self.waiter is None:
            return False
        if now >= self.expires:
            self._fail(TransportTimeout("no answer in time"))
        return True

    def _fail(self, exc: Exception) -> None:
        waiter, self.waiter = self.waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)


class Http11Transport(HttpTransport):
    """Kept-alive connections per server, made as needed (no cap: the scheduler and the envs' pools
    bound what is in flight), newest idle one first; aiohttp for what this does not speak."""

    def __init__(
        self, timeout_s: float, connect_timeout_s: float = 10.0, max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES
    ) -> None:
        self.max_answer_bytes = max_answer_bytes
        self._timeout_s = timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._fallback = AiohttpTransport(timeout_s, connect_timeout_s, max_answer_bytes)
        self._idle: dict[tuple[str, int], dict[_Connection, None]] = {}
        self._live: set[_Connection] = set()
        self._closed = False
        self._loop: asyncio.AbstractEventLoop | None = None  # connections belong to the loop that made them
        self._sweeper: asyncio.Task | None = None  # fails requests past their deadline (SWEEP_S)
        # Per method, URL and headers: the server and the request's head (None: aiohttp sends it).
        self._heads: dict[tuple, tuple[tuple[str, int], bytes] | None] = {}

    async def _send(
        self, method: str, url: str, body: bytes | None, headers: dict[str, str], deadline_s: float | None
    ) -> HttpAnswer:
        if self._closed:
            raise TransportError("the client is closed")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif self._loop is not loop:  # as aiohttp: a bug in the caller, not a server's failure
            raise RuntimeError("this HTTP client is used from another event loop than the one it started on")
        request = self._request(method, url, body, headers)
        if request is None:
            return await self._fallback._send(method, url, body, headers, deadline_s)
        server, data = request
        deadline = self._timeout_s if deadline_s is None else deadline_s
        if deadline <= 0:
            raise TransportTimeout("no time left for the request")
        return await self._exchange(server, data, method in _IDEMPOTENT, loop.time() + deadline)

    def _request(
        self, method: str, url: str, body: bytes | None, headers: dict[str, str]
    ) -> tuple[tuple[str, int], bytes] | None:
        """The server and the request's bytes, or None where aiohttp must send it."""
        key = (method, url, *headers.items())
        if key in self._heads:
            head = self._heads[key]
        else:
            if len(self._heads) >= _MAX_HEADS:  # URLs that name episodes, say: not kept for long
                self._heads.clear()
            head = self._heads[key] = self._head(method, url, headers)
        if head is None:
            return None
        server, lines = head
        if body is not None or method in _WITH_BODY:
            lines += b"Content-Length: %d\r\n" % len(body or b"")
        return server, lines + b"\r\n" + body if body else lines + b"\r\n"

    def _head(self, method: str, url: str, headers: dict[str, str]) -> tuple[tuple[str, int], bytes] | None:
        """The server and the request's head but its Content-Length and end, or None where aiohttp
        must send it."""
        if method not in _METHODS or not url.startswith("http://") or self._fallback.proxy_for(url) is not None:
            return None
        parts = urllib.parse.urlsplit(url)
        try:
            host, port = parts.hostname, parts.port
        except ValueError:  # a port that is not one: aiohttp says so
            return None
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        if not host or "@" in parts.netloc or not _plain(parts.netloc) or not _PLAIN_TARGET.fullmatch(target):
            return None
        lines = [f"{method} {target} HTTP/1.1", f"Host: {parts.netloc}"]
        names = {name.lower() for name in headers}
        if len(names) < len(headers) or names & _OWN_HEADERS:
            return None
        for name, value in headers.items():
            if not _plain(name) or not _plain(value, spaces=True):
                return None
            lines.append(f"{name}: {value}")
        return (host, 80 if port is None else port), ("\r\n".join(lines) + "\r\n").encode("ascii")

    async def _exchange(self, server: tuple[str, int], request: bytes, idempotent: bool, expires: float) -> HttpAnswer:
        idle = self._idle.setdefault(server, {})
        connection = self._kept(idle) or await self._connect(server, idle, expires)
        reused = connection.idle_since > 0
        try:
            return await self._ask(connection, request, expires)
        except _Dropped as exc:
            if not (reused and idempotent) or exc.answered or self._closed:
                raise
        # A kept-alive connection that ended with no byte of an answer: the server most likely closed
        # it (its idle timeout) as the request went out. Idempotent, so sent once more, on a new one.
        return await self._ask(await self._connect(server, idle, expires), request, expires)

    async def _ask(self, connection: _Connection, request: bytes, expires: float) -> HttpAnswer:
        """The request on `connection`, with the deadline check running while it waits (a check whose
        last pass found nothing waiting has ended; one cancelled before it ever ran is done too)."""
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return await connection.exchange(request, expires)

    async def _sweep(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            waiting = True
            while waiting:  # until a pass finds no request in flight (the next one starts another)
                await asyncio.sleep(SWEEP_S)
                now = loop.time()
                waiting = False
                for connection in list(self._live):  # a copy: a failed request's connection leaves the set
                    waiting = connection.expire(now) or waiting
        finally:
            self._sweeper = None

    @staticmethod
    def _kept(idle: dict[_Connection, None]) -> _Connection | None:
        """The most recently used idle connection, closing those idle too long to trust."""
        now = time.monotonic()
        while idle:
            connection = idle.popitem()[0]
            usable = connection.transport is not None and not connection.transport.is_closing()
            if (
                usable
                and not connection.closed
                and now - connection.idle_since < min(MAX_IDLE_S, connection.max_idle_s)
            ):
                return connection
            connection.abort()
        return None

    async def _connect(self, server: tuple[str, int], idle: dict[_Connection, None], expires: float) -> _Connection:
        loop = asyncio.get_running_loop()
        left = expires - loop.time()
        try:
            async with asyncio.timeout(min(self._connect_timeout_s, left)):
                _, connection = await loop.create_connection(
                    lambda: _Connection(idle, self._live, self.max_answer_bytes), *server
                )
        except TimeoutError:
            if left <= self._connect_timeout_s:
                raise TransportTimeout("no answer in time") from None
            raise TransportTimeout(f"no connection to {server[0]}:{server[1]} in time") from None
        except (OSError, ValueError) as exc:  # refused, no such host (ValueError: a name that cannot be one)
            raise ConnectRefused(f"{type(exc).__name__}: {exc}") from None
        if self._closed:  # closed while this connection was being made
            connection.abort()
            raise TransportError("the client is closed")
        # Only now: a connect cancelled at its end may never see connection_lost (uvloop).
        self._live.add(connection)
        return connection

    async def aclose(self) -> None:
        self._closed = True
        if self._sweeper is not None and not self._sweeper.get_loop().is_closed():
            self._sweeper.cancel()
        for connection in list(self._live):
            connection.abort()  # a request still waiting gets TransportError
        self._idle.clear()
        await self._fallback.aclose()


def _keep_alive_timeout(value: bytes) -> float:
    """The `timeout=N` of a Keep-Alive header (RFC 2068 19.7.1): how long the server keeps an idle
    connection; no limit where it names none."""
    for part in value.split(b","):
        key, _, number = part.partition(b"=")
        if key.strip().lower() == b"timeout":
            try:
                return max(0.0, float(number.strip()))
            except ValueError:
                break
    return float("inf")


def _plain(text: str, spaces: bool = False) -> bool:
    """Printable ASCII that needs no escaping in a request line or header (no CR, LF, controls)."""
    return text.isascii() and text.isprintable() and (spaces or " " not in text)
