"""WebRTC signalling, WHEP-style: ``POST /v1/webrtc`` (a new session), ``POST /v1/sessions/{id}/webrtc`` (attach),
``DELETE /v1/sessions/{id}/webrtc`` (end), ``OPTIONS /v1/webrtc`` (the STUN/TURN servers to use). Declared once; ``app.state.sessions`` answers (``app/backend.py``).

The body of a POST is the client's SDP offer (``application/sdp``, at most 64 KiB); the answer comes back as
``application/sdp`` with status 201 and ``Location`` the session's WebRTC resource (what ``DELETE`` takes).
Errors have the REST shape. See ``app/transport/webrtc.py`` for what the peer connection carries.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Request, Response

from app.deps import CallerDep, ServerDep, SessionsDep
from app.routes import ERROR_RESPONSES
from app.schemas import MAX_ID_CHARS
from app.transport.webrtc import ice_server_links

router = APIRouter(tags=["webrtc"], responses=ERROR_RESPONSES)

SessionId = Annotated[str, Path(max_length=MAX_ID_CHARS, description="the session to attach to")]
OFFER = {"requestBody": {"required": True, "content": {"application/sdp": {"schema": {"type": "string"}}}},
         "responses": {"201": {"description": "the SDP answer", "content": {"application/sdp": {}}}}}


@router.options("/v1/webrtc", status_code=204, response_class=Response)
async def ice_config(caller: CallerDep, server: ServerDep):
    """The STUN/TURN servers a peer should use, as WHEP tells them: `Link: <stun:…>; rel="ice-server"` (no header
    when the server uses host candidates only). Under the same access rules as an offer (TURN credentials)."""
    return Response(status_code=204, headers=ice_server_links(server.settings.webrtc_ice_servers))


@router.post("/v1/webrtc", status_code=201, response_class=Response, openapi_extra=OFFER)
async def create_peer(request: Request, caller: CallerDep, sessions: SessionsDep, pace: bool = True):
    """A new session over a peer connection (as `WS /v1/stream`); `?pace=false`: best effort."""
    return await sessions.create_peer(request, caller, pace)


@router.post("/v1/sessions/{session_id}/webrtc", status_code=201, response_class=Response, openapi_extra=OFFER)
async def attach_peer(session_id: SessionId, request: Request, caller: CallerDep, sessions: SessionsDep):
    """Attach a peer connection to a session (what is attached is replaced, as a socket's attach does)."""
    return await sessions.attach_peer(request, caller, session_id)


@router.delete("/v1/sessions/{session_id}/webrtc", status_code=204, response_class=Response)
async def end_peer(session_id: SessionId, request: Request, caller: CallerDep, sessions: SessionsDep):
    """End the session (WHEP's DELETE of the resource): its peer gets `closed` (reason `client`)."""
    return await sessions.delete_session(request, caller, session_id)
