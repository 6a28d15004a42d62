"""The HTTP transport of the hot path: every reset, step, tokenize and completion goes through it.

The service sends several requests per turn, so what one costs in the service's own CPU bounds the
turns/s one process drives. httpx costs ~2.3 ms of CPU per request under 64-way concurrency here
(its connection pool is scanned per request); aiohttp with orjson ~0.35 ms (measured with
bench/ceiling.py and a micro-benchmark against bench/standins.py, 2026-12-01). So the default is
aiohttp; `HttpxTransport` runs the same calls over any httpx transport, for tests that stand in
for a server with httpx's MockTransport.

Bodies are JSON. orjson encodes; a body it refuses (a lone UTF-16 surrogate in a string) is encoded
by the standard library instead, escaped as JSON allows. Answers are decoded by orjson, or by the
standard library where orjson refuses them (a surrogate escape), so callers see what `json` would
give them. Two differences from `json` remain, neither reachable with token ids and the models'
bounded sampling parameters: orjson writes NaN and infinities as null, and reads integers over
64 bits as floats.
"""

from __future__ import annotations

import json as std_json
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
import orjson


class TransportError(Exception):
    """No answer: the request could not be sent or its answer not read."""


class TransportTimeout(TransportError):
    """No answer within the deadline."""


class ConnectRefused(TransportError):
    """No server is listening (or the connection could not be made at all)."""


def dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value)
    except TypeError:  # a lone surrogate (orjson refuses it), or a type only `json` knows
        return std_json.dumps(value).encode()


def loads(body: bytes) -> Any:
    """`body` as JSON; ValueError when it is not JSON."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        return std_json.loads(body)  # a surrogate escape orjson will not take; raises ValueError if not JSON


@dataclass
class HttpAnswer:
    status: int
    body: bytes

    def json(self) -> Any:
        """The body as JSON; ValueError when it is not JSON."""
        return loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


_MAX_HEADER_BYTES = 64 * 1024


class HttpTransport:
    """One pool of keep-alive connections; `request` answers whatever status the server sent."""

    async def request(
        self,
        method: str,
        url: str,
        *,
        json: Any = None,
        headers: dict[str, str] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - a per-request deadline, passed to the HTTP library
    ) -> HttpAnswer:
        """Send `json` (if any) as the body; raise TransportTimeout, ConnectRefused or TransportError
        when there is no answer."""
        send_headers = dict(headers or {})
        body = None
        if json is not None:
            body = dumps(json)
            send_headers["Content-Type"] = "application/json"
        return await self._send(method, url, body, send_headers, timeout)

    async def _send(
        self, method: str, url: str, body: bytes | None, headers: dict[str, str], deadline_s: float | None
    ) -> HttpAnswer:
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError


class AiohttpTransport(HttpTransport):
    """aiohttp's client; its session is made on first use, inside the loop that will use it."""

    def __init__(self, timeout_s: float, connect_timeout_s: float = 10.0) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=connect_timeout_s)
        self._connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._closed = False

    def _open(self) -> aiohttp.ClientSession:
        if self._closed:
            raise TransportError("the client is closed")
        if self._session is None:
            # No cap on connections: the scheduler and the envs' pools bound what is in flight. No DNS
            # cache: connections are kept alive, so lookups are rare, and a backend restarted on a new
            # address (a pod, a container) must be found at once, as httpx found it.
            connector = aiohttp.TCPConnector(limit=0, use_dns_cache=False)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=self._timeout,
                skip_auto_headers=("User-Agent",),
                raise_for_status=False,
                trust_env=True,  # HTTP(S)_PROXY / NO_PROXY, as httpx honoured them
                max_line_size=_MAX_HEADER_BYTES,  # a proxy in between may add long headers
                max_field_size=_MAX_HEADER_BYTES,
            )
        return self._session

    async def _send(
        self, method: str, url: str, body: bytes | None, headers: dict[str, str], deadline_s: float | None
    ) -> HttpAnswer:
        if deadline_s is not None and deadline_s <= 0:  # aiohttp reads 0 as "no deadline"
            raise TransportTimeout("no time left for the request")
        session = self._open()
        deadline = (
            aiohttp.ClientTimeout(total=deadline_s, connect=min(deadline_s, self._connect_timeout_s))
            if deadline_s is not None
            else self._timeout
        )
        try:
            async with session.request(
                method,
                url,
                data=body,
                headers=headers,
                timeout=deadline,
                allow_redirects=False,  # as httpx: a redirect is an answer to report, not to follow
            ) as response:
                return HttpAnswer(response.status, await response.read())
        except TimeoutError as exc:
            raise TransportTimeout(f"{type(exc).__name__}: no answer in time") from None
        except (aiohttp.ClientConnectorError, ValueError) as exc:  # ValueError: a host name that cannot be one
            raise ConnectRefused(f"{type(exc).__name__}: {exc}") from None
        except aiohttp.ClientError as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from None
        except RuntimeError as exc:
            if self._closed or session.closed:  # closed under a request (shutdown): no answer
                raise TransportError(f"{type(exc).__name__}: {exc}") from None
            raise  # a bug (say, a second event loop): not a backend's failure

    async def aclose(self) -> None:
        self._closed = True
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


def make_transport(timeout_s: float, stand_in: httpx.AsyncBaseTransport | None = None) -> HttpTransport:
    """aiohttp, or (tests) `stand_in`, an httpx transport answering for the servers."""
    if stand_in is not None:
        return HttpxTransport(httpx.AsyncClient(transport=stand_in, timeout=timeout_s))
    return AiohttpTransport(timeout_s)


class HttpxTransport(HttpTransport):
    """The same calls over an httpx client (any of its transports: tests stand in for servers so)."""

    def __init__(self, client: httpx.AsyncClient) -> None:
        self._http = client

    async def _send(
        self, method: str, url: str, body: bytes | None, headers: dict[str, str], deadline_s: float | None
    ) -> HttpAnswer:
        kwargs: dict[str, Any] = {} if deadline_s is None else {"timeout": deadline_s}
        try:
            response = await self._http.request(method, url, content=body, headers=headers, **kwargs)
        except httpx.TimeoutException as exc:
            raise TransportTimeout(f"{type(exc).__name__}: no answer in time") from None
        except httpx.ConnectError as exc:
            raise ConnectRefused(f"{type(exc).__name__}: {exc}") from None
        except httpx.HTTPError as exc:
            raise TransportError(f"{type(exc).__name__}: {exc}") from None
        except RuntimeError as exc:
            if self._http.is_closed:
                raise TransportError(f"{type(exc).__name__}: {exc}") from None
            raise
        return HttpAnswer(response.status_code, response.content)

    async def aclose(self) -> None:
        await self._http.aclose()
