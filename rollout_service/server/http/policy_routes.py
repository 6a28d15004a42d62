"""The policy the replicas serve: GET /policy, POST /policy (a new version), POST /policy/pause."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from ...protocol import PauseRequest, PolicyState, PolicyUpdate, PolicyUpdateResult
from .auth import Plane, on_plane
from .route_helpers import ERRORS, ready

router = APIRouter()


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
    responses=ERRORS,
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
    responses=ERRORS,
    summary="Hold every policy replica paused while the trainer pushes weights itself; POST /policy resumes",
    description="A lease: asking again while paused renews it; when it runs out, the replicas whose "
    "/weight_info still shows the version from before the pause are resumed and the others kept out of "
    "routing (the reason in /health/detail). 422 pause_too_long past --max-pause-timeout.",
)
async def pause_policy(request: Request, body: PauseRequest | None = None) -> PolicyState:
    return await asyncio.shield(ready(request).replicas.versions.pause(None if body is None else body.timeout_s))
