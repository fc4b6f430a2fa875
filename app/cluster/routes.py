"""The front end's routes: the single server's paths and answers, each backed by the session's worker.

Bodies are validated here with the same models as a single server (so a bad request is refused before
any worker is asked, with the same code) and then passed on byte for byte; the worker's answer —
status, body, ``Retry-After``, ``WWW-Authenticate`` — comes back as it is.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Depends, Request, Response, WebSocket
from fastapi.responses import JSONResponse
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4
from starlette.requests import HTTPConnection

from app.cluster.frontend import FrontEnd
from app.deps import CallerDep
from app.routes import ERROR_RESPONSES, UNAVAILABLE_RETRY_AFTER_S
from app.routes.sessions import SessionId
from app.schemas import (
    CreateSessionRequest,
    Health,
    PromptRequest,
    SessionCreated,
    SessionDetail,
    SessionList,
    SessionStateResponse,
)


async def _frontend(connection: HTTPConnection) -> FrontEnd:
    return connection.app.state.service


FrontEndDep = Annotated[FrontEnd, Depends(_frontend)]

health = APIRouter(tags=["health"])
sessions = APIRouter(prefix="/v1/sessions", tags=["sessions"], responses=ERROR_RESPONSES)
stream = APIRouter()


# --- health and metrics ------------------------------------------------------------------------------


@health.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The front end's process is up and its event loop answers."""
    return Health(status="ok")


@health.get("/readyz", response_model=Health, responses={503: {"model": Health}})
async def readyz(frontend: FrontEndDep):
    """200 while at least one worker is warm, alive and not draining (a full one counts: like a single full
    server, it refuses sessions one by one rather than going unready) and the front end is not draining."""
    reason = frontend.not_ready_reason()
    if reason is None:
        return Health(status="ok")
    return JSONResponse(Health(status="unavailable", detail=reason).model_dump(), status_code=503,
                        headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)})


@health.get("/metrics", response_class=Response, tags=["metrics"])
async def metrics(frontend: FrontEndDep) -> Response:
    """The front end's counts and each worker's capacity (``worker`` label); no session ids."""
    return Response(frontend.metrics.render(frontend.view()), media_type=CONTENT_TYPE_PLAIN_0_0_4)


# --- REST ----------------------------------------------------------------------------------------------


@sessions.post("", status_code=201, response_model=SessionCreated)
async def create_session(
    request: Request, caller: CallerDep, frontend: FrontEndDep,
    body: Annotated[CreateSessionRequest | None, Body()] = None,
) -> Response:
    """Create a session on the worker with the most headroom; `stream_url` attaches through this front end."""
    return await frontend.create_session(request, caller, await request.body())


@sessions.get("", response_model=SessionList)
async def list_sessions(request: Request, caller: CallerDep, frontend: FrontEndDep) -> SessionList:
    """Session ids and states over every worker (with auth on, only the caller's)."""
    return SessionList.model_validate({"sessions": await frontend.list_sessions(request)})


@sessions.get("/{session_id}", response_model=SessionDetail)
async def get_session(session_id: SessionId, request: Request, caller: CallerDep, frontend: FrontEndDep) -> Response:
    return await frontend.forward(request, session_id, "GET")


@sessions.post("/{session_id}/prompt", response_model=SessionStateResponse)
async def change_prompt(session_id: SessionId, body: PromptRequest, request: Request, caller: CallerDep,
                        frontend: FrontEndDep) -> Response:
    return await frontend.forward(request, session_id, "POST", "/prompt", await request.body())


@sessions.post("/{session_id}/pause", response_model=SessionStateResponse)
async def pause(session_id: SessionId, request: Request, caller: CallerDep, frontend: FrontEndDep) -> Response:
    return await frontend.forward(request, session_id, "POST", "/pause")


@sessions.post("/{session_id}/resume", response_model=SessionStateResponse)
async def resume(session_id: SessionId, request: Request, caller: CallerDep, frontend: FrontEndDep) -> Response:
    return await frontend.forward(request, session_id, "POST", "/resume")


@sessions.post("/{session_id}/reset", response_model=SessionStateResponse)
async def reset(session_id: SessionId, request: Request, caller: CallerDep, frontend: FrontEndDep) -> Response:
    return await frontend.forward(request, session_id, "POST", "/reset")


@sessions.delete("/{session_id}", status_code=204, response_class=Response)
async def delete_session(session_id: SessionId, request: Request, caller: CallerDep, frontend: FrontEndDep) -> Response:
    return await frontend.forward(request, session_id, "DELETE")


# --- sockets -------------------------------------------------------------------------------------------


@stream.websocket("/v1/stream")
async def create_stream(websocket: WebSocket, frontend: FrontEndDep) -> None:
    await frontend.create_stream(websocket)


@stream.websocket("/v1/sessions/{session_id}/stream", name="attach_stream")
async def attach_stream(websocket: WebSocket, session_id: str, frontend: FrontEndDep) -> None:
    await frontend.attach_stream(websocket, session_id)
