"""The sampler's routes: POST /groups/sample, the streams (POST /samplers, GET/DELETE /samplers/{id},
POST /samplers/{id}/pull) and GET /tasks/stats. Routes only: the engine is `sampler.Sampler`, the
streams `sampler/streams.SamplerStreams`, the difficulty book `sampler/task_stats.TaskStatsBook`."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response

from ...protocol import ErrorBody
from ...sampler_protocol import SampleRequest, StreamCreate, StreamPull, StreamState, TaskStats
from ..groups.group_json import group_line
from ..groups.streaming import BoundedStream, HeldResults
from ..sampler.sampler import Sampler
from ..sampler.streams import dropped_line, sample_summary, summary_line
from .auth import Plane, on_plane
from .route_helpers import ready

router = APIRouter()
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 404, 409, 410, 413, 422, 429, 503)
}


@router.post(
    "/groups/sample",
    openapi_extra=on_plane(Plane.DATA),
    responses=_ERRORS,
    summary="Draw tasks and run groups until `count` carry signal or the budget is spent",
    response_description="NDJSON: {group} for each kept group as it finishes, {dropped} for each group not kept "
    "(task, rewards, why), then {summary} (groups run, kept, dropped by reason, what the dropped ones cost, and "
    "why it stopped: complete is false when the budget ran out first)",
)
async def sample(body: SampleRequest, request: Request) -> Response:
    service = ready(request)
    held = HeldResults(service.admission)
    sampler = Sampler(service.samplers.rooms, body, body.budget, lambda: body.count - sampler.tally.kept, held)
    sampler.check_first()  # what would refuse every group is an HTTP error, before any line
    return BoundedStream(
        _sample_lines(sampler, body.count, held),
        service.config.stream_stall_timeout,
        "POST /groups/sample",
        request=request,
        # Also when the answer ends before its first line (the generator's `finally` never ran): the
        # sampler's pin is released.
        on_end=sampler.close,
    )


async def _sample_lines(sampler: Sampler, count: int, held: HeldResults) -> AsyncIterator[bytes]:
    try:
        while sampler.tally.kept < count:
            item = await sampler.next()
            if item is None:
                break
            if item.body is not None:
                sampler.count_kept()
                line = group_line(b'{"group": ', item.body)
                attempts = item.attempts
                del item
                yield line
                held.release(attempts)
            else:
                assert item.dropped is not None
                yield dropped_line(item.dropped)
        kept = sampler.tally.kept
        if kept >= count:
            stopped = "count reached"
        elif sampler.budget_spent():
            stopped = f"budget spent: max_groups={sampler.budget} groups were run and {kept} of {count} carried signal"
        else:
            stopped = sampler.stopped or "stopped"
        cancelled = sampler.close()
        yield summary_line(sample_summary(sampler, count, stopped, cancelled))
    finally:
        sampler.close()
        held.close()


@router.post(
    "/samplers",
    openapi_extra=on_plane(Plane.DATA),
    status_code=201,
    response_model=StreamState,
    responses=_ERRORS,
    summary="Open a sampler stream: groups are generated into a bounded buffer while the trainer trains",
)
async def create_stream(body: StreamCreate, request: Request) -> StreamState:
    service = ready(request)
    # The key the request came in with (auth.PlaneAuth): streams are capped per key.
    return service.samplers.create(body, request.scope.get("caller", "open")).state()


@router.get(
    "/samplers/{stream_id}",
    openapi_extra=on_plane(Plane.DATA),
    response_model=StreamState,
    responses=_ERRORS,
    summary="A stream's state",
)
async def stream_state(stream_id: str, request: Request) -> StreamState:
    return ready(request).samplers.get(stream_id).state()


@router.post(
    "/samplers/{stream_id}/pull",
    openapi_extra=on_plane(Plane.DATA),
    responses=_ERRORS,
    summary="Take `count` groups from a stream",
    response_description="NDJSON: {lag, group} per group handed out (lag: policy updates behind the current "
    "version, never above the stream's max_staleness), {dropped} for each group not kept since the last pull "
    "(stale and undelivered ones included), then {summary}: this pull's counts and lags, and `stream`, the "
    "stream's state and totals over its life. 410 sampler_gone: deleted or expired; 404 unknown_sampler: not "
    "made by this process (a restart)",
)
async def pull(stream_id: str, body: StreamPull, request: Request) -> Response:
    service = ready(request)
    lines, end = service.samplers.get(stream_id).start_pull(body.count, body.timeout_s)
    what = f"pull from sampler stream {stream_id}"
    # Not reset on a stall: the lines written before it count as handed out (groups/streaming.py).
    config = service.config
    return BoundedStream(lines, config.stream_stall_timeout, what, request=request, on_end=end, reset_on_stall=False)


@router.delete(
    "/samplers/{stream_id}",
    openapi_extra=on_plane(Plane.DATA),
    response_model=StreamState,
    responses=_ERRORS,
    summary="Close a stream, cancel its groups",
)
async def delete_stream(stream_id: str, request: Request) -> StreamState:
    service = ready(request)
    stream = await service.samplers.remove(stream_id, "deleted by DELETE /samplers/{id}")
    return stream.state()


@router.get(
    "/tasks/stats",
    openapi_extra=on_plane(Plane.DATA),
    response_model=list[TaskStats],
    summary="Per task and policy version: groups, graded attempts, mean reward, pass rate, share with signal",
)
async def task_stats(request: Request, task_id: list[str] | None = Query(None)) -> list[TaskStats]:
    return ready(request).task_stats.stats(task_id)
