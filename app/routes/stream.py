"""The stream sockets: ``WS /v1/stream`` (create + attach) and ``WS /v1/sessions/{id}/stream`` (attach).

Declared once; ``app.state.sessions`` serves them (``app/backend.py``) through the socket transport
(``app/transport/``), which runs the checks every server runs, so a refused client learns why:
1. origin and token, *before* accept: a failure closes the socket unaccepted, which the server answers
   with HTTP 403 instead of the upgrade (close code 1008 under an ASGI test client);
2. after accept: draining (``closed`` draining, 1001), dead engine (``closed`` failed, 1011),
   capacity (``closed`` capacity, 1013), unknown session (4404) — accepted first so that browsers,
   which hide the close code of a refused handshake, can see these codes.
"""

from __future__ import annotations

from fastapi import APIRouter, WebSocket

from app.deps import SessionsDep

router = APIRouter()


@router.websocket("/v1/stream")
async def create_stream(websocket: WebSocket, sessions: SessionsDep) -> None:
    await sessions.create_stream(websocket)


@router.websocket("/v1/sessions/{session_id}/stream", name="attach_stream")
async def attach_stream(websocket: WebSocket, session_id: str, sessions: SessionsDep) -> None:
    await sessions.attach_stream(websocket, session_id)
