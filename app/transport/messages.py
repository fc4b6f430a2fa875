"""Server messages every transport words alike, so a client meets the same text over the socket and WebRTC."""

from __future__ import annotations

from app.schemas import ChunkMessage, ChunkTimingsOut, ProtocolError
from engine.session import Chunk, now_ms


def chunk_message(chunk: Chunk, encode_ms: float) -> ChunkMessage:
    """A chunk's ``chunk`` message (``encode_ms``: the transport's own encoding of it, 0 where it has none yet),
    naming the controls its first frame is the first to show and the live frame it shows."""
    timings = chunk.timings
    return ChunkMessage(
        index=chunk.index,
        pts=chunk.pts,
        frames=int(chunk.frames.shape[0]),
        audio_samples=int(chunk.audio.shape[-1]) if chunk.audio is not None else 0,
        timings=ChunkTimingsOut(
            started_at=timings.started_at,
            queued_ms=round(timings.queued_ms, 3),
            denoise_ms=round(timings.denoise_ms, 3),
            decode_ms=round(timings.decode_ms, 3),
            encode_ms=round(encode_ms, 3),
            sent_at=now_ms(),
        ),
        controls=[mark.control_id for mark in chunk.marks if mark.control_id is not None] or None,
        input_frame=chunk.input_frame,
    )


def rate_limited(rate_per_s: float, message_id: str | None) -> ProtocolError:
    """A control message over the client's rate (``control_rate_per_s``): refused, not applied."""
    return ProtocolError("rate_limited", f"more than {rate_per_s:g} messages per second; slow down", message_id)
