"""The running service: the engine, the session table, the encoder threads, and their lifetime.

Built by the app's lifespan from the settings. ``drain`` is the one shutdown path (SIGTERM, lifespan
exit, dead engine): readiness turns 503, every session is closed with ``draining`` so each socket
gets ``closed`` and close code 1001, then the engine releases everything and stops.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from app.media import AudioSpec, EncoderWarmup, warm_up_encoders
from app.memory import FreedMemoryReleaser
from app.registry import SessionRegistry
from app.settings import Settings
from app.telemetry import ServiceMetrics
from engine.api import Engine, Geometry, NotReady


class OpenSocket(Protocol):
    """What the drain needs of a stream socket (``app.transport.websocket.StreamConnection``)."""

    finished: asyncio.Event  # set once the socket is fully done


log = logging.getLogger("arstream.service")

SUPERVISE_INTERVAL_S = 0.25


class Service:
    def __init__(self, settings: Settings, engine: Engine | None = None) -> None:
        self.settings = settings
        self.engine = engine or Engine(settings.engine)
        self.registry = SessionRegistry(self.engine, settings)
        self.metrics = ServiceMetrics()
        # Encoding is CPU-bound and synchronous: it runs here, never on the event loop.
        self.encoder_pool = ThreadPoolExecutor(settings.encode_threads, thread_name_prefix="arstream-encode")
        # Client pictures and frames are decoded on their own thread: a client flooding frames (within its rate)
        # queues behind itself there, never in front of another session's media encoding.
        self.input_pool = ThreadPoolExecutor(1, thread_name_prefix="arstream-input")
        self.connections: set[OpenSocket] = set()
        self.freed_memory = FreedMemoryReleaser()  # ended sockets ask it to return freed memory to the OS
        self.media_warmup: EncoderWarmup | None = None  # set once the encoders were opened at start-up
        # The clock the stream sockets time first media and stream opening with (monotonic seconds; tests give
        # their own, so a timing property is checked without depending on the machine's speed).
        self.clock: Callable[[], float] = time.monotonic
        self.exit_code = 0
        self.on_engine_dead: Callable[[], None] | None = None  # the CLI stops the server with it
        self._supervisor: asyncio.Task | None = None
        self._drain: asyncio.Task | None = None
        self._warmup: asyncio.Task | None = None

    # Readiness is the engine's (Engine.not_ready): the service adds nothing of its own to it.
    def not_ready(self) -> NotReady | None:
        return self.engine.not_ready()

    def not_ready_reason(self) -> str | None:
        """What ``/readyz`` says (None: ready)."""
        reason = self.engine.not_ready()
        return reason.value if reason is not None else None

    @property
    def ready(self) -> bool:
        return self.engine.ready

    @property
    def geometry(self) -> Geometry:
        """The media every session's chunks have (final once the engine is built)."""
        return self.engine.geometry

    def render_metrics(self) -> bytes:
        """``/metrics``: what the service counted and the engine's counters now."""
        return self.metrics.render(self.engine.counters())

    def begin_start(self) -> None:
        """Build and warm the engine in the background: the server answers ``/healthz`` (and ``/readyz`` 503)
        meanwhile. A start that fails asks the process to exit with status 3."""
        self._warmup = asyncio.get_running_loop().create_task(self._start_or_exit(), name="arstream-warmup")

    async def wait_started(self) -> None:
        if self._warmup is not None:
            await asyncio.shield(self._warmup)

    async def _start_or_exit(self) -> None:
        try:
            await self.start()
        except Exception as error:  # the engine keeps it as its start error: not ready, for good
            self.exit_code = 3
            log.error("engine start failed; the server exits", extra={"error": repr(error)})
            if self.on_engine_dead is not None:
                self.on_engine_dead()

    async def start(self) -> None:
        await self.engine.start(before_ready=self._warm_up_media)
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise(), name="arstream-supervisor")
        geometry = self.engine.geometry
        log.info(
            "service ready",
            extra={
                "preset": self.settings.engine.preset,
                "device": self.settings.engine.device,
                "width": geometry.width,
                "height": geometry.height,
                "fps": geometry.fps,
                "capacity": self.engine.capacity,
                "auth": self.settings.auth_enabled,
                "environment": self.settings.environment,
            },
        )

    async def _warm_up_media(self, geometry: Geometry) -> None:
        """Open the media encoders once before the engine reports ready: detecting them (and the first
        stream's open and encode at this size) is otherwise paid by the first socket (``app.media``)."""
        audio = None
        if geometry.audio_sample_rate:
            audio = AudioSpec(sample_rate=geometry.audio_sample_rate, channels=geometry.audio_channels or 2)
        warmup = await asyncio.get_running_loop().run_in_executor(
            self.encoder_pool, warm_up_encoders, geometry.width, geometry.height, geometry.fps,
            geometry.pixel_frames_per_block, audio,
        )
        self.media_warmup = warmup
        log.info(
            "media encoders warmed",
            extra={"video_encoder": warmup.video_encoder, "audio_encoder": warmup.audio_encoder,
                   "probe_ms": round(warmup.probe_s * 1000.0, 1), "stream_ms": round(warmup.stream_s * 1000.0, 1)},
        )

    async def drain(self) -> None:
        """Shut down once, whoever asks first; later callers wait for the same drain."""
        if self._drain is None:
            self._drain = asyncio.get_running_loop().create_task(self._drain_once(), name="arstream-drain")
        await asyncio.shield(self._drain)

    async def _drain_once(self) -> None:
        self.engine.begin_drain()
        if self._warmup is not None and not self._warmup.done():
            with contextlib.suppress(Exception):
                await self._warmup  # the device thread cannot be interrupted mid-build
        log.info("draining", extra={"sessions": len(self.engine.open_sessions()), "sockets": len(self.connections)})
        await self.engine.shutdown("draining")
        waiting = [connection.finished.wait() for connection in list(self.connections)]
        if waiting:
            _, pending = await asyncio.wait(
                [asyncio.ensure_future(w) for w in waiting], timeout=self.settings.drain_timeout_s
            )
            for task in pending:
                task.cancel()
            if pending:
                log.warning("drain timed out", extra={"sockets_left": len(pending)})
        if self._supervisor is not None:
            self._supervisor.cancel()
        self.encoder_pool.shutdown(wait=True, cancel_futures=True)
        self.input_pool.shutdown(wait=True, cancel_futures=True)
        log.info("drained")

    async def _supervise(self) -> None:
        """Forget closed sessions after their retention; when the engine dies, ask the process to exit 1."""
        while True:
            await asyncio.sleep(SUPERVISE_INTERVAL_S)
            try:
                self.registry.sweep()
            except Exception:
                log.exception("session sweep failed")
            if not self.engine.alive and self.exit_code == 0:
                self.exit_code = 1
                log.error("engine dead; the server exits", extra={"error": self.engine.dead_reason})
                if self.on_engine_dead is not None:
                    self.on_engine_dead()
