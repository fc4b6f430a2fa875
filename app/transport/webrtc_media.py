"""A WebRTC peer's media: the session's frames and sound as tracks sent at their presentation times, and the
viewer's camera as the session's live input.

The engine releases a paced session's media shortly before it plays (its lead lives on the server,
docs/ENGINE.md). Over WebRTC the server also holds the *pacing*: each frame is handed to the peer's encoder at
the moment it should show (:class:`Timeline`), so the browser's jitter buffer needs only a few frames and a
control is never stuck behind media buffered in the client. A frame that comes later than its time is sent at
once and the timeline moves on by the difference (the viewer's stall), as a player's clock would.

aiortc encodes what the tracks return (H.264 or VP8 for video, Opus for audio); nothing here knows about
sessions or the engine: the peer (``app/transport/webrtc.py``) pushes each chunk's frames and audio in.
"""

from __future__ import annotations

import asyncio
import fractions
import time
from collections import deque

import av
import numpy as np
from aiortc import MediaStreamTrack
from aiortc.mediastreams import MediaStreamError

from app.media_input import FrameSize, fit_video_frame

VIDEO_CLOCK_RATE = 90_000  # RTP's video clock
VIDEO_TIME_BASE = fractions.Fraction(1, VIDEO_CLOCK_RATE)
AUDIO_FRAME_SAMPLES = 960  # 20 ms at 48 kHz: Opus's frame
MAX_AUDIO_WAIT_S = 0.2  # audio trails video (its decoder's lookahead): wait this long for it, then send silence
MAX_QUEUED_FRAMES = 48  # two merged chunks: the engine releases media just in time, a peer never holds more


class Timeline:
    """The viewer's clock for one peer: frame ``pts`` shows at ``anchor + pts / fps``.

    The first frame sets the anchor: it shows as it arrives (it plays then on the engine's playback clock, and every
    later piece is released the peer's margin, ``margin_s``, before its time, so the peer needs no delay of its own
    for jitter: 0.05 s here was 0.05 s more control-to-screen, docs/BENCHMARKS.md). A frame that comes after its
    time moves the clock on (a stall). Behind the engine's clock after a stall (every frame of the last
    ``CATCH_UP_WINDOW_S`` waited longer than the margin), the peer catches up by sending frames a little sooner
    (``CATCH_UP_RATE``), so a stall does not add to every later control's time to the screen. Where the engine
    restarts its clock (a resume, an attach: the chunk's ``starts_clock``) the peer restarts its own the same way,
    and the gap before is no stall (``restarts`` counts them).
    """

    CATCH_UP_WINDOW_S = 2.0
    CATCH_UP_RATE = 0.1  # at most this part of a frame's time taken off each frame: playback 1.1x while behind
    CATCH_UP_TOLERANCE_S = 0.02

    def __init__(self, fps: int, margin_s: float = 0.0, clock=time.monotonic) -> None:
        self.fps = fps
        self.margin_s = margin_s
        self.clock = clock
        self.anchor: float | None = None
        self.stalls = 0  # frames that came after their time
        self.restarts = 0  # the clock restarted with the engine's (after a pause, an attach)
        self.stalled_s = 0.0  # how far the clock moved on for them
        self.caught_up_s = 0.0  # how far it was brought back since
        self.min_slack_s: float | None = None  # the least time a frame waited for its time (the margin left)
        # Since the last stall, each frame's arrival less its place on the timeline: a frame's slack is the anchor
        # less this, so the window's least slack follows the anchor as it moves.
        self._arrival_offsets: deque[float] = deque(maxlen=max(1, round(self.CATCH_UP_WINDOW_S * fps)))

    def show_time(self, pts: int, arrived: float, restart: bool = False) -> float:
        if self.anchor is None or restart:
            self.restarts += self.anchor is not None
            self.anchor = arrived - pts / self.fps
            self._arrival_offsets.clear()
            return arrived
        due = self.anchor + pts / self.fps
        if arrived > due:  # late: it shows on arrival, and so does everything after it, that much later
            self.stalls += 1
            self.stalled_s += arrived - due
            self.anchor += arrived - due
            self._arrival_offsets.clear()
            return arrived
        slack = due - arrived
        self.min_slack_s = slack if self.min_slack_s is None else min(self.min_slack_s, slack)
        self._arrival_offsets.append(arrived - pts / self.fps)
        if len(self._arrival_offsets) == self._arrival_offsets.maxlen:
            # Behind by what it stalled and has not made up, as far as the pieces' slack shows it.
            least_slack = self.anchor - max(self._arrival_offsets)
            behind = min(least_slack - self.margin_s, self.stalled_s - self.caught_up_s)
            if behind > self.CATCH_UP_TOLERANCE_S:
                step = min(behind, self.CATCH_UP_RATE / self.fps)
                self.anchor -= step
                self.caught_up_s += step
                due -= step
        return due

    def sample_time(self, sample: int, sample_rate: int) -> float | None:
        return None if self.anchor is None else self.anchor + sample / sample_rate


class SessionVideoTrack(MediaStreamTrack):
    """The session's frames, each returned to the encoder at its presentation time."""

    kind = "video"

    def __init__(self, timeline: Timeline) -> None:
        super().__init__()
        self.timeline = timeline
        self._frames: asyncio.Queue[tuple[int, np.ndarray, float, bool]] = asyncio.Queue(MAX_QUEUED_FRAMES)
        self.frames_sent = 0

    def push(self, pts: int, frames: np.ndarray, starts_clock: bool = False) -> None:
        """A chunk's frames (uint8 ``[F, H, W, 3]``, the first at ``pts``; ``starts_clock``: the chunk restarts the
        engine's playback clock); the oldest waiting ones make room."""
        arrived = self.timeline.clock()
        for offset, rgb in enumerate(frames):
            if self._frames.full():
                self._frames.get_nowait()
            self._frames.put_nowait((pts + offset, rgb, arrived, starts_clock and offset == 0))

    async def recv(self) -> av.VideoFrame:
        if self.readyState != "live":
            raise MediaStreamError
        pts, rgb, arrived, restart = await self._frames.get()
        wait = self.timeline.show_time(pts, arrived, restart) - self.timeline.clock()
        if wait > 0:
            await asyncio.sleep(wait)
        frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
        frame.pts = pts * VIDEO_CLOCK_RATE // self.timeline.fps
        frame.time_base = VIDEO_TIME_BASE
        self.frames_sent += 1
        return frame


class SessionAudioTrack(MediaStreamTrack):
    """The session's sound in 20 ms frames at their presentation times (on the video's timeline); silence where
    none has come in time, so the track's clock never stops."""

    kind = "audio"

    def __init__(self, timeline: Timeline, sample_rate: int, channels: int) -> None:
        super().__init__()
        self.timeline = timeline
        self.sample_rate = sample_rate
        self.channels = channels
        self._pcm: deque[np.ndarray] = deque()  # float32 [channels, n], contiguous from timeline sample self._next
        self._buffered = 0
        self._next = 0  # the timeline sample of the next frame sent
        self._started = False
        self._arrived = asyncio.Event()

    def push(self, start: int, pcm: np.ndarray) -> None:
        """A chunk's audio (float32 ``[channels, n]``, its first sample at timeline sample ``start``)."""
        if not self._started:
            self._next, self._started = start, True
        end = self._next + self._buffered
        if start > end:  # a gap (nothing lost here: the engine's audio is contiguous) is silence
            self._append(np.zeros((self.channels, start - end), np.float32))
        elif start < end:
            pcm = pcm[:, end - start:]
        if pcm.shape[1]:
            self._append(pcm)
        self._arrived.set()

    def _append(self, pcm: np.ndarray) -> None:
        self._pcm.append(pcm)
        self._buffered += pcm.shape[1]
        limit = 2 * self.sample_rate  # bounded: two seconds at most wait here
        while self._buffered - self._pcm[0].shape[1] >= limit:
            dropped = self._pcm.popleft()
            self._buffered -= dropped.shape[1]
            self._next += dropped.shape[1]

    async def recv(self) -> av.AudioFrame:
        if self.readyState != "live":
            raise MediaStreamError
        while not self._started or self.timeline.anchor is None:
            self._arrived.clear()
            await self._arrived.wait()
        start = self._next
        due = self.timeline.sample_time(start, self.sample_rate)
        while self._buffered < AUDIO_FRAME_SAMPLES and self.timeline.clock() < due + MAX_AUDIO_WAIT_S:
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), max(0.0, due + MAX_AUDIO_WAIT_S - self.timeline.clock()))
            except TimeoutError:
                break
        pcm = self._take(AUDIO_FRAME_SAMPLES)
        wait = due - self.timeline.clock()
        if wait > 0:
            await asyncio.sleep(wait)
        samples = (np.clip(pcm.T, -1.0, 1.0) * 32767.0).round().astype(np.int16).reshape(1, -1)
        frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="stereo" if self.channels == 2 else "mono")
        frame.sample_rate = self.sample_rate
        frame.pts = start
        frame.time_base = fractions.Fraction(1, self.sample_rate)
        return frame

    def _take(self, count: int) -> np.ndarray:
        """The next ``count`` samples (silence for what has not come)."""
        parts, needed = [], count
        while needed and self._pcm:
            head = self._pcm[0]
            part = head[:, :needed]
            parts.append(part)
            needed -= part.shape[1]
            if part.shape[1] == head.shape[1]:
                self._pcm.popleft()
            else:
                self._pcm[0] = head[:, part.shape[1]:]
        if needed:
            parts.append(np.zeros((self.channels, needed), np.float32))
        taken = np.concatenate(parts, axis=1)
        self._buffered -= count - needed
        self._next += count
        return taken


async def read_camera(track: MediaStreamTrack, size: FrameSize, *, admit, push, fit_in, max_pixels: int) -> None:
    """The viewer's camera as live input: each frame within the session's rate (``admit()``: its number, or None
    to drop it unread, counted by the engine) is scaled and cropped to the session's size (``fit_in``: the
    service's input thread) and handed on with its number (``push``). Ends with the track."""
    loop = asyncio.get_running_loop()
    while True:
        try:
            frame = await track.recv()
        except MediaStreamError:
            return
        number = admit()
        if number is None:
            continue
        if frame.width * frame.height > max_pixels:
            continue  # over the live frame bound: not decoded further (a real camera never sends one)
        rgb = await loop.run_in_executor(fit_in, fit_video_frame, frame, size)
        push(rgb, number)
