"""The viewer's routes: the page and its assets (public, so the page loads before the key is typed)
and its JSON reads (the data plane: the trainers' key), every answer with a strict
Content-Security-Policy (see `SecurityHeaders`)."""

from __future__ import annotations

from importlib import resources
from typing import Protocol

from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ..protocol import GroupResult
from ..server.http.auth import Plane, on_plane
from .book import MAX_PAGE, GroupPage, GroupQuery, RunLogChanged
from .overview import Overview, TaskRow

PREFIX = "/ui"
# Nothing but the viewer's own script and stylesheet runs or loads: text from a rollout that reached
# the page as markup could neither run script nor fetch anything.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
_HEADERS = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"cache-control", b"no-store"),
]
_ASSETS = {"app.js": "text/javascript", "charts.js": "text/javascript", "style.css": "text/css"}


def _asset(name: str) -> bytes:
    return resources.files(__package__).joinpath("static", name).read_bytes()


class Book(Protocol):
    """What the routes read: a live service's (live.LiveBook) or a run log's (runlog_book.RunLogBook)."""

    async def refresh(self) -> None: ...
    def overview(self) -> Overview: ...
    def groups(self, query: GroupQuery) -> GroupPage: ...
    async def group(self, seq: int) -> GroupResult | None: ...
    def tasks(self) -> list[TaskRow]: ...


async def _book(request: Request) -> Book:
    book: Book = request.app.state.viewer
    await book.refresh()
    return book


router = APIRouter(prefix=PREFIX)


@router.get("", openapi_extra=on_plane(Plane.PUBLIC), summary="The run viewer (a page; its data needs the API key)")
async def page() -> Response:
    return Response(_asset("index.html"), media_type="text/html; charset=utf-8")


@router.get("/assets/{name}", openapi_extra=on_plane(Plane.PUBLIC), summary="The viewer's script and stylesheet")
async def asset(name: str) -> Response:
    if name not in _ASSETS:
        raise HTTPException(404, f"no viewer asset {name!r}")
    return Response(_asset(name), media_type=_ASSETS[name])


@router.get(
    "/api/overview",
    openapi_extra=on_plane(Plane.DATA),
    response_model=Overview,
    summary="The viewer's overview: counters over time, replicas, lag, signal per version, failures",
)
async def overview(request: Request) -> Overview:
    return (await _book(request)).overview()


@router.get(
    "/api/groups",
    openapi_extra=on_plane(Plane.DATA),
    response_model=GroupPage,
    summary="One page of the groups the viewer holds, newest first, filtered",
)
async def groups(
    request: Request,
    task: str | None = Query(None, max_length=300, description="a task id or slug"),
    family: str | None = Query(None, max_length=200),
    version: str | None = Query(None, max_length=200, description="the policy version the group ended on"),
    status: str | None = Query(None, max_length=50, description="groups with an attempt of this status"),
    min_reward: float | None = Query(None, allow_inf_nan=False, description="mean reward at least"),
    max_reward: float | None = Query(None, allow_inf_nan=False, description="mean reward at most"),
    signal: bool | None = Query(None, description="true: groups whose graded rewards differ"),
    offset: int = Query(0, ge=0, le=10_000_000),
    limit: int = Query(50, ge=1, le=MAX_PAGE),
) -> GroupPage:
    query = GroupQuery(task, family, version, status, min_reward, max_reward, signal, offset, limit)
    return (await _book(request)).groups(query)


@router.get(
    "/api/groups/{seq}",
    openapi_extra=on_plane(Plane.DATA),
    response_model=GroupResult,
    summary="One group as the service answered it, by its place in the viewer's list",
)
async def group(seq: int, request: Request) -> Response:
    try:
        result = await (await _book(request)).group(seq)
    except RunLogChanged as exc:
        raise HTTPException(409, f"{exc}: open the group list again") from None
    if result is None:
        raise HTTPException(
            404,
            f"no group {seq} here: groups are numbered from 0 in the order they finished, and the live viewer "
            "keeps the newest ones only (`rollout-service view RUNLOG` reads every group of a run log)",
        )
    return Response(result.model_dump_json(by_alias=True), media_type="application/json")


@router.get(
    "/api/tasks",
    openapi_extra=on_plane(Plane.DATA),
    response_model=list[TaskRow],
    summary="GET /tasks/stats with each task's family",
)
async def tasks(request: Request) -> list[TaskRow]:
    return (await _book(request)).tasks()


class SecurityHeaders:
    """The CSP and its companions on every answer under `prefix` ("" for every answer)."""

    def __init__(self, app: ASGIApp, prefix: str = PREFIX) -> None:
        self.app = app
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not str(scope.get("path", "")).startswith(self.prefix):
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), *_HEADERS]
            await send(message)

        await self.app(scope, receive, send_with_headers)
