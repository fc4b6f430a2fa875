"""REST for sessions: the same controls as the socket, for controllers that do not hold the stream."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Body, Path, Request, Response

from app.deps import CallerDep, RegistryDep
from app.registry import RegisteredSession, SessionRegistry
from app.routes import ERROR_RESPONSES, ApiError
from app.schemas import (
    MAX_ID_CHARS,
    CreateSessionRequest,
    PromptRequest,
    SessionCreated,
    SessionDetail,
    SessionList,
    SessionStateResponse,
    SessionSummary,
)
from engine.errors import CapacityFull, EngineError

router = APIRouter(prefix="/v1/sessions", tags=["sessions"], responses=ERROR_RESPONSES)

SessionId = Annotated[str, Path(max_length=MAX_ID_CHARS, description="the id POST /v1/sessions returned")]


def _stream_url(request: Request, session_id: str) -> str:
    url = request.url_for("attach_stream", session_id=session_id)
    return str(url.replace(scheme="wss" if url.scheme == "https" else "ws"))


def _controlled(registry: SessionRegistry, session_id: str) -> RegisteredSession:
    """The session, if this control may run now (REST controls share a per-session rate limit)."""
    try:
        record = registry.get(session_id)
    except EngineError as error:
        raise ApiError.from_engine(error) from None
    if not record.rest_bucket.allow():
        wait_s = record.rest_bucket.seconds_until_allowed()
        raise ApiError.from_code("rate_limited", "too many control requests", wait_s)
    return record


def _state(registry: SessionRegistry, session_id: str) -> SessionStateResponse:
    return SessionStateResponse.model_validate(registry.status(session_id))


@router.post("", status_code=201, response_model=SessionCreated)
async def create_session(
    request: Request,
    caller: CallerDep,
    registry: RegistryDep,
    body: Annotated[CreateSessionRequest | None, Body()] = None,
) -> SessionCreated:
    """Create a session in `created`. With a prompt it starts generating when a socket attaches to
    `stream_url`; without one, the socket sends `start`."""
    body = body or CreateSessionRequest()
    record = registry.create(caller, prompt=body.prompt, seed=body.seed, options=body.options, via="rest")
    if isinstance(record, CapacityFull):
        raise ApiError.capacity(record)
    return SessionCreated(
        session_id=record.session_id,
        state=registry.status(record.session_id).state,
        stream_url=_stream_url(request, record.session_id),
    )


@router.get("", response_model=SessionList)
async def list_sessions(caller: CallerDep, registry: RegistryDep) -> SessionList:
    """Session ids and states (with auth on, only the caller's)."""
    return SessionList(sessions=[SessionSummary.model_validate(r.session) for r in registry.visible(caller)])


@router.get("/{session_id}", response_model=SessionDetail)
async def get_session(session_id: SessionId, caller: CallerDep, registry: RegistryDep) -> SessionDetail:
    """State, counters, timings and how it keeps real time; of the prompt only its length."""
    return SessionDetail.model_validate(registry.status(session_id))


@router.post("/{session_id}/prompt", response_model=SessionStateResponse)
async def change_prompt(session_id: SessionId, body: PromptRequest, caller: CallerDep, registry: RegistryDep):
    """The next block uses the new prompt (`policy`: soft, recache or reset)."""
    _controlled(registry, session_id)
    registry.set_prompt(session_id, body.prompt, body.policy)
    return _state(registry, session_id)


@router.post("/{session_id}/pause", response_model=SessionStateResponse)
async def pause(session_id: SessionId, caller: CallerDep, registry: RegistryDep):
    _controlled(registry, session_id)
    registry.announce(session_id, registry.pause(session_id))
    return _state(registry, session_id)


@router.post("/{session_id}/resume", response_model=SessionStateResponse)
async def resume(session_id: SessionId, caller: CallerDep, registry: RegistryDep):
    _controlled(registry, session_id)
    registry.announce(session_id, registry.resume(session_id))
    return _state(registry, session_id)


@router.post("/{session_id}/reset", response_model=SessionStateResponse)
async def reset(session_id: SessionId, caller: CallerDep, registry: RegistryDep):
    """Content restarts as if new (same seed, current prompt); the media timeline continues."""
    _controlled(registry, session_id)
    registry.reset(session_id)
    return _state(registry, session_id)


@router.delete("/{session_id}", status_code=204, response_class=Response)
async def delete_session(session_id: SessionId, caller: CallerDep, registry: RegistryDep) -> Response:
    """Close and forget: an attached socket gets `closed` (reason `client`); GET then answers 404."""
    _controlled(registry, session_id)
    registry.delete(session_id)
    return Response(status_code=204)
