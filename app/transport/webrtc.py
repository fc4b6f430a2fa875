"""WebRTC beside the WebSocket: a session over a browser-native peer connection (aiortc).

Signalling is WHEP-style, on the same ``/v1`` tree and under the socket's access rules and admission: the client
POSTs an SDP offer (``application/sdp``) to ``/v1/webrtc`` (a new session, as ``WS /v1/stream``) or
``/v1/sessions/{id}/webrtc`` (attach, as the socket's attach: it replaces whatever is attached), and gets the
answer back (201, ``application/sdp``, ``Location`` the session's WebRTC resource); ``DELETE`` on it ends the
session. A refused session (capacity, draining, too many from one address) is refused before any media is
negotiated, with the REST error shape and ``Retry-After``.

One peer connection per session (:class:`PeerStream`):

- **media out**: a video track, and an audio track when the model makes sound, fed from the session's chunks
  at their presentation times (``app/transport/webrtc_media.py``): the server holds the pacing, so no client buffer
  delays a control. H.264 where the browser offers it, VP8 otherwise; Opus for sound.
- **controls**: a data channel the client opens carries the v1 control protocol unchanged, JSON both ways:
  ``start``, ``prompt``, ``pause``, ``resume``, ``reset``, ``live``, ``close`` and every server message
  (``session``, ``chunk`` without its segment, ``ack``, ``state``, ``error``, ``closed``). Binary messages are
  not used on this transport (pictures and clips go over the socket).
- **camera in**: a video track the client sends is the session's live input while ``live`` is on, dropped and
  counted like socket frames when it outruns the engine.

Host ICE candidates only by default: nothing reaches a STUN or TURN server unless the service's
``webrtc_ice_servers`` lists some: the server gathers through them, and tells clients of them as WHEP does
(``Link`` headers on ``OPTIONS /v1/webrtc`` and on every answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from typing import TYPE_CHECKING

import aioice.ice
from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription
from aiortc.rtcrtpsender import RTCRtpSender
from aiortc.sdp import SessionDescription

from app.media_input import FrameSize
from app.registry import Attachment
from app.schemas import (
    AckMessage,
    AudioInfo,
    ClosedMessage,
    ErrorMessage,
    MediaAnnouncement,
    ProtocolError,
    SessionMessage,
    StateMessage,
    VideoInfo,
    parse_client_message,
    to_text,
)
from app.security import Caller, TokenBucket
from app.settings import IceServer
from app.transport.controls import apply_control
from app.transport.messages import chunk_message, rate_limited
from app.transport.webrtc_media import SessionAudioTrack, SessionVideoTrack, Timeline, read_camera
from engine.errors import EngineError, NotLive, SessionClosed, UnknownSession
from engine.session import Chunk, now_ms

if TYPE_CHECKING:
    from app.service import Service

log = logging.getLogger("arstream.webrtc")

MAX_OFFER_BYTES = 64 * 1024
NEGOTIATION_TIMEOUT_S = 10.0  # an offer is answered within this (host candidates gather in milliseconds)
CONNECT_TIMEOUT_S = 20.0  # a peer that never connects after its answer is dropped (its session detaches)
MAX_PENDING_MESSAGES = 64  # server messages waiting for the data channel to open


class OfferRefused(Exception):
    """An offer the server cannot answer: ``code`` is the protocol's, ``status`` the HTTP status."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def check_offer(sdp: str) -> None:
    """Every check an offer can fail before a session exists: bounded, SDP that parses, a video section the
    server can send on. (aiortc's parser only; no peer connection, no sockets.)"""
    if len(sdp.encode("utf-8", "surrogatepass")) > MAX_OFFER_BYTES:
        raise OfferRefused(413, "invalid_field", f"an SDP offer holds at most {MAX_OFFER_BYTES} bytes")
    if not sdp.startswith("v=0"):
        raise OfferRefused(400, "invalid_field", "the body is not an SDP offer (application/sdp, starting v=0)")
    try:
        parsed = SessionDescription.parse(sdp)
    except (ValueError, KeyError, IndexError, TypeError, AssertionError) as error:
        raise OfferRefused(400, "invalid_field", f"the SDP offer could not be read ({type(error).__name__})") from None
    videos = [media for media in parsed.media if media.kind == "video"]
    if not videos:
        raise OfferRefused(400, "invalid_field", "the offer has no video section: add a recvonly video transceiver")
    # The client's direction: it must receive video (recvonly, or sendrecv when it also sends its camera).
    if not any(media.direction in ("recvonly", "sendrecv", None) for media in videos):
        raise OfferRefused(400, "invalid_field", "the offer receives no video: its video section is sendonly")


def without_mdns_candidates(sdp: str) -> str:
    """The offer less its mDNS host candidates (``<uuid>.local``, what browsers offer instead of their addresses).

    aiortc resolves each one before it answers, and a name nobody answers for (a container, a server off the
    browser's LAN) holds the answer for aioice's 1 s timeout: measured, the demo page's first media 1.6 s instead of
    0.5 s. Without them the peer still connects: the browser's checks reach the server's own candidates, and the
    server learns the browser's address from them (a peer-reflexive candidate)."""
    lines = sdp.split("\n")
    kept = [line for line in lines if not (line.startswith("a=candidate:") and _candidate_address(line).endswith(".local"))]
    return "\n".join(kept)


def audio_in_its_own_stream(sdp: str) -> str:
    """The answer with its audio track in a media stream of its own (``a=msid``), so the browser does not hold
    the video back to lip-sync it with the sound.

    Both tracks are sent on one clock (:class:`~app.transport.webrtc_media.Timeline`), so they arrive in step; but a
    browser that syncs them (tracks of one stream) also delays the video to its audio jitter buffer's depth: in
    Chromium the video's buffer went from 9 to 151 ms and control to screen up by 0.15-0.4 s (docs/BENCHMARKS.md).
    Apart, the sound plays about 40 ms after its picture (the audio buffer's depth less the video's), well inside
    what viewers notice. The client's own media and the SDP's other lines are unchanged."""
    lines = sdp.split("\n")
    section = None
    for index, line in enumerate(lines):
        if line.startswith("m="):
            section = line[2:].split(" ", 1)[0]
        elif section == "audio" and line.startswith("a=msid:"):
            fields = line[len("a=msid:"):].split(" ", 1)
            if len(fields) == 2 and fields[0] not in ("-", ""):
                lines[index] = f"a=msid:{fields[0]}-audio {fields[1]}"
    return "\n".join(lines)


def _candidate_address(line: str) -> str:
    """``a=candidate:<foundation> <component> <transport> <priority> <address> <port> typ ...``: the address."""
    fields = line.split()
    return fields[4].rstrip("\r").lower() if len(fields) > 4 else ""


def ice_servers(servers: list[IceServer]) -> list[RTCIceServer]:
    """The configured STUN/TURN servers, as aiortc takes them (the server's own candidates)."""
    return [RTCIceServer(urls=s.urls, username=s.username, credential=s.credential) for s in servers]


def ice_server_links(servers: list[IceServer]) -> dict[str, str]:
    """The configured STUN/TURN servers as WHEP tells a client: one ``Link`` header of ``rel="ice-server"`` values
    (empty: no header). A client configures its peer connection with them before it makes its offer."""
    values = []
    for server in servers:
        value = f'<{server.urls}>; rel="ice-server"'
        if server.username is not None:
            value += f'; username="{server.username}"; credential="{server.credential}"; credential-type="password"'
        values.append(value)
    return {"Link": ", ".join(values)} if values else {}


class PeerStream:
    """Serves one session over one peer connection until the peer or the session ends."""

    def __init__(self, service: Service, session_id: str, caller: Caller) -> None:
        self.service = service
        self.session_id = session_id
        self.caller = caller
        settings = service.settings
        # The peer's margin, given to the engine at attach and kept by its timeline.
        self.playout_margin_s = settings.webrtc_playout_margin_s
        if self.playout_margin_s is None:
            self.playout_margin_s = service.engine.config.playout_margin_s
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=ice_servers(settings.webrtc_ice_servers)))
        geometry = service.geometry
        self.timeline = Timeline(geometry.fps, self.playout_margin_s)
        self.video = SessionVideoTrack(self.timeline)
        self.audio = None
        if geometry.audio_sample_rate:
            self.audio = SessionAudioTrack(self.timeline, geometry.audio_sample_rate, geometry.audio_channels or 2)
        self.channel = None
        self._pending: list[str] = []  # server messages waiting for the channel
        self._bucket = TokenBucket(settings.control_rate_per_s, settings.control_burst)
        self._attachment: Attachment | None = None
        self._tasks: set[asyncio.Task] = set()
        self._replaced = False
        self.ended = asyncio.Event()  # the peer or the session ended: stop
        self.finished = asyncio.Event()  # everything it held is released (the service's drain waits on it)
        self.video_codec: str | None = None
        self._connected = asyncio.Event()

    # --- negotiation ------------------------------------------------------------------------------
    async def answer(self, offer_sdp: str) -> str:
        """The SDP answer to the client's offer (raises :class:`OfferRefused` for an offer it cannot serve)."""
        check_offer(offer_sdp)
        pc = self.pc
        pc.on("datachannel", self._on_channel)
        pc.on("track", self._on_track)
        pc.on("connectionstatechange", self._on_state)
        try:
            await asyncio.wait_for(pc.setRemoteDescription(RTCSessionDescription(sdp=without_mdns_candidates(offer_sdp),
                                                                                 type="offer")),
                                   NEGOTIATION_TIMEOUT_S)
        except (ValueError, KeyError, IndexError, TypeError, AssertionError) as error:
            raise OfferRefused(400, "invalid_field", f"the SDP offer could not be read ({type(error).__name__})") from None
        # What the offer lets this side do in each section (aiortc keeps the client's direction reversed): the
        # server must be able to send video (the client recvonly, or sendrecv when it also sends its camera).
        video = [t for t in pc.getTransceivers()
                 if t.kind == "video" and getattr(t, "_offerDirection", None) in ("sendonly", "sendrecv")]
        if not video:
            raise OfferRefused(400, "invalid_field", "the offer receives no video: its video section is sendonly")
        video[0].setCodecPreferences(_preferred_video_codecs(offer_sdp))
        pc.addTrack(self.video)
        if self.audio is not None and any(t.kind == "audio" and getattr(t, "_offerDirection", None)
                                          in ("sendonly", "sendrecv") for t in pc.getTransceivers()):
            pc.addTrack(self.audio)
        answer = await pc.createAnswer()
        await asyncio.wait_for(pc.setLocalDescription(answer), NEGOTIATION_TIMEOUT_S)
        self.video_codec = _video_codec_of(pc.localDescription.sdp)
        return audio_in_its_own_stream(pc.localDescription.sdp)

    # --- the table's view of an attached transport (app/registry.py AttachedSocket) ------------------
    async def replace(self) -> None:
        """Another socket or peer attaches: tell ours ``replaced`` and stop taking chunks."""
        self._replaced = True
        self._send(ClosedMessage(reason="replaced"))
        await self._flush_and_close()

    def post_state(self, state: str, reason: str | None = None) -> None:
        self._send(StateMessage(state=state, reason=reason))

    # --- the peer's life --------------------------------------------------------------------------
    async def run(self) -> None:
        """Attached to the session: chunks to the tracks (and their `chunk` messages) until it or the peer ends."""
        service = self.service
        service.connections.add(self)
        try:
            await self._serve()
        finally:
            service.connections.discard(self)
            self.finished.set()

    async def _serve(self) -> None:
        service = self.service
        try:
            self._attachment = await service.registry.attach(self.session_id, self)
        except EngineError as error:
            self._send(ErrorMessage(code=error.code if error.code != "unknown_session" else "session_closed",
                                    message=error.message))
            await self._flush_and_close()
            with contextlib.suppress(Exception):
                await self.pc.close()
            return
        self._send(self._hello())
        pump = asyncio.create_task(self._pump(), name="arstream-webrtc-pump")
        watchdog = asyncio.create_task(self._expect_connection(), name="arstream-webrtc-connect")
        self._tasks |= {pump, watchdog}
        try:
            await self.ended.wait()
        finally:
            for task in list(self._tasks):
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if not self._replaced:
                service.registry.detach(self.session_id, self)
            with contextlib.suppress(Exception):
                await self.pc.close()
            service.freed_memory.request()
            timeline = self.timeline
            log.info("peer finished", extra={
                "session_id": self.session_id, "frames_sent": self.video.frames_sent, "stalls": timeline.stalls,
                "restarts": timeline.restarts,
                "stalled_s": round(timeline.stalled_s, 3), "caught_up_s": round(timeline.caught_up_s, 3),
                "min_slack_s": None if timeline.min_slack_s is None else round(timeline.min_slack_s, 3)})

    async def close(self) -> None:
        """End the peer (the session's ``DELETE``, a drain): it goes at once."""
        await self._flush_and_close()

    async def _expect_connection(self) -> None:
        try:
            await asyncio.wait_for(self._connected.wait(), CONNECT_TIMEOUT_S)
        except TimeoutError:
            log.info("peer never connected", extra={"session_id": self.session_id})
            self.ended.set()

    async def _pump(self) -> None:
        session = None
        try:
            async for chunk in self.service.registry.chunks(self.session_id):
                if self._replaced:
                    return
                self._deliver(chunk)
            session = self.service.registry.status(self.session_id)
        except (UnknownSession, SessionClosed):
            pass
        reason = session.close_reason if session is not None and session.close_reason else "client"
        if not self._replaced:
            self._send(ClosedMessage(reason=reason))
        await self._flush_and_close()

    def _deliver(self, chunk: Chunk) -> None:
        self.video.push(chunk.pts, chunk.frames, chunk.starts_clock)
        if self.audio is not None and chunk.audio is not None:
            self.audio.push(chunk.audio_start, chunk.audio)
        self._send(chunk_message(chunk, 0.0))  # encoded by aiortc as the track sends each frame
        metrics = self.service.metrics
        metrics.chunk_sent(int(chunk.frames.shape[0]), 0, (now_ms() - chunk.timings.started_at) / 1000.0, 0.0)
        for mark in chunk.marks:
            if mark.latency_s is not None:
                metrics.control_shown(mark.kind, mark.latency_s)

    def _hello(self) -> SessionMessage:
        geometry = self.service.geometry
        codec = self.video_codec or "vp8"
        audio = None
        if self.audio is not None:
            audio = AudioInfo(codec="opus", sample_rate=geometry.audio_sample_rate,
                              channels=geometry.audio_channels or 2)
        return SessionMessage(
            session_id=self.session_id, state=self._attachment.session.state, mime=f"video/{codec.upper()}",
            video=VideoInfo(codec=codec, width=geometry.width, height=geometry.height, fps=geometry.fps),
            audio=audio, transport="webrtc",
        )

    # --- the peer's events -----------------------------------------------------------------------
    def _on_state(self) -> None:
        state = self.pc.connectionState
        if state == "connected":
            self._connected.set()
        elif state in ("failed", "closed"):
            self.ended.set()

    def _on_channel(self, channel) -> None:
        if self.channel is not None:
            channel.close()  # one control channel per peer
            return
        self.channel = channel
        channel.on("message", self._on_message)
        if channel.readyState == "open":
            self._flush()
        else:
            channel.on("open", self._flush)

    def _on_track(self, track) -> None:
        if track.kind != "video":
            return  # the client's microphone is not used
        service = self.service
        geometry = service.geometry
        registry = service.registry

        def admit() -> int | None:
            try:
                return registry.admit_frame(self.session_id)
            except NotLive:
                return None  # live input is off: the camera's frames are not used
            except EngineError:
                return None

        def push(frame, number: int) -> None:
            with contextlib.suppress(EngineError):
                registry.push_frame(self.session_id, frame, number)

        task = asyncio.get_running_loop().create_task(read_camera(
            track, FrameSize(geometry.width, geometry.height), admit=admit, push=push, fit_in=service.input_pool,
            max_pixels=service.settings.inputs.max_frame_pixels))
        self._tasks.add(task)

    def _on_message(self, message) -> None:
        # Handled in the channel's callback, nothing awaited: a flood costs no task per message, only its answer.
        try:
            self._handle(message, self.service.clock())
        except Exception:  # a bug of ours: answered and logged, as on the socket; the peer goes on
            log.exception("client message handling failed", extra={"session_id": self.session_id})
            self._refuse(ProtocolError("internal", "the message could not be handled"))

    def _handle(self, message, arrived: float) -> None:
        settings = self.service.settings
        metrics = self.service.metrics
        if isinstance(message, (bytes, bytearray)):
            return self._refuse(ProtocolError("bad_json", "binary messages are not used over WebRTC: the camera is a "
                                                          "video track, pictures and clips go over the socket"))
        if len(message) > settings.max_message_bytes:
            return self._refuse(ProtocolError("invalid_field", f"a message holds at most {settings.max_message_bytes} "
                                                               "bytes"))
        allowed = self._bucket.allow()
        try:
            parsed = parse_client_message(message)
        except ProtocolError as error:
            return self._refuse(error if allowed else rate_limited(settings.control_rate_per_s, error.message_id))
        metrics.count(metrics.client_messages, parsed.type)
        if not allowed:
            return self._refuse(rate_limited(settings.control_rate_per_s, parsed.id))
        if isinstance(getattr(parsed, "input", None), MediaAnnouncement):
            return self._refuse(ProtocolError("input_unsupported", "pictures and clips go over the socket; over "
                                                                   "WebRTC the camera is a video track", parsed.id))
        try:
            applied = apply_control(self.service.registry, self.session_id, parsed, None, arrived)
        except ProtocolError as refused:
            return self._refuse(refused)
        self._send(AckMessage(id=parsed.id, of=parsed.type, **applied.ack))
        if applied.state is not None:
            self._send(StateMessage(state=applied.state))

    def _refuse(self, error: ProtocolError) -> None:
        metrics = self.service.metrics
        metrics.count(metrics.errors, error.code)
        metrics.message_rejected("webrtc", error.code)
        self._send(ErrorMessage(code=error.code, message=error.message, id=error.message_id))

    # --- sending ---------------------------------------------------------------------------------
    def _send(self, message) -> None:
        text = to_text(message)
        channel = self.channel
        if channel is not None and channel.readyState == "open":
            with contextlib.suppress(Exception):
                channel.send(text)
            return
        if len(self._pending) < MAX_PENDING_MESSAGES:
            self._pending.append(text)

    def _flush(self) -> None:
        pending, self._pending = self._pending, []
        for text in pending:
            with contextlib.suppress(Exception):
                self.channel.send(text)

    async def _flush_and_close(self) -> None:
        self._flush()
        await asyncio.sleep(0.05)  # let the channel carry the farewell before the transport goes
        self.ended.set()


def _preferred_video_codecs(offer_sdp: str):
    """H.264 first where the offer has it (hardware decoders, what the socket sends too), else VP8."""
    capabilities = RTCRtpSender.getCapabilities("video").codecs
    h264 = [c for c in capabilities if c.mimeType.lower() == "video/h264"]
    others = [c for c in capabilities if c.mimeType.lower() != "video/h264"]
    return (h264 + others) if "H264" in offer_sdp else (others + h264)


def _video_codec_of(answer_sdp: str) -> str | None:
    """The video codec the answer chose: the first payload of its video section that carries video (not RTX)."""
    section = answer_sdp.split("m=video", 1)
    if len(section) < 2:
        return None
    payloads = section[1].split("\n", 1)[0].split()[3:]
    names = dict(re.findall(r"a=rtpmap:(\d+) ([A-Za-z0-9-]+)/", section[1]))
    for payload in payloads:
        name = names.get(payload, "").lower()
        if name and name not in ("rtx", "red", "ulpfec"):
            return name
    return None


def set_peer_timeout(seconds: float) -> None:
    """A peer whose network went away (no ICE consent answers) is dropped after about ``seconds`` (aioice checks
    consent 6 times, each interval apart; its default 5 s interval makes 30 s). Process-wide: one service runs in
    a process."""
    aioice.ice.CONSENT_INTERVAL = max(0.2, seconds / aioice.ice.CONSENT_FAILURES)


def offer_text(body: bytes) -> str:
    """The request body as an SDP offer's text (UTF-8; refused otherwise)."""
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        raise OfferRefused(400, "invalid_field", "the SDP offer is not UTF-8 text") from None

