"""Groups: POST /groups, POST /groups/batch (NDJSON, one line per group as it finishes), GET /tasks."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from ...protocol import BatchRequest, GroupRequest, GroupResult
from ..errors import shutting_down
from ..groups.streaming import HeldResults, batch_answer
from .auth import Plane, on_plane
from .route_helpers import ERRORS, ready, service_of, with_cancellation

router = APIRouter()


@router.post(
    "/groups",
    openapi_extra=on_plane(Plane.DATA),
    response_model=GroupResult,
    responses=ERRORS,
    summary="Run one group",
)
@with_cancellation
async def post_group(body: GroupRequest, request: Request) -> Response:
    service = service_of(request)
    (task,) = service.admission.start_groups([body])
    try:
        outcome = await task
    except asyncio.CancelledError:
        if task.cancelled() and not asyncio.current_task().cancelling():  # type: ignore[union-attr]
            raise shutting_down() from None  # the service cancelled the group, not the client
        raise
    return Response(outcome.body, media_type="application/json")


@router.post(
    "/groups/batch",
    openapi_extra=on_plane(Plane.DATA),
    responses=ERRORS,
    summary="Run many groups; stream each as it finishes",
    response_description="NDJSON: one line per group, {index, group} or {index, error}",
)
async def post_batch(body: BatchRequest, request: Request) -> Response:
    service = service_of(request)
    tasks, window = service.admission.start_batch(body.groups)
    sizes = [g.n for g in body.groups]
    held = HeldResults(service.admission)  # finished, unsent groups count against the queue cap (groups/streaming.py)
    for task, size in zip(tasks, sizes, strict=True):
        held.hold_when_done(task, size)
    return batch_answer(request, service.admission, tasks, sizes, held, window, service.config.stream_stall_timeout)


@router.get("/tasks", openapi_extra=on_plane(Plane.DATA), summary="Tasks served by the envs")
async def tasks(request: Request) -> dict:
    listed = ready(request).envs.task_list()
    return {"tasks": listed, "count": len(listed)}
