"""One benchmark client of the stream socket, and what its observations say.

`run_session` is a plain `websockets` client that follows the wire protocol: it sends `start` as soon as the socket
is open (the protocol lets a client send before `session` arrives; a viewer's click is what starts the clock, so
nothing the server does while opening the stream is left out), then reads `session` and the init segment, records every `chunk` message with the arrival time of its media segment, may send
controls at set times (`reset`, `prompt`), and at its stop time sends `close` and waits for `closed`. A socket
refused at once (capacity, warming up, draining) is recorded as a refusal with its reason, close code and
`retry_after_s` when the server gives one.

`session_stats` turns one record into the figures a viewer would care about (all times on the client's clock,
except the server's own timings from the `chunk` messages):
- time to first media: `start` sent (right after the socket opened) -> the first media segment received; and from
  before the connect (`connect_to_first_media_ms`: the handshake and the stream's opening too);
- frames/s after the first chunk (steady) and from `start` (overall);
- chunk gaps: arrival to arrival of consecutive segments; the worst, and how many exceed 1.5x the nominal chunk
  duration (the most common chunk's frames / fps; a short opening chunk does not set it);
- deadline misses: chunk i is due when its first frame should play, first arrival + pts_i / fps; a chunk that
  arrives after that made the viewer's playback stall; and the video buffered ahead at the last arrival (a lone
  opening frame, a split first block, is a preview: playback starts with the block's rest, and how long the
  still frame stayed beyond its own 1/fps is reported as `opening_stall_ms`);
- the server's per-chunk timings (queued/denoise/decode/encode ms), median and max; socket latency (server
  `sent_at` -> client receipt, same host so the same clock).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

HELLO_TIMEOUT_S = 30.0
CLOSE_WAIT_S = 30.0
GAP_LIMIT_FACTOR = 1.5
LATE_TOLERANCE_MS = 0.5  # float noise: chunk 0 is due exactly when it arrives
MAX_LISTED = 10  # longest gaps / late chunks listed per session


@dataclass
class ChunkSeen:
    index: int
    pts: int
    frames: int
    timings: dict
    received: float  # time.monotonic() seconds
    received_epoch_ms: float
    segment_bytes: int


@dataclass
class ObservedSession:
    """What one benchmark client saw of its session."""

    label: str
    pace: bool
    video: dict | None = None  # the `session` message's video info (codec, width, height, fps)
    connect_started: float | None = None  # monotonic seconds, before the connect
    start_sent: float | None = None  # monotonic seconds
    chunks: list[ChunkSeen] = field(default_factory=list)
    events: list[tuple[str, float]] = field(default_factory=list)  # (what, monotonic seconds when sent)
    errors: list[dict] = field(default_factory=list)
    refusal: dict | None = None
    closed_reason: str | None = None
    close_code: int | None = None
    chunks_after_close: int = 0
    failure: str | None = None  # the client itself broke (timeout, lost connection)
    media: list[bytes] | None = None  # init segment + media segments, when asked to keep them


async def run_session(
    base_url: str,
    *,
    label: str,
    pace: bool,
    seed: int,
    prompt: str,
    stop_at: float,
    actions: list[tuple[float, dict]] = (),
    keep_media: bool = False,
) -> ObservedSession:
    """One session from connect to `closed`. ``stop_at`` is monotonic seconds; ``actions`` are (seconds after
    `start`, message) controls sent while streaming; ``keep_media`` keeps the bytes for :func:`media_check`."""
    record = ObservedSession(label=label, pace=pace, media=[] if keep_media else None)
    record.connect_started = time.monotonic()
    try:
        async with connect(f"{base_url}/v1/stream", compression=None, max_size=2**26, open_timeout=HELLO_TIMEOUT_S,
                           close_timeout=5) as ws:
            try:
                await _stream(ws, record, pace=pace, seed=seed, prompt=prompt, stop_at=stop_at, actions=actions)
            except ConnectionClosed:
                pass
        record.close_code = ws.close_code  # known once the closing handshake is over
    except InvalidStatus as error:
        record.refusal = {"reason": "http", "status": error.response.status_code}
    except (OSError, TimeoutError, ConnectionClosed) as error:
        record.failure = repr(error)
    return record


async def _stream(ws, record: ObservedSession, *, pace, seed, prompt, stop_at, actions) -> None:
    # `start` at once, not after `session`: a server that is slow to open the stream shows in the time to first media.
    start_sent = time.monotonic()
    try:
        await ws.send(json.dumps({"type": "start", "prompt": prompt, "seed": seed, "options": {"pace": pace}}))
    except ConnectionClosed:
        pass  # refused at once: the refusal is still there to read
    hello = json.loads(await asyncio.wait_for(ws.recv(), HELLO_TIMEOUT_S))
    if hello.get("type") != "session":
        await _read_refusal(ws, record, hello)
        return
    record.start_sent = start_sent
    record.video = hello.get("video")
    init = await asyncio.wait_for(ws.recv(), HELLO_TIMEOUT_S)
    if record.media is not None:
        record.media.append(init)
    controls = asyncio.create_task(_send_controls(ws, record, actions))
    pending: dict | None = None
    try:
        while (left := stop_at - time.monotonic()) > 0:
            try:
                message = await asyncio.wait_for(ws.recv(), left)
            except TimeoutError:
                break
            if isinstance(message, bytes):
                if pending is not None:
                    record.chunks.append(_seen(pending, message))
                    if record.media is not None:
                        record.media.append(message)
                    pending = None
                continue
            parsed = json.loads(message)
            kind = parsed.get("type")
            if kind == "chunk":
                pending = parsed
            elif kind == "error":
                record.errors.append({"code": parsed.get("code"), "message": parsed.get("message")})
            elif kind == "closed":
                record.closed_reason = parsed.get("reason")
                return  # the server ended the session before our stop time
    finally:
        controls.cancel()
    await ws.send(json.dumps({"type": "close"}))
    deadline = time.monotonic() + CLOSE_WAIT_S
    while (left := deadline - time.monotonic()) > 0:
        try:
            message = await asyncio.wait_for(ws.recv(), left)
        except TimeoutError:
            record.failure = "no `closed` within 30 s of `close`"
            return
        if isinstance(message, bytes):
            record.chunks_after_close += 1
        elif json.loads(message).get("type") == "closed":
            record.closed_reason = json.loads(message).get("reason")
            return


async def _read_refusal(ws, record: ObservedSession, first: dict) -> None:
    refusal = {"reason": None, "retry_after_s": None, "error": None}
    message = first
    while True:
        if message.get("type") == "error":
            refusal["error"] = message.get("code")
        elif message.get("type") == "closed":
            refusal["reason"] = message.get("reason")
            refusal["retry_after_s"] = message.get("retry_after_s")
        try:
            message = json.loads(await asyncio.wait_for(ws.recv(), HELLO_TIMEOUT_S))
        except (ConnectionClosed, TimeoutError):
            break
    try:
        await asyncio.wait_for(ws.wait_closed(), HELLO_TIMEOUT_S)
    except TimeoutError:
        pass
    refusal["close_code"] = ws.close_code
    record.refusal = refusal


async def _send_controls(ws, record: ObservedSession, actions) -> None:
    for after_s, message in sorted(actions, key=lambda action: action[0]):
        await asyncio.sleep(max(0.0, record.start_sent + after_s - time.monotonic()))
        record.events.append((message.get("policy", message["type"]), time.monotonic()))
        await ws.send(json.dumps(message))


def _seen(message: dict, segment: bytes) -> ChunkSeen:
    return ChunkSeen(
        index=message["index"], pts=message["pts"], frames=message["frames"], timings=message.get("timings") or {},
        received=time.monotonic(), received_epoch_ms=time.time() * 1000.0, segment_bytes=len(segment),
    )


# --- figures ----------------------------------------------------------------------------------------


def _median(values) -> float | None:
    values = list(values)
    return round(statistics.median(values), 2) if values else None


def _max(values) -> float | None:
    values = list(values)
    return round(max(values), 2) if values else None


def session_stats(record: ObservedSession, default_fps: int = 16) -> dict:
    out: dict = {"label": record.label, "pace": record.pace}
    fps = (record.video or {}).get("fps") or default_fps
    if record.refusal is not None:
        return {**out, "refused": record.refusal}
    if record.failure is not None:
        out["client_failure"] = record.failure
    chunks = record.chunks
    out.update(chunks=len(chunks), frames=sum(c.frames for c in chunks), closed_reason=record.closed_reason,
               close_code=record.close_code, errors=record.errors)
    if not chunks:
        return out
    common_frames = max(Counter(c.frames for c in chunks).most_common(), key=lambda item: (item[1], item[0]))[0]
    chunk_ms = common_frames / fps * 1000.0
    first = chunks[0].received
    gaps = [((b.received - a.received) * 1000.0, b.index) for a, b in zip(chunks, chunks[1:])]
    # A lone opening frame (a split first block) is a preview: playback, as the server counts it, starts
    # with the block's rest, and the still frame's extra time on screen is reported as the opening stall.
    anchor = first
    opening_stall_ms = None
    if len(chunks) > 1 and chunks[0].frames == 1 and chunks[1].pts == 1:
        # Never before the opening frame itself: the rest arriving within a frame's time of it is on time.
        anchor = max(first, chunks[1].received - chunks[1].pts / fps)
        opening_stall_ms = round((anchor - first) * 1000.0, 1)
    late = [((c.received - (anchor + c.pts / fps)) * 1000.0, c.index) for c in chunks]
    over = [(round(gap, 1), index) for gap, index in gaps if gap > GAP_LIMIT_FACTOR * chunk_ms]
    misses = [(round(ms, 1), index) for ms, index in late if ms > LATE_TOLERANCE_MS]
    span_s = chunks[-1].received - first
    timings = {name: [c.timings[name] for c in chunks if name in c.timings]
               for name in ("queued_ms", "denoise_ms", "decode_ms", "encode_ms")}
    out.update(
        time_to_first_media_ms=round((first - record.start_sent) * 1000.0, 1),
        connect_to_first_media_ms=(round((first - record.connect_started) * 1000.0, 1)
                                   if record.connect_started is not None else None),
        opening_stall_ms=opening_stall_ms,
        fps_steady=round(sum(c.frames for c in chunks[1:]) / span_s, 2) if span_s > 0 else None,
        fps_overall=round(out["frames"] / (chunks[-1].received - record.start_sent), 2),
        chunk_duration_ms=round(chunk_ms, 1),
        worst_gap_ms=_max(gap for gap, _ in gaps),
        gaps_over_1_5x=len(over),
        longest_gaps=sorted(over, reverse=True)[:MAX_LISTED],  # [ms, index of the chunk that came late]
        deadline_misses=len(misses),
        worst_late_ms=round(max(ms for ms, _ in late), 1),
        late_chunks=sorted(misses, reverse=True)[:MAX_LISTED],
        # Video received but not yet due at the last arrival (negative: the playback clock is ahead of the media).
        buffer_at_end_s=round((chunks[-1].pts + chunks[-1].frames) / fps - span_s, 3),
        timeline_breaks=sum(1 for a, b in zip(chunks, chunks[1:]) if b.index != a.index + 1 or b.pts != a.pts + a.frames),
        socket_latency_ms_median=_median(c.received_epoch_ms - c.timings["sent_at"] for c in chunks if "sent_at" in c.timings),
        segment_kib_median=round(statistics.median(c.segment_bytes for c in chunks) / 1024, 1),
        chunks_after_close=record.chunks_after_close,
        **{f"server_{name}_median": _median(values) for name, values in timings.items()},
        **{f"server_{name}_max": _max(values) for name, values in timings.items()},
    )
    if record.events:
        out["events"] = event_windows(record, chunk_ms)
    return out


def event_windows(record: ObservedSession, chunk_ms: float) -> list[dict]:
    """Per control sent: the chunk gaps that ended between it and the next control (or the end)."""
    chunks, events = record.chunks, record.events
    windows = []
    for position, (name, sent) in enumerate(events):
        until = events[position + 1][1] if position + 1 < len(events) else float("inf")
        gaps = [(b.received - a.received) * 1000.0 for a, b in zip(chunks, chunks[1:]) if sent <= b.received < until]
        windows.append({
            "event": name,
            "at_s": round(sent - record.start_sent, 2),
            "chunks_after": len(gaps),
            "worst_gap_ms": _max(gaps),
            "gaps_over_1_5x": sum(1 for gap in gaps if gap > GAP_LIMIT_FACTOR * chunk_ms),
        })
    return windows


def media_check(record: ObservedSession) -> dict | None:
    """Decode the kept stream (init + every segment, concatenated, is an MP4 file): the frames the `chunk`
    messages announced must all be there, so the figures above describe real, playable video."""
    if not record.media or not record.chunks:
        return None
    import io

    import av

    announced = sum(c.frames for c in record.chunks)
    try:
        with av.open(io.BytesIO(b"".join(record.media)), format="mp4") as container:
            decoded = sum(1 for _ in container.decode(video=0))
    except av.FFmpegError as error:
        return {"ok": False, "error": str(error)[:200], "frames_announced": announced}
    return {"ok": decoded == announced, "frames_decoded": decoded, "frames_announced": announced}


def case_summary(sessions: list[dict]) -> dict:
    """Across one case's sessions: the worst and the sums a capacity claim rests on."""
    served = [s for s in sessions if "refused" not in s and s.get("chunks")]
    steady = [s["fps_steady"] for s in served if s.get("fps_steady") is not None]
    return {
        "sessions": len(sessions),
        "served": len(served),
        "refused": sum(1 for s in sessions if "refused" in s),
        "fps_steady_min": min(steady) if steady else None,
        "fps_steady_sum": round(sum(steady), 2) if steady else None,
        "time_to_first_media_ms_max": _max(s["time_to_first_media_ms"] for s in served),
        "connect_to_first_media_ms_max": _max(s["connect_to_first_media_ms"] for s in served
                                              if s.get("connect_to_first_media_ms") is not None),
        "worst_gap_ms": _max(s["worst_gap_ms"] for s in served if s.get("worst_gap_ms") is not None),
        "gaps_over_1_5x": sum(s.get("gaps_over_1_5x", 0) for s in served),
        "deadline_misses": sum(s.get("deadline_misses", 0) for s in served),
    }
