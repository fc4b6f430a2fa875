"""The runner: the one place that binds a session's device state to model calls.

It owns, per session, the KV handle, the pipeline's progress (RNG, block in
flight) and the streaming decoder state, and runs a :class:`StepPlan` on the
engine's single device thread. Every way a session ends — close, reset,
eviction, idle timeout, failed forward, shutdown — goes through
:meth:`Runner.release`, which frees all of them together.

Work is *dispatched*: :meth:`Runner.dispatch` queues a plan's device work and
returns at once with one :class:`PendingWork` per work item; its block's
frames land in host memory when the device gets there (:meth:`PendingWork.wait`).
So the engine can queue block N+1 while the device still runs block N, and the
GPU never waits for the host between blocks. :meth:`Runner.execute` is the
synchronous form (dispatch, then wait for each), for warm-up and tests.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from decoders.audio import AudioDecodeState, AudioStreamingDecoder
from decoders.video import StreamingDecodeState, WanStreamingDecoder
from engine.kv_cache import KVCacheManager, SessionKVState
from engine.models.pipeline import CausalWanPipeline, SessionProgress
from engine.plan import OpenSession, PromptUpdate, SessionWork, StepPlan
from engine.session import ChunkTimings, now_ms

log = logging.getLogger("arstream.runner")


STEADY_WARMUP_BLOCKS = 2  # warm-up blocks timed after every shape was met: the block-cost seed


@dataclass
class DeviceSession:
    """Everything one session holds on the device."""

    kv: SessionKVState
    progress: SessionProgress
    decode_state: StreamingDecodeState
    audio_state: AudioDecodeState | None
    open_request: OpenSession
    audio_samples_to_trim: int = 0  # the opening latent frame's audio before t = 0 (AudioTiming)
    audio_carry: torch.Tensor | None = None  # the previous content's audio tail, flushed at reset
    block_started_at: float | None = None  # epoch ms of the current output's first forward
    queued_ms: float = 0.0
    denoise_parts: list["_WorkTimer"] = field(default_factory=list)  # the current output's denoising so far
    opening_frame_sent: bool = False  # the first block's opening frame went out ahead of its commit pass

    def decoder_state_bytes(self) -> int:
        """Bytes its streaming decoder caches (video and audio) hold on the device now."""
        audio = self.audio_state.nbytes() if self.audio_state is not None else 0
        return self.decode_state.nbytes() + audio


@dataclass(frozen=True)
class BlockOutput:
    session_id: str
    block_index: int
    frames: np.ndarray  # uint8 [F, H, W, 3]
    audio: np.ndarray | None  # float32 [channels, samples]: what became decodable with this block
    timings: ChunkTimings
    decoder_state_bytes: int = 0  # the session's video + audio decoder caches after this block
    opening_frame: bool = False  # the opening frame of a session's first block; the block's other frames follow


@dataclass(frozen=True)
class WorkCost:
    """Device seconds one session's work took this tick: its controls (open, reset, prompt) and its block."""

    session_id: str
    control_s: float
    block_s: float
    controls: tuple[str, ...]  # which controls ran, costliest first (engine.plan.CONTROL_KINDS)


@dataclass(frozen=True)
class SessionFailure:
    session_id: str
    message: str


@dataclass
class StepResult:
    outputs: list[BlockOutput] = field(default_factory=list)
    failures: list[SessionFailure] = field(default_factory=list)
    costs: list[WorkCost] = field(default_factory=list)
    fatal: str | None = None  # a device-fatal error: the engine is dead


@dataclass
class _QueuedOutput:
    """A block output whose frames (and audio) are still on their way to host memory."""

    frames: torch.Tensor  # uint8 [F, H, W, 3] in host memory (pinned on a GPU), complete once the device is done
    audio: torch.Tensor | None  # float32 [channels, samples], likewise
    block_index: int
    started_at: float
    queued_ms: float
    denoise_parts: list["_WorkTimer"]
    decoder_state_bytes: int
    opening_frame: bool


@dataclass
class PendingWork:
    """One work item whose device work is queued. :meth:`wait` blocks until the device is done with it and
    returns its output (if it made one) and its cost, both measured on the device."""

    session_id: str
    controls: tuple[str, ...]
    ran: bool  # the work advanced the session's block (not controls alone): it counts as in flight
    timer: "_WorkTimer"
    output: _QueuedOutput | None = None

    @property
    def frames(self) -> int:
        """Frames this work will deliver (0 if none): known at dispatch."""
        return 0 if self.output is None else int(self.output.frames.shape[0])

    def wait(self) -> tuple[BlockOutput | None, WorkCost]:
        self.timer.wait()
        control_s, block_s, decode_s = self.timer.seconds()
        cost = WorkCost(self.session_id, control_s, block_s, self.controls)
        queued = self.output
        if queued is None:
            return None, cost
        output = BlockOutput(
            session_id=self.session_id,
            block_index=queued.block_index,
            frames=queued.frames.numpy(),
            audio=queued.audio.numpy() if queued.audio is not None else None,
            timings=ChunkTimings(
                started_at=queued.started_at,
                queued_ms=queued.queued_ms,
                denoise_ms=sum(part.denoise_seconds() for part in queued.denoise_parts) * 1000.0,
                decode_ms=decode_s * 1000.0,
            ),
            decoder_state_bytes=queued.decoder_state_bytes,
            opening_frame=queued.opening_frame,
        )
        return output, cost


@dataclass
class Dispatch:
    """What :meth:`Runner.dispatch` returns: work queued on the device, and what failed while queueing it."""

    pending: list[PendingWork] = field(default_factory=list)
    failures: list[SessionFailure] = field(default_factory=list)
    fatal: str | None = None


def is_device_fatal(error: BaseException) -> bool:
    """Errors after which the device cannot be trusted for any session."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return False  # one session's allocation failed; the device itself is fine
    text = str(error)
    return any(marker in text for marker in ("CUDA error", "device-side assert", "illegal memory access"))


class Runner:
    """Runs step plans; lives on (and is only called from) the engine's device thread."""

    def __init__(
        self,
        pipeline: CausalWanPipeline,
        decoder: WanStreamingDecoder,
        kv_manager: KVCacheManager,
        *,
        stepwise: bool = False,
        audio_decoder: AudioStreamingDecoder | None = None,
        audio_trim_samples: int = 0,
        split_first_block: bool = False,
    ) -> None:
        """``split_first_block``: a session's first block goes out as two outputs, its opening frame as soon
        as the block is denoised (before its commit pass and the rest of its decode), to shorten the time to
        first media; the frames are the same as unsplit (chunked decode equals one-call decode)."""
        if (audio_decoder is None) != (pipeline.audio_shape is None):
            raise ValueError("an audio decoder is needed exactly when the model emits audio latents")
        self.pipeline = pipeline
        self.decoder = decoder
        self.audio_decoder = audio_decoder
        self.audio_trim_samples = audio_trim_samples
        self.kv_manager = kv_manager
        self.stepwise = stepwise
        self.split_first_block = split_first_block
        self.device_sessions: dict[str, DeviceSession] = {}

    # --- lifetime ---------------------------------------------------------
    def open(self, session_id: str, request: OpenSession) -> DeviceSession:
        kv = self.kv_manager.open_session(session_id)
        if kv is None:
            # Admission on the event loop counts the same slots; reaching this is a bug.
            raise RuntimeError("no KV capacity for an admitted session")
        try:
            device_session = DeviceSession(
                kv=kv,
                progress=self.pipeline.new_progress(request.seed, request.prompt, request.negative_prompt),
                decode_state=self.decoder.new_state(session_id),
                audio_state=self.audio_decoder.new_state(session_id) if self.audio_decoder is not None else None,
                open_request=request,
                audio_samples_to_trim=self.audio_trim_samples,
            )
        except Exception:
            kv.close()
            raise
        self.device_sessions[session_id] = device_session
        return device_session

    def release(self, session_id: str, reason: str) -> None:
        """The one release path: KV blocks, cross caches, decoder state and model state, together."""
        device_session = self.device_sessions.pop(session_id, None)
        if device_session is None:
            return
        errors = []
        actions = [device_session.kv.close, lambda: self.decoder.release(device_session.decode_state)]
        if device_session.audio_state is not None:
            actions.append(lambda: self.audio_decoder.release(device_session.audio_state))
        for action in actions:
            try:
                action()
            except Exception as error:  # release everything even if one part fails
                errors.append(error)
        device_session.progress.latents = device_session.progress.clean = None
        device_session.progress.sink_latents.clear()
        device_session.progress.window_latents.clear()
        log.info("session released", extra={"session_id": session_id, "reason": reason})
        if errors:
            raise errors[0]

    def reset(self, session_id: str, prompt: str | None = None, negative_prompt: str | None = None) -> None:
        """Restart content as a new session with the same seed (and the given or current prompt)."""
        old = self.device_sessions[session_id].open_request
        request = OpenSession(
            seed=old.seed,
            prompt=old.prompt if prompt is None else prompt,
            negative_prompt=old.negative_prompt if negative_prompt is None else negative_prompt,
        )
        # The old content's held-back audio ends where its video ends: flush it into the next chunk so
        # the session's audio timeline stays continuous (no gap, no drift) across the reset.
        old = self.device_sessions[session_id]
        tail = None
        if old.audio_state is not None and old.audio_state.frames_received:
            expected = old.audio_state.pending_frames * self.audio_decoder.hop
            tail = self.audio_decoder.flush(old.audio_state)
            # Oobleck's transposed convs crop a few samples at a clip's true end: pad them back with
            # silence so the timeline keeps exactly hop samples per latent frame.
            tail = torch.nn.functional.pad(tail, (0, max(0, expected - tail.shape[1])))
        self.release(session_id, "reset")
        self.open(session_id, request).audio_carry = tail

    def close_all(self, reason: str) -> None:
        for session_id in list(self.device_sessions):
            try:
                self.release(session_id, reason)
            except Exception:
                log.exception("release failed during close_all")

    @contextmanager
    def bound(self, session_id: str) -> Iterator[DeviceSession]:
        """Bind one session for a model call and fail closed: on any error it is released first."""
        device_session = self.device_sessions[session_id]
        try:
            yield device_session
        except Exception:
            try:
                self.release(session_id, "failed")
            except Exception:
                log.exception("release after a failed forward also failed")
            raise

    # --- execution ----------------------------------------------------------
    def dispatch(self, plan: StepPlan) -> Dispatch:
        """Release the plan's finished sessions, then queue each work item's device work, in order."""
        dispatch = Dispatch()
        for finished in plan.finished:
            try:
                self.release(finished.session_id, finished.reason)
            except Exception as error:
                dispatch.failures.append(SessionFailure(finished.session_id, f"release failed: {error}"))
        for work in plan.work:
            timer = _WorkTimer.start(self.pipeline.transformer.device)
            try:
                output = self._do(work, plan.planned_at, timer)
            except Exception as error:
                if self._failed(work.session_id, error, dispatch.failures):
                    dispatch.fatal = str(error)
                    return dispatch
                continue
            timer.end()
            dispatch.pending.append(PendingWork(work.session_id, work.control_kinds, work.run, timer, output))
        return dispatch

    def execute(self, plan: StepPlan) -> StepResult:
        """Dispatch the plan and wait for all of it: its outputs and costs, in order."""
        dispatch = self.dispatch(plan)
        result = StepResult(failures=dispatch.failures, fatal=dispatch.fatal)
        for pending in dispatch.pending:
            try:
                output, cost = pending.wait()
            except Exception as error:
                if self._failed(pending.session_id, error, result.failures):
                    result.fatal = str(error)
                    return result
                continue
            result.costs.append(cost)
            if output is not None:
                result.outputs.append(output)
        return result

    def _failed(self, session_id: str, error: Exception, failures: list[SessionFailure]) -> bool:
        """Release a session whose work failed and record why; True if the device itself is lost (all released)."""
        log.warning("session step failed", extra={"session_id": session_id, "error": repr(error)}, exc_info=error)
        try:
            self.release(session_id, "failed")  # no-op when bound() already released it
        except Exception:
            log.exception("release after a failed step also failed")
        failures.append(SessionFailure(session_id, f"{type(error).__name__}: {error}"))
        if is_device_fatal(error):
            self.close_all("failed")
            return True
        return False

    def _do(self, work: SessionWork, planned_at: float, timer: "_WorkTimer") -> _QueuedOutput | None:
        if work.open is not None:
            self.open(work.session_id, work.open)
        if work.session_id not in self.device_sessions:
            return None
        if work.reset:
            self.reset(work.session_id)
        if work.prompt is not None:
            self._change_prompt(work)
        timer.controls_done()
        if not work.run:
            return None
        with self.bound(work.session_id) as device_session:
            return self._advance(device_session, planned_at, timer)

    def _change_prompt(self, work: SessionWork) -> None:
        update = work.prompt
        if update.policy == "reset":
            self.reset(work.session_id, update.prompt, update.negative_prompt)
            return
        with self.bound(work.session_id) as device_session:
            self.pipeline.set_prompt(
                device_session.kv, device_session.progress, update.prompt, update.negative_prompt, update.policy
            )
            request = device_session.open_request
            device_session.open_request = OpenSession(request.seed, update.prompt, update.negative_prompt)

    def _advance(self, device_session: DeviceSession, planned_at: float, timer: "_WorkTimer") -> _QueuedOutput | None:
        progress = device_session.progress
        if device_session.block_started_at is None:
            device_session.block_started_at = now_ms()
            device_session.denoise_parts = []
            device_session.queued_ms = max(0.0, device_session.block_started_at - planned_at)
        device_session.denoise_parts.append(timer)
        opening = self.split_first_block and progress.block_index == 0 and not device_session.opening_frame_sent
        if opening:
            clean = self.pipeline.denoise_step(device_session.kv, progress)
            while clean is None and not self.stepwise:
                clean = self.pipeline.denoise_step(device_session.kv, progress)
        elif self.stepwise:
            clean = self.pipeline.step(device_session.kv, progress)
        else:
            clean = self.pipeline.run_block(device_session.kv, progress)
        if clean is None:
            return None
        # No wait anywhere here: the decode queues behind the commit pass, the frames' copy to pinned host
        # memory behind the decode, and the caller may queue the next block before any of it has run.
        timer.denoised()
        video = self.decoder.denormalize(clean.video)
        if opening:
            video = video[:, :, :1]
        elif progress.block_index == 1 and device_session.opening_frame_sent:
            video = video[:, :, 1:]  # the rest of the first block; its opening frame went out already
        frames = _to_host(self.decoder.to_uint8_tensor(self.decoder.decode_chunk(video, device_session.decode_state)))
        # The opening frame carries no audio: the block's audio is decoded whole with the rest of it.
        audio = None
        if self.audio_decoder is not None and not opening:
            audio = _to_host(self._decode_audio(device_session, clean))
        device_session.opening_frame_sent |= opening
        output = _QueuedOutput(
            frames=frames,
            audio=audio,
            block_index=progress.block_index if opening else progress.block_index - 1,
            started_at=device_session.block_started_at,
            queued_ms=device_session.queued_ms,
            denoise_parts=device_session.denoise_parts,
            decoder_state_bytes=device_session.decoder_state_bytes(),
            opening_frame=opening,
        )
        device_session.block_started_at = None
        return output

    def _decode_audio(self, device_session: DeviceSession, clean) -> torch.Tensor:
        """The samples this block made decodable (float32, on the device), minus the part of the opening
        frame before t = 0."""
        pcm = self.audio_decoder.decode_block(clean.audio, device_session.audio_state)
        trim = min(device_session.audio_samples_to_trim, pcm.shape[1])
        device_session.audio_samples_to_trim -= trim
        pcm = pcm[:, trim:]
        if device_session.audio_carry is not None:
            pcm = torch.cat([device_session.audio_carry.to(pcm), pcm], dim=1)
            device_session.audio_carry = None
        return pcm.float()

    # --- warmup -----------------------------------------------------------
    def warmup(self, blocks: int = 2, *, transitions: bool = True) -> list[float]:
        """Throwaway sessions through every shape a real session meets; the pool must come back whole.

        A session runs at least ``blocks`` blocks and enough to fill its window
        and evict (every history length, so every attention shape, compiled
        kernel and cuDNN plan is built here, not in a viewer's stream). With
        ``transitions``, a second session then joins mid-stream, the first
        changes its prompt with ``recache`` and is reset, each followed by a
        block — all through :meth:`execute`, the path real sessions take.
        Returns the device seconds of two more plain blocks at the full window, run once every shape
        has been met (they seed the engine's per-block cost estimate, so admission does not count the
        one-time compiles and graph captures of the first blocks).
        """
        first, second = "__warmup__", "__warmup_2__"
        spec = self.kv_manager.spec
        plain_blocks = max(blocks, -(-spec.resident_frames // spec.frames_per_block) + 1) if transitions else blocks
        free_before = self.kv_manager.block_pool.num_free_blocks
        opening = OpenSession(seed=0, prompt="warmup", negative_prompt="")
        seconds = []

        def run(*work: SessionWork) -> None:
            result = self.execute(StepPlan(work=list(work), planned_at=now_ms()))
            if result.failures or result.fatal:
                raise RuntimeError(f"warmup failed: {result.fatal or result.failures[0].message}")

        try:
            for index in range(plain_blocks + (STEADY_WARMUP_BLOCKS if transitions else 0)):
                started = time.perf_counter()
                run(SessionWork(first, open=opening if index == 0 else None, run=True))
                seconds.append(time.perf_counter() - started)
            if transitions:
                seconds = seconds[-STEADY_WARMUP_BLOCKS:]
                if self.kv_manager.max_sessions > 1:  # a viewer joining while another streams
                    run(SessionWork(second, open=opening, run=True), SessionWork(first, run=True))
                run(SessionWork(first, prompt=PromptUpdate("warmup, changed", "", "recache"), run=True))
                run(SessionWork(first, reset=True, run=True))
        finally:
            for session_id in (first, second):
                self.release(session_id, "warmup_complete")
        free_after = self.kv_manager.block_pool.num_free_blocks
        if free_after != free_before:
            raise RuntimeError(f"warmup did not restore the KV pool (free {free_before} -> {free_after})")
        return seconds


def runner_for(
    bundle, kv_manager: KVCacheManager, *, stepwise: bool = False, split_first_block: bool = False
) -> Runner:
    """A runner over a built :class:`~engine.bundle.ModelBundle` (audio wired when the model has it)."""
    timing = bundle.audio_timing
    return Runner(
        bundle.pipeline,
        bundle.decoder,
        kv_manager,
        stepwise=stepwise,
        audio_decoder=bundle.audio_decoder,
        audio_trim_samples=timing.samples_before_start if timing is not None else 0,
        split_first_block=split_first_block,
    )


class _WorkTimer:
    """One work item's controls, denoise and decode seconds, taken without making the host wait: CUDA events
    on a GPU (each part is timed from when the device reaches it, so device work still queued ahead of it
    does not count), the host's clock elsewhere (the CPU runs eagerly). Marks: start, controls done, denoised
    (only if the work made an output), end."""

    _MARKS = ("start", "controls", "denoised", "end")

    def __init__(self, cuda: bool) -> None:
        self._cuda = cuda
        self._marks: dict[str, "torch.cuda.Event | float"] = {}
        self._mark("start")

    @classmethod
    def start(cls, device: torch.device) -> "_WorkTimer":
        return cls(device.type == "cuda")

    def _mark(self, name: str) -> None:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks[name] = event
        else:
            self._marks[name] = time.perf_counter()

    def controls_done(self) -> None:
        self._mark("controls")

    def denoised(self) -> None:
        self._mark("denoised")

    def end(self) -> None:
        self._mark("end")

    def wait(self) -> None:
        """Block until the device has done everything queued before :meth:`end` (async errors surface here)."""
        end = self._marks["end"]
        if self._cuda:
            end.synchronize()

    def _between(self, first: str, second: str) -> float:
        a, b = self._marks[first], self._marks[second]
        if self._cuda:
            return a.elapsed_time(b) / 1000.0
        return b - a

    def denoise_seconds(self) -> float:
        """The block's part before its decode (all of it when the work made no output), after :meth:`wait`."""
        return self._between("controls", "denoised" if "denoised" in self._marks else "end")

    def seconds(self) -> tuple[float, float, float]:
        """(controls, block, decode) seconds, after :meth:`wait`; block = denoise + decode."""
        controls = self._between("start", "controls")
        block = self._between("controls", "end")
        decode = self._between("denoised", "end") if "denoised" in self._marks else 0.0
        return controls, block, decode


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor`` that fills in when the device gets there (pinned memory, no wait)."""
    if tensor.device.type != "cuda":
        return tensor.contiguous()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
