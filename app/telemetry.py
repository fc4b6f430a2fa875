"""Service metrics, exposed through ``prometheus-client`` from a registry owned by the service.

Everything is updated on the event loop. Counts the service makes (chunks sent, refusals, client
messages, errors) live here; the engine's are read from its counters snapshot at scrape time. Label
sets are bounded: session ids never appear (an id is a capability, and the set is unbounded); a
labelled table takes at most ``MAX_LABEL_VALUES`` values, the rest count under ``other``. Per-session
figures are exported as aggregates over the open sessions (min / max / sum).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from engine.api import EngineCounters

LATENCY_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
CONTROL_BUCKETS_S = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.2, 1.5, 2.0, 3.0, 5.0, 10.0)
CONTROL_KINDS = ("prompt_soft", "prompt_recache", "prompt_reset", "reset", "live")
FIRST_CHUNK_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ENCODE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
FPS_WINDOW_S = 10.0
REFUSAL_LOG_RATE_PER_S = 2.0  # refused client inputs logged per second (a burst of REFUSAL_LOG_BURST), the rest counted
REFUSAL_LOG_BURST = 20

refusal_log = logging.getLogger("arstream.refused")
MAX_LABEL_VALUES = 32
OTHER_LABEL = "other"


class ServiceMetrics:
    """What the socket senders and routes count; :meth:`render` adds the engine's counters."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.chunk_latency = Histogram(
            "arstream_chunk_latency_seconds", "Block denoise start to its media segment sent.",
            buckets=LATENCY_BUCKETS_S, registry=self.registry,
        )
        self.time_to_first_chunk = Histogram(
            "arstream_time_to_first_chunk_seconds",
            "Arrival of a socket's start (or, for a session started on attach, the socket's acceptance) to the "
            "session's first media segment sent.",
            buckets=FIRST_CHUNK_BUCKETS_S, registry=self.registry,
        )
        self.stream_open = Histogram(
            "arstream_stream_open_seconds", "Stream socket accepted to its session message and init segment sent.",
            buckets=LATENCY_BUCKETS_S, registry=self.registry,
        )
        self.encode = Histogram(
            "arstream_encode_seconds", "Encoding one chunk into a media segment.",
            buckets=ENCODE_BUCKETS_S, registry=self.registry,
        )
        self.control_latency = Histogram(
            "arstream_control_latency_seconds",
            "A control's arrival (prompt change by policy, reset, live input change) to its first frame on the "
            "viewer's screen, by the server's playback clock.",
            ["kind"], buckets=CONTROL_BUCKETS_S, registry=self.registry,
        )
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
        # code a protocol error code (bounded like every label set).
        self.rejected_messages: dict[tuple[str, str], int] = {}
        self._recent_frames: deque[tuple[float, int]] = deque()
        self.refusals = RefusalLog()
        self._engine: EngineCounters | None = None
        self.registry.register(_Snapshot(self))

    def chunk_sent(self, frames: int, segment_bytes: int, latency_s: float, encode_s: float) -> None:
        self.chunks_sent += 1
        self.frames_sent += frames
        self.bytes_sent += segment_bytes
        self.chunk_latency.observe(latency_s)
        self.encode.observe(encode_s)
        now = time.monotonic()
        self._recent_frames.append((now, frames))
        self._forget_old(now)

    def control_shown(self, kind: str, latency_s: float) -> None:
        self.control_latency.labels(kind if kind in CONTROL_KINDS else OTHER_LABEL).observe(latency_s)

    def count(self, table: dict[str, int], key: str) -> None:
        count_bounded(table, key, OTHER_LABEL)

    def message_rejected(self, via: str, code: str) -> None:
        count_bounded(self.rejected_messages, (via, code), (via, OTHER_LABEL))
        self.refusals.log(via, code)

    def frames_per_second(self) -> float:
        """Frames sent per second over the last ``FPS_WINDOW_S``, all sessions together."""
        now = time.monotonic()
        self._forget_old(now)
        return sum(frames for _, frames in self._recent_frames) / FPS_WINDOW_S

    def _forget_old(self, now: float) -> None:
        while self._recent_frames and now - self._recent_frames[0][0] > FPS_WINDOW_S:
            self._recent_frames.popleft()

    def render(self, engine: EngineCounters) -> bytes:
        """The exposition text (format 0.0.4) of everything, with ``engine`` as the engine's state."""
        self._engine = engine
        try:
            return generate_latest(self.registry)
        finally:
            self._engine = None


class RefusalLog:
    """One log line per refused client input (``via``: rest or socket, ``code``: the protocol's error code), so an
    operator sees them, bounded: a flood logs a few lines a second and says how many it left out."""

    def __init__(self, rate_per_s: float = REFUSAL_LOG_RATE_PER_S, burst: int = REFUSAL_LOG_BURST) -> None:
        self.rate, self.burst = rate_per_s, burst
        self.tokens = float(burst)
        self.updated = time.monotonic()
        self.left_out = 0

    def log(self, via: str, code: str) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens < 1.0:
            self.left_out += 1
            return
        self.tokens -= 1.0
        refusal_log.info("client input refused", extra={"via": via, "code": code, "not_logged_before": self.left_out})
        self.left_out = 0


class _Snapshot:
    """A collector over the service's plain counts and the engine counters given to ``render``."""

    def __init__(self, metrics: ServiceMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m, engine = self.metrics, self.metrics._engine
        if engine is None:
            return
        yield _gauge("arstream_ready", "1 when the engine is warm, alive and not draining.", int(engine.ready))
        yield _gauge("arstream_engine_alive", "0 once the engine's device failed.", int(engine.alive))
        yield _gauge("arstream_draining", "1 while shutting down.", int(engine.draining))
        yield _gauge("arstream_session_capacity", "Sessions the memory holds at once.", engine.capacity)
        by_state = GaugeMetricFamily("arstream_sessions", "Sessions by protocol state.", labels=["state"])
        for state, count in sorted(engine.sessions_by_state.items()):
            by_state.add_metric([state], count)
        yield by_state
        yield _counter("arstream_engine_ticks", "Engine loop ticks that ran work.", engine.ticks)
        yield _counter("arstream_engine_blocks", "AR blocks generated.", engine.blocks)
        yield _gauge("arstream_kv_blocks_total", "KV cache blocks in the pool.", engine.kv_blocks_total)
        yield _gauge("arstream_kv_blocks_in_use", "KV cache blocks held by sessions.", engine.kv_blocks_in_use)
        yield _gauge("arstream_decoder_state_bytes", "Streaming decoder caches held by sessions on the device.",
                     engine.decoder_state_bytes)
        # Pictures and video in (docs/PROTOCOL.md).
        yield _gauge("arstream_encoder_state_bytes", "Streaming encoder states (live input) held by sessions on the device.",
                     engine.encoder_state_bytes)
        yield _gauge("arstream_live_input_sessions", "Open sessions with live video input on.", engine.live_input_sessions)
        inputs = CounterMetricFamily("arstream_input_frames", "Live input frames, by what became of them.",
                                     labels=["outcome"])
        for outcome, count in sorted((engine.input_frames or {}).items()):
            inputs.add_metric([outcome], count)
        yield inputs
        if engine.device_memory_peak_bytes is not None:
            yield _gauge("arstream_device_memory_peak_bytes", "The most device memory torch's allocator has held.",
                         engine.device_memory_peak_bytes)
            limit = engine.device_memory_limit_bytes
            yield _gauge("arstream_device_memory_limit_bytes", "The allocator's cap under gpu_memory_gib (NaN: none).",
                         limit if limit is not None else float("nan"))
        depths = engine.queue_depths
        yield _gauge("arstream_queue_depth_total", "Chunks waiting for their consumer, all sessions.", sum(depths))
        yield _gauge("arstream_queue_depth_max", "Chunks waiting for their consumer, worst session.",
                     max(depths, default=0))
        # Realtime admission (docs/ENGINE.md).
        yield _gauge("arstream_realtime_admission", "1 when live sessions are admitted only while all keep real time.",
                     int(engine.realtime_admission))
        yield _gauge("arstream_live_session_capacity",
                     "Live sessions the device keeps in real time at the measured block cost (NaN: not measured).",
                     engine.live_capacity if engine.live_capacity is not None else float("nan"))
        yield _gauge("arstream_block_cost_seconds", "Running estimate of device time per block (NaN: not measured).",
                     engine.block_cost_ms / 1000.0 if engine.block_cost_ms is not None else float("nan"))
        yield _gauge("arstream_realtime_utilisation",
                     "Device time the running live sessions need per second (above 1 they fall behind).",
                     engine.realtime_utilisation)
        yield _gauge("arstream_live_sessions", "Open sessions with pacing on.", engine.live_sessions)
        yield _gauge("arstream_live_sessions_below_realtime", "Running live sessions the device cannot keep in real time.",
                     engine.live_sessions_below_realtime)
        yield _counter("arstream_deadline_misses", "Live chunks emitted later than their playback time.",
                       engine.deadline_misses)
        yield _counter("arstream_realtime_refusals", "Live sessions refused because the device had no time left.",
                       engine.refused_realtime)
        misses = engine.session_deadline_misses
        yield _gauge("arstream_session_deadline_misses_max", "Deadline misses of the worst open live session.",
                     max(misses, default=0))
        rates = GaugeMetricFamily("arstream_session_frames_per_second",
                                  "Frames per second of the active sessions (min, max, mean; no ids).", labels=["stat"])
        fps = engine.session_frames_per_second
        rates.add_metric(["min"], min(fps, default=0.0))
        rates.add_metric(["max"], max(fps, default=0.0))
        rates.add_metric(["mean"], sum(fps) / len(fps) if fps else 0.0)
        yield rates
        # What the service itself counted.
        yield _gauge("arstream_frames_per_second", f"Frames sent per second over the last {FPS_WINDOW_S:g} s.",
                     m.frames_per_second())
        yield _counter("arstream_chunks_sent", "Chunks sent to clients.", m.chunks_sent)
        yield _counter("arstream_frames_sent", "Video frames sent to clients.", m.frames_sent)
        yield _counter("arstream_media_bytes_sent", "Media segment bytes sent.", m.bytes_sent)
        yield _gauge("arstream_websockets_open", "Attached stream sockets.", m.connections_open)
        yield _counter("arstream_websockets", "Stream sockets accepted.", m.connections_total)
        yield labelled_counter("arstream_websockets_refused", "Stream sockets refused, by reason.", ("reason",),
                               m.refused)
        yield labelled_counter("arstream_client_messages", "Client control messages, by type.", ("type",),
                               m.client_messages)
        yield labelled_counter("arstream_errors", "Error messages sent, by protocol code.", ("code",), m.errors)
        yield _counter("arstream_websockets_stalled", "Stream sockets detached because their client stopped reading.",
                       m.stalled_sockets)
        yield labelled_counter("arstream_client_messages_rejected",
                               "Client messages and requests refused for their input, before the engine.",
                               ("via", "code"), m.rejected_messages)


def _gauge(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, value=value)


def _counter(name: str, help_text: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, help_text, value=value)


def count_bounded(table: dict, key, overflow) -> None:
    """One more for ``key``; a key new to a table that already holds ``MAX_LABEL_VALUES`` counts under ``overflow``."""
    if key not in table and len(table) >= MAX_LABEL_VALUES:
        key = overflow
    table[key] = table.get(key, 0) + 1


def labelled_counter(name: str, help_text: str, labels: tuple[str, ...], table: dict) -> CounterMetricFamily:
    """A counter family from ``table``: keys are label values (a tuple of them for several labels)."""
    family = CounterMetricFamily(name, help_text, labels=list(labels))
    for key, value in sorted(table.items()):
        family.add_metric(list(key) if isinstance(key, tuple) else [key], value)
    return family
