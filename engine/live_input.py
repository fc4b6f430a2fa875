"""A session's live video input: its strength, the frames waiting for blocks, and what came and went.

Owned by the engine core (one per :class:`~engine.session_record.SessionRecord`, on the event loop). Frames
arrive at the client's pace and leave at the session's; both ends are bounded so neither can grow without
limit or hold up anyone else::

    client frames ──rate (token bucket)──▶ buffer (capacity, oldest dropped) ──offer──▶ next block (takes 9 or 12)
                     over the rate: dropped before they are decoded       stale: dropped at the offer

A block takes the oldest frames it needs, but never from behind a standing queue: a block offered frames finds
at most its own frames and ``jitter_frames`` more waiting (config ``live_input_jitter_frames``, 1: one frame of
arrival jitter, so a frame that comes just before a block instead of just after it is not dropped), the older
ones dropped as stale. Frames arrive as fast as blocks take them, so whatever waited beyond that when a block
began (the frames that came while the blocks made before live input played out) would wait for every block after
it, each frame on screen that much later, for the rest of the session (twenty-second session: 3 frames, 0.19 s of
the fast 1.3B's camera-to-screen on an H100).

Frames are numbered so that the frames it took, and only those,
leave the buffer, even when newer ones arrived (and older ones were dropped) while it was being planned.
Offered frames that a full buffer pushes out before the block's take is known are not counted yet: the
block has its copies, so the ones it took count as used, the rest as dropped (on a GPU the dispatch holds
the host for much of a block, while a full second of frames can arrive).
The engine never waits for a frame: a block that finds too few repeats the last one it has (the runner's).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from engine.plan import LiveFrames


@dataclass
class InputCounters:
    """What a session's input did over its life (live on and off, resets included)."""

    frames_received: int = 0  # binary frames that reached the engine (admitted or not)
    frames_used: int = 0  # taken by a block
    frames_dropped: int = 0  # over the rate, or pushed out of a full buffer
    frames_invalid: int = 0  # could not be read (the client got `invalid_media` / `media_too_large`)
    context_frames: int = 0  # latent frames of the image or clip the content last started from

    def add(self, outcome: str, frames: int = 1) -> None:
        """``frames`` more of ``outcome``: received, used, dropped or invalid."""
        name = f"frames_{outcome}"
        setattr(self, name, getattr(self, name) + frames)


class LiveInput:
    """Live input while it is on: ``first_step`` (the strength on the model's schedule), the waiting frames."""

    def __init__(self, *, strength: float, first_step: int, capacity: int, rate_per_s: float, burst: int,
                 jitter_frames: int = 1) -> None:
        if capacity < 1 or rate_per_s <= 0 or burst < 1 or jitter_frames < 0:
            raise ValueError("capacity, rate and burst must be positive, jitter_frames not negative")
        self.jitter_frames = jitter_frames
        self.strength = strength
        self.first_step = first_step
        self.capacity = capacity
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._tokens = float(burst)
        self._refilled_at: float | None = None
        self._waiting: deque[tuple[int, int | None, np.ndarray]] = deque()  # (seq, the client's number, frame)
        self._next_seq = 0
        self._offered_until = 0  # frames numbered below this were offered to a block whose take is not known yet
        self._pushed_out_offered: list[int] = []  # ... of them, the ones a full buffer pushed out meanwhile
        self._stale = 0  # frames dropped from behind a standing queue, not yet counted (consume reports them)

    def admit(self, now: float) -> bool:
        """Whether a frame arriving at ``now`` (monotonic seconds) is within the rate; takes a token if so."""
        if self._refilled_at is not None:
            self._tokens = min(float(self.burst), self._tokens + (now - self._refilled_at) * self.rate_per_s)
        self._refilled_at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def push(self, frame: np.ndarray, number: int | None = None) -> int:
        """Add a decoded frame (``number``: its place among the live frames the session received, which a chunk
        made from it names); returns how many old frames were dropped to make room (0 or 1; an offered frame
        pushed out is counted by :meth:`consume`)."""
        dropped = 0
        if len(self._waiting) >= self.capacity:
            seq, _, _ = self._waiting.popleft()
            if seq < self._offered_until and len(self._pushed_out_offered) < self.capacity:
                self._pushed_out_offered.append(seq)
            else:
                dropped = 1
        self._waiting.append((self._next_seq, number, frame))
        self._next_seq += 1
        return dropped

    def offer(self, limit: int) -> LiveFrames:
        """Up to ``limit`` of the oldest waiting frames, for the next block; only stale frames leave the buffer
        (more than ``limit`` + ``jitter_frames`` waiting, none offered to a block whose take is not known yet)."""
        if not self._waiting or self._waiting[0][0] >= self._offered_until:
            while len(self._waiting) > limit + self.jitter_frames:
                self._waiting.popleft()
                self._stale += 1
        offered = list(self._waiting)[:limit]
        first_seq = self._waiting[0][0] if self._waiting else self._next_seq
        self._offered_until = max(self._offered_until, first_seq + len(offered))
        return LiveFrames(first_step=self.first_step, frames=tuple(frame for _, _, frame in offered),
                          first_seq=first_seq, numbers=tuple(number for _, number, _ in offered))

    def consume(self, first_seq: int, taken: int) -> tuple[int, int]:
        """The block took the ``taken`` frames numbered from ``first_seq``: those still waiting leave. Returns
        (used, dropped): the frames it took, waiting or pushed out since the offer, and the offered frames
        pushed out that it did not take, with the stale frames dropped since the last call."""
        end = first_seq + taken
        used = sum(first_seq <= seq < end for seq in self._pushed_out_offered)
        dropped = len(self._pushed_out_offered) - used + self._stale
        self._stale = 0
        self._pushed_out_offered.clear()
        self._offered_until = end
        while self._waiting and self._waiting[0][0] < end:
            if self._waiting[0][0] >= first_seq:
                used += 1
            self._waiting.popleft()
        return used, dropped

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def nbytes(self) -> int:
        return sum(frame.nbytes for _, _, frame in self._waiting)
