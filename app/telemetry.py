"""Service metrics in the Prometheus text exposition format (0.0.4), written by hand.

No client library: the set is small, everything is updated on the event loop (no locks), and the
format is a few lines per metric. Session ids never appear as labels: an id is a capability.
"""

from __future__ import annotations

import bisect
import math
import time
from collections import deque
from collections.abc import Sequence

from engine.api import EngineCounters

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
FIRST_CHUNK_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ENCODE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
FPS_WINDOW_S = 10.0


class Histogram:
    """Cumulative-bucket histogram, as Prometheus expects."""

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        self.name = name
        self.help_text = help_text
        self.buckets = tuple(sorted(buckets))
        self.counts = [0] * (len(self.buckets) + 1)  # the last one is +Inf
        self.total = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        if math.isnan(value):
            return
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        cumulative = 0
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            lines.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {_number(self.total)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


class ServiceMetrics:
    """What the socket senders and routes count; :meth:`render` adds the engine's counters."""

    def __init__(self) -> None:
        self.chunk_latency = Histogram(
            "arstream_chunk_latency_seconds", "Block denoise start to its media segment sent.", LATENCY_BUCKETS_S
        )
        self.time_to_first_chunk = Histogram(
            "arstream_time_to_first_chunk_seconds", "Start accepted to the first media segment sent.",
            FIRST_CHUNK_BUCKETS_S,
        )
        self.encode = Histogram("arstream_encode_seconds", "Encoding one block into a media segment.", ENCODE_BUCKETS_S)
        self.chunks_sent = 0
        self.frames_sent = 0
        self.bytes_sent = 0
        self.connections_open = 0
        self.connections_total = 0
        self.stalled_sockets = 0  # detached because a media send stayed blocked past the stall bound
        self.refused: dict[str, int] = {}  # reason -> count
        self.client_messages: dict[str, int] = {}  # type -> count
        self.errors: dict[str, int] = {}  # protocol code -> count
        # Client input refused before it reached the engine: (via, code) -> count; via is socket or rest,
        # code a protocol error code, so the label set stays bounded.
        self.rejected_messages: dict[tuple[str, str], int] = {}
        self._recent_frames: deque[tuple[float, int]] = deque()

    def chunk_sent(self, frames: int, segment_bytes: int, latency_s: float, encode_s: float) -> None:
        self.chunks_sent += 1
        self.frames_sent += frames
        self.bytes_sent += segment_bytes
        self.chunk_latency.observe(latency_s)
        self.encode.observe(encode_s)
        now = time.monotonic()
        self._recent_frames.append((now, frames))
        self._forget_old(now)

    def count(self, table: dict, key) -> None:
        table[key] = table.get(key, 0) + 1

    def message_rejected(self, via: str, code: str) -> None:
        self.count(self.rejected_messages, (via, code))

    def frames_per_second(self) -> float:
        """Frames sent per second over the last ``FPS_WINDOW_S``, all sessions together."""
        now = time.monotonic()
        self._forget_old(now)
        return sum(frames for _, frames in self._recent_frames) / FPS_WINDOW_S

    def _forget_old(self, now: float) -> None:
        while self._recent_frames and now - self._recent_frames[0][0] > FPS_WINDOW_S:
            self._recent_frames.popleft()

    def render(self, engine: EngineCounters, *, draining: bool) -> str:
        lines: list[str] = []
        gauge = _family(lines, "gauge")
        counter = _family(lines, "counter")

        gauge("arstream_ready", "1 when the engine is warm, alive and not draining.",
              [("", int(engine.ready and engine.alive and not draining))])
        gauge("arstream_engine_alive", "0 once the engine's device failed.", [("", int(engine.alive))])
        gauge("arstream_draining", "1 while shutting down.", [("", int(draining or engine.draining))])
        gauge("arstream_session_capacity", "Sessions the engine admits at once.", [("", engine.capacity)])
        gauge("arstream_sessions", "Sessions by protocol state.",
              [(f'state="{state}"', count) for state, count in sorted(engine.sessions_by_state.items())] or [("", 0)])
        counter("arstream_engine_ticks_total", "Engine loop ticks that ran work.", [("", engine.ticks)])
        counter("arstream_engine_blocks_total", "AR blocks generated.", [("", engine.blocks)])
        gauge("arstream_kv_blocks_total", "KV cache blocks in the pool.", [("", engine.kv_blocks_total)])
        gauge("arstream_kv_blocks_in_use", "KV cache blocks held by sessions.", [("", engine.kv_blocks_in_use)])
        depths = list(engine.queue_depths.values())
        gauge("arstream_queue_depth_total", "Chunks waiting for their consumer, all sessions.", [("", sum(depths))])
        gauge("arstream_queue_depth_max", "Chunks waiting for their consumer, worst session.",
              [("", max(depths, default=0))])
        gauge("arstream_frames_per_second", f"Frames sent per second over the last {FPS_WINDOW_S:g} s.",
              [("", self.frames_per_second())])
        counter("arstream_chunks_sent_total", "Chunks sent to clients.", [("", self.chunks_sent)])
        counter("arstream_frames_sent_total", "Video frames sent to clients.", [("", self.frames_sent)])
        counter("arstream_media_bytes_sent_total", "Media segment bytes sent.", [("", self.bytes_sent)])
        gauge("arstream_websockets_open", "Attached stream sockets.", [("", self.connections_open)])
        counter("arstream_websockets_total", "Stream sockets accepted.", [("", self.connections_total)])
        counter("arstream_websockets_stalled_total", "Stream sockets detached because their client stopped reading.",
                [("", self.stalled_sockets)])
        counter("arstream_websockets_refused_total", "Stream sockets refused, by reason.",
                _labelled("reason", self.refused))
        counter("arstream_client_messages_total", "Client control messages, by type.",
                _labelled("type", self.client_messages))
        counter("arstream_errors_total", "Error messages sent, by protocol code.", _labelled("code", self.errors))
        counter("arstream_client_messages_rejected_total", "Client messages and requests refused as invalid.",
                [(f'via="{via}",code="{code}"', value) for (via, code), value in sorted(self.rejected_messages.items())]
                or [("", 0)])
        for histogram in (self.chunk_latency, self.time_to_first_chunk, self.encode):
            lines.extend(histogram.render())
        return "\n".join(lines) + "\n"


def _labelled(label: str, table: dict[str, int]) -> list[tuple[str, float]]:
    return [(f'{label}="{key}"', value) for key, value in sorted(table.items())] or [("", 0)]


def _family(lines: list[str], kind: str):
    def write(name: str, help_text: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lines.append(f"{name}{{{labels}}} {_number(value)}" if labels else f"{name} {_number(value)}")

    return write


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))
