"""The HTTP routes: POST /groups, POST /groups/batch (NDJSON), /policy, /envs, /replicas, /health, /tasks, /metrics.

Routes only: the logic is in the service's rooms (admission, envs, replicas, policy, health), reached
through `request.app.state.service`.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ...protocol import (
    BatchRequest,
    EnvAdd,
    EnvRef,
    EnvRemove,
    EnvRemoved,
    EnvState,
    ErrorBody,
    GroupRequest,
    GroupResult,
    PauseRequest,
    PolicyState,
    PolicyUpdate,
    PolicyUpdateResult,
    ReplicaAdd,
    ReplicaRef,
    ReplicaRemove,
    ReplicaState,
)
from ..errors import shutting_down
from ..groups.streaming import HeldResults, batch_answer, disconnected
from ..service import RolloutService
from ..status import HealthDetail
from .auth import Plane, on_plane

router = APIRouter()
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorBody} for code in (400, 401, 404, 409, 413, 422, 429, 502, 503, 504)
}


def _service(request: Request) -> RolloutService:
    return request.app.state.service


def ready(request: Request) -> RolloutService:
    """The service, or 503 `starting` (with what it waits for) while its backends are not all up."""
    service = _service(request)
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


@router.post(
    "/groups",
    openapi_extra=on_plane(Plane.DATA),
    response_model=GroupResult,
    responses=_ERRORS,
    summary="Run one group",
)
@with_cancellation
async def post_group(body: GroupRequest, request: Request) -> Response:
    service = _service(request)
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
    responses=_ERRORS,
    summary="Run many groups; stream each as it finishes",
    response_description="NDJSON: one line per group, {index, group} or {index, error}",
)
async def post_batch(body: BatchRequest, request: Request) -> Response:
    service = _service(request)
    tasks = service.admission.start_batch(body.groups)
    sizes = [g.n for g in body.groups]
    held = HeldResults(service.admission)  # finished, unsent groups count against the queue cap (groups/streaming.py)
    for task, size in zip(tasks, sizes, strict=True):
        held.hold_when_done(task, size)
    return batch_answer(request, service.admission, tasks, sizes, held, service.config.stream_stall_timeout)


@router.get(
    "/policy",
    openapi_extra=on_plane(Plane.DATA),
    response_model=PolicyState,
    summary="The policy version served, per replica, and recent updates",
)
async def get_policy(request: Request) -> PolicyState:
    return ready(request).replicas.versions.state()


@router.post(
    "/policy",
    openapi_extra=on_plane(Plane.ADMIN),
    response_model=PolicyUpdateResult,
    responses=_ERRORS,
    summary="Serve a new policy version: a LoRA adapter, full weights from disk, or weights the trainer pushed",
    description="New turns use the new version once every replica that took it serves it; turns already "
    "sent finish on the version they named. 409 version_exists, 409 not_paused (a bare version without "
    "POST /policy/pause first), 422/502 update_failed (no replica took it: every replica keeps the old one).",
)
async def post_policy(body: PolicyUpdate, request: Request) -> PolicyUpdateResult:
    # Not cancelled with its client: an update half-applied to the replicas must finish either way.
    return await asyncio.shield(ready(request).replicas.versions.update(body))


@router.post(
    "/policy/pause",
    openapi_extra=on_plane(Plane.ADMIN),
    response_model=PolicyState,
    responses=_ERRORS,
    summary="Hold every policy replica paused while the trainer pushes weights itself; POST /policy resumes",
    description="A lease: asking again while paused renews it; when it runs out, the replicas whose "
    "/weight_info still shows the version from before the pause are resumed and the others kept out of "
    "routing (the reason in /health/detail). 422 pause_too_long past --max-pause-timeout.",
)
async def pause_policy(request: Request, body: PauseRequest | None = None) -> PolicyState:
    return await asyncio.shield(ready(request).replicas.versions.pause(None if body is None else body.timeout_s))


@router.get(
    "/envs",
    openapi_extra=on_plane(Plane.ADMIN),
    response_model=list[EnvState],
    summary="The envs scheduled on, with their pools and slots held",
)
async def list_envs(request: Request) -> list[EnvState]:
    envs = ready(request).envs
    return [envs.state(env) for env in envs.envs.values()]


@router.post(
    "/envs",
    openapi_extra=on_plane(Plane.ADMIN),
    status_code=201,
    response_model=EnvState,
    responses=_ERRORS,
    summary="Schedule on one more env server",
    description="It must answer /health ready within timeout_s (504 env_not_ready), speak the step contract "
    "(422 env_refused) and share the dataset and reward version of the envs serving the same tasks (409 "
    "env_incomparable). Attempts already queued for its tasks may take its worlds at once.",
)
async def add_env(body: EnvAdd, request: Request) -> EnvState:
    return await _service(request).envs.add(body)


@router.post(
    "/envs/drain",
    openapi_extra=on_plane(Plane.ADMIN),
    response_model=EnvState,
    responses=_ERRORS,
    summary="Start no new episode on an env; the episodes on it finish",
)
async def drain_env(body: EnvRef, request: Request) -> EnvState:
    return _service(request).envs.drain(body)


@router.post(
    "/envs/remove",
    openapi_extra=on_plane(Plane.ADMIN),
    response_model=EnvRemoved,
    responses=_ERRORS,
    summary="Drain an env, wait for its episodes to finish, then stop scheduling on it",
    description="Nothing is cut short: 409 env_busy if episodes still run on it after timeout_s (it stays "
    "draining). Attempts queued for it alone fail as env_no_world; tasks no other env serves are listed.",
)
async def remove_env(body: EnvRemove, request: Request) -> EnvRemoved:
    # Not cancelled with its client: a removal half done (drained, not yet forgotten) finishes either way.
    return await asyncio.shield(_service(request).envs.remove(body))


@router.post(
    "/replicas",
    openapi_extra=on_plane(Plane.ADMIN),
    status_code=201,
    response_model=ReplicaState,
    responses=_ERRORS,
    summary="Route to one more replica of the policy (or support) model",
    description="It must list the model within timeout_s (504 replica_not_ready; 422 replica_refused if it "
    "serves another). A policy replica is routed to only once it serves the current version: the service "
    "brings it there (adapter loaded, full weights reloaded) and answers when it is routed, or at timeout_s "
    "with routed: false and the reason. It joins between policy updates: 409 policy_busy if one (or a restarted "
    "replica's restore) still runs at timeout_s; add it again.",
)
async def add_replica(body: ReplicaAdd, request: Request) -> ReplicaState:
    return await asyncio.shield(_service(request).replicas.add(body))


@router.post(
    "/replicas/drain",
    openapi_extra=on_plane(Plane.ADMIN),
    response_model=ReplicaState,
    responses=_ERRORS,
    summary="Send no new turn to a replica; groups pinned there move at their next turn",
)
async def drain_replica(body: ReplicaRef, request: Request) -> ReplicaState:
    return _service(request).replicas.drain(body)


@router.post(
    "/replicas/remove",
    openapi_extra=on_plane(Plane.ADMIN),
    response_model=ReplicaState,
    responses=_ERRORS,
    summary="Drain a replica, wait for its requests in flight to end, then stop routing to it",
    description="409 replica_busy if requests still run on it after timeout_s (it stays draining); 409 "
    "last_replica: a route keeps one replica that is not draining.",
)
async def remove_replica(body: ReplicaRemove, request: Request) -> ReplicaState:
    return await asyncio.shield(_service(request).replicas.remove(body))


@router.get(
    "/health",
    openapi_extra=on_plane(Plane.PUBLIC),
    summary="Status only (ok, degraded, starting, failed): cheap and public; 503 until started, so probes wait",
)
async def health(request: Request) -> Response:
    status = _service(request).health.status()
    return JSONResponse({"status": status}, status_code=503 if status in ("starting", "failed") else 200)


@router.get(
    "/health/detail",
    openapi_extra=on_plane(Plane.DATA),
    response_model=HealthDetail,
    response_model_exclude_unset=True,
    summary="Each env and model server as last probed, the run log, the queues (behind the API key when one is set)",
)
async def health_detail(request: Request) -> HealthDetail:
    detail = _service(request).health.detail()
    warnings = getattr(request.app.state, "warnings", [])
    if warnings:
        detail.warnings = list(warnings)
    return detail


@router.get("/tasks", openapi_extra=on_plane(Plane.DATA), summary="Tasks served by the envs")
async def tasks(request: Request) -> dict:
    listed = ready(request).envs.task_list()
    return {"tasks": listed, "count": len(listed)}


@router.get("/metrics", openapi_extra=on_plane(Plane.DATA), summary="Prometheus metrics")
async def metrics(request: Request) -> Response:
    return Response(_service(request).metrics.render(), media_type="text/plain; version=0.0.4")
