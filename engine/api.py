"""The engine's public API — the one surface the web service and the CLI call.

All methods run on the asyncio event loop and never wait on the device:
controls are recorded on the session and carried to the device thread by the
next step plan. Capacity shortfall is a value (:class:`CapacityFull`), refused
requests raise an :class:`EngineError` whose ``code`` is the protocol's.

Typical use::

    engine = Engine(EngineConfig())
    await engine.start()                      # build, warm up, start the loop
    session = engine.create_session(seed=1)   # or CapacityFull
    engine.start_session(session.session_id, "a red fox")
    async for chunk in engine.chunks(session.session_id):
        ...                                   # uint8 frames [F, H, W, 3]
    await engine.shutdown()
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.errors import (
    AlreadyStarted,
    CapacityFull,
    EngineUnavailable,
    InvalidRequest,
    NotStarted,
    PromptTooLong,
    SessionClosed,
    UnknownSession,
)
from engine.kv_cache import KVCacheManager
from engine.loop import EngineLoop
from engine.models.builder import ModelBundle, build_models
from engine.plan import FinishedSession, StepPlan
from engine.runner import Runner, StepResult, runner_for
from engine.scheduler import Scheduler
from engine.session import (
    Chunk,
    ChunkQueue,
    ChunkTimings,
    PromptChange,
    Session,
    SessionState,
    new_session_id,
    now_ms,
)

log = logging.getLogger("arstream.engine")

PROMPT_POLICIES = ("soft", "recache", "reset")
MAX_PROMPT_CHARS = 2000
MAX_SEED = 2**63 - 1
ACTIVATION_MARGIN = 1.25  # headroom over the measured activation peak (allocator fragmentation)
DEVICE_RESERVE_BYTES = 2 * 2**30  # CUDA context, cuBLAS/cuDNN workspaces, encoder buffers


@dataclass(frozen=True)
class SessionStatus:
    session_id: str
    state: str  # protocol state: created, active, paused, detached, closed, draining
    attached: bool
    seed: int
    pace: bool
    prompt_length: int
    chunks: int
    frames: int
    audio_samples: int  # the next chunk's audio starts here on the session timeline
    blocks_since_reset: int
    queue_depth: int
    created_at: float  # epoch seconds
    time_to_first_chunk_ms: float | None
    last_timings: ChunkTimings | None
    close_reason: str | None


@dataclass(frozen=True)
class EngineCounters:
    ready: bool
    alive: bool
    draining: bool
    ticks: int
    blocks: int
    capacity: int
    sessions_by_state: dict[str, int]
    kv_blocks_total: int
    kv_blocks_in_use: int
    queue_depths: dict[str, int]


@dataclass(frozen=True)
class Geometry:
    """What a client needs to know about the media the engine produces."""

    width: int
    height: int
    fps: int
    frames_per_block: int  # latent frames
    pixel_frames_per_block: int  # 4x temporal: 12 for 3 latent frames (the first block has 9)
    audio_sample_rate: int | None
    audio_channels: int | None = None


class Engine:
    """Sessions, admission, controls and the loop around one runner."""

    def __init__(self, config: EngineConfig, *, bundle: ModelBundle | None = None) -> None:
        self.config = config
        self._bundle = bundle
        self.sessions: dict[str, Session] = {}
        self._finished: list[FinishedSession] = []
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="arstream-device")
        self.runner: Runner | None = None
        self.loop: EngineLoop | None = None
        self.capacity = 0
        self.per_session_bytes = 0
        self.ready = False
        self.alive = True
        self.draining = False
        self.dead_reason: str | None = None
        self.blocks = 0
        self.geometry = self._geometry(config.resolved_width, config.resolved_height)  # final once built
        self.scheduler = Scheduler(
            fps=config.fps, frames_per_chunk=self.geometry.pixel_frames_per_block, lead_chunks=config.lead_chunks
        )

    # --- lifetime -----------------------------------------------------------
    async def start(self) -> None:
        """Build the models and pools on the device thread, warm up, start ticking."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._executor, self._build)
        self.loop = EngineLoop(self, self._executor)
        self.loop.start()
        self.ready = True
        log.info("engine ready", extra={"capacity": self.capacity, "preset": self.config.preset})

    def _build(self) -> None:
        config = self.config
        threads = config.cpu_threads
        if threads is None and torch.device(config.device).type == "cpu":
            # Half the cores: the encoder threads and the event loop need the rest, and torch's
            # intra-op threads spinning against them cost far more than they give (docs/BENCHMARKS.md).
            threads = max(1, (os.cpu_count() or 2) // 2)
        if threads is not None:
            torch.set_num_threads(threads)
        bundle = self._bundle or build_models(config)
        spec = bundle.pipeline.kv_spec()
        decoder_bytes = bundle.decoder.declared_state_bytes(bundle.height, bundle.width, config.torch_dtype)
        if bundle.audio_decoder is not None:
            decoder_bytes += bundle.audio_decoder.declared_state_bytes()
        self.per_session_bytes = spec.session_bytes + decoder_bytes
        budget = config.kv_memory_budget_bytes
        if budget is None and torch.device(config.device).type == "cuda":
            budget = self._cuda_budget(bundle, spec)
        capacity = config.max_sessions
        if budget is not None:
            capacity = min(capacity, budget // self.per_session_bytes)
        if capacity < 1:
            raise ValueError(
                f"the memory budget holds no session: one needs {self.per_session_bytes} bytes "
                f"(KV {spec.session_bytes}, decoder {decoder_bytes}), budget {budget}"
            )
        self.capacity = int(capacity)
        manager = KVCacheManager(spec, self.capacity, config.device)
        self.runner = runner_for(bundle, manager, stepwise=config.step_mode == "stepwise")
        self.geometry = self._geometry(bundle.width, bundle.height, bundle)
        if bundle.audio_decoder is not None and bundle.audio_decoder.graphs is not None:
            bundle.audio_decoder.graphs.warmup(config.device)
        if config.warmup_blocks:
            self.runner.warmup(config.warmup_blocks)

    def _geometry(self, width: int, height: int, bundle: ModelBundle | None = None) -> Geometry:
        config = self.config
        timing = bundle.audio_timing if bundle is not None else None
        return Geometry(
            width=width,
            height=height,
            fps=config.fps,
            frames_per_block=config.frames_per_block,
            pixel_frames_per_block=4 * config.frames_per_block,
            audio_sample_rate=timing.sample_rate if timing is not None else None,
            audio_channels=bundle.audio_channels if bundle is not None else None,
        )

    def _cuda_budget(self, bundle: ModelBundle, spec) -> int:
        """Free device memory left for sessions after a warm-up measured peak activation memory.

        One probe session runs a block with its own pool; what the step
        allocated beyond the resident tensors is the activation peak, kept free
        (with a margin) for every later step.
        """
        device = torch.device(self.config.device)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        probe = runner_for(bundle, KVCacheManager(spec, 1, device))
        resident = torch.cuda.memory_allocated(device)
        probe.warmup(1)
        activation_peak = torch.cuda.max_memory_allocated(device) - resident
        del probe
        torch.cuda.empty_cache()
        free, _ = torch.cuda.mem_get_info(device)
        staging = spec.frames_per_block * spec.block_bytes * len(spec.branch_names)
        budget = int(free - ACTIVATION_MARGIN * activation_peak - staging - DEVICE_RESERVE_BYTES)
        log.info("cuda memory budget", extra={"free": free, "activation_peak": activation_peak, "budget": budget})
        return max(budget, 0)

    async def shutdown(self, reason: str = "draining") -> None:
        """Drain: refuse new work, close every session with ``reason``, release, stop the device thread."""
        self.draining = True
        self.ready = False
        for session in list(self.sessions.values()):
            if session.is_open:
                self._close(session, reason)
        if self.loop is not None:
            await self.loop.stop()
        if self.runner is not None:
            runner = self.runner
            finished = list(self._finished)
            self._finished.clear()
            await asyncio.get_running_loop().run_in_executor(
                self._executor, runner.execute, StepPlan(finished=finished)
            )
            await asyncio.get_running_loop().run_in_executor(self._executor, runner.close_all, reason)
        self._executor.shutdown(wait=True)

    # --- sessions -----------------------------------------------------------
    def create_session(
        self, *, seed: int | None = None, prompt: str | None = None, negative_prompt: str = "", pace: bool = True
    ) -> Session | CapacityFull:
        """A new session in ``created`` (``active`` when a prompt is given), or :class:`CapacityFull`."""
        self._require_serving()
        seed = self._check_seed(seed)
        if prompt is not None:
            self._check_prompt(prompt)
        self._check_prompt(negative_prompt, allow_empty=True)
        if len(self.open_sessions()) >= self.capacity and not self._evict_one():
            return CapacityFull(retry_after_s=max(1.0, self.geometry.pixel_frames_per_block / self.geometry.fps))
        session = Session(
            session_id=new_session_id(),
            seed=seed,
            pace=pace,
            queue=ChunkQueue(),
            negative_prompt=negative_prompt,
        )
        self.sessions[session.session_id] = session
        if prompt is not None:
            self.start_session(session.session_id, prompt)
        return session

    def _evict_one(self) -> bool:
        """Close the least recently active session without a live client that is detached or paused."""
        # A session with a live client is never evicted: the newcomer is refused instead.
        candidates = [
            s
            for s in self.open_sessions()
            if not s.attached and (s.detached_at is not None or s.state is SessionState.PAUSED)
        ]
        if not candidates:
            return False
        victim = min(candidates, key=lambda s: s.last_active)
        self._close(victim, "evicted")
        return True

    def get(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise UnknownSession("unknown session")
        return session

    def _open(self, session_id: str) -> Session:
        session = self.get(session_id)
        if not session.is_open:
            raise SessionClosed(f"session is closed ({session.close_reason})")
        return session

    def attach(self, session_id: str) -> Session:
        """Mark a socket attached; the queue is cleared (no replay: the client gets live chunks)."""
        session = self._open(session_id)
        session.attached = True
        session.detached_at = None
        session.queue.clear()
        session.touch()
        self._wake()
        return session

    def detach(self, session_id: str) -> None:
        session = self.sessions.get(session_id)
        if session is None or not session.is_open:
            return
        session.attached = False
        session.detached_at = time.monotonic()
        session.touch()

    def start_session(
        self, session_id: str, prompt: str, *, seed: int | None = None, negative_prompt: str | None = None,
        pace: bool | None = None,
    ) -> None:
        session = self._open(session_id)
        self._check_prompt(prompt)
        if session.state is not SessionState.CREATED:
            raise AlreadyStarted("the session is already running")
        if seed is not None:
            session.seed = self._check_seed(seed)
        if negative_prompt is not None:
            self._check_prompt(negative_prompt, allow_empty=True)
            session.negative_prompt = negative_prompt
        if pace is not None:
            session.pace = pace
        session.prompt = prompt
        session.state = SessionState.ACTIVE
        session.started_at = time.monotonic()
        session.touch()
        self._wake()

    def set_prompt(self, session_id: str, prompt: str, policy: str = "soft", negative_prompt: str | None = None) -> None:
        session = self._open(session_id)
        self._check_prompt(prompt)
        if policy not in PROMPT_POLICIES:
            raise InvalidRequest(f"policy must be one of {PROMPT_POLICIES}")
        if session.state is SessionState.CREATED:
            raise NotStarted("send start before changing the prompt")
        if negative_prompt is not None:
            self._check_prompt(negative_prompt, allow_empty=True)
            session.negative_prompt = negative_prompt
        session.prompt = prompt
        pending = session.pending_prompt
        # A reset still waiting to be applied must survive a later soft change.
        if pending is not None and pending.policy == "reset":
            policy = "reset"
        session.pending_prompt = PromptChange(prompt, session.negative_prompt, policy)
        session.touch()
        self._wake()

    def pause(self, session_id: str) -> None:
        session = self._open(session_id)
        if session.state is SessionState.CREATED:
            raise NotStarted("send start before pause")
        session.state = SessionState.PAUSED
        session.touch()

    def resume(self, session_id: str) -> None:
        session = self._open(session_id)
        if session.state is SessionState.CREATED:
            raise NotStarted("send start before resume")
        if session.state is SessionState.PAUSED:
            session.state = SessionState.ACTIVE
            # The playback clock does not run while paused: restart it at the media edge.
            if session.first_chunk_at is not None:
                session.first_chunk_at = time.monotonic() - session.frames_emitted / self.config.fps
        session.touch()
        self._wake()

    def reset(self, session_id: str) -> None:
        session = self._open(session_id)
        if session.state is SessionState.CREATED:
            raise NotStarted("send start before reset")
        session.pending_reset = True
        session.pending_prompt = None  # the reset restarts with the current prompt
        session.blocks_since_reset = 0
        session.touch()
        self._wake()

    def close(self, session_id: str, reason: str = "client") -> None:
        session = self.get(session_id)
        if session.is_open:
            self._close(session, reason)

    def _close(self, session: Session, reason: str, error: str | None = None) -> None:
        session.state = SessionState.CLOSED
        session.close_reason = reason
        session.error = error
        session.queue.end()
        if session.opened_on_device:
            self._finished.append(FinishedSession(session.session_id, reason))
        self._wake()

    def forget(self, session_id: str) -> None:
        """Drop a closed session's record (the service calls this once the client has been told)."""
        session = self.sessions.get(session_id)
        if session is not None and not session.is_open:
            del self.sessions[session_id]

    async def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
        """Chunks of the session as they are decoded; ends when the session closes."""
        session = self.get(session_id)
        while True:
            session.queue.release()  # asking for the next chunk releases the previous one
            self._wake()  # ... so the session may be scheduled again
            chunk = await session.queue.get()
            if chunk is None:
                return
            yield chunk

    # --- status -------------------------------------------------------------
    def status(self, session_id: str) -> SessionStatus:
        session = self.get(session_id)
        state = session.state.value
        if session.is_open and session.detached_at is not None:
            state = "detached"
        if self.draining and session.is_open:
            state = "draining"
        return SessionStatus(
            session_id=session.session_id,
            state=state,
            attached=session.attached,
            seed=session.seed,
            pace=session.pace,
            prompt_length=len(session.prompt or ""),
            chunks=session.chunks_emitted,
            frames=session.frames_emitted,
            audio_samples=session.audio_samples_emitted,
            blocks_since_reset=session.blocks_since_reset,
            queue_depth=len(session.queue),
            created_at=time.time() - (time.monotonic() - session.created_at),
            time_to_first_chunk_ms=session.time_to_first_chunk_ms,
            last_timings=session.last_timings,
            close_reason=session.close_reason,
        )

    def list_sessions(self) -> list[SessionStatus]:
        return [self.status(session_id) for session_id in self.sessions]

    def open_sessions(self) -> list[Session]:
        return [s for s in self.sessions.values() if s.is_open]

    def counters(self) -> EngineCounters:
        by_state: dict[str, int] = {}
        for session_id in self.sessions:
            state = self.status(session_id).state
            by_state[state] = by_state.get(state, 0) + 1
        pool = self.runner.kv_manager.block_pool if self.runner is not None else None
        return EngineCounters(
            ready=self.ready,
            alive=self.alive,
            draining=self.draining,
            ticks=self.loop.ticks if self.loop is not None else 0,
            blocks=self.blocks,
            capacity=self.capacity,
            sessions_by_state=by_state,
            kv_blocks_total=pool.num_blocks if pool is not None else 0,
            kv_blocks_in_use=(pool.num_blocks - pool.num_free_blocks) if pool is not None else 0,
            queue_depths={s.session_id: len(s.queue) for s in self.open_sessions()},
        )

    # --- loop hooks (event loop only) ------------------------------------------
    def next_plan(self) -> StepPlan:
        finished, self._finished = self._finished, []
        return self.scheduler.plan(self.open_sessions(), finished)

    def apply_result(self, result: StepResult) -> None:
        for failure in result.failures:
            session = self.sessions.get(failure.session_id)
            if session is not None and session.is_open:
                session.opened_on_device = False  # the runner already released it
                self._close(session, "failed", error=failure.message)
        for output in result.outputs:
            session = self.sessions.get(output.session_id)
            if session is None or not session.is_open:
                continue
            self._deliver(session, output)
        if result.fatal is not None:
            self.alive = False
            self.ready = False
            self.dead_reason = result.fatal
            log.error("engine dead: device-fatal error", extra={"error": result.fatal})
            for session in self.open_sessions():
                session.opened_on_device = False
                self._close(session, "failed", error="the engine's device failed")

    def _deliver(self, session: Session, output) -> None:
        now = time.monotonic()
        timings = ChunkTimings(
            started_at=output.started_at,
            queued_ms=output.queued_ms,
            denoise_ms=output.denoise_ms,
            decode_ms=output.decode_ms,
        )
        chunk = Chunk(
            session_id=session.session_id,
            index=session.chunks_emitted,
            pts=session.frames_emitted,
            frames=output.frames,
            audio=output.audio,
            audio_start=session.audio_samples_emitted,
            block_index=output.block_index,
            timings=timings,
            ready_at=now_ms(),
        )
        if session.first_chunk_at is None:
            session.first_chunk_at = now
            if session.started_at is not None:
                session.time_to_first_chunk_ms = (now - session.started_at) * 1000.0
        session.chunks_emitted += 1
        session.frames_emitted += int(output.frames.shape[0])
        if output.audio is not None:
            session.audio_samples_emitted += int(output.audio.shape[1])
        session.blocks_since_reset += 1
        session.last_timings = timings
        self.blocks += 1
        session.queue.put_nowait(chunk)

    def enforce_limits(self) -> None:
        """Close sessions past their grace period, idle timeout or maximum duration."""
        now = time.monotonic()
        config = self.config
        for session in self.open_sessions():
            if now - session.created_at > config.max_session_s:
                self._close(session, "max_duration")
            elif session.detached_at is not None and now - session.detached_at > config.detach_grace_s:
                self._close(session, "idle_timeout")
            elif session.state in (SessionState.CREATED, SessionState.PAUSED) and (
                now - session.last_active > config.idle_timeout_s
            ):
                self._close(session, "idle_timeout")

    # --- helpers --------------------------------------------------------------
    def _wake(self) -> None:
        if self.loop is not None:
            self.loop.wake.set()

    def _require_serving(self) -> None:
        if not self.alive:
            raise EngineUnavailable(f"the engine is dead: {self.dead_reason}")
        if self.draining:
            raise EngineUnavailable("the engine is draining")
        if not self.ready:
            raise EngineUnavailable("the engine is warming up; try again later")

    @staticmethod
    def _check_seed(seed: int | None) -> int:
        if seed is None:
            return secrets.randbelow(2**31)
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed <= MAX_SEED:
            raise InvalidRequest(f"seed must be an integer in [0, {MAX_SEED}]")
        return seed

    @staticmethod
    def _check_prompt(prompt: str, *, allow_empty: bool = False) -> None:
        if not isinstance(prompt, str):
            raise InvalidRequest("prompt must be a string")
        if not prompt and not allow_empty:
            raise InvalidRequest("prompt must not be empty")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise PromptTooLong(f"prompt longer than {MAX_PROMPT_CHARS} characters")
