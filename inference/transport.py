"""The HTTP transport of the hot path: every reset, step, tokenize and completion goes through it.

The service sends several requests per turn, so what one costs in the service's own CPU bounds the
turns/s one process drives. httpx costs ~2.3 ms of CPU per request under 64-way concurrency here
(its connection pool is scanned per request); aiohttp with orjson ~0.35 ms (measured with
bench/ceiling.py and a micro-benchmark against bench/standins.py, 2026-12-01). The default is the
bare HTTP/1.1 client of inference/http11.py, with aiohttp behind it for what that does not speak
(https, proxies); `HttpxTransport` runs the same calls over any httpx transport, for tests that
stand in for a server with httpx's MockTransport.

aiohttp's own `trust_env` is off: with it, every request ran two jobs on the default thread pool
(the proxy variables looked up and ~/.netrc looked for), which took half of the service's CPU at
the ceiling (py-spy, bench/ceiling.py, 2026-12-02). HTTP_PROXY / HTTPS_PROXY / NO_PROXY are read
once, when the transport starts, and each host's answer kept. No netrc and no cookies: the service
authenticates with the headers its config names, and one env's cookies are not another's.

Bodies are JSON. orjson encodes; a body it refuses (a lone UTF-16 surrogate in a string) is encoded
by the standard library instead, escaped as JSON allows. Answers are decoded by orjson, or by the
standard library where orjson refuses them (a surrogate escape), so `loads` gives what `json`
would; an answer's `json()` also makes such text encodable (`clean_text`), as what orjson reads
always is. Two differences from `json` remain, neither reachable with token ids and the models'
bounded sampling parameters: orjson writes NaN and infinities as null, and reads integers over
64 bits as floats. A JsonList in a body is sent as the JSON it kept (see there).
"""

from __future__ import annotations

import base64
import json as std_json
import logging
import os
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
import orjson

from .text import clean_text

logger = logging.getLogger(__name__)


class TransportError(Exception):
    """No answer: the request could not be sent or its answer not read."""


class TransportTimeout(TransportError):
    """No answer within the deadline."""


class ConnectRefused(TransportError):
    """No server is listening (or the connection could not be made at all)."""


class AnswerTooLarge(TransportError):
    """The answer was longer than the transport's cap: cut off as it came, never held whole."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(f"the answer is longer than {limit} bytes (--max-answer-bytes)")


# What one answer from an env or a model server may hold unless a transport is told otherwise. The
# largest legitimate one is a completion: max_tokens (at most 32,768) times an id, a logprob and its
# text (under 128 bytes a token, written as JSON, with the chat endpoint's per-token entries) for
# each of up to 16 choices is 64 MiB; an env's observation is far below that.
DEFAULT_MAX_ANSWER_BYTES = 64 << 20


class JsonList(list):
    """A list that keeps its own JSON as it grows: an exact attempt's prompt is thousands of ids, sent
    once a turn and written again in the group's result (in each turn's record too, until 2026-12-03),
    and serialising them again each time took ~9% of the service's CPU at bench/ceiling.py's ceiling.
    Appended to with `grow` and `repeat` (which write the new items' JSON once); copies share what was
    written.

    A list changed with list methods is written as a plain list (each of them marks it so) until its
    next `grow` or `repeat`, which writes its JSON again. Anything that reads a list can read one."""

    __slots__ = ("_body", "_upto", "_count")

    def __init__(self, items: Any = ()) -> None:
        super().__init__(items)
        self._body = bytearray(_dump_items(self))  # items and their commas; only ever appended to
        self._upto = len(self._body)
        self._count = len(self)  # -1 once changed with a list method: the JSON no longer holds

    def grow(self, items: list) -> None:
        """`items` appended; their JSON is written here, or taken from a JsonList that has it."""
        written = items._items_json() if isinstance(items, JsonList) else None
        self._written(written if written is not None else _dump_items(items), items)

    def repeat(self, item: int | None, times: int) -> None:
        """`times` more of `item` (0, 1 or None)."""
        self._written(((orjson.dumps(item) + b",") * times)[:-1], [item] * times)

    def snapshot(self) -> JsonList:
        """A copy of the list as it is now, sharing the JSON (later growth of this list is not in it)."""
        copy = JsonList.__new__(JsonList)
        list.extend(copy, list.copy(self))  # from a plain list: a subclass would be copied item by item
        copy._body, copy._upto, copy._count = self._body, self._upto, self._count
        return copy

    def json(self) -> orjson.Fragment | None:
        """The list's JSON for orjson to copy as it is; None when the list has changed since."""
        items = self._items_json()
        return None if items is None else orjson.Fragment(b"".join((b"[", items, b"]")))

    def _items_json(self) -> bytearray | None:
        """The JSON of the items without the brackets (a copy); None when the list has changed since."""
        return self._body[: self._upto] if len(self) == self._count else None

    def _written(self, part: bytes | bytearray, items: list) -> None:
        if len(self) != self._count:  # changed with list methods: written again
            self._body = bytearray(_dump_items(list(self)))
            self._upto = len(self._body)
        elif self._upto != len(self._body):
            # The body is shared (with the list this one is a snapshot of, or another snapshot) and
            # holds more than this list: from here on this list writes a body of its own.
            self._body = self._body[: self._upto]
        if part:
            if self._upto:
                self._body += b","
            self._body += part
            self._upto = len(self._body)
        list.extend(self, items)
        self._count = len(self)

    def _changed(self) -> None:
        self._count = -1

    def __setitem__(self, index: Any, value: Any) -> None:
        list.__setitem__(self, index, value)
        self._changed()

    def __delitem__(self, index: Any) -> None:
        list.__delitem__(self, index)
        self._changed()

    def __iadd__(self, items: Any) -> JsonList:  # type: ignore[misc]
        list.extend(self, items)
        self._changed()
        return self

    def __imul__(self, times: Any) -> JsonList:  # type: ignore[misc]
        list.__imul__(self, times)
        self._changed()
        return self

    def append(self, item: Any) -> None:
        list.append(self, item)
        self._changed()

    def extend(self, items: Any) -> None:
        list.extend(self, items)
        self._changed()

    def insert(self, index: Any, item: Any) -> None:
        list.insert(self, index, item)
        self._changed()

    def pop(self, index: Any = -1) -> Any:
        item = list.pop(self, index)
        self._changed()
        return item

    def remove(self, item: Any) -> None:
        list.remove(self, item)
        self._changed()

    def clear(self) -> None:
        list.clear(self)
        self._changed()

    def sort(self, *args: Any, **kwargs: Any) -> None:
        list.sort(self, *args, **kwargs)
        self._changed()

    def reverse(self) -> None:
        list.reverse(self)
        self._changed()


def _dump_items(items: list) -> bytes:
    """`items` as JSON without the brackets: orjson's, or the standard library's for what orjson
    refuses (an int over 64 bits)."""
    try:
        return orjson.dumps(items)[1:-1]
    except TypeError:
        return std_json.dumps(items, separators=(",", ":")).encode()[1:-1]


def plain_json(value: Any) -> Any:
    """orjson's `default` with OPT_PASSTHROUGH_SUBCLASS: a JsonList's own JSON; other subclasses of
    what JSON knows as what they are JSON of."""
    if isinstance(value, JsonList):
        written = value.json()
        return written if written is not None else list(value)
    if isinstance(value, str):
        return str.__str__(value)  # a str enum's value, not its name
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, list | dict):
        return list(value) if isinstance(value, list) else dict(value)
    raise TypeError(f"{type(value).__name__} is not JSON")


def dumps(value: Any) -> bytes:
    try:
        return orjson.dumps(value, default=plain_json, option=orjson.OPT_PASSTHROUGH_SUBCLASS)
    except TypeError:  # a lone surrogate (orjson refuses it), or a type only `json` knows
        return std_json.dumps(value).encode()


def loads(body: bytes | str) -> Any:
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
        """The body as JSON, every string encodable (`clean_text`); ValueError when it is not JSON."""
        try:
            return orjson.loads(self.body)  # refuses what clean_text would change
        except orjson.JSONDecodeError:
            return clean_text(std_json.loads(self.body))

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


MAX_HEADER_BYTES = 64 * 1024


class EnvProxies:
    """The proxy each URL goes through, from HTTP_PROXY / HTTPS_PROXY / NO_PROXY as they were when
    this was made, by the standard library's rules (as httpx read them; ALL_PROXY and ~/.netrc are
    not used); each scheme and host is decided once."""

    def __init__(self) -> None:
        found = urllib.request.getproxies_environment()
        self._bypass = found.get("no", "")
        self._proxies: dict[str, tuple[str, dict[str, str]]] = {}
        for scheme in ("http", "https"):
            if not found.get(scheme):
                continue
            try:
                proxy = urllib.parse.urlsplit(found[scheme])
                _ = proxy.port  # a port that is not one raises here, not at every request
            except ValueError as exc:
                proxy = None
                logger.warning("%s_PROXY=%s is not a URL (%s); requests go direct", scheme.upper(), found[scheme], exc)
            if proxy is None:
                continue
            if proxy.scheme != "http":  # aiohttp speaks to plain-HTTP proxies only
                logger.warning("%s_PROXY=%s is not an http:// proxy; requests go direct", scheme.upper(), found[scheme])
                continue
            headers = {}
            if proxy.username is not None:
                credentials = f"{urllib.parse.unquote(proxy.username)}:{urllib.parse.unquote(proxy.password or '')}"
                headers["Proxy-Authorization"] = "Basic " + base64.b64encode(credentials.encode()).decode()
            self._proxies[scheme] = (proxy._replace(netloc=proxy.netloc.rpartition("@")[2]).geturl(), headers)
        self._decided: dict[tuple[str, str], tuple[str, dict[str, str]] | None] = {}

    def __call__(self, url: str) -> tuple[str, dict[str, str]] | None:
        """The proxy's URL and the headers it is sent (its credentials), or None: go direct."""
        if not self._proxies:
            return None
        parts = urllib.parse.urlsplit(url)
        key = (parts.scheme, parts.netloc)
        if key not in self._decided:
            proxy = self._proxies.get(parts.scheme)
            # NO_PROXY entries may name a host or a host:port, and an IPv6 one with or without brackets.
            host_port, host = parts.netloc.rpartition("@")[2], parts.hostname or ""
            # The standard library's own NO_PROXY rules (what getproxies and httpx follow); untyped in typeshed.
            bypass = urllib.request.proxy_bypass_environment  # type: ignore[attr-defined]
            no = {"no": self._bypass}
            if proxy is not None and (bypass(host_port, no) or bypass(host, no)):
                proxy = None
            self._decided[key] = proxy
        return self._decided[key]


class HttpTransport:
    """One pool of keep-alive connections; `request` answers whatever status the server sent, or
    raises AnswerTooLarge as soon as more than `max_answer_bytes` of an answer's body has come."""

    max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES

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

    def __init__(
        self, timeout_s: float, connect_timeout_s: float = 10.0, max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES
    ) -> None:
        self.max_answer_bytes = max_answer_bytes
        self._timeout = aiohttp.ClientTimeout(total=timeout_s, connect=connect_timeout_s)
        self._connect_timeout_s = connect_timeout_s
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        self.proxy_for = EnvProxies()

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
                cookie_jar=aiohttp.DummyCookieJar(),
                max_line_size=MAX_HEADER_BYTES,  # a proxy in between may add long headers
                max_field_size=MAX_HEADER_BYTES,
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
        proxy = self.proxy_for(url)
        if proxy is not None and proxy[1] and urllib.parse.urlsplit(url).scheme == "http":
            headers = {**headers, **proxy[1]}  # a plain-HTTP request goes to the proxy itself: no CONNECT
        try:
            async with session.request(
                method,
                url,
                data=body,
                headers=headers,
                timeout=deadline,
                allow_redirects=False,  # as httpx: a redirect is an answer to report, not to follow
                proxy=proxy[0] if proxy else None,
                proxy_headers=proxy[1] if proxy else None,
            ) as response:
                return HttpAnswer(response.status, await self._read(response))
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

    async def _read(self, response: aiohttp.ClientResponse) -> bytes:
        """The body, refused as soon as it outgrows the cap (an announced length over it at once)."""
        limit = self.max_answer_bytes
        if response.content_length is not None and response.content_length > limit:
            raise AnswerTooLarge(limit)
        body = bytearray()
        async for chunk in response.content.iter_any():
            body += chunk
            if len(body) > limit:
                raise AnswerTooLarge(limit)  # leaving the block closes the connection: the rest is unread
        return bytes(body)

    async def aclose(self) -> None:
        self._closed = True
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


def make_transport(
    timeout_s: float,
    stand_in: httpx.AsyncBaseTransport | None = None,
    *,
    max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
) -> HttpTransport:
    """The bare HTTP/1.1 client (aiohttp behind it for what it does not speak), or (tests) `stand_in`,
    an httpx transport answering for the servers; either reads at most `max_answer_bytes` of an answer."""
    if stand_in is not None:
        return HttpxTransport(httpx.AsyncClient(transport=stand_in, timeout=timeout_s), max_answer_bytes)
    # Only for bench/http_stacks.py's side-by-side measurement of the candidate stacks.
    stack = os.environ.get("ROLLOUT_BENCH_HTTP_STACK", "http11")
    if stack == "aiohttp":
        return AiohttpTransport(timeout_s, max_answer_bytes=max_answer_bytes)
    if stack == "httpx":
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
        return HttpxTransport(httpx.AsyncClient(timeout=timeout_s, trust_env=False, limits=limits), max_answer_bytes)
    from .http11 import Http11Transport  # here: it builds on this module's types

    return Http11Transport(timeout_s, max_answer_bytes=max_answer_bytes)


class HttpxTransport(HttpTransport):
    """The same calls over an httpx client (any of its transports: tests stand in for servers so)."""

    def __init__(self, client: httpx.AsyncClient, max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES) -> None:
        self._http = client
        self.max_answer_bytes = max_answer_bytes

    async def _send(
        self, method: str, url: str, body: bytes | None, headers: dict[str, str], deadline_s: float | None
    ) -> HttpAnswer:
        kwargs: dict[str, Any] = {} if deadline_s is None else {"timeout": deadline_s}
        try:
            async with self._http.stream(method, url, content=body, headers=headers, **kwargs) as response:
                received = bytearray()
                async for chunk in response.aiter_bytes():
                    received += chunk
                    if len(received) > self.max_answer_bytes:
                        raise AnswerTooLarge(self.max_answer_bytes)
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
        return HttpAnswer(response.status_code, bytes(received))

    async def aclose(self) -> None:
        await self._http.aclose()
