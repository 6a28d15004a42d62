"""The service's backend calls over an httpx client, for what a real server cannot be made to do: tests
answer for a server with httpx's MockTransport (a malformed answer, a failure on demand) and hand the
result to a client as its `http`; bench/http_stacks.py measures httpx as a candidate stack. The service
itself talks to its backends through rollout_service/backends/transport.py's aiohttp client only."""

from __future__ import annotations

from typing import Any

import httpx

from rollout_service.backends.transport import (
    DEFAULT_MAX_ANSWER_BYTES,
    AnswerTooLarge,
    ConnectRefused,
    HttpAnswer,
    HttpTransport,
    TransportError,
    TransportTimeout,
)


def stand_in(
    answers: httpx.AsyncBaseTransport, timeout_s: float = 30.0, max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES
) -> HttpTransport:
    """A client's `http` whose servers are `answers` (e.g. httpx.MockTransport(handler))."""
    return HttpxTransport(httpx.AsyncClient(transport=answers, timeout=timeout_s), max_answer_bytes)


class HttpxTransport(HttpTransport):
    """The same calls over an httpx client (any of its transports: tests stand in for servers so)."""

    def __init__(self, client: httpx.AsyncClient, max_answer_bytes: int = DEFAULT_MAX_ANSWER_BYTES) -> None:
        self._http = client
        self.max_answer_bytes = max_answer_bytes

    async def _send(
        self, method: str, url: str, body: bytes | None, headers: dict[str, str], deadline_s: float | None
    ) -> HttpAnswer:
        kwargs: dict[str, Any] = {} if deadline_s is None else {"timeout": deadline_s}
        if body is not None:
            headers = {"Content-Type": "application/json", **headers}
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
