"""The stream sockets: ``WS /v1/stream`` (create + attach) and ``WS /v1/sessions/{id}/stream`` (attach).

Order of checks, so a refused client learns why:
1. origin and token, *before* accept: a failure closes 1008 without ever accepting;
2. after accept: draining (``closed`` draining, 1001), dead engine (``closed`` failed, 1011),
   capacity (``closed`` capacity, 1013), unknown session (4404) — accepted first so that browsers,
   which hide the close code of a refused handshake, can see these codes.
"""

from __future__ import annotations

import logging
from typing import Protocol

from fastapi import APIRouter, WebSocket

from app.deps import ServiceDep
from app.routes import UNAVAILABLE_RETRY_AFTER_S
from app.schemas import MAX_ID_CHARS, ErrorMessage, to_text
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
from app.service import Service
from app.settings import Settings
from app.streaming import (
    CLOSE_CODE_BY_REASON,
    CLOSE_POLICY,
    CLOSE_UNKNOWN_SESSION,
    StreamConnection,
    closed_message,
)
from engine.api import NotReady
from engine.errors import CapacityFull, EngineError, EngineUnavailable

log = logging.getLogger("arstream.stream")

router = APIRouter()

PER_CLIENT_RETRY_AFTER_S = 1.0  # as REST's 429 for the same refusal


@router.websocket("/v1/stream")
async def create_stream(websocket: WebSocket, service: ServiceDep) -> None:
    caller = await admit_socket(websocket, service)
    if caller is None or not await _serving(websocket, service):
        return
    try:
        record = service.registry.create(caller, via="websocket")
    except EngineUnavailable:  # it stopped serving meanwhile
        await _refuse_not_ready(websocket, service, service.not_ready() or NotReady.DEAD)
        return
    except EngineError as error:  # too many sessions for this client
        await refuse_socket(websocket, service, "capacity", error=(error.code, error.message),
                            retry_after_s=PER_CLIENT_RETRY_AFTER_S)
        return
    if isinstance(record, CapacityFull):
        await refuse_socket(websocket, service, "capacity", retry_after_s=record.retry_after_s)
        return
    await StreamConnection(websocket, service, record.session_id, caller).run()


@router.websocket("/v1/sessions/{session_id}/stream", name="attach_stream")
async def attach_stream(websocket: WebSocket, session_id: str, service: ServiceDep) -> None:
    caller = await admit_socket(websocket, service)
    if caller is None or not await _serving(websocket, service):
        return
    if len(session_id) > MAX_ID_CHARS or not service.registry.knows(session_id):
        service.metrics.count(service.metrics.refused, "unknown_session")
        await websocket.close(CLOSE_UNKNOWN_SESSION, "unknown session")
        return
    await StreamConnection(websocket, service, session_id, caller).run()


class RefusalCounts(Protocol):
    refused: dict[str, int]  # reason -> count

    def count(self, table: dict[str, int], key: str) -> None: ...


class Gate(Protocol):
    """What the socket checks need of the process answering: the service here, or a front end (app/cluster)."""

    settings: Settings
    metrics: RefusalCounts


async def admit_socket(websocket: WebSocket, service: Gate) -> Caller | None:
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


async def _deny(websocket: WebSocket, service: Gate, reason: str, address: str) -> None:
    service.metrics.count(service.metrics.refused, reason)
    log.info("socket refused", extra={"reason": reason, "client": address})
    await websocket.close(CLOSE_POLICY, f"{reason} not allowed")
    return None


async def _serving(websocket: WebSocket, service: Service) -> bool:
    reason = service.not_ready()
    if reason is not None:
        await _refuse_not_ready(websocket, service, reason)
    return reason is None


async def _refuse_not_ready(websocket: WebSocket, service: Service, reason: NotReady) -> None:
    """Draining: ``closed`` draining (1001); dead or failed to start: ``closed`` failed (1011); warming up: try later."""
    if reason is NotReady.DRAINING:
        await refuse_socket(websocket, service, "draining")
    elif reason.final:
        await refuse_socket(websocket, service, "failed", error=("internal", "the engine is not available"))
    else:
        await refuse_socket(websocket, service, "capacity", error=("internal", "the engine is warming up; try again later"),
                            retry_after_s=UNAVAILABLE_RETRY_AFTER_S)


async def refuse_socket(websocket: WebSocket, service: Gate, reason: str, error: tuple[str, str] | None = None,
                        retry_after_s: float | None = None) -> None:
    """An accepted socket that gets no session: optional ``error``, then ``closed`` (with ``retry_after_s``
    for capacity and draining) and the close code."""
    service.metrics.count(service.metrics.refused, reason)
    if error is not None:
        await websocket.send_text(to_text(ErrorMessage(code=error[0], message=error[1])))
    await websocket.send_text(to_text(closed_message(reason, service, retry_after_s)))
    await websocket.close(CLOSE_CODE_BY_REASON[reason], reason)
