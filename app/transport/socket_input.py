"""Pictures and video a socket's client sends: announced images and clips, and live frames (docs/PROTOCOL.md).

Two paths, both bounded before they cost anything:

    start/reset + input ──▶ the next message, within announce_timeout_s ──▶ decode (input thread) ──▶ frames
    binary frame        ──▶ engine: live on? within the session's rate? ──▶ decode (input thread) ──▶ engine buffer

A frame over the session's rate is dropped before it is decoded (the engine counts it), so a client sending
far too fast costs a token check per frame; decoding runs on the service's one input thread, never on the event
loop and never in front of another session's media encoding. Decoding itself is ``app/media_input.py``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import numpy as np
from starlette.websockets import WebSocket

from app.media_input import FrameSize, MediaRejected, decode_clip, decode_image
from app.schemas import MAX_ANNOUNCED_BYTES, MediaAnnouncement, ProtocolError, decode_client_json
from engine.errors import EngineError, NotLive, SessionClosed, UnknownSession
from engine.plan import InputContext

if TYPE_CHECKING:
    from app.service import Service

log = logging.getLogger("arstream.input")


class ReceiverEnds(Exception):
    """While waiting for announced bytes the client left, or sent a message over the bounds: the receiver ends
    with ``outcome`` (``disconnected`` / ``too_big``), as it would have without the announcement."""

    def __init__(self, outcome: str) -> None:
        super().__init__(outcome)
        self.outcome = outcome


class SocketInput:
    """The input side of one attached socket."""

    def __init__(self, service: Service, session_id: str) -> None:
        self.service = service
        self.session_id = session_id

    # --- images and clips ------------------------------------------------------------------------
    async def announced(self, websocket: WebSocket, announcement: MediaAnnouncement, message
                        ) -> tuple[np.ndarray | InputContext | None, str | None, ProtocolError | None]:
        """Take the announced bytes off the socket (always, so they are never read as something else), then
        decode them. Returns the context for ``message`` (frames for a ``start``, an :class:`InputContext` for a
        ``reset``), a text message that came instead of the bytes (to be handled next), and the error that
        answers ``message`` instead of its ack."""
        limits = self.service.settings.inputs
        leftover, data = None, None
        try:
            received = await asyncio.wait_for(websocket.receive(), limits.announce_timeout_s)
        except TimeoutError:
            return None, None, self._error(message, "invalid_media",
                                           f"the announced {announcement.kind} did not arrive within "
                                           f"{limits.announce_timeout_s:g} s")
        if received["type"] == "websocket.disconnect":
            raise ReceiverEnds("disconnected")
        if received.get("text") is not None:
            leftover = received["text"]
        else:
            data = received.get("bytes") or b""
            if len(data) > limits.max_binary_bytes:
                raise ReceiverEnds("too_big")
        if data is None:
            return None, leftover, self._error(message, "invalid_media",
                                               f"a text message came where the announced {announcement.kind}'s "
                                               "bytes were expected")
        if len(data) != announcement.bytes:
            return None, None, self._error(message, "invalid_media",
                                           f"announced {announcement.bytes} bytes, received {len(data)}")
        refusal = self.service.engine.input_refusal
        if refusal is not None:
            return None, None, self._error(message, "input_unsupported", refusal)
        try:
            frames = await self._decode(announcement.kind, data)
        except MediaRejected as rejected:
            return None, None, self._error(message, rejected.code, rejected.message)
        return (frames if message.type == "start" else InputContext(frames)), None, None

    async def discard(self, websocket: WebSocket) -> str | None:
        """A refused ``start`` or ``reset`` announced bytes: take them off the socket all the same (the protocol
        promises it, so they are never read as something else). Returns a text message that came instead."""
        try:
            received = await asyncio.wait_for(websocket.receive(), self.service.settings.inputs.announce_timeout_s)
        except TimeoutError:
            return None
        if received["type"] == "websocket.disconnect":
            raise ReceiverEnds("disconnected")
        if received.get("text") is not None:
            return received["text"]
        if len(received.get("bytes") or b"") > self.service.settings.inputs.max_binary_bytes:
            raise ReceiverEnds("too_big")
        return None

    @staticmethod
    def announces_bytes(text: str) -> bool:
        """Whether a message that was refused before it was read whole announced bytes to follow (its ``input``
        looks like an announcement, whatever else is wrong with it)."""
        try:
            parsed = decode_client_json(text)
        except ProtocolError:
            return False
        announced = parsed.get("input") if isinstance(parsed, dict) else None
        if not isinstance(announced, dict) or parsed.get("type") not in ("start", "reset"):
            return False
        size = announced.get("bytes")
        return announced.get("kind") in ("image", "clip") and isinstance(size, int) and not isinstance(size, bool) \
            and 1 <= size <= MAX_ANNOUNCED_BYTES

    @staticmethod
    def no_context() -> InputContext:
        """``reset`` with ``{"kind": "none"}``: from the prompt alone."""
        return InputContext(None)

    async def _decode(self, kind: str, data: bytes) -> np.ndarray:
        limits = self.service.settings.inputs
        geometry = self.service.geometry
        size = FrameSize(geometry.width, geometry.height)
        if kind == "image":
            def work() -> np.ndarray:
                return decode_image(data, size, max_bytes=limits.max_image_bytes,
                                    max_pixels=limits.max_image_pixels)[np.newaxis]
        else:
            def work() -> np.ndarray:
                return decode_clip(data, size, fps=geometry.fps, max_frames_kept=self.service.engine.max_context_frames,
                                   max_bytes=limits.max_clip_bytes, max_seconds=limits.max_clip_seconds,
                                   max_pixels=limits.max_clip_pixels)
        return await asyncio.get_running_loop().run_in_executor(self.service.input_pool, work)

    @staticmethod
    def _error(message, code: str, text: str) -> ProtocolError:
        return ProtocolError(code, text, message.id)

    # --- live frames -----------------------------------------------------------------------------
    async def frame(self, data: bytes) -> None:
        """One binary message outside an announcement: a live frame, or a ``bad_json`` error while live is off.
        Raises :class:`ProtocolError` for the socket to answer."""
        registry = self.service.registry
        try:
            number = registry.admit_frame(self.session_id)
            if number is None:
                return  # over the session's rate: dropped unread (counted by the engine)
        except NotLive:
            raise ProtocolError("bad_json", "binary messages are live input frames: send a live message first "
                                            "(or announce an image or clip on start or reset)") from None
        except (SessionClosed, UnknownSession) as error:
            raise ProtocolError("session_closed", error.message) from None
        limits = self.service.settings.inputs
        geometry = self.service.geometry
        size = FrameSize(geometry.width, geometry.height)
        try:
            frame = await asyncio.get_running_loop().run_in_executor(
                self.service.input_pool,
                lambda: decode_image(data, size, max_bytes=limits.max_frame_bytes,
                                     max_pixels=limits.max_frame_pixels, what="frame"),
            )
        except MediaRejected as rejected:
            registry.count_invalid_frame(self.session_id)
            raise ProtocolError(rejected.code, rejected.message) from None
        try:
            registry.push_frame(self.session_id, frame, number)
        except EngineError:
            return  # the session ended while the frame was decoded
