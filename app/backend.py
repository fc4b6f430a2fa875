"""What answers the routes of ``app/routes``: the routes are declared once, against these two interfaces.

    Server        the process: settings, counts, readiness, /metrics      (app.state.service)
    SessionsApi   REST sessions and the stream sockets                     (app.state.sessions)

A single server is ``app.service.Service`` and ``app.local_sessions.LocalSessions`` (its session registry);
a front end before several workers (``arstream serve --devices``) is ``app.cluster.frontend.FrontEnd`` for
both, forwarding each call to the worker a session lives on. So a client sees the same paths, bodies,
status codes and OpenAPI document from either.
"""

from __future__ import annotations

from typing import Protocol

from fastapi import Request, Response, WebSocket
from pydantic import BaseModel

from app.schemas import CreateSessionRequest, PromptRequest
from app.security import Caller
from app.settings import Settings

# The session controls REST offers besides create and delete (POST /v1/sessions/{id}/<control>).
REST_CONTROLS = ("prompt", "pause", "resume", "reset")


class Counts(Protocol):
    """The counting interface the shared checks (origin, token, request targets, body size) count into."""

    refused: dict[str, int]  # reason -> count

    def count(self, table: dict[str, int], key: str) -> None: ...

    def message_rejected(self, via: str, code: str) -> None: ...


class Server(Protocol):
    settings: Settings
    metrics: Counts

    def not_ready_reason(self) -> str | None:
        """What ``/readyz`` says; None: ready."""

    def render_metrics(self) -> bytes:
        """The ``/metrics`` text."""


class SessionsApi(Protocol):
    """Each call answers one route; a model is sent with the route's status, a ``Response`` as it is."""

    async def create_session(self, request: Request, caller: Caller, body: CreateSessionRequest) -> BaseModel | Response:
        ...

    async def list_sessions(self, request: Request, caller: Caller) -> BaseModel | Response: ...

    async def session_detail(self, request: Request, caller: Caller, session_id: str) -> BaseModel | Response: ...

    async def control(self, request: Request, caller: Caller, session_id: str, control: str,
                      body: PromptRequest | None = None) -> BaseModel | Response:
        """One of ``REST_CONTROLS`` (``body`` with ``prompt``)."""

    async def delete_session(self, request: Request, caller: Caller, session_id: str) -> Response: ...

    async def create_stream(self, websocket: WebSocket) -> None:
        """``WS /v1/stream``: create a session and attach the socket to it."""

    async def attach_stream(self, websocket: WebSocket, session_id: str) -> None:
        """``WS /v1/sessions/{id}/stream``."""

    async def create_peer(self, request: Request, caller: Caller, pace: bool) -> Response:
        """``POST /v1/webrtc``: a new session over a peer connection; the SDP answer (``app/transport/webrtc.py``)."""

    async def attach_peer(self, request: Request, caller: Caller, session_id: str) -> Response:
        """``POST /v1/sessions/{id}/webrtc``."""
