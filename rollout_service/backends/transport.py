"""The service's one HTTP stack for its backends: every env call, completion, tokenize, weight
update and membership probe goes through it. aiohttp, chosen by measurement (docs/benchmarks-http.md):
the service sends several requests per turn, so what one costs the service's own CPU bounds the
turns/s one process drives. (tests/httpx_stand_in.py runs the same calls over an httpx transport,
for tests that stand in for a server with httpx's MockTransport; the service never uses it.)

aiohttp's own `trust_env` is off: with it, every request ran two jobs on the default thread pool
(the proxy variables looked up and ~/.netrc looked for), which took half of the service's CPU at
the ceiling. HTTP_PROXY / HTTPS_PROXY / NO_PROXY are read once, when the transport starts, and each
host's answer kept. No netrc and no cookies: the service authenticates with the headers its config
names, and one env's cookies are not another's. Redirects are answers, not followed. Every answer's
body is capped while it is read (AnswerTooLarge).

Bodies are JSON (rollout_service/backends/json_body.py); an answer's `json()` also makes text with a lone
surrogate escape encodable (`clean_text`), as what orjson reads always is.
"""

from __future__ import annotations

import asyncio
import json as std_json
import logging
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson
import yarl

from .addresses import AddressPolicy, CheckedResolver, RefusedAddress, canonical_ipv4
from .deadlines import DeadlineSweep
from .json_body import dumps
from .limits import DEFAULT_MAX_ANSWER_BYTES
from .proxies import EnvProxies
from .text import clean_text

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


class TransportError(Exception):
    """No answer: the request could not be sent or its answer not read."""


class TransportTimeout(TransportError):
    """No answer within the deadline."""


class ConnectRefused(TransportError):
    """No server is listening (or the connection could not be made at all)."""


class EncodedAnswer(TransportError):
    """An answer with a Content-Encoding though only identity was asked for: its size on the wire says
    nothing of what it unpacks to (a 300 KB gzip can hold 300 MB), so it is refused, not unpacked."""

    def __init__(self, encoding: str) -> None:
        self.encoding = encoding[:40]
        super().__init__(f"the answer is encoded ({self.encoding!r}) though identity was asked for")


class AddressRefused(TransportError):
    """The backend's name resolved to an address the service may not reach (its address policy,
    --allow-backends): no connection was made, nothing was sent."""


class AnswerTooLarge(TransportError):
    """The answer was longer than the transport's cap: cut off as it came, never held whole."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        super().__init__(f"the answer is longer than {limit} bytes (--max-answer-bytes)")


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
MAX_IDLE_S = 2.0
USER_AGENT = "rollout-service"
_KEPT_URLS = 1024


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
        return await self._send(method, url, None if json is None else dumps(json), headers or {}, timeout)

    async def _send(
        self, method: str, url: str, body: bytes | None, headers: dict[str, str], deadline_s: float | None
    ) -> HttpAnswer:
        """`body` (JSON, sent as application/json) and `headers` (the caller's, not to be changed)."""
        raise NotImplementedError

    async def aclose(self) -> None:
        raise NotImplementedError


class AiohttpTransport(HttpTransport):
    """aiohttp's client; its session is made on first use, inside the loop that will use it."""

    def __init__(
        self,
        timeout_s: float,
        connect_timeout_s: float = 10.0,
        max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
        address_policy: AddressPolicy | None = None,
    ) -> None:
        self.max_answer_bytes = max_answer_bytes
        self.address_policy = address_policy  # None: any address the system resolves a name to
        self._timeout_s = timeout_s
        # A request's whole deadline is kept by DeadlineSweep; aiohttp bounds only the making of a connection.
        self._timeout = aiohttp.ClientTimeout(total=None, connect=connect_timeout_s)
        self._deadlines = DeadlineSweep()
        self._session: aiohttp.ClientSession | None = None
        self._closed = False
        self.proxy_for = EnvProxies()
        self._urls: dict[str, yarl.URL] = {}

    def _url(self, url: str) -> yarl.URL:
        """`url` parsed (and escaped) as aiohttp would for each request, once: the service asks the
        same few URLs over and over. Kept up to _KEPT_URLS; the rest (an episode's DELETE, say) come
        and go."""
        parsed = self._urls.get(url)
        if parsed is None:
            try:
                parsed = yarl.URL(url)
            except ValueError as exc:  # as aiohttp says it of a URL it cannot parse
                raise aiohttp.InvalidUrlClientError(url) from exc
            if len(self._urls) >= _KEPT_URLS:
                self._urls.clear()
            self._urls[url] = parsed
        return parsed

    def _open(self) -> aiohttp.ClientSession:
        if self._closed:
            raise TransportError("the client is closed")
        if self._session is None:
            # No cap on connections: the scheduler and the envs' pools bound what is in flight. No DNS
            # cache: connections are kept alive, so lookups are rare, and a backend restarted on a new
            # address (a pod, a container) must be found at once, as httpx found it.
            # A connection idle past MAX_IDLE_S is closed, not reused: servers close idle ones (uvicorn
            # after 5 s), and a POST written as the server closes would fail its turn.
            # With an address policy, every name is resolved and checked at each connection (see
            # CheckedResolver).
            resolver = None
            if self.address_policy is not None:
                resolver = CheckedResolver(self.address_policy, self.proxy_for.hosts)
            connector = aiohttp.TCPConnector(
                limit=0, use_dns_cache=False, keepalive_timeout=MAX_IDLE_S, resolver=resolver
            )
            # Answers are read as sent, never unpacked: the cap counts the bytes that would be held.
            # (aiohttp would otherwise ask for gzip and unpack past the cap checked on Content-Length.)
            # Its own User-Agent rather than aiohttp's, named here: asking aiohttp to skip one made it
            # build two header maps more for every request.
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                headers={"Accept-Encoding": "identity", "User-Agent": USER_AGENT},
                timeout=self._timeout,
                raise_for_status=False,
                cookie_jar=aiohttp.DummyCookieJar(),
                max_line_size=MAX_HEADER_BYTES,  # a proxy in between may add long headers
                max_field_size=MAX_HEADER_BYTES,
            )
        return self._session

    async def _send(
        self, method: str, url: str, body: bytes | None, headers: dict[str, str], deadline_s: float | None
    ) -> HttpAnswer:
        if deadline_s is not None and deadline_s <= 0:
            raise TransportTimeout("no time left for the request")
        session = self._open()
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("an HTTP request must run in a task")
        # Counted against what the task had before: a request made in cleanup after a cancellation
        # (its task still cancelling) keeps its deadline as TransportTimeout.
        cancelling = task.cancelling()
        self._deadlines.add(task, self._timeout_s if deadline_s is None else deadline_s)
        try:
            answer = await self._exchange(session, method, url, body, headers)
        except BaseException as exc:
            expired = self._deadlines.remove(task)
            if not expired or (isinstance(exc, asyncio.CancelledError) and task.cancelling() > cancelling):
                raise  # not past its deadline, or cancelled by its caller as well
            if not isinstance(exc, (Exception, asyncio.CancelledError)):
                raise  # KeyboardInterrupt, SystemExit: the process's, whatever the deadline
            raise TransportTimeout("no answer in time") from None
        self._deadlines.remove(task)  # past its deadline as the answer came: the answer stands
        return answer

    async def _exchange(
        self, session: aiohttp.ClientSession, method: str, url: str, body: bytes | None, headers: dict[str, str]
    ) -> HttpAnswer:
        proxy = self.proxy_for(url)
        if proxy is not None and proxy[1] and urllib.parse.urlsplit(url).scheme == "http":
            headers = {**headers, **proxy[1]}  # a plain-HTTP request goes to the proxy itself: no CONNECT
        try:
            async with session.request(
                method,
                self._url(url),
                # A payload made here, with its type, rather than one aiohttp finds for bytes and a
                # Content-Type header merged into the caller's.
                data=None if body is None else aiohttp.BytesPayload(body, content_type="application/json"),
                headers=headers,
                allow_redirects=False,  # as httpx: a redirect is an answer to report, not to follow
                proxy=proxy[0] if proxy else None,
                proxy_headers=proxy[1] if proxy else None,
            ) as response:
                return HttpAnswer(response.status, await self._read(response))
        except TimeoutError as exc:
            raise TransportTimeout(f"{type(exc).__name__}: no answer in time") from None
        except aiohttp.InvalidUrlClientError as exc:
            # yarl takes only the canonical dotted form of an IPv4 address: "127.1" is 127.0.0.1, as
            # the system's resolver reads it. Anything else it refuses is no connection.
            canonical = canonical_ipv4(url)
            if canonical is None:
                raise ConnectRefused(f"{type(exc).__name__}: {exc}") from None
            return await self._exchange(session, method, canonical, body, headers)
        except aiohttp.ClientConnectorError as exc:
            if isinstance(exc.os_error, RefusedAddress):
                raise AddressRefused(str(exc.os_error)) from None
            raise ConnectRefused(f"{type(exc).__name__}: {exc}") from None
        except ValueError as exc:  # a host name that cannot be one
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
        encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise EncodedAnswer(encoding)
        length = response.content_length  # parsed from the header on each reading
        if length is not None:
            if length > limit:
                raise AnswerTooLarge(limit)
            if response.content.is_eof():  # the whole body came with the head: taken as it lies
                return response.content.read_nowait()
            return await response.read()  # reads what the length announced and no more
        body = bytearray()
        async for chunk in response.content.iter_any():
            body += chunk
            if len(body) > limit:
                raise AnswerTooLarge(limit)  # leaving the block closes the connection: the rest is unread
        return bytes(body)

    async def aclose(self) -> None:
        self._closed = True
        self._deadlines.close()
        if self._session is not None:
            session, self._session = self._session, None
            await session.close()


def make_transport(
    timeout_s: float,
    *,
    max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES,
    address_policy: AddressPolicy | None = None,
) -> HttpTransport:
    """The service's client (aiohttp), connecting only where `address_policy` allows and reading at
    most `max_answer_bytes` of an answer."""
    return AiohttpTransport(timeout_s, max_answer_bytes=max_answer_bytes, address_policy=address_policy)
