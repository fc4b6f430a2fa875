"""The front end's ``/metrics``: its own counts, and each worker's capacity labelled ``worker="cuda:0"``.

The ``worker`` label takes one value per device the front end was started with (bounded by the
command line); everything else follows ``app/telemetry.py``: no session ids, labelled tables bounded.
Each worker's full engine metrics stay on the worker (the front end does not merge them).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from app.telemetry import OTHER_LABEL, RefusalLog, count_bounded, labelled_counter


@dataclass(frozen=True)
class WorkerView:
    """One worker as ``/metrics`` shows it (gauges are 0 while it is down)."""

    name: str
    up: bool  # its process listens (the pool lists it)
    ready: bool
    admitting: bool
    generation: int
    restarts: int
    lost: int
    live_sessions: int
    open_sessions: int
    live_headroom: int | None
    slots_free: int
    utilisation: float
    placed: int


@dataclass(frozen=True)
class FrontEndView:
    ready: bool
    draining: bool
    tracked_sessions: int
    workers: list[WorkerView]


class FrontEndMetrics:
    """What the front end counts (updated on the event loop); :meth:`render` adds a view of the workers."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.connections_open = 0
        self.connections_total = 0
        self.refused: dict[str, int] = {}  # reason -> count (the same reasons as a single server's)
        self.rejected_messages: dict[tuple[str, str], int] = {}
        self.placement_refusals = 0  # new sessions every ready worker refused
        self.failed_by_worker_loss = 0  # relayed sockets ended `failed` because their worker was lost
        self.media_bytes_relayed = 0
        self._view: FrontEndView | None = None
        self.refusals = RefusalLog()
        self.registry.register(_Collector(self))

    # The same counting interface as app.telemetry.ServiceMetrics, so the shared socket checks and
    # middlewares (origin, token, request targets, body size) count here too.
    def count(self, table: dict[str, int], key: str) -> None:
        count_bounded(table, key, OTHER_LABEL)

    def message_rejected(self, via: str, code: str) -> None:
        count_bounded(self.rejected_messages, (via, code), (via, OTHER_LABEL))
        self.refusals.log(via, code)

    def render(self, view: FrontEndView) -> bytes:
        self._view = view
        try:
            return generate_latest(self.registry)
        finally:
            self._view = None


class _Collector:
    def __init__(self, metrics: FrontEndMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m, view = self.metrics, self.metrics._view
        if view is None:
            return
        yield GaugeMetricFamily("arstream_ready", "1 while a worker is ready and the front end is not draining.",
                                value=int(view.ready))
        yield GaugeMetricFamily("arstream_draining", "1 while shutting down.", value=int(view.draining))
        yield GaugeMetricFamily("arstream_workers", "Engine workers the front end runs.", value=len(view.workers))
        yield GaugeMetricFamily("arstream_tracked_sessions", "Session ids the front end routes to a worker.",
                                value=view.tracked_sessions)
        per_worker = [
            ("arstream_worker_up", "1 while the worker's process listens.", lambda w: int(w.up), GaugeMetricFamily),
            ("arstream_worker_ready", "1 while the worker's engine is warm, alive and not draining.",
             lambda w: int(w.ready), GaugeMetricFamily),
            ("arstream_worker_admitting", "1 while the worker would admit a new live session.",
             lambda w: int(w.admitting), GaugeMetricFamily),
            ("arstream_worker_generation", "The worker's start count (+1 on every restart).",
             lambda w: w.generation, GaugeMetricFamily),
            ("arstream_worker_live_sessions", "Open paced sessions on the worker.", lambda w: w.live_sessions,
             GaugeMetricFamily),
            ("arstream_worker_open_sessions", "Open sessions on the worker.", lambda w: w.open_sessions,
             GaugeMetricFamily),
            ("arstream_worker_live_headroom",
             "More live sessions the worker keeps in real time (NaN: nothing measured yet).",
             lambda w: w.live_headroom if w.live_headroom is not None else math.nan, GaugeMetricFamily),
            ("arstream_worker_slots_free", "Memory slots no open session holds.", lambda w: w.slots_free,
             GaugeMetricFamily),
            ("arstream_worker_utilisation", "Device time the worker's running live sessions need per second.",
             lambda w: w.utilisation, GaugeMetricFamily),
            ("arstream_worker_restarts", "Times the worker was started again.", lambda w: w.restarts,
             CounterMetricFamily),
            ("arstream_worker_lost", "Times the worker was lost while serving.", lambda w: w.lost, CounterMetricFamily),
            ("arstream_worker_sessions_placed", "New sessions placed on the worker.", lambda w: w.placed,
             CounterMetricFamily),
        ]
        for name, help_text, value, kind in per_worker:
            family = kind(name, help_text, labels=["worker"])
            for worker in view.workers:
                family.add_metric([worker.name], value(worker))
            yield family
        yield CounterMetricFamily("arstream_placement_refusals", "New sessions every ready worker refused.",
                                  value=m.placement_refusals)
        yield CounterMetricFamily("arstream_sessions_failed_by_worker_loss",
                                  "Relayed sockets ended failed because their worker was lost.",
                                  value=m.failed_by_worker_loss)
        yield CounterMetricFamily("arstream_media_bytes_relayed", "Binary bytes relayed from workers to clients.",
                                  value=m.media_bytes_relayed)
        yield GaugeMetricFamily("arstream_websockets_open", "Relayed stream sockets.", value=m.connections_open)
        yield CounterMetricFamily("arstream_websockets", "Stream sockets relayed.", value=m.connections_total)
        yield labelled_counter("arstream_websockets_refused", "Stream sockets refused, by reason.", ("reason",),
                               m.refused)
        yield labelled_counter("arstream_client_messages_rejected",
                               "Requests refused for their input by the front end itself.", ("via", "code"),
                               m.rejected_messages)
