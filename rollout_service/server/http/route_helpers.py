"""What every route module shares: the service a request reaches, the refusals its OpenAPI entry
lists, and a handler cancelled with its client."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from ...protocol import ErrorBody
from ..groups.streaming import disconnected
from ..service import RolloutService

ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 404, 409, 413, 422, 429, 502, 503, 504)
}


def service_of(request: Request) -> RolloutService:
    return request.app.state.service


def ready(request: Request) -> RolloutService:
    """The service, or 503 `starting` (with what it waits for) while its backends are not all up."""
    service = service_of(request)
    service.lifecycle.refuse_unless_ready()
    return service


def with_cancellation(handler: Callable[..., Awaitable[Response]]) -> Callable[..., Awaitable[Response]]:
    """Cancel the handler (and so abandon its episodes) when the client disconnects first.
    The handler must take the `Request` as its `request` keyword argument."""

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Response:
        work = asyncio.ensure_future(handler(*args, **kwargs))
        watcher = asyncio.ensure_future(disconnected(kwargs["request"]))
        try:
            await asyncio.wait([work, watcher], return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                work.cancel()
                await asyncio.wait([work])
                return Response(status_code=499)  # nobody reads it: the client is gone
            return work.result()
        finally:
            watcher.cancel()
            if not work.done():  # we were cancelled ourselves (shutdown)
                work.cancel()
                await asyncio.wait([work])

    return wrapper
