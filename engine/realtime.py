"""Time as a budget: per-block cost estimates, realtime admission, deadlines, frame rates.

A live session (pacing on) must get one block of device time every
``block_seconds`` (pixel frames per block / fps: 0.75 s for 12 frames at
16 fps), or its viewer stalls. Device work runs on one thread, one block after
another, so the live sessions keep real time together only while

    headroom × Σ cost_i  ≤  block_seconds          (cost_i: device seconds per block of live session i)

A newcomer is admitted only if that still holds with it (its cost is the
engine-wide estimate until it has run). ``headroom`` (``realtime_headroom``, default 1.1) is the
margin for what the sum does not see: a tick delivers its blocks together, so
a block can wait for the others of its tick; the encoder threads and the event
loop share the CPU with the device thread; and the estimate trails a change of
load by a few blocks.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

COST_EMA_WEIGHT = 0.2  # weight of the newest block: follows a change of load within ~5 blocks
RECENT_PEAK_SAMPLES = 8  # observations the recent peak looks back over
FPS_WINDOW_CHUNKS = 8
RETRY_AFTER_MAX_S = 60.0


class RunningCost:
    """Exponential moving average of device seconds per block (or per control of one kind)."""

    def __init__(self, seed_s: float | None = None) -> None:
        self.seconds = seed_s
        self.samples = 0
        self.recent: deque[float] = deque(maxlen=RECENT_PEAK_SAMPLES)

    def observe(self, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:
            return
        self.seconds = seconds if self.seconds is None else (1 - COST_EMA_WEIGHT) * self.seconds + COST_EMA_WEIGHT * seconds
        self.samples += 1
        self.recent.append(seconds)

    @property
    def recent_peak(self) -> float | None:
        """The second longest of the last few observations (a margin against their jitter that one outlier, a
        compile or a stall elsewhere, does not set; the longest while there are fewer than 4; None before any)."""
        if not self.recent:
            return None
        ordered = sorted(self.recent)
        return ordered[-2] if len(ordered) >= 4 else ordered[-1]


@dataclass(frozen=True)
class RealtimePolicy:
    block_seconds: float
    headroom: float
    enabled: bool

    def utilisation(self, live_costs_s: list[float]) -> float:
        """Device time the live sessions need per unit of time (> 1: they all fall behind)."""
        return sum(live_costs_s) / self.block_seconds

    def admits(self, live_costs_s: list[float], newcomer_cost_s: float | None) -> bool:
        """Whether one more live session keeps every live session in real time.

        The first live session is always admitted (it may still be below real
        time: then it is reported so), and so is one whose cost nobody has
        measured yet (no warm-up, nothing run): there is no evidence to refuse on.
        """
        if not self.enabled or not live_costs_s or newcomer_cost_s is None:
            return True
        return self.headroom * (sum(live_costs_s) + newcomer_cost_s) <= self.block_seconds

    def live_capacity(self, live_costs_s: list[float], newcomer_cost_s: float | None) -> int | None:
        """Live sessions the device keeps in real time: those admitted plus as many newcomers of the
        engine-wide cost as :meth:`admits` would still take (at least the always-admitted first).

        Consistent with :meth:`admits` by construction: a newcomer is refused exactly when this
        equals the number of live sessions.
        """
        if newcomer_cost_s is None or newcomer_cost_s <= 0:
            return None
        budget = self.block_seconds / self.headroom
        spare = budget - sum(live_costs_s)
        if spare >= 0:
            return max(1, len(live_costs_s) + math.floor(spare / newcomer_cost_s))
        # Over budget (the always-admitted first, or admission off): how many of them would fit.
        fitting, used = 0, 0.0
        for cost in sorted(live_costs_s):
            used += cost
            if used > budget:
                break
            fitting += 1
        return max(1, fitting)


def clamp_retry_after(wait_s: float, block_seconds: float) -> float:
    """A ``Retry-After`` worth obeying: at least one block, at most a minute."""
    return min(max(wait_s, block_seconds, 1.0), RETRY_AFTER_MAX_S)


class FrameRate:
    """Frames per second over the last few chunks, from their emission times."""

    def __init__(self) -> None:
        self._chunks: deque[tuple[float, int]] = deque(maxlen=FPS_WINDOW_CHUNKS)

    def add(self, at: float, frames: int) -> None:
        self._chunks.append((at, frames))

    def clear(self) -> None:
        self._chunks.clear()

    def per_second(self, now: float | None = None) -> float:
        if len(self._chunks) < 2:
            return 0.0
        first_at = self._chunks[0][0]
        span = (time.monotonic() if now is None else now) - first_at
        frames = sum(frames for _, frames in list(self._chunks)[1:])
        return frames / span if span > 0 else 0.0
