"""The stream sockets: ``WS /v1/stream`` (create + attach) and ``WS /v1/sessions/{id}/stream`` (attach).

Declared once; ``app.state.sessions`` serves them (``app/backend.py``). The checks every server runs, so a
refused client learns why:
1. origin and token, *before* accept: a failure closes the socket unaccepted, which the server answers
   with HTTP 403 instead of the upgrade (close code 1008 under an ASGI test client);
2. after accept: draining (``closed`` draining, 1001), dead engine (``closed`` failed, 1011),
   capacity (``closed`` capacity, 1013), unknown session (4404) — accepted first so that browsers,
   which hide the close code of a refused handshake, can see these codes.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, WebSocket

from app.backend import Server
from app.deps import SessionsDep
from app.routes import UNAVAILABLE_RETRY_AFTER_S
from app.schemas import ErrorMessage, to_text
from app.security import (
    PROTOCOL_SUBPROTOCOL,
    Caller,
    Unauthorized,
    authenticate,
    bearer_from_header,
    bearer_from_subprotocols,
    client_address,
    origin_allowed,
)
from app.streaming import CLOSE_CODE_BY_REASON, CLOSE_POLICY, closed_message
from engine.api import NotReady

log = logging.getLogger("arstream.stream")

router = APIRouter()


@router.websocket("/v1/stream")
async def create_stream(websocket: WebSocket, sessions: SessionsDep) -> None:
    await sessions.create_stream(websocket)


@router.websocket("/v1/sessions/{session_id}/stream", name="attach_stream")
async def attach_stream(websocket: WebSocket, session_id: str, sessions: SessionsDep) -> None:
    await sessions.attach_stream(websocket, session_id)


async def admit_socket(websocket: WebSocket, service: Server) -> Caller | None:
    """Origin and token checks before accept; on success the socket is accepted (``arstream.v1``)."""
    settings = service.settings
    address = client_address(websocket.scope)
    if not origin_allowed(websocket.headers.get("origin"), websocket.headers.get("host"), settings):
        return await _deny(websocket, service, "origin", address)
    offered = list(websocket.scope.get("subprotocols") or [])
    presented = bearer_from_header(websocket.headers) or bearer_from_subprotocols(offered)
    try:
        principal = authenticate(presented, settings)
    except Unauthorized:
        return await _deny(websocket, service, "token", address)
    # Answer only a subprotocol the client offered: browsers fail the handshake otherwise.
    await websocket.accept(subprotocol=PROTOCOL_SUBPROTOCOL if PROTOCOL_SUBPROTOCOL in offered else None)
    return Caller(principal=principal, address=address)


async def _deny(websocket: WebSocket, service: Server, reason: str, address: str) -> None:
    service.metrics.count(service.metrics.refused, reason)
    log.info("socket refused", extra={"reason": reason, "client": address})
    await websocket.close(CLOSE_POLICY, f"{reason} not allowed")
    return None


async def socket_pace(websocket: WebSocket, service: Server) -> bool | None:
    """``WS /v1/stream?pace=false`` admits the session best-effort at connect (so a full realtime capacity does not
    refuse a client that will stream with pacing off); ``true`` or absent: live. Anything else is refused with
    ``invalid_field`` (None returned, the socket closed 1008)."""
    value = websocket.query_params.get("pace")
    if value is None or value == "true":
        return True
    if value == "false":
        return False
    service.metrics.message_rejected("socket", "invalid_field")
    await websocket.send_text(to_text(ErrorMessage(code="invalid_field", message="pace must be true or false")))
    await websocket.close(CLOSE_POLICY, "invalid query")
    return None


async def refuse_not_ready(websocket: WebSocket, service: Server, reason: NotReady) -> None:
    """Draining: ``closed`` draining (1001); dead or failed to start: ``closed`` failed (1011); warming up: try later."""
    if reason is NotReady.DRAINING:
        await refuse_socket(websocket, service, "draining")
    elif reason.final:
        await refuse_socket(websocket, service, "failed", error=("internal", "the engine is not available"))
    else:
        await refuse_socket(websocket, service, "capacity", error=("internal", "the engine is warming up; try again later"),
                            retry_after_s=UNAVAILABLE_RETRY_AFTER_S)


async def refuse_socket(websocket: WebSocket, service: Server, reason: str, error: tuple[str, str] | None = None,
                        retry_after_s: float | None = None) -> None:
    """An accepted socket that gets no session: optional ``error``, then ``closed`` (with ``retry_after_s``
    for capacity and draining) and the close code."""
    service.metrics.count(service.metrics.refused, reason)
    if error is not None:
        await websocket.send_text(to_text(ErrorMessage(code=error[0], message=error[1])))
    await websocket.send_text(to_text(closed_message(reason, service, retry_after_s)))
    await websocket.close(CLOSE_CODE_BY_REASON[reason], reason)
