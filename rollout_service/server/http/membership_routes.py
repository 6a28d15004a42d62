"""Membership, on the admin plane: envs and model replicas listed, added, drained and removed."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from ...protocol import (
    EnvAdd,
    EnvRef,
    EnvRemove,
    EnvRemoved,
    EnvState,
    ReplicaAdd,
    ReplicaRef,
    ReplicaRemove,
    ReplicaState,
)
from .auth import Plane, on_plane
from .route_helpers import ERRORS, ready, service_of

router = APIRouter()


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
    responses=ERRORS,
    summary="Schedule on one more env server",
    description="It must answer /health ready within timeout_s (504 env_not_ready), speak the step contract "
    "(422 env_refused) and share the dataset and reward version of the envs serving the same tasks (409 "
    "env_incomparable). Attempts already queued for its tasks may take its worlds at once.",
)
async def add_env(body: EnvAdd, request: Request) -> EnvState:
    return await service_of(request).envs.add(body)


@router.post(
    "/envs/drain",
    openapi_extra=on_plane(Plane.ADMIN),
    response_model=EnvState,
    responses=ERRORS,
    summary="Start no new episode on an env; the episodes on it finish",
)
async def drain_env(body: EnvRef, request: Request) -> EnvState:
    return service_of(request).envs.drain(body)


@router.post(
    "/envs/remove",
    openapi_extra=on_plane(Plane.ADMIN),
    response_model=EnvRemoved,
    responses=ERRORS,
    summary="Drain an env, wait for its episodes to finish, then stop scheduling on it",
    description="Nothing is cut short: 409 env_busy if episodes still run on it after timeout_s (it stays "
    "draining). Attempts queued for it alone fail as env_no_world; tasks no other env serves are listed.",
)
async def remove_env(body: EnvRemove, request: Request) -> EnvRemoved:
    # Not cancelled with its client: a removal half done (drained, not yet forgotten) finishes either way.
    return await asyncio.shield(service_of(request).envs.remove(body))


@router.post(
    "/replicas",
    openapi_extra=on_plane(Plane.ADMIN),
    status_code=201,
    response_model=ReplicaState,
    responses=ERRORS,
    summary="Route to one more replica of the policy (or support) model",
    description="It must list the model within timeout_s (504 replica_not_ready; 422 replica_refused if it "
    "serves another). A policy replica is routed to only once it serves the current version: the service "
    "brings it there (adapter loaded, full weights reloaded) and answers when it is routed, or at timeout_s "
    "with routed: false and the reason. It joins between policy updates: 409 policy_busy if one (or a restarted "
    "replica's restore) still runs at timeout_s; add it again.",
)
async def add_replica(body: ReplicaAdd, request: Request) -> ReplicaState:
    return await asyncio.shield(service_of(request).replicas.add(body))


@router.post(
    "/replicas/drain",
    openapi_extra=on_plane(Plane.ADMIN),
    response_model=ReplicaState,
    responses=ERRORS,
    summary="Send no new turn to a replica; groups pinned there move at their next turn",
)
async def drain_replica(body: ReplicaRef, request: Request) -> ReplicaState:
    return service_of(request).replicas.drain(body)


@router.post(
    "/replicas/remove",
    openapi_extra=on_plane(Plane.ADMIN),
    response_model=ReplicaState,
    responses=ERRORS,
    summary="Drain a replica, wait for its requests in flight to end, then stop routing to it",
    description="409 replica_busy if requests still run on it after timeout_s (it stays draining); 409 "
    "last_replica: a route keeps one replica that is not draining.",
)
async def remove_replica(body: ReplicaRemove, request: Request) -> ReplicaState:
    return await asyncio.shield(service_of(request).replicas.remove(body))
