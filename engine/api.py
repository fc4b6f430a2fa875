"""The engine's public API — the one surface the web service and the CLI call.

A thin async facade over :class:`~engine.core.EngineCore`: it checks inputs,
submits controls (applied at the next tick) and hands out immutable
:class:`~engine.status.SessionStatus` snapshots. Nothing here waits on the
device. Capacity shortfall is a value (:class:`CapacityFull`); refused
requests raise an :class:`EngineError` whose ``code`` is the protocol's.

Typical use::

    engine = Engine(EngineConfig())
    await engine.start()                      # build, warm up, start the loop
    session = engine.create_session(seed=1)   # a SessionStatus, or CapacityFull
    engine.start_session(session.session_id, "a red fox")
    async for chunk in engine.chunks(session.session_id):
        ...                                   # uint8 frames [F, H, W, 3]
    await engine.shutdown()
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from engine.bundle import ModelBundle
from engine.config import EngineConfig
from engine.controls import Close, Detach, Pause, Reset, Resume, SetPrompt, Start
from engine.core import EngineCore
from engine.errors import CapacityFull, EngineUnavailable, InputUnsupported, InvalidRequest, UnknownSession
from engine.loop import EngineLoop
from engine.plan import InputContext, StepPlan
from engine.prompts import MAX_PROMPT_CHARS, check_prompt
from engine.runner import Runner
from engine.session import Chunk, ControlMark
from engine.startup import build_engine, geometry_for
from engine.status import AdmissionOutlook, EngineCounters, Geometry, NotReady, SessionStatus

log = logging.getLogger("arstream.engine")

PROMPT_POLICIES = ("soft", "recache", "reset")
MAX_SEED = 2**63 - 1

__all__ = ["Engine", "EngineCounters", "Geometry", "NotReady", "SessionStatus", "MAX_PROMPT_CHARS", "MAX_SEED"]


class Engine:
    """Build, serve and drain one engine core."""

    def __init__(self, config: EngineConfig, *, bundle: ModelBundle | None = None) -> None:
        self.config = config
        self._bundle = bundle
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="arstream-device")
        self._core: EngineCore | None = None
        self._loop: EngineLoop | None = None
        self._started = False
        self.draining = False  # the one draining flag: set once, by begin_drain (the service, a signal, shutdown)
        self.start_error: BaseException | None = None
        # Final once built; until then what the config says.
        self.geometry: Geometry = geometry_for(config, config.resolved_width, config.resolved_height)

    # --- lifetime -------------------------------------------------------------------------------
    async def start(self, before_ready: Callable[[Geometry], Awaitable[None]] | None = None) -> None:
        """Build the models and pools on the device thread, warm up, start ticking.

        ``before_ready(geometry)``: the owner's own warm-up for this geometry (the service's media encoders),
        awaited before readiness turns true, so a first session never pays for it; its failure is a start
        failure like the build's.
        """
        try:
            built = await asyncio.get_running_loop().run_in_executor(
                self._executor, build_engine, self.config, self._bundle
            )
            self._bundle = None  # the core owns it now
            self.geometry = built.geometry
            self._core = EngineCore(self.config, built, self._executor, draining=lambda: self.draining)
            self._loop = EngineLoop(self._core)
            self._loop.start()
            if before_ready is not None:
                await before_ready(self.geometry)
        except BaseException as error:  # not ready for good: readiness says so
            self.start_error = error
            raise
        self._started = True
        log.info("engine ready", extra={"capacity": built.capacity, "preset": self.config.preset})

    def begin_drain(self) -> None:
        """Refuse new sessions from now on (readiness turns false); :meth:`shutdown` ends the open ones."""
        self.draining = True

    async def shutdown(self, reason: str = "draining") -> None:
        """Drain: refuse new work, end every session with ``reason``, release, stop the device thread."""
        self.begin_drain()
        core = self._core
        if core is not None:
            core.finish_all(reason)
            if self._loop is not None:
                await self._loop.stop()
            await core.drain()
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(self._executor, core.runner.execute, StepPlan(finished=core.take_finished()))
            await loop.run_in_executor(self._executor, core.runner.close_all, reason)
            core.conditioning.close()
        self._executor.shutdown(wait=True)

    def not_ready(self) -> NotReady | None:
        """Why new sessions are refused now; None when warm, alive and not draining (the one readiness rule)."""
        if self.draining:
            return NotReady.DRAINING
        if self.start_error is not None:
            return NotReady.FAILED_TO_START
        if not self.alive:
            return NotReady.DEAD
        if not self._started:
            return NotReady.WARMING_UP
        return None

    @property
    def ready(self) -> bool:
        return self.not_ready() is None

    @property
    def alive(self) -> bool:
        return self._core is None or self._core.alive

    @property
    def dead_reason(self) -> str | None:
        return self._core.dead_reason if self._core is not None else None

    @property
    def capacity(self) -> int:
        return self._core.capacity if self._core is not None else 0

    @property
    def per_session_bytes(self) -> int:
        """Memory one session reserves: KV blocks, cross caches, decoder and model state."""
        return self._core.per_session_bytes if self._core is not None else 0

    @property
    def live_capacity(self) -> int | None:
        """Live sessions kept in real time at the measured block cost (None before anything was measured)."""
        return self._core.live_capacity() if self._core is not None else None

    @property
    def runner(self) -> Runner | None:
        """The device side (tests and benchmarks reach through it; the service never does)."""
        return self._core.runner if self._core is not None else None

    # --- sessions -------------------------------------------------------------------------------
    def create_session(
        self,
        *,
        seed: int | None = None,
        prompt: str | None = None,
        negative_prompt: str = "",
        pace: bool = True,
        start_on_attach: bool = False,
    ) -> SessionStatus | CapacityFull:
        """A new session in ``created`` (``active`` when a prompt is given), or :class:`CapacityFull`.

        With ``start_on_attach`` the prompt is kept (and reported) but generation starts only once a
        consumer attaches.
        """
        core = self._serving()
        seed = _check_seed(seed)
        if prompt is not None:
            _check_prompt(prompt)
        _check_prompt(negative_prompt, allow_empty=True)
        record = core.admit(
            seed=seed, pace=pace, negative_prompt=negative_prompt, prompt=prompt, start_on_attach=start_on_attach
        )
        if isinstance(record, CapacityFull):
            return record
        return core.status(record.session_id)

    def attach(self, session_id: str, margin_s: float | None = None) -> SessionStatus:
        """Mark a consumer attached; the queue is cleared (no replay: the consumer gets live chunks).

        ``margin_s``: how long before it plays the consumer needs each piece of a paced session (the engine's
        ``playout_margin_s`` when None). The snapshot returned says where the consumer's timeline starts
        (``frames``, ``audio_samples``).
        """
        core = self._known()
        core.attach(session_id, margin_s)
        return core.status(session_id)

    def detach(self, session_id: str) -> None:
        core = self._core
        if core is not None and session_id in core.records:
            core.submit(session_id, Detach())

    def start_session(
        self, session_id: str, prompt: str, *, seed: int | None = None, negative_prompt: str | None = None,
        pace: bool | None = None, context: np.ndarray | None = None,
    ) -> str:
        """``context``: an image's or clip's frames to start from (:meth:`check_context`)."""
        core = self._known()
        core.record(session_id)
        _check_prompt(prompt)
        if seed is not None:
            seed = _check_seed(seed)
        if negative_prompt is not None:
            _check_prompt(negative_prompt, allow_empty=True)
        if context is not None:
            self.check_context(context)
        start = Start(prompt=prompt, seed=seed, negative_prompt=negative_prompt, pace=pace, context=context)
        return core.submit(session_id, start).value

    def set_prompt(self, session_id: str, prompt: str, policy: str = "soft", negative_prompt: str | None = None, *,
                   control_id: str | None = None, arrived_at: float | None = None) -> None:
        """``control_id``, ``arrived_at`` (monotonic; default: now): the client's id for the change and when it
        arrived, to follow it to the first frames that show it (``Chunk.marks``, the session's control latency)."""
        core = self._known()
        core.record(session_id)
        _check_prompt(prompt)
        if policy not in PROMPT_POLICIES:
            raise InvalidRequest(f"policy must be one of {PROMPT_POLICIES}")
        if negative_prompt is not None:
            _check_prompt(negative_prompt, allow_empty=True)
        mark = _mark(control_id, f"prompt_{policy}", arrived_at)
        core.submit(session_id, SetPrompt(prompt, negative_prompt, policy, mark=mark))

    def unknown_words(self, prompt: str) -> tuple[str, ...] | None:
        """The words of ``prompt`` the model cannot read, each once, in order (None: it reads any text)."""
        core = self._core  # asked after a control was accepted: never refused for readiness
        return None if core is None else core.unknown_words(prompt)

    def pause(self, session_id: str) -> str:
        return self._known().submit(session_id, Pause()).value

    def resume(self, session_id: str) -> str:
        return self._known().submit(session_id, Resume()).value

    def reset(self, session_id: str, context: InputContext | None = None, *, control_id: str | None = None,
              arrived_at: float | None = None) -> None:
        """``context``: what the content restarts from (``InputContext(None)``: the prompt alone); None: what it
        last started from. ``control_id``, ``arrived_at``: as for :meth:`set_prompt`."""
        core = self._known()
        if context is not None and context.frames is not None:
            self.check_context(context.frames)
        core.submit(session_id, Reset(context, mark=_mark(control_id, "reset", arrived_at)))

    # --- pictures and video in ----------------------------------------------------------------
    @property
    def input_refusal(self) -> str | None:
        """Why this engine takes no image, clip or live input (its codec cannot encode); None when it does."""
        if not self.config.resolved_video_input:
            why = "the default under gpu_memory_gib" if self.config.video_input is None else "its configuration"
            return f"this server takes no pictures or video input (video_input is off: {why})"
        runner = self.runner
        if runner is not None and runner.encoder is None:
            return (f"this server cannot encode pictures: its video decoder ({self.config.resolved_video_decoder}) "
                    "comes without an encoder; image, clip and live input need the Wan VAE, a TAEHV file with its encoder "
                    "half, or the tiny preset's codec")
        return None

    @property
    def max_context_frames(self) -> int:
        """The most frames of a clip a session starts from: ``1 + 4 (n - 1)`` for the model's context of ``n``
        latent frames (sink + window)."""
        return 1 + 4 * (self.config.sink_frames + self.config.window_frames - 1)

    def check_context(self, frames: np.ndarray) -> None:
        """A context is uint8 ``[1 + 4 (n - 1), H, W, 3]`` at the engine's frame size, n within the context."""
        refusal = self.input_refusal
        if refusal is not None:
            raise InputUnsupported(refusal)
        geometry = self.geometry
        shape = (geometry.height, geometry.width, 3)
        if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 \
                or tuple(frames.shape[1:]) != shape:
            raise InvalidRequest(f"context frames must be uint8 [T, {shape[0]}, {shape[1]}, 3]")
        if (frames.shape[0] - 1) % 4 or not 1 <= frames.shape[0] <= self.max_context_frames:
            raise InvalidRequest(f"a context holds 1 + 4k frames, at most {self.max_context_frames}")

    def set_live(self, session_id: str, strength: float | None, *, control_id: str | None = None,
                 arrived_at: float | None = None) -> tuple[float, int] | None:
        """Live input on with ``strength`` in [0, 1] (or its strength changed), or off (None). Returns the noise
        level used (the model's schedule point nearest to ``strength``, 0 included) and the denoising steps a
        block then runs; None when switched off. ``control_id``, ``arrived_at``: as for :meth:`set_prompt`."""
        core = self._known()
        if strength is None:
            core.set_live(session_id, None, None, capacity=1, rate_per_s=1.0, burst=1)
            return None
        refusal = self.input_refusal
        if refusal is not None:
            raise InputUnsupported(refusal)
        if isinstance(strength, bool) or not isinstance(strength, (int, float)) or not 0.0 <= strength <= 1.0:
            raise InvalidRequest("strength must be a number in [0, 1]")
        pipeline = core.runner.pipeline
        first_step = pipeline.first_step_for(float(strength))
        sigma = pipeline.strength_at(first_step)
        config = self.config
        core.set_live(session_id, sigma, first_step, capacity=config.resolved_live_input_buffer_frames,
                      rate_per_s=config.live_input_fps, burst=config.live_input_burst,
                      jitter_frames=config.live_input_jitter_frames, mark=_mark(control_id, "live", arrived_at))
        return sigma, pipeline.num_steps - first_step

    def admit_input_frame(self, session_id: str) -> int | None:
        """A live frame arrived: its number (from 0, in the order the session's live frames arrived, dropped ones
        included) if it is within the session's rate (decode it and :meth:`push_input_frame` it with the number),
        None if it was dropped (counted). Raises ``NotLive`` while live input is off."""
        return self._known().admit_frame(session_id)

    def push_input_frame(self, session_id: str, frame: np.ndarray, number: int | None = None) -> None:
        """A decoded live frame (uint8 ``[H, W, 3]`` at the engine's frame size) joins the session's buffer;
        ``number`` (from :meth:`admit_input_frame`) is what a chunk made from it names (``Chunk.input_frame``)."""
        geometry = self.geometry
        if frame.dtype != np.uint8 or frame.shape != (geometry.height, geometry.width, 3):
            raise InvalidRequest(f"a live frame must be uint8 [{geometry.height}, {geometry.width}, 3]")
        self._known().push_frame(session_id, frame, number)

    def count_invalid_input(self, session_id: str) -> None:
        """A live frame of the session could not be read (the client was told)."""
        if self._core is not None:
            self._core.count_invalid_frame(session_id)

    def close(self, session_id: str, reason: str = "client") -> None:
        self._known().submit(session_id, Close(reason))

    def end(self, session_id: str, reason: str = "client") -> None:
        """End the session now, not at the next tick (REST ``DELETE`` forgets it right after)."""
        self._known().end_now(session_id, reason)

    def forget(self, session_id: str) -> None:
        """Drop an ended session's record (the service calls this once its retention is over)."""
        if self._core is not None:
            self._core.forget(session_id)

    async def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
        """Chunks of the session as they are decoded; ends when the session ends."""
        core = self._known()
        queue = core.record(session_id).queue
        while True:
            queue.release()  # asking for the next chunk releases the previous one...
            core.wake.set()  # ... so the session may be scheduled again
            chunk = await queue.get()
            if chunk is None:
                return
            yield chunk

    # --- status ---------------------------------------------------------------------------------
    def status(self, session_id: str) -> SessionStatus:
        return self._known().status(session_id)

    def list_sessions(self) -> list[SessionStatus]:
        return self._core.statuses() if self._core is not None else []

    def open_sessions(self) -> list[SessionStatus]:
        return [status for status in self.list_sessions() if status.is_open]

    def outlook(self) -> AdmissionOutlook | None:
        """Whether a live newcomer would be admitted now, and the room left (None until the engine is built)."""
        return self._core.outlook() if self._core is not None else None

    def counters(self) -> EngineCounters:
        if self._core is None:
            return EngineCounters(
                ready=False, alive=True, draining=self.draining, ticks=0, blocks=0, capacity=0, live_capacity=None,
                realtime_admission=self.config.realtime_admission, block_cost_ms=None, realtime_utilisation=0.0,
                sessions_by_state={}, live_sessions=0, live_sessions_below_realtime=0, deadline_misses=0,
                refused_realtime=0, kv_blocks_total=0, kv_blocks_in_use=0, decoder_state_bytes=0, queue_depths=(),
                session_frames_per_second=(), session_deadline_misses=(), input_frames={},
            )
        return self._core.counters(ready=self.ready)

    # --- helpers --------------------------------------------------------------------------------
    def _known(self) -> EngineCore:
        if self._core is None:
            raise UnknownSession("unknown session")
        return self._core

    def _serving(self) -> EngineCore:
        reason = self.not_ready()
        if reason is NotReady.DEAD:
            raise EngineUnavailable(f"the engine is dead: {self.dead_reason}")
        if reason is not None:
            raise EngineUnavailable(_UNAVAILABLE[reason])
        return self._core


_UNAVAILABLE = {
    NotReady.WARMING_UP: "the engine is warming up; try again later",
    NotReady.DRAINING: "the engine is draining",
    NotReady.FAILED_TO_START: "the engine failed to start",
}


def _mark(control_id: str | None, kind: str, arrived_at: float | None) -> ControlMark:
    return ControlMark(control_id, kind, time.monotonic() if arrived_at is None else arrived_at)


def _check_seed(seed: int | None) -> int:
    if seed is None:
        return secrets.randbelow(2**31)
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
        raise InvalidRequest(f"seed must be an integer in [0, {MAX_SEED}]")
    return seed


def _check_prompt(prompt: str, *, allow_empty: bool = False) -> None:
    check_prompt(prompt, allow_empty=allow_empty)
