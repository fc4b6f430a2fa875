"""A single server's sessions on the HTTP surface: REST and the stream sockets, through its session registry.

The routes (``app/routes``) are declared once and call this (``app/backend.py``); a front end answers the
same calls for several workers (``app/cluster/frontend.py``).
"""

from __future__ import annotations

import asyncio

from fastapi import Request, Response, WebSocket

from app.registry import RegisteredSession, TooManySessions
from app.schemas import (
    MAX_ID_CHARS,
    CreateSessionRequest,
    PromptRequest,
    SessionCreated,
    SessionDetail,
    SessionList,
    SessionOptions,
    SessionStateResponse,
    SessionSummary,
)
from app.security import Caller
from app.service import Service
from app.transport.refusal import capacity_full, not_ready, too_many_peers, too_many_sessions
from app.transport.rest import ApiError
from app.transport.webrtc import (
    OfferRefused,
    PeerStream,
    check_offer,
    ice_server_links,
    offer_text,
    set_peer_timeout,
)
from app.transport.websocket import (
    StreamConnection,
    admit_socket,
    refuse_socket,
    refuse_unknown_session,
    socket_pace,
)
from engine.api import NotReady
from engine.errors import CapacityFull, EngineError, EngineUnavailable


class LocalSessions:
    def __init__(self, service: Service) -> None:
        self.service = service
        self.registry = service.registry
        set_peer_timeout(service.settings.webrtc_peer_timeout_s)
        self.negotiating: set[str] = set()  # sessions whose WebRTC offer is being answered
        self._negotiating_from: dict[str, int] = {}  # client address -> offers being answered
        self._peers: set[asyncio.Task] = set()

    # --- REST ---------------------------------------------------------------------------------------
    async def create_session(self, request: Request, caller: Caller, body: CreateSessionRequest) -> SessionCreated:
        record = self.registry.create(caller, prompt=body.prompt, seed=body.seed, options=body.options, via="rest")
        if isinstance(record, CapacityFull):
            raise ApiError.refused(capacity_full(record))
        return SessionCreated(session_id=record.session_id, state=record.session.state,
                              stream_url=_stream_url(request, record.session_id))

    async def list_sessions(self, request: Request, caller: Caller) -> SessionList:
        return SessionList(sessions=[SessionSummary.model_validate(r.session) for r in self.registry.visible(caller)])

    async def session_detail(self, request: Request, caller: Caller, session_id: str) -> SessionDetail:
        return SessionDetail.model_validate(self.registry.status(session_id))

    async def control(self, request: Request, caller: Caller, session_id: str, control: str,
                      body: PromptRequest | None = None) -> SessionStateResponse:
        registry = self.registry
        self._controlled(session_id)
        if control == "prompt":
            registry.set_prompt(session_id, body.prompt, body.policy)
        elif control == "pause":
            registry.announce(session_id, registry.pause(session_id))
        elif control == "resume":
            registry.announce(session_id, registry.resume(session_id))
        else:
            registry.reset(session_id)
        return SessionStateResponse.model_validate(registry.status(session_id))

    async def delete_session(self, request: Request, caller: Caller, session_id: str) -> Response:
        self._controlled(session_id)
        self.registry.delete(session_id)
        return Response(status_code=204)

    def _controlled(self, session_id: str) -> RegisteredSession:
        """The session, if this control may run now (REST controls share a per-session rate limit)."""
        try:
            record = self.registry.get(session_id)
        except EngineError as error:
            raise ApiError.from_engine(error) from None
        if not record.rest_bucket.allow():
            raise ApiError.from_code("rate_limited", "too many control requests", record.rest_bucket.seconds_until_allowed())
        return record

    # --- stream sockets -------------------------------------------------------------------------------
    async def create_stream(self, websocket: WebSocket) -> None:
        service = self.service
        caller = await self._admitted(websocket)
        if caller is None:
            return
        pace = await socket_pace(websocket, service)
        if pace is None:
            return
        try:
            record = self.registry.create(caller, options=SessionOptions(pace=pace), via="websocket")
        except EngineUnavailable:  # it stopped serving meanwhile
            await refuse_socket(websocket, service, not_ready(service.not_ready() or NotReady.DEAD))
            return
        except TooManySessions as error:
            await refuse_socket(websocket, service, too_many_sessions(error.message))
            return
        if isinstance(record, CapacityFull):
            await refuse_socket(websocket, service, capacity_full(record))
            return
        await StreamConnection(websocket, service, record.session_id, caller).run()

    async def attach_stream(self, websocket: WebSocket, session_id: str) -> None:
        service = self.service
        caller = await self._admitted(websocket)
        if caller is None:
            return
        if len(session_id) > MAX_ID_CHARS or not self.registry.knows(session_id):
            await refuse_unknown_session(websocket, service)
            return
        await StreamConnection(websocket, service, session_id, caller).run()

    async def _admitted(self, websocket: WebSocket) -> Caller | None:
        """The socket's caller once origin and token pass and the engine serves (else refused)."""
        caller = await admit_socket(websocket, self.service)
        if caller is None:
            return None
        reason = self.service.not_ready()
        if reason is not None:
            await refuse_socket(websocket, self.service, not_ready(reason))
            return None
        return caller


    # --- WebRTC (app/transport/webrtc.py) -------------------------------------------------------------
    async def create_peer(self, request: Request, caller: Caller, pace: bool) -> Response:
        offer = await self._offer(request, caller)
        try:
            record = self.registry.create(caller, options=SessionOptions(pace=pace), via="webrtc")
        except EngineUnavailable:  # it stopped serving meanwhile
            raise ApiError.refused(not_ready(self.service.not_ready() or NotReady.DEAD)) from None
        except TooManySessions as error:
            raise ApiError.refused(too_many_sessions(error.message)) from None
        if isinstance(record, CapacityFull):
            raise ApiError.refused(capacity_full(record))
        try:
            return await self._answer(request, caller, record.session_id, offer)
        except BaseException:  # refused, failed, or the client went away meanwhile
            self.registry.delete(record.session_id)  # nothing was negotiated: the session goes with the offer
            raise

    async def attach_peer(self, request: Request, caller: Caller, session_id: str) -> Response:
        offer = await self._offer(request, caller)
        try:
            self.registry.get(session_id)
        except EngineError as error:
            raise ApiError.from_engine(error) from None
        if session_id in self.negotiating:
            raise ApiError(409, "conflict", "an offer for this session is being answered; wait for it")
        return await self._answer(request, caller, session_id, offer)

    async def _offer(self, request: Request, caller: Caller) -> str:
        """The request's SDP offer, checked, from a caller allowed one more peer (else refused, before a session)."""
        reason = self.service.not_ready()
        if reason is not None:
            raise ApiError.refused(not_ready(reason))
        limit = self.service.settings.max_peers_per_client
        held = sum(1 for peer in self.service.connections if isinstance(peer, PeerStream)
                   and peer.caller.address == caller.address)
        if held + self._negotiating_from.get(caller.address, 0) >= limit:
            raise ApiError.refused(too_many_peers(held, limit))
        try:
            offer = offer_text(await request.body())
            check_offer(offer)
        except OfferRefused as refused:
            raise ApiError(refused.status, refused.code, refused.message) from None
        return offer

    async def _answer(self, request: Request, caller: Caller, session_id: str, offer: str) -> Response:
        peer = PeerStream(self.service, session_id, caller)
        self.negotiating.add(session_id)
        self._negotiating_from[caller.address] = self._negotiating_from.get(caller.address, 0) + 1
        try:
            answer = await peer.answer(offer)
        except OfferRefused as refused:
            await peer.pc.close()
            raise ApiError(refused.status, refused.code, refused.message) from None
        except TimeoutError:  # aiortc did not answer within NEGOTIATION_TIMEOUT_S (a starved event loop)
            await peer.pc.close()
            raise ApiError.from_code("unavailable", "the offer could not be answered in time; try again", 1.0) from None
        except BaseException:
            await peer.pc.close()
            raise
        finally:
            self.negotiating.discard(session_id)
            left = self._negotiating_from.get(caller.address, 1) - 1
            if left > 0:
                self._negotiating_from[caller.address] = left
            else:
                self._negotiating_from.pop(caller.address, None)
        task = asyncio.get_running_loop().create_task(peer.run(), name="arstream-webrtc-peer")
        self._peers.add(task)
        task.add_done_callback(self._peers.discard)
        location = str(request.url_for("attach_peer", session_id=session_id).path)
        return Response(answer, status_code=201, media_type="application/sdp",
                        headers={"Location": location, "X-Session-Id": session_id,
                                 **ice_server_links(self.service.settings.webrtc_ice_servers)})


def _stream_url(request: Request, session_id: str) -> str:
    url = request.url_for("attach_stream", session_id=session_id)
    return str(url.replace(scheme="wss" if url.scheme == "https" else "ws"))
