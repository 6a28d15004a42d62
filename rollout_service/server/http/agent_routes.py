"""The per-attempt model endpoint agent servers call (docs/agents.md): POST
/agent/{attempt_id}/v1/chat/completions and GET /agent/{attempt_id}/v1/models.

On the agent plane: neither the trainers' key nor the operators' is taken here, only the token the
attempt's run was given, checked before the body is read. Errors have OpenAI's shape
(`{"error": {"message", "type", "code"}}`), which OpenAI clients read.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from ..agents.completions import answer, parse_request, stream_chunks, take_turn
from ..agents.sessions import AgentRefused, AgentSession
from .auth import Plane, on_plane
from .route_helpers import service_of

router = APIRouter()

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 413: "invalid_request_error"}


async def refused(request: Request, exc: AgentRefused) -> JSONResponse:
    """AgentRefused in OpenAI's error shape (http/app.py installs it as the app's handler)."""
    body = {"error": {"message": exc.message, "type": _TYPES.get(exc.status, "api_error"), "code": exc.code}}
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(body, status_code=exc.status, headers=headers)


def _session(request: Request, attempt_id: str) -> AgentSession:
    return service_of(request).agents.sessions.check(attempt_id, request.headers.get("authorization"))


@router.post(
    "/agent/{attempt_id}/v1/chat/completions",
    openapi_extra=on_plane(Plane.AGENT),
    summary="One turn of an attempt on an agent server (OpenAI chat completions; the attempt's token)",
)
async def chat_completions(attempt_id: str, request: Request) -> Response:
    session = _session(request, attempt_id)
    cap = service_of(request).config.agent_max_body_bytes
    declared = request.headers.get("content-length", "")
    # Refused unread where its length is declared: a long history costs nothing.
    if (declared.isdigit() and int(declared) > cap) or len(await request.body()) > cap:
        raise session.refuse(413, "body_too_large", f"bodies are capped at {cap} bytes (--agent-max-body-bytes)")
    call = parse_request(await request.body())
    turn, parsed = await session.call(take_turn(session, call))
    whole = answer(session, turn, parsed, session.run.group.route.model)
    if call.stream:
        return StreamingResponse(stream_chunks(whole), media_type="text/event-stream")
    return JSONResponse(whole)


@router.get(
    "/agent/{attempt_id}/v1/models",
    openapi_extra=on_plane(Plane.AGENT),
    summary="The model an attempt's turns are served by (the attempt's token)",
)
async def models(attempt_id: str, request: Request) -> Response:
    model = _session(request, attempt_id).run.group.route.model
    return JSONResponse({"object": "list", "data": [{"id": model, "object": "model", "owned_by": "rollout-service"}]})
