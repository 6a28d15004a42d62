"""The service's state: GET /health (public), GET /health/detail, GET /metrics."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from ..status import HealthDetail
from .auth import Plane, on_plane
from .route_helpers import service_of

router = APIRouter()


@router.get(
    "/health",
    openapi_extra=on_plane(Plane.PUBLIC),
    summary="Status only (ok, degraded, starting, failed): cheap and public; 503 until started, so probes wait",
)
async def health(request: Request) -> Response:
    status = service_of(request).health.status()
    return JSONResponse({"status": status}, status_code=503 if status in ("starting", "failed") else 200)


@router.get(
    "/health/detail",
    openapi_extra=on_plane(Plane.DATA),
    response_model=HealthDetail,
    response_model_exclude_unset=True,
    summary="Each env and model server as last probed, the run log, the queues (behind the API key when one is set)",
)
async def health_detail(request: Request) -> HealthDetail:
    detail = service_of(request).health.detail()
    warnings = getattr(request.app.state, "warnings", [])
    if warnings:
        detail.warnings = list(warnings)
    return detail


@router.get("/metrics", openapi_extra=on_plane(Plane.DATA), summary="Prometheus metrics")
async def metrics(request: Request) -> Response:
    return Response(service_of(request).metrics.render(), media_type="text/plain; version=0.0.4")
