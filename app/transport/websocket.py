"""One attached stream socket: the media sender, the control receiver, and how the socket ends.

Two tasks share the socket:

    pump      registry.chunks(id) ──▶ encode (worker thread) ──▶ `chunk` JSON + ONE binary segment
    receiver  client JSON ──▶ validate ──▶ registry control ──▶ `ack` (+ `state`) or `error`

The receiver listens from the moment the socket is accepted and stamps each message's arrival, but
handles none before `session` and the init segment are out. So a client may send `start` at once, and
time to first media (`arstream_time_to_first_chunk_seconds`) counts from when that `start` arrived,
whatever held the socket's opening up (`arstream_stream_open_seconds` times the opening itself).

The pump asks the engine for chunk N+1 only after chunk N's segment was handed to the socket; the
engine starts block N+1 only then, so a block's media is on the wire before the next block is made,
and a client that reads slowly holds back only its own session. Sends are serialised by one lock,
held across a `chunk` message and its segment so nothing comes between them.

A client that stops reading: once the transport's small buffers are full, handing a segment over
blocks. A hand-over still blocked after ``stall_chunks`` chunk durations means the client is not
keeping up at all — the socket is detached (its session waits the grace period for a reconnect, then
ends ``idle_timeout``) instead of holding its slot for as long as it stays connected.

A bad client message is answered with ``error`` and changes nothing else: it never reaches the engine
and never ends the session, whatever it contains.

Pictures and video in (docs/PROTOCOL.md): a ``start`` or ``reset`` announcing an image or clip makes the
receiver take the next message as its bytes (then decode them off the event loop, then answer once); while
live input is on, every binary message is a frame (``app/transport/socket_input.py``).

Before a socket gets a session: :func:`admit_socket` checks who calls (``app/transport/access.py``) and accepts or
closes it unaccepted, :func:`socket_pace` reads its query, :func:`refuse_socket` words a refusal
(``app/transport/refusal.py``) as ``error`` + ``closed`` + close code, :func:`refuse_unknown_session` closes 4404.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import numpy as np
from fastapi import WebSocket
from pydantic import BaseModel
from starlette.websockets import WebSocketDisconnect

from app.backend import Server
from app.media import AudioSpec, FragmentedMp4Stream
from app.registry import Attachment
from app.schemas import (
    AckMessage,
    AudioInfo,
    ChunkMessage,
    ClosedMessage,
    ErrorMessage,
    MediaAnnouncement,
    ProtocolError,
    ResetMessage,
    SessionMessage,
    StartMessage,
    StateMessage,
    VideoInfo,
    parse_client_message,
    to_text,
)
from app.security import PROTOCOL_SUBPROTOCOL, Caller, TokenBucket, client_address
from app.transport.access import AccessDenied, identify
from app.transport.controls import apply_control
from app.transport.messages import chunk_message, rate_limited
from app.transport.refusal import Refusal
from app.transport.socket_input import ReceiverEnds, SocketInput
from engine.errors import EngineError, SessionClosed, UnknownSession
from engine.session import Chunk, now_ms

if TYPE_CHECKING:
    from app.service import Service

log = logging.getLogger("arstream.stream")

CLOSE_NORMAL = 1000
CLOSE_GOING_AWAY = 1001
CLOSE_POLICY = 1008
CLOSE_TOO_BIG = 1009
CLOSE_FAILED = 1011
CLOSE_TRY_LATER = 1013
CLOSE_UNKNOWN_SESSION = 4404
CLOSE_CODE_BY_REASON = {
    "client": CLOSE_NORMAL,
    "replaced": CLOSE_NORMAL,
    "idle_timeout": CLOSE_NORMAL,
    "max_duration": CLOSE_NORMAL,
    "evicted": CLOSE_NORMAL,
    "draining": CLOSE_GOING_AWAY,
    "capacity": CLOSE_TRY_LATER,
    "failed": CLOSE_FAILED,
}
FAREWELL_TIMEOUT_S = 2.0  # a client that stopped reading must not hold up a replacement or a drain


def closed_message(reason: str, server: Server, retry_after_s: float | None = None) -> ClosedMessage:
    """``closed``; a client turned away for ``draining`` or ``capacity`` also learns when to try again."""
    if reason == "draining":
        retry_after_s = server.settings.drain_timeout_s  # a restarted server takes about this long to be back
    if retry_after_s is not None and reason in ("draining", "capacity"):
        return ClosedMessage(reason=reason, retry_after_s=round(max(retry_after_s, 1.0), 3))
    return ClosedMessage(reason=reason)


# --- before a socket gets a session ------------------------------------------------------------


async def admit_socket(websocket: WebSocket, server: Server) -> Caller | None:
    """Origin and token checks before accept; on success the socket is accepted (``arstream.v1``). A socket
    refused here is closed unaccepted (1008), which the server answers with HTTP 403 instead of the upgrade."""
    try:
        caller = identify(websocket, server.settings)
    except AccessDenied as denied:
        server.metrics.count(server.metrics.refused, denied.reason)
        log.info("socket refused", extra={"reason": denied.reason, "client": client_address(websocket.scope)})
        await websocket.close(CLOSE_POLICY, f"{denied.reason} not allowed")
        return None
    # Answer only a subprotocol the client offered: browsers fail the handshake otherwise.
    offered = websocket.scope.get("subprotocols") or []
    await websocket.accept(subprotocol=PROTOCOL_SUBPROTOCOL if PROTOCOL_SUBPROTOCOL in offered else None)
    return caller


async def socket_pace(websocket: WebSocket, server: Server) -> bool | None:
    """``WS /v1/stream?pace=false`` admits the session best-effort at connect (so a full realtime capacity does not
    refuse a client that will stream with pacing off); ``true`` or absent: live. Anything else is refused with
    ``invalid_field`` (None returned, the socket closed 1008)."""
    value = websocket.query_params.get("pace")
    if value is None or value == "true":
        return True
    if value == "false":
        return False
    server.metrics.message_rejected("socket", "invalid_field")
    await websocket.send_text(to_text(ErrorMessage(code="invalid_field", message="pace must be true or false")))
    await websocket.close(CLOSE_POLICY, "invalid query")
    return None


async def refuse_socket(websocket: WebSocket, server: Server, refusal: Refusal) -> None:
    """An accepted socket that gets no session: ``error`` (unless ``closed`` says it all), then ``closed`` (with
    ``retry_after_s`` for capacity and draining) and the reason's close code."""
    server.metrics.count(server.metrics.refused, refusal.reason)
    told = _error_code_of(refusal)
    if told is not None:
        await websocket.send_text(to_text(ErrorMessage(code=told, message=refusal.message)))
    await websocket.send_text(to_text(closed_message(refusal.reason, server, refusal.retry_after_s)))
    await websocket.close(CLOSE_CODE_BY_REASON[refusal.reason], refusal.reason)


def _error_code_of(refusal: Refusal) -> str | None:
    """The ``error`` a refused socket hears first; None where ``closed`` says it all (draining, no room)."""
    if refusal.reason == "draining" or refusal.code == "capacity":
        return None
    # The socket's protocol has no `unavailable`: to its client, a server that cannot serve failed.
    return "internal" if refusal.code == "unavailable" else refusal.code


async def refuse_unknown_session(websocket: WebSocket, server: Server) -> None:
    """Attaching to a session id this server does not know: close 4404."""
    server.metrics.count(server.metrics.refused, "unknown_session")
    await websocket.close(CLOSE_UNKNOWN_SESSION, "unknown session")


# --- an attached socket -----------------------------------------------------------------------


class ClientGone(Exception):
    """The socket can no longer be written to."""


class ClientStalled(Exception):
    """Handing media to the socket stayed blocked past the stall bound: the client stopped reading."""


class _Replaced(Exception):
    """Another socket took the session over before this one started streaming."""


class MediaEncoder:
    """One socket's fragmented-MP4 stream, used from the shared encoder pool one call at a time."""

    def __init__(self, stream: FragmentedMp4Stream, pool: ThreadPoolExecutor) -> None:
        self.stream = stream
        self._pool = pool
        self._last: Future | None = None

    @classmethod
    async def open(cls, pool: ThreadPoolExecutor, width: int, height: int, fps: int, audio: AudioSpec | None,
                   start_pts: int, audio_start: int) -> "MediaEncoder":
        loop = asyncio.get_running_loop()
        stream = await loop.run_in_executor(
            pool,
            lambda: FragmentedMp4Stream(
                width, height, fps, audio=audio, start_pts=start_pts, audio_start_sample=audio_start
            ),
        )
        return cls(stream, pool)

    async def encode(self, frames: np.ndarray, audio: np.ndarray | None) -> tuple[bytes, float]:
        """The block's media segment and the seconds its encoding took."""

        def run() -> tuple[bytes, float]:
            started = time.perf_counter()
            segment = self.stream.encode_block(frames, audio)
            return segment, time.perf_counter() - started

        self._last = self._pool.submit(run)
        return await asyncio.wrap_future(self._last)

    async def close(self) -> None:
        """Release the encoder once no encode of ours is still running (the stream is not thread-safe)."""
        last, stream = self._last, self.stream

        def close_after_last() -> None:
            if last is not None:
                wait([last])
            stream.close()

        try:
            await asyncio.get_running_loop().run_in_executor(self._pool, close_after_last)
        except RuntimeError:  # the pool already shut down (drain): nothing left to release
            pass


class StreamConnection:
    """Serves one accepted socket attached to one session until the socket or the session ends."""

    playout_margin_s = None  # the engine's: the network and the client's player are between a piece and the screen

    def __init__(self, websocket: WebSocket, service: Service, session_id: str, caller: Caller) -> None:
        self.websocket = websocket
        self.service = service
        self.session_id = session_id
        self.caller = caller
        self.finished = asyncio.Event()  # set once this socket is fully done (drain waits on it)
        self._consumer_stopped = asyncio.Event()  # set once the pump no longer takes chunks
        self._replace_requested = asyncio.Event()
        self._receiver_idle = asyncio.Event()  # set while waiting for a message, not while handling one
        self._send_lock = asyncio.Lock()
        self._opened = asyncio.Event()  # set once `session` and the init segment are out: messages are handled after
        self._clock = service.clock
        self._accepted_at = self._clock()  # the socket was accepted and its session found just before
        self._first_media_from: float | None = None  # arrival of this socket's `start` (None: it sent none)
        settings = service.settings
        self._bucket = TokenBucket(settings.control_rate_per_s, settings.control_burst)
        self._media: MediaEncoder | None = None
        self._inputs = SocketInput(service, session_id)
        self._attachment: Attachment | None = None
        self._background: set[asyncio.Task] = set()
        self._chunks_sent = 0
        geometry = service.geometry
        self._stall_after_s = settings.stall_chunks * geometry.pixel_frames_per_block / geometry.fps

    # --- called by others ----------------------------------------------------------------------
    async def replace(self) -> None:
        """Another socket attaches to this session: stop consuming, then tell our client ``replaced``.

        Returns once this socket takes no further chunk — at the latest after ``FAREWELL_TIMEOUT_S``
        even if it is stuck sending to a client that stopped reading: it checks the request before
        it would take another chunk, so the newcomer never shares the session's chunks with it."""
        self._replace_requested.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._consumer_stopped.wait(), FAREWELL_TIMEOUT_S)

    def post_state(self, state: str, reason: str | None = None) -> None:
        """Queue a ``state`` message from outside the socket's own tasks (a REST control)."""
        task = asyncio.get_running_loop().create_task(self._send_quietly(StateMessage(state=state, reason=reason)))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # --- the socket's life -----------------------------------------------------------------------
    async def run(self) -> None:
        """Attach, send ``session`` + init segment, then stream and take controls until the end."""
        service = self.service
        service.connections.add(self)
        service.metrics.connections_open += 1
        service.metrics.connections_total += 1
        tasks: list[asyncio.Task] = []
        # Listening from now on: a message sent before the opening is out is stamped when it arrives.
        receiver = asyncio.create_task(self._receive(), name="arstream-receiver")
        outcome = "disconnected"
        try:
            # Nothing else may reach the client before `session` and the init segment.
            async with self._send_lock:
                try:
                    self._attachment = await service.registry.attach(self.session_id, self)
                except SessionClosed as error:
                    outcome = "refused"
                    await self._tell_already_closed(error)
                    return
                except EngineError:
                    outcome = "refused"
                    await self._close_socket(CLOSE_UNKNOWN_SESSION, "unknown session")
                    return
                await self._hello()
            self._opened.set()
            service.metrics.stream_open.observe(self._clock() - self._accepted_at)
            if self._replace_requested.is_set():
                raise _Replaced()
            pump = asyncio.create_task(self._pump(), name="arstream-pump")
            replaced = asyncio.create_task(self._replace_requested.wait())
            tasks = [pump, replaced, receiver]
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            outcome = self._outcome(pump, receiver)
        except _Replaced:
            outcome = "replaced"
        except ClientGone:
            outcome = "disconnected"
        except ClientStalled:
            outcome = "stalled"
        except Exception:
            log.exception("stream socket failed", extra={"session_id": self.session_id})
            outcome = "failed"
        finally:
            # Synchronous part first: under cancellation (server force-exit, test client) it still runs.
            for task in tasks[:2]:
                task.cancel()
            self._consumer_stopped.set()  # a cancelled pump takes no further chunk
            # Whatever the outcome, this socket no longer holds the session: a session that ended stays
            # listed only for the retention time, an open one waits the grace period for a reconnect.
            # (A replaced socket was already swapped out: detach does nothing for it.)
            service.registry.detach(self.session_id, self)
            service.metrics.connections_open -= 1
            try:
                if not self._opened.is_set():
                    receiver.cancel()  # it handles nothing before the opening, which will not come now
                else:
                    try:
                        # Let a control being handled finish, so its ack is not lost (e.g. `close`).
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self._receiver_idle.wait(), FAREWELL_TIMEOUT_S)
                    finally:
                        receiver.cancel()
                for task in self._background:
                    task.cancel()
                await asyncio.gather(receiver, *tasks, *self._background, return_exceptions=True)
                await self._finish(outcome)
            finally:
                service.connections.discard(self)
                self.finished.set()

    def _outcome(self, pump: asyncio.Task, receiver: asyncio.Task) -> str:
        if self._replace_requested.is_set():
            return "replaced"
        if pump.done():
            error = pump.exception()
            if error is None:
                return "ended"
            if isinstance(error, ClientGone):
                return "disconnected"
            if isinstance(error, ClientStalled):
                return "stalled"
            log.error("media pump failed", extra={"session_id": self.session_id, "error": repr(error)})
            return "failed"
        error = receiver.exception()
        if error is not None and not isinstance(error, ClientGone):
            log.error("receiver failed", extra={"session_id": self.session_id, "error": repr(error)})
            return "failed"
        return receiver.result() if error is None else "disconnected"

    async def _finish(self, outcome: str) -> None:
        """Say goodbye as the protocol asks, close the socket, release the encoder."""
        session = self._attachment.session if self._attachment is not None else None
        if outcome == "failed" and session is not None and session.is_open:
            with contextlib.suppress(EngineError):  # our media broke: end it cleanly
                self.service.registry.close(self.session_id, "failed")
        if session is not None and session.error is not None:
            log.warning("session failed", extra={"session_id": self.session_id, "error": session.error})
        if outcome in ("ended", "failed") and session is not None:
            reason = session.close_reason or "failed"
            if reason == "failed":
                await self._farewell(ErrorMessage(code="internal", message="generation failed; the session was closed"))
            await self._farewell(closed_message(reason, self.service))
            await self._close_socket(CLOSE_CODE_BY_REASON.get(reason, CLOSE_NORMAL))
        elif outcome == "replaced":
            await self._farewell(ClosedMessage(reason="replaced"))
            await self._close_socket(CLOSE_NORMAL)
        elif outcome == "too_big":
            self.service.metrics.count(self.service.metrics.refused, "message_too_big")
            self.service.metrics.message_rejected("socket", "message_too_big")
            await self._close_socket(CLOSE_TOO_BIG)
        elif outcome == "stalled":
            # Nothing more can reach this client; the close frame is best effort (the transport gives up
            # on a peer that does not read: see app.ws_protocol).
            self.service.metrics.stalled_sockets += 1
            log.warning("client stopped reading; socket detached",
                        extra={"session_id": self.session_id, "stall_after_s": round(self._stall_after_s, 3)})
            await self._close_socket(CLOSE_NORMAL)
        log.info("socket finished", extra={"session_id": self.session_id, "outcome": outcome,
                                           "reason": session.close_reason if session else None,
                                           "chunks_sent": self._chunks_sent})
        if self._media is not None:
            await self._media.close()
        self.service.freed_memory.request()  # its encoders and buffers are free now

    async def _tell_already_closed(self, error: SessionClosed) -> None:
        """Attaching to a session that has ended (still listed for a while): say so, and why it ended."""
        try:
            reason = self.service.registry.status(self.session_id).close_reason or "client"
        except UnknownSession:  # forgotten meanwhile
            reason = "client"
        self.service.metrics.count(self.service.metrics.errors, "session_closed")
        # The caller holds the send lock.
        await self._send_text(to_text(ErrorMessage(code="session_closed", message=error.message)))
        await self._send_text(to_text(closed_message(reason, self.service)))
        await self._close_socket(CLOSE_CODE_BY_REASON.get(reason, CLOSE_NORMAL), "session closed")

    async def _hello(self) -> None:
        """The `session` message and the init segment (the caller holds the send lock)."""
        geometry = self.service.geometry
        audio = None
        if geometry.audio_sample_rate:
            audio = AudioSpec(sample_rate=geometry.audio_sample_rate, channels=geometry.audio_channels or 2)
        self._media = await MediaEncoder.open(
            self.service.encoder_pool, geometry.width, geometry.height, geometry.fps, audio,
            self._attachment.start_pts, self._attachment.audio_start,
        )
        stream = self._media.stream
        audio_info = None
        if audio is not None and stream.audio_codec is not None:
            audio_info = AudioInfo(codec=stream.audio_codec, sample_rate=audio.sample_rate, channels=audio.channels)
        message = SessionMessage(
            session_id=self.session_id,
            state=self._attachment.session.state,
            mime=stream.mime,
            video=VideoInfo(codec=stream.video_codec, width=geometry.width, height=geometry.height, fps=geometry.fps),
            audio=audio_info,
        )
        await self._send_text(to_text(message))
        await self._send_bytes(stream.init_segment())

    # --- media ---------------------------------------------------------------------------------
    async def _pump(self) -> None:
        """Chunks until the session ends; returns normally then (the caller reads the close reason)."""
        try:
            async for chunk in self.service.registry.chunks(self.session_id):
                if self._replace_requested.is_set():
                    return  # replaced while this chunk was coming: it belongs to the newcomer now
                await self._send_chunk(chunk)
                if self._replace_requested.is_set():
                    return  # asking for the next chunk would take it from the newcomer
        except UnknownSession:
            return  # deleted before we started listening: it is closed

    async def _send_chunk(self, chunk: Chunk) -> None:
        media = self._media
        if chunk.pts != media.stream.next_pts:
            raise RuntimeError(f"chunk pts {chunk.pts} breaks this socket's timeline at {media.stream.next_pts}")
        segment, encode_s = await media.encode(chunk.frames, chunk.audio)
        timings = chunk.timings
        try:
            async with asyncio.timeout(self._stall_after_s):
                message = await self._hand_over(chunk, segment, encode_s)
        except TimeoutError:
            raise ClientStalled() from None
        sent_at = now_ms()
        self._chunks_sent += 1
        metrics = self.service.metrics
        metrics.chunk_sent(message.frames, len(segment), (sent_at - timings.started_at) / 1000.0, encode_s)
        for mark in chunk.marks:
            if mark.latency_s is not None:
                metrics.control_shown(mark.kind, mark.latency_s)
        if chunk.index == 0:
            # From the arrival of the `start` this socket sent; a session that started when it attached
            # (created over REST with a prompt) from the socket's acceptance.
            origin = self._first_media_from if self._first_media_from is not None else self._accepted_at
            metrics.time_to_first_chunk.observe(self._clock() - origin)

    async def _hand_over(self, chunk: Chunk, segment: bytes, encode_s: float) -> ChunkMessage:
        """The `chunk` message and its segment, back to back under the send lock."""
        async with self._send_lock:
            message = chunk_message(chunk, encode_s * 1000.0)
            await self._send_text(to_text(message))
            await self._send_bytes(segment)
        return message

    # --- controls --------------------------------------------------------------------------------
    async def _receive(self) -> str:
        """Handle client messages until the client leaves ("disconnected") or oversteps ("too_big")."""
        while True:
            self._receiver_idle.set()
            message = await self.websocket.receive()
            arrived = self._clock()
            self._receiver_idle.clear()
            outcome = await self._handle(message, arrived)
            if outcome is not None:
                return outcome

    async def _handle(self, message: dict, arrived: float) -> str | None:
        """One client message (``arrived``: when it came in, the service's clock); an outcome when the receiver
        must end."""
        if message["type"] == "websocket.disconnect":
            return "disconnected"
        await self._opened.wait()  # nothing is answered before `session` and the init segment
        text, data = message.get("text"), message.get("bytes")
        if text is None:
            if len(data or b"") > self.service.settings.inputs.max_binary_bytes:
                return "too_big"
            await self._guarded(self._inputs.frame(data or b""))
            return None
        while text is not None:
            # Cheap bound first: a character is at least one byte.
            max_bytes = self.service.settings.max_message_bytes
            if len(text) > max_bytes or len(text.encode("utf-8", "surrogatepass")) > max_bytes:
                return "too_big"
            try:
                text = await self._guarded(self._handle_text(text, arrived))
            except ReceiverEnds as instead:
                return instead.outcome
            arrived = self._clock()  # a text message that came where announced bytes were due: handled now
        return None

    async def _guarded(self, handling):
        """Run one message's handling: a protocol error is answered, a bug of ours is answered ``internal`` and
        logged; neither ends the session."""
        try:
            return await handling
        except (ClientGone, ReceiverEnds):
            raise
        except ProtocolError as error:
            await self._send_error(error)
        except Exception:
            log.exception("client message handling failed", extra={"session_id": self.session_id})
            await self._send_error(ProtocolError("internal", "the message could not be handled"))
        return None

    async def _handle_text(self, text: str, arrived: float) -> str | None:
        """Handle one text message (``arrived``: when it came in, the service's clock); returns a text message
        that came where announced bytes were expected (it is handled next)."""
        allowed = self._bucket.allow()
        try:
            message = parse_client_message(text)
        except ProtocolError as error:
            if not allowed:
                error = self._rate_limited(error.message_id)
            # Refused before it was read, it may still have announced a picture: its bytes are taken off all the
            # same (answered once, with this error), so they are not read as a frame (an extra `bad_json`).
            leftover = await self._inputs.discard(self.websocket) if SocketInput.announces_bytes(text) else None
            await self._send_error(error)
            return leftover
        self.service.metrics.count(self.service.metrics.client_messages, message.type)
        if not allowed:
            announced = isinstance(getattr(message, "input", None), MediaAnnouncement)
            leftover = await self._inputs.discard(self.websocket) if announced else None
            await self._send_error(self._rate_limited(message.id))
            return leftover
        context, leftover = None, None
        announced = getattr(message, "input", None)
        if isinstance(announced, MediaAnnouncement):
            context, leftover, error = await self._inputs.announced(self.websocket, announced, message)
            if error is not None:
                await self._send_error(error)
                return leftover
        elif isinstance(message, ResetMessage) and message.input is not None:
            context = self._inputs.no_context()
        try:
            applied = apply_control(self.service.registry, self.session_id, message, context, arrived)
        except ProtocolError as error:
            await self._send_error(error)
            return leftover
        if isinstance(message, StartMessage):
            self._first_media_from = arrived
        async with self._send_lock:
            await self._send_text(to_text(AckMessage(id=message.id, of=message.type, **applied.ack)))
            if applied.state is not None:
                await self._send_text(to_text(StateMessage(state=applied.state)))
        return leftover

    def _rate_limited(self, message_id: str | None) -> ProtocolError:
        return rate_limited(self.service.settings.control_rate_per_s, message_id)

    # --- sending ---------------------------------------------------------------------------------
    async def _send_error(self, error: ProtocolError) -> None:
        """Answer a client message that was not applied (every one is counted as rejected)."""
        self.service.metrics.count(self.service.metrics.errors, error.code)
        self.service.metrics.message_rejected("socket", error.code)
        async with self._send_lock:
            await self._send_text(to_text(ErrorMessage(code=error.code, message=error.message, id=error.message_id)))

    async def _send_quietly(self, message: BaseModel) -> None:
        try:
            async with self._send_lock:
                await self._send_text(to_text(message))
        except ClientGone:
            pass

    async def _farewell(self, message: BaseModel) -> None:
        try:
            await asyncio.wait_for(self._send_quietly(message), FAREWELL_TIMEOUT_S)
        except TimeoutError:
            pass

    async def _close_socket(self, code: int, reason: str | None = None) -> None:
        try:
            await asyncio.wait_for(self.websocket.close(code, reason), FAREWELL_TIMEOUT_S)
        except (TimeoutError, RuntimeError, OSError, WebSocketDisconnect):
            pass  # already closed by the client, or the client stopped reading

    async def _send_text(self, text: str) -> None:
        try:
            await self.websocket.send_text(text)
        except (WebSocketDisconnect, OSError, RuntimeError) as error:
            raise ClientGone() from error

    async def _send_bytes(self, data: bytes) -> None:
        try:
            await self.websocket.send_bytes(data)
        except (WebSocketDisconnect, OSError, RuntimeError) as error:
            raise ClientGone() from error
