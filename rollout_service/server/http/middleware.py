"""Small ASGI middlewares: paths with control characters refused, the body cap, both checked before
anything is parsed or routed (bearer keys: auth.py)."""

from __future__ import annotations

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ...protocol import UNPRINTABLE


def error_response(status: int, error: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": error, "message": message}, status_code=status, headers=headers)


class RefuseControlPaths:
    """400 `invalid_path` for a path holding a control character, a line break or a lone surrogate, before
    routing and before the keys."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            # As the decoded path holds them (`%0A` arrives as a newline): no route has one, a router's
            # pattern may still match around one (`$` matches before a final newline), and the path is logged.
            found = UNPRINTABLE.search(scope["path"])
            if found is not None:
                response = error_response(
                    400,
                    "invalid_path",
                    f"the path holds a control character (U+{ord(found.group()):04X})",
                )
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Refuse bodies over `max_bytes` with 413, declared (Content-Length) or streamed (chunked).

    The body is read here, counted, and handed on whole: the app never sees a body over the cap,
    and a chunked one gets the same 413 as a declared one rather than the app's parse error.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or ()).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away before the body ended
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: wait for the disconnect, as the app expects

        await self.app(scope, replay, send)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        response = error_response(
            413, "body_too_large", f"request bodies are capped at {self.max_bytes} bytes (--max-body-bytes)"
        )
        await response(scope, receive, send)
