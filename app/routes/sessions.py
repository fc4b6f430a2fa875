"""REST for sessions: the same controls as the socket, for controllers that do not hold the stream.

Declared once for a single server and a front end alike: each route asks ``app.state.sessions``
(``app/backend.py``). Bodies are validated here with the protocol's models, so a bad request is refused
before anything else is asked, with the same code everywhere.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Path, Request, Response

from app.deps import CallerDep, SessionsDep
from app.routes import ERROR_RESPONSES
from app.schemas import (
    MAX_ID_CHARS,
    CreateSessionRequest,
    PromptRequest,
    SessionCreated,
    SessionDetail,
    SessionList,
    SessionStateResponse,
)

router = APIRouter(prefix="/v1/sessions", tags=["sessions"], responses=ERROR_RESPONSES)

SessionId = Annotated[str, Path(max_length=MAX_ID_CHARS, description="the id POST /v1/sessions returned")]


@router.post("", status_code=201, response_model=SessionCreated)
async def create_session(
    request: Request,
    caller: CallerDep,
    sessions: SessionsDep,
    body: Annotated[CreateSessionRequest | None, Body()] = None,
):
    """Create a session in `created`. With a prompt it starts generating when a socket attaches to
    `stream_url`; without one, the socket sends `start`."""
    return await sessions.create_session(request, caller, body or CreateSessionRequest())


@router.get("", response_model=SessionList)
async def list_sessions(request: Request, caller: CallerDep, sessions: SessionsDep):
    """Session ids and states (with auth on, only the caller's)."""
    return await sessions.list_sessions(request, caller)


@router.get("/{session_id}", response_model=SessionDetail)
async def get_session(session_id: SessionId, request: Request, caller: CallerDep, sessions: SessionsDep):
    """State, counters, timings and how it keeps real time; of the prompt only its length."""
    return await sessions.session_detail(request, caller, session_id)


@router.post("/{session_id}/prompt", response_model=SessionStateResponse)
async def change_prompt(session_id: SessionId, body: PromptRequest, request: Request, caller: CallerDep,
                        sessions: SessionsDep):
    """The next block uses the new prompt (`policy`: soft, recache or reset)."""
    return await sessions.control(request, caller, session_id, "prompt", body)


@router.post("/{session_id}/pause", response_model=SessionStateResponse)
async def pause(session_id: SessionId, request: Request, caller: CallerDep, sessions: SessionsDep):
    return await sessions.control(request, caller, session_id, "pause")


@router.post("/{session_id}/resume", response_model=SessionStateResponse)
async def resume(session_id: SessionId, request: Request, caller: CallerDep, sessions: SessionsDep):
    return await sessions.control(request, caller, session_id, "resume")


@router.post("/{session_id}/reset", response_model=SessionStateResponse)
async def reset(session_id: SessionId, request: Request, caller: CallerDep, sessions: SessionsDep):
    """Content restarts as if new (same seed, current prompt); the media timeline continues."""
    return await sessions.control(request, caller, session_id, "reset")


@router.delete("/{session_id}", status_code=204, response_class=Response)
async def delete_session(session_id: SessionId, request: Request, caller: CallerDep, sessions: SessionsDep):
    """Close and forget: an attached socket gets `closed` (reason `client`); GET then answers 404."""
    return await sessions.delete_session(request, caller, session_id)
