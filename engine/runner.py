"""The runner: the one place that binds a session's device state to model calls.

It owns, per session, the KV handle, the pipeline's progress (RNG, block in
flight), the streaming decoder states and the streaming encoder state (live
input), and runs a :class:`StepPlan` on the
engine's single device thread. Every way a session ends — close, reset,
eviction, idle timeout, failed forward, shutdown — goes through
:meth:`Runner.release`, which frees all of them together.

Work is *dispatched*: :meth:`Runner.dispatch` queues a plan's device work and
returns at once with one :class:`PendingWork` per *piece* of output — a block's
frames are decoded one latent frame at a time, and each latent frame's frames
(4 at 16 fps, the content's opening one 1) are a piece of their own — plus one
for a work that made no frames. A piece's frames land in host memory when the
device gets there (:meth:`PendingWork.wait`). So the engine can queue block N+1
while the device still runs block N, the GPU never waits for the host between
blocks, and a block's first frames can leave before the rest is decoded (on the
CPU, where work runs as it is queued, ``on_pending`` hears of each piece the
moment it is made). :meth:`Runner.execute` is the synchronous form (dispatch,
then wait for each, one output per block), for warm-up and tests.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import torch

from decoders.audio import AudioDecodeState, AudioStreamingDecoder
from decoders.video import StreamingDecodeState, WanStreamingDecoder
from engine.kv_cache import KVCacheManager, SessionKVState
from engine.models.latents import BlockLatents
from engine.models.pipeline import CausalWanPipeline, SessionProgress
from engine.plan import InputContext, LiveFrames, OpenSession, PromptUpdate, Rewind, SessionWork, StepPlan
from engine.session import ChunkTimings, now_ms
from engine.undo import BlockUndo, before_block, take_back

log = logging.getLogger("arstream.runner")


STEADY_WARMUP_BLOCKS = 2  # warm-up blocks timed after every shape was met: the block-cost seed
BLOCK_INPUTS_KEPT = 8  # blocks back whose live input numbers a session keeps (more than undo can take back)


@dataclass
class DeviceSession:
    """Everything one session holds on the device."""

    kv: SessionKVState
    progress: SessionProgress
    decode_state: StreamingDecodeState
    audio_state: AudioDecodeState | None
    open_request: OpenSession
    encode_state: object | None = None  # the live input's stream (the engine's streaming encoder), None without one
    context: BlockLatents | None = None  # the image's or clip's latents the content started from (for a reset)
    last_input_frame: np.ndarray | None = None  # repeated when a block's live input has not arrived
    audio_samples_to_trim: int = 0  # the opening latent frame's audio before t = 0 (AudioTiming)
    audio_carry: torch.Tensor | None = None  # the previous content's audio tail, flushed at reset
    block_started_at: float | None = None  # epoch ms of the current output's first forward
    queued_ms: float = 0.0
    denoise_parts: list["_WorkTimer"] = field(default_factory=list)  # the current output's denoising so far
    opening_frame_sent: bool = False  # the first block's opening frame went out ahead of its commit pass
    undo: deque[BlockUndo] = field(default_factory=deque)  # the last blocks, oldest first (engine/undo.py)
    # A block made again from its middle: the old one's clean video, its latent frames sent, and the frames of the
    # next one the viewer has too (a cut inside a piece: that piece is decoded whole, sent from the cut on).
    redo: tuple[torch.Tensor, int, int] | None = None
    # The live frames each recent block took (block index -> their numbers, and how many the block needed): its
    # pieces name the frame their first frame shows (a block made again keeps its input, and its entry).
    block_inputs: dict[int, tuple[tuple[int | None, ...], int]] = field(default_factory=dict)
    # A restart asked for the block being queued to stop between two forwards (Runner.stop_block): its frames
    # would be cut anyway, and the device is then free for the new content a block sooner.
    stop_requested: bool = False

    def decoder_state_bytes(self) -> int:
        """Bytes its streaming decoder caches (video and audio) hold on the device now."""
        audio = self.audio_state.nbytes() if self.audio_state is not None else 0
        return self.decode_state.nbytes() + audio

    def encoder_state_bytes(self) -> int:
        return self.encode_state.nbytes() if self.encode_state is not None else 0


@dataclass(frozen=True)
class BlockOutput:
    session_id: str
    block_index: int
    frames: np.ndarray  # uint8 [F, H, W, 3]
    audio: np.ndarray | None  # float32 [channels, samples]: what became decodable with this block (its first piece)
    timings: ChunkTimings
    decoder_state_bytes: int = 0  # the session's video + audio decoder caches after this block
    opening_frame: bool = False  # the opening frame of a session's first block; the block's other frames follow
    encoder_state_bytes: int = 0  # the session's live-input encoder state after this block
    last_piece: bool = True  # the block's last piece (its other pieces came before it)
    first_of_block: bool = True  # the first frames of its block (or of a content: an opening frame)
    shows_controls: bool = True  # the first frames made under the controls its work applied (not a split's rest)
    input_frame: int | None = None  # the live frame its first frame shows (its number), None: not from live input


@dataclass(frozen=True)
class WorkCost:
    """Device seconds one session's work took this tick: its controls (open, reset, prompt) and its block."""

    session_id: str
    control_s: float
    block_s: float
    controls: tuple[str, ...]  # which controls ran, costliest first (engine.plan.CONTROL_KINDS)
    first_piece_s: float | None = None  # a block's first piece: from the block's start to its frames in host memory


@dataclass(frozen=True)
class SessionFailure:
    session_id: str
    message: str
    out_of_memory: bool = False  # the device's allocator refused the step (start-up turns it into a refusal)


class WarmupFailed(RuntimeError):
    """A warm-up block failed; ``out_of_memory`` when the device's allocator refused it."""

    def __init__(self, message: str, *, out_of_memory: bool = False) -> None:
        super().__init__(message)
        self.out_of_memory = out_of_memory


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
    encoder_state_bytes: int = 0
    last_piece: bool = True
    first_of_block: bool = True
    shows_controls: bool = True
    input_frame: int | None = None


@dataclass
class _BatchedBlock:
    """A session's block made in a batch (:meth:`Runner._run_batch`), waiting for its work's turn."""

    timer: "_WorkTimer"
    undo: BlockUndo | None
    clean: BlockLatents | None


@dataclass
class PendingWork:
    """One piece of a work item's output (or the whole work, when it made none) whose device work is queued.
    :meth:`wait` blocks until the device is done with it and returns its output (if any) and its cost, both
    measured on the device. A work's first one carries what the work reports (its controls, the input it took);
    ``first`` and ``last`` say where in its work a piece stands."""

    session_id: str
    controls: tuple[str, ...]
    ran: bool  # the work advanced the session's block (not controls alone): it counts as in flight
    timer: "_WorkTimer"
    output: _QueuedOutput | None = None
    live_first_seq: int | None = None  # the live frames offered to the work (LiveFrames.first_seq) ...
    input_frames_taken: int = 0  # ... and how many of them its block took (0: it began no block)
    context_frames: int | None = None  # latent frames of a context the work started the content from
    first: bool = True  # the work's first piece (it carries the work's controls and reports)
    last: bool = True  # the work's last piece: once it is done, so is the work
    stopped: bool = False  # its block was stopped before its frames (Runner.stop_block): no block was made
    device_idle: bool = False  # stopped, and the host waited until the device had done all queued before it

    @property
    def frames(self) -> int:
        """Frames this piece will deliver (0 if none): known at dispatch."""
        return 0 if self.output is None else int(self.output.frames.shape[0])

    def wait(self) -> tuple[BlockOutput | None, WorkCost]:
        self.timer.wait()
        control_s, block_s, decode_s = self.timer.seconds()
        queued = self.output
        begins_block = self.first and queued is not None and not queued.opening_frame and self.ran
        cost = WorkCost(self.session_id, control_s, block_s, self.controls,
                        first_piece_s=block_s if begins_block else None)
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
            encoder_state_bytes=queued.encoder_state_bytes,
            last_piece=queued.last_piece,
            first_of_block=queued.first_of_block,
            shows_controls=queued.shows_controls,
            input_frame=queued.input_frame,
        )
        return output, cost


@dataclass
class Dispatch:
    """What :meth:`Runner.dispatch` returns: work queued on the device, and what failed while queueing it."""

    pending: list[PendingWork] = field(default_factory=list)
    failures: list[SessionFailure] = field(default_factory=list)
    fatal: str | None = None
    device_idle: bool = False  # its last work's block was stopped, and the device had done all queued before it


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
        audio_samples_per_frame: int = 0,
        split_first_block: bool = False,
        encoder=None,
        undo_blocks: int = 0,
        stoppable: bool = False,
        batch_sessions: int = 1,
    ) -> None:
        """``split_first_block``: a session's first block goes out as two outputs, its opening frame as soon
        as the block is denoised (before its commit pass and the rest of its decode), to shorten the time to
        first media; the frames are the same as unsplit (chunked decode equals one-call decode). With blocks of
        one latent frame the first block is its opening frame alone: nothing to split (the rest would be a tick
        that makes nothing), so it is not.
        ``encoder``: the streaming video encoder of pictures and live input (``decoders``), None when the
        codec cannot encode. ``undo_blocks``: how many of a session's last blocks can be taken back and made again
        (supersede, ``engine/undo.py``; 0: none, nothing is recorded). ``stoppable``: a block's denoising forwards
        are queued one ahead of the device at most, and a restart may stop them (:meth:`stop_block`).
        ``batch_sessions``: the most sessions whose plain blocks of one plan share one forward a step
        (:meth:`_run_batch`; the pipeline needs as many ``batch_slots``); 1: every block alone."""
        if not 1 <= batch_sessions <= pipeline.batch_slots or (batch_sessions > 1 and stepwise):
            raise ValueError(f"batch_sessions={batch_sessions} needs grouped steps and a pipeline of as many batch "
                             f"slots (it has {pipeline.batch_slots})")
        if (audio_decoder is None) != (pipeline.audio_shape is None):
            raise ValueError("an audio decoder is needed exactly when the model emits audio latents")
        self.pipeline = pipeline
        self.decoder = decoder
        self.audio_decoder = audio_decoder
        self.audio_trim_samples = audio_trim_samples
        self.audio_samples_per_frame = audio_samples_per_frame
        self.encoder = encoder
        self.kv_manager = kv_manager
        self.stepwise = stepwise
        self.split_first_block = split_first_block and pipeline.frames_per_block > 1
        self.undo_blocks = 0 if stepwise else undo_blocks  # a stepwise block spans ticks: nothing to take back
        self.stoppable = stoppable and not stepwise
        self.batch_sessions = batch_sessions
        self.batches = 0  # batched forwards' blocks run (a batch of n counts once)
        self.device_sessions: dict[str, DeviceSession] = {}
        # The plan being dispatched: a stop asked for (from the engine's loop) reaches only its blocks.
        self._stop_lock = threading.Lock()
        self._dispatching: StepPlan | None = None

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
                encode_state=self.encoder.new_state(session_id) if self.encoder is not None else None,
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
        if device_session.encode_state is not None:
            actions.append(lambda: self.encoder.release(device_session.encode_state))
        for action in actions:
            try:
                action()
            except Exception as error:  # release everything even if one part fails
                errors.append(error)
        device_session.progress.latents = device_session.progress.clean = device_session.progress.block_input = None
        device_session.context = None
        device_session.progress.sink_latents.clear()
        device_session.progress.window_latents.clear()
        log.info("session released", extra={"session_id": session_id, "reason": reason})
        if errors:
            raise errors[0]

    def reset(
        self, session_id: str, prompt: str | None = None, negative_prompt: str | None = None,
        context: InputContext | None = None, *, flush_audio: bool = True,
    ) -> BlockLatents | None:
        """Restart content as a new session with the same seed (and the given or current prompt), from
        ``context`` (None: the image or clip it last started from). Returns the context's latents to begin
        from (:meth:`_begin_from`), or None for a start from the prompt alone. ``flush_audio=False``: the old
        content's held-back audio is dropped (its frames were cut from the stream), not flushed into the next."""
        old = self.device_sessions[session_id]
        latents = old.context
        if context is not None:
            latents = None if context.frames is None else self._encode_context(context.frames)
        request = OpenSession(
            seed=old.open_request.seed,
            prompt=old.open_request.prompt if prompt is None else prompt,
            negative_prompt=old.open_request.negative_prompt if negative_prompt is None else negative_prompt,
        )
        # The old content's held-back audio ends where its video ends: flush it into the next chunk so
        # the session's audio timeline stays continuous (no gap, no drift) across the reset.
        tail = None
        if flush_audio and old.audio_state is not None and old.audio_state.frames_received:
            expected = old.audio_state.pending_frames * self.audio_decoder.hop
            tail = self.audio_decoder.flush(old.audio_state)
            # Oobleck's transposed convs crop a few samples at a clip's true end: pad them back with
            # silence so the timeline keeps exactly hop samples per latent frame.
            tail = torch.nn.functional.pad(tail, (0, max(0, expected - tail.shape[1])))
        last_input = old.last_input_frame
        self.release(session_id, "reset")
        reopened = self.open(session_id, request)
        reopened.audio_carry = tail
        reopened.last_input_frame = last_input  # the live input goes on: a new stream, the same camera
        return latents

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
    def dispatch(self, plan: StepPlan, on_pending: Callable[[PendingWork], None] | None = None) -> Dispatch:
        """Release the plan's finished sessions, then queue each work item's device work, in order.

        ``on_pending`` (called on this thread) hears of each :class:`PendingWork` as soon as it is queued: on
        the CPU a block's first piece is then ready while its other latent frames are still being decoded."""
        dispatch = Dispatch()

        def emit(pending: PendingWork) -> None:
            dispatch.pending.append(pending)
            if on_pending is not None:
                on_pending(pending)

        with self._stop_lock:
            self._dispatching = plan
        try:
            self._dispatch(plan, dispatch, emit)
        finally:
            with self._stop_lock:  # a stop asked for too late is forgotten: it must not reach a later block
                self._dispatching = None
                for work in plan.work:
                    if (device_session := self.device_sessions.get(work.session_id)) is not None:
                        device_session.stop_requested = False
        dispatch.device_idle = bool(dispatch.pending) and dispatch.pending[-1].device_idle
        return dispatch

    def stop_block(self, session_id: str, plan: StepPlan) -> None:
        """Ask the session's block in ``plan`` (being dispatched) to stop before its next denoising forward (any
        thread). The engine asks when a restart will cut the block's frames anyway; a block past its denoising, or
        a plan no longer being dispatched, goes on as it was."""
        with self._stop_lock:
            if plan is self._dispatching and (device_session := self.device_sessions.get(session_id)) is not None:
                device_session.stop_requested = True

    def _dispatch(self, plan: StepPlan, dispatch: Dispatch, emit: Callable[[PendingWork], None]) -> None:
        for finished in plan.finished:
            try:
                self.release(finished.session_id, finished.reason)
            except Exception as error:
                dispatch.failures.append(SessionFailure(finished.session_id, f"release failed: {error}"))
        batches = self._batches(plan.work)
        made: dict[str, _BatchedBlock] = {}  # the blocks of a batch run ahead of their works' turn
        failed: set[str] = set()
        for work in plan.work:
            if work.session_id in failed:
                continue
            try:
                if work.session_id in batches:  # the first member of a batch: it runs for all of them now
                    members = batches[work.session_id]
                    for member in members:
                        del batches[member.session_id]
                    try:
                        made.update(self._run_batch(members, plan.planned_at))
                    except Exception as error:  # one forward made every member's block: its failure is theirs
                        others = [member.session_id for member in members if member is not work]
                        failed.update(others)
                        if any(self._failed(session_id, error, dispatch.failures) for session_id in others):
                            dispatch.fatal = str(error)
                            return
                        raise
                if work.session_id in made:
                    self._emit_batched(work, made.pop(work.session_id), plan.planned_at, emit)
                else:
                    self._do(work, plan.planned_at, _WorkTimer.start(self.pipeline.transformer.device), emit)
            except Exception as error:
                if self._failed(work.session_id, error, dispatch.failures):
                    dispatch.fatal = str(error)
                    return
                continue

    def execute(self, plan: StepPlan) -> StepResult:
        """Dispatch the plan and wait for all of it: its outputs (one per block: a block's pieces joined) and
        costs, in order."""
        dispatch = self.dispatch(plan)
        result = StepResult(failures=dispatch.failures, fatal=dispatch.fatal)
        # A session that failed after some of its block's pieces were queued (its commit pass runs after the
        # first piece) returns none of that block.
        failed = {failure.session_id for failure in dispatch.failures}
        pieces: list[BlockOutput] = []
        for pending in dispatch.pending:
            if pending.session_id in failed:
                continue
            try:
                output, cost = pending.wait()
            except Exception as error:
                if self._failed(pending.session_id, error, result.failures):
                    result.fatal = str(error)
                    return result
                continue
            result.costs.append(cost)
            if output is not None:
                pieces.append(output)
                if output.last_piece or output.opening_frame or pending.last:
                    result.outputs.append(_joined(pieces))
                    pieces = []
        return result

    def _failed(self, session_id: str, error: Exception, failures: list[SessionFailure]) -> bool:
        """Release a session whose work failed and record why; True if the device itself is lost (all released)."""
        log.warning("session step failed", extra={"session_id": session_id, "error": repr(error)}, exc_info=error)
        try:
            self.release(session_id, "failed")  # no-op when bound() already released it
        except Exception:
            log.exception("release after a failed step also failed")
        failures.append(SessionFailure(session_id, f"{type(error).__name__}: {error}",
                                       out_of_memory=isinstance(error, torch.OutOfMemoryError)))
        if is_device_fatal(error):
            self.close_all("failed")
            return True
        return False

    # --- sessions batched into one forward ------------------------------------------------
    def _batches(self, works: list[SessionWork]) -> dict[str, list[SessionWork]]:
        """The plan's works that share batched forwards: plain blocks (:attr:`SessionWork.plain_block`) of
        sessions past their first block, not begun, with nothing to make again, grouped by the pipeline's batch
        key (the same history length) in plan order, ``batch_sessions`` at most a group; groups of one run alone.
        Maps each member's session to its group."""
        if self.batch_sessions < 2:
            return {}
        groups: dict[tuple, list[SessionWork]] = {}
        for work in works:
            device_session = self.device_sessions.get(work.session_id)
            if (not work.plain_block or device_session is None or device_session.redo is not None
                    or device_session.progress.block_index < 1 or not self.pipeline.can_batch(device_session.progress)):
                continue
            groups.setdefault(self.pipeline.batch_key(device_session.kv), []).append(work)
        batches = {}
        for members in groups.values():
            for start in range(0, len(members), self.batch_sessions):
                chunk = members[start : start + self.batch_sessions]
                if len(chunk) > 1:
                    batches.update((work.session_id, chunk) for work in chunk)
        return batches

    def _run_batch(self, works: list[SessionWork], planned_at: float) -> dict[str, "_BatchedBlock"]:
        """The members' blocks, denoising and commit, through batched forwards (``pipeline.denoise_blocks`` and
        ``commit_blocks``; a stoppable runner takes a member out whose stop was asked for); each member's pieces
        are decoded and emitted at its own turn (:meth:`_emit_batched`). A member's device time is its share of
        the batch's (``_WorkTimer.share``) and its own decode."""
        device = self.pipeline.transformer.device
        members, blocks = [], {}
        for work in works:
            device_session = self.device_sessions[work.session_id]
            if work.settled_before is not None:
                self._settle(device_session, work.settled_before)
            timer = _WorkTimer.start(device)
            timer.controls_done()
            if device_session.block_started_at is None:
                device_session.block_started_at = now_ms()
                device_session.denoise_parts = []
                device_session.queued_ms = max(0.0, device_session.block_started_at - planned_at)
            blocks[work.session_id] = _BatchedBlock(timer, self._undo_record(device_session), None)
            members.append((device_session.kv, device_session.progress))
        span = _WorkTimer.start(device)
        cleans = self.pipeline.denoise_blocks(members, self._batch_stops(works) if self.stoppable else None)
        going = [member for member, clean in zip(members, cleans) if clean is not None]
        if going:
            self.pipeline.commit_blocks(going)
        span.end()
        self.batches += 1
        for work, clean in zip(works, cleans):
            block = blocks[work.session_id]
            block.timer.share(span, len(works))
            block.clean = clean
        return blocks

    def _batch_stops(self, works: list[SessionWork]) -> Callable[[], list[int]]:
        """Asked before each of a batch's steps: the members whose stop was asked for (:meth:`stop_block`); they
        leave the batch, the others go on. As for one block (:meth:`_denoise_stoppable`), on a GPU the host queues
        a step only when the one before the last is done, so a stop takes effect within about two steps."""
        ahead = _OneAhead(self.pipeline.transformer.device)

        def stopped() -> list[int]:
            ahead.queued()  # (asked before each step: the one before it is the one just queued)
            return [position for position, work in enumerate(works)
                    if self.device_sessions[work.session_id].stop_requested]

        return stopped

    def _emit_batched(self, work: SessionWork, block: "_BatchedBlock", planned_at: float,
                      emit: Callable[[PendingWork], None]) -> None:
        """A batched member's turn: its block is made and committed; its pieces are decoded and emitted."""
        report = PendingWork(work.session_id, work.control_kinds, work.run, block.timer)
        with self.bound(work.session_id) as device_session:
            self._advance(device_session, planned_at, report, emit, made=block)

    def _undo_record(self, device_session: DeviceSession) -> BlockUndo | None:
        """The session as it is before its next block, where blocks can be taken back (room made for it: the
        pools hold ``undo_blocks`` blocks' frames)."""
        progress = device_session.progress
        if not (self.undo_blocks and progress.block_index >= 1 and progress.latents is None and progress.clean is None):
            return None
        while len(device_session.undo) >= self.undo_blocks:
            device_session.kv.settle(device_session.undo.popleft().kv_journal)
        return before_block(progress, device_session.kv, device_session.decode_state, device_session.audio_state,
                            audio_samples_to_trim=device_session.audio_samples_to_trim,
                            audio_carry=device_session.audio_carry)

    def _do(self, work: SessionWork, planned_at: float, timer: "_WorkTimer", emit: Callable[[PendingWork], None]) -> None:
        """Run one work item's controls and block; ``emit`` each piece of its output as it is queued (the first
        carries what the work reports), or the work alone when it made no output."""
        report = PendingWork(work.session_id, work.control_kinds, work.run, timer)
        context = None  # latents an open or a reset starts the content from
        if work.open is not None:
            self.open(work.session_id, work.open)
            if work.open.context is not None:
                with self.bound(work.session_id):
                    context = self._encode_context(work.open.context)
        if work.session_id not in self.device_sessions:
            timer.end()
            emit(report)
            return
        if work.settled_before is not None:
            self._settle(self.device_sessions[work.session_id], work.settled_before)
        if work.rewind is not None:
            with self.bound(work.session_id) as device_session:
                self._rewind(device_session, work.rewind)
        restarted = work.open is not None
        if work.reset:
            with self.bound(work.session_id):
                context = self.reset(work.session_id, context=work.reset_context, flush_audio=not work.cut)
            restarted = True
        if work.prompt is not None:
            if work.prompt.policy == "reset":
                with self.bound(work.session_id):
                    context = self.reset(work.session_id, work.prompt.prompt, work.prompt.negative_prompt,
                                         flush_audio=not work.cut)
                restarted = True
            else:
                self._change_prompt(work)
        output = None
        if restarted:
            report.context_frames = 0 if context is None else context.frames
            if context is not None:
                # The content starts from the input: its last frame goes out now, alone; the block runs next.
                with self.bound(work.session_id) as device_session:
                    output = self._begin_from(device_session, context, planned_at)
        timer.controls_done()
        if output is not None or not work.run:
            timer.end()
            report.output = output
            emit(report)
            return
        with self.bound(work.session_id) as device_session:
            if work.live is not None:
                report.live_first_seq = work.live.first_seq
                report.input_frames_taken = self._take_live_input(device_session, work.live)
            self._advance(device_session, planned_at, report, emit)

    # --- pictures and video in --------------------------------------------------
    def _encode_context(self, frames: np.ndarray) -> BlockLatents:
        """An image's or clip's frames (``1 + 4 (n - 1)``, uint8) -> ``n`` model-space latent frames, encoded as one
        causal stream of their own (a throw-away state, not the session's live one)."""
        if self.encoder is None:
            raise RuntimeError("this engine's video codec cannot encode")
        state = self.encoder.new_state("context")
        try:
            return self._encode(frames, state)
        finally:
            self.encoder.release(state)

    def _encode(self, frames: np.ndarray, state) -> BlockLatents:
        """uint8 frames continuing ``state``'s stream -> model-space latents, with silence for their audio."""
        video = self.encoder.normalize(self.encoder.encode_chunk(self.encoder.from_uint8(frames), state)).float()
        return BlockLatents(video, self._silent_audio(video.shape[2]))

    def _silent_audio(self, latent_frames: int) -> torch.Tensor | None:
        """Audio latents for frames that come with no sound (zeros: the latent space's neutral value)."""
        if self.pipeline.audio_shape is None:
            return None
        _, channels, per_block = self.pipeline.audio_shape
        per_frame = per_block // self.pipeline.frames_per_block
        return torch.zeros(1, channels, latent_frames * per_frame, device=self.pipeline.transformer.device)

    def _begin_from(self, device_session: DeviceSession, context: BlockLatents, planned_at: float) -> _QueuedOutput:
        """Commit ``context`` as the session's opening history and decode it (the decoder's stream then continues
        from it); the output is its last frame, the first thing the client sees, with no audio."""
        device_session.context = context
        self.pipeline.commit_context(device_session.kv, device_session.progress, context)
        pixels = self.decoder.decode_chunk(self.decoder.denormalize(context.video), device_session.decode_state)
        frames = _to_host(self.decoder.to_uint8_tensor(pixels[:, :, -1:]))
        # The audio stream starts with the first generated block, on a latent boundary: nothing to trim; the
        # input's frame carries one frame of silence, which goes out with that block's sound.
        device_session.audio_samples_to_trim = 0
        if self.audio_decoder is not None:
            carry = device_session.audio_carry  # a reset's flushed tail comes first, on its own device
            silence = torch.zeros(self.audio_decoder.channels, self.audio_samples_per_frame,
                                  device=None if carry is None else carry.device,
                                  dtype=torch.float32 if carry is None else carry.dtype)
            device_session.audio_carry = silence if carry is None else torch.cat([carry, silence], dim=1)
        started = now_ms()
        return _QueuedOutput(
            frames=frames, audio=None, block_index=device_session.progress.block_index, started_at=started,
            queued_ms=max(0.0, started - planned_at), denoise_parts=[],
            decoder_state_bytes=device_session.decoder_state_bytes(), opening_frame=True,
            encoder_state_bytes=device_session.encoder_state_bytes(),
        )

    def _take_live_input(self, device_session: DeviceSession, live: LiveFrames) -> int:
        """Give the block that begins now its live input, encoded on the session's stream; returns the frames it
        took (0 when no block begins here: a stepwise tick inside one, the rest of a split first block, or a
        block made again, which keeps the input it had)."""
        progress = device_session.progress
        if self.encoder is None or progress.latents is not None or progress.clean is not None or device_session.redo:
            return 0
        need = self.encoder.frames_needed(self.pipeline.frames_per_block, device_session.encode_state)
        taken = list(live.frames[:need])
        if taken:
            device_session.last_input_frame = taken[-1]
        if device_session.last_input_frame is None:
            return 0  # nothing has arrived yet: this block comes from the prompt alone
        inputs = device_session.block_inputs
        inputs[progress.block_index] = (tuple(live.numbers[:len(taken)]), need)
        for block in [block for block in inputs if block < progress.block_index - BLOCK_INPUTS_KEPT]:
            del inputs[block]
        # Too few arrived: repeat the last frame (the engine never waits for input).
        frames = np.stack(taken + [device_session.last_input_frame] * (need - len(taken)))
        self.pipeline.set_block_input(progress, self._encode(frames, device_session.encode_state), live.first_step)
        return len(taken)

    def _change_prompt(self, work: SessionWork) -> None:
        update = work.prompt
        with self.bound(work.session_id) as device_session:
            # Blocks made under the old prompt are not taken back past this (a recache rewrites their K/V).
            self._settle(device_session, device_session.progress.block_index)
            self.pipeline.set_prompt(
                device_session.kv, device_session.progress, update.prompt, update.negative_prompt, update.policy
            )
            request = device_session.open_request
            device_session.open_request = OpenSession(request.seed, update.prompt, update.negative_prompt)

    def _advance(self, device_session: DeviceSession, planned_at: float, report: PendingWork,
                 emit: Callable[[PendingWork], None], made: "_BatchedBlock | None" = None) -> None:
        """Run the session's block (or, stepwise, one forward of it) and emit its output piece by piece: each
        latent frame is decoded on its own, its frames' copy to host memory queued, and its piece emitted before
        the next latent frame is decoded. ``made``: the block was made (and committed) in a batch already."""
        progress = device_session.progress
        timer = report.timer
        if device_session.block_started_at is None:
            device_session.block_started_at = now_ms()
            device_session.denoise_parts = []
            device_session.queued_ms = max(0.0, device_session.block_started_at - planned_at)
        device_session.denoise_parts.append(timer)
        opening = (self.split_first_block and progress.block_index == 0 and not device_session.opening_frame_sent
                   and device_session.context is None)  # after a context, its frame was the opening one
        undo = made.undo if made is not None else self._undo_record(device_session)
        commit_pending = False  # the block's commit pass is still to be queued (after its first piece's decode)
        if made is not None:
            clean = made.clean
            if clean is None:  # stopped for a restart while its batch went on: no block
                report.stopped = True
                device_session.block_started_at = None
        elif opening:
            clean = self.pipeline.denoise_step(device_session.kv, progress)
            while clean is None and not self.stepwise:
                clean = self.pipeline.denoise_step(device_session.kv, progress)
        elif self.stepwise:
            clean = self.pipeline.step(device_session.kv, progress)
        elif self.stoppable and not report.controls:
            clean = self._denoise_stoppable(device_session, progress)
            if clean is None:  # stopped for a restart: no block, the device free within about a forward
                report.stopped = report.device_idle = True
                device_session.block_started_at = None
            commit_pending = True
        else:
            clean = self.pipeline.denoise_block(device_session.kv, progress)
            commit_pending = True
        if clean is None:
            timer.end()
            emit(report)
            return
        # The block's index: a commit pass already run has moved the session on to its next block.
        block_index = progress.block_index if opening or commit_pending else progress.block_index - 1
        rest_of_split = not opening and block_index == 0 and device_session.opening_frame_sent
        video = self.decoder.denormalize(clean.video)

        def commit() -> None:
            """The block's commit pass if it is still to come, then its undo record (which holds the commit's KV
            journal)."""
            nonlocal commit_pending
            if commit_pending:
                self.pipeline.commit_block(device_session.kv, progress)
                commit_pending = False
            if undo is not None:
                undo.kv_journal, undo.clean_video = device_session.kv.take_journal(), video
                self._remember(device_session, undo)

        # No wait anywhere here: the first piece's decode queues behind the last denoising forward, the block's
        # commit pass behind it (the frames do not depend on it: the first piece leaves one forward sooner), the
        # frames' copy to pinned host memory behind the decode, and the caller may queue the next block before
        # any of it has run. A block of one piece commits first: its commit stays in its denoise time.
        first = 0
        if not opening:
            first = device_session.redo[1] if device_session.redo is not None else (1 if rest_of_split else 0)
        if not commit_pending or video.shape[2] - first == 1:
            commit()
        timer.denoised()
        offset = 0  # the next piece's first frame within its block's frames
        sent_before_cut = 0  # frames of the first piece the viewer has already (a cut inside it)
        if opening:
            latent_frames = [video[:, :, :1]]
        else:
            offset = 1 if rest_of_split else 0  # the opening frame was the block's first
            if device_session.redo is not None:
                # Made again from the middle: the old block's first latent frames were sent; decoding them again
                # gives the decoder the context the viewer saw (their frames are not sent twice).
                old, first, sent_before_cut = device_session.redo
                for index in range(first):
                    again = self.decoder.decode_chunk(old[:, :, index:index + 1], device_session.decode_state)
                    offset += again.shape[2]
                device_session.redo = None
            latent_frames = [video[:, :, index:index + 1] for index in range(first, video.shape[2])]
        # The opening frame carries no audio: the block's audio is decoded whole with the rest of it, and goes
        # with its first piece.
        audio = None
        if self.audio_decoder is not None and not opening:
            audio = _to_host(self._decode_audio(device_session, clean))
        device_session.opening_frame_sent |= opening
        shown_input = self._shown_input(device_session, block_index)
        pending = report
        for position, latent in enumerate(latent_frames):
            if position:
                pending = PendingWork(report.session_id, (), report.ran, _WorkTimer.start(timer.device), first=False)
                pending.timer.controls_done()
                if commit_pending:
                    commit()  # timed with the second piece: in its block time, in no chunk's denoise or decode
                pending.timer.denoised()
            frames = self.decoder.to_uint8_tensor(self.decoder.decode_chunk(latent, device_session.decode_state))
            if position == 0 and sent_before_cut:
                # Decoded whole (the decoder's context is the new frames'), sent from the cut on.
                frames, offset = frames[sent_before_cut:], offset + sent_before_cut
            input_frame, offset = shown_input(offset), offset + frames.shape[0]
            last = position == len(latent_frames) - 1
            pending.last = last
            pending.output = _QueuedOutput(
                frames=_to_host(frames),
                audio=audio if position == 0 else None,
                block_index=block_index,
                started_at=device_session.block_started_at,
                queued_ms=device_session.queued_ms,
                denoise_parts=device_session.denoise_parts,
                decoder_state_bytes=device_session.decoder_state_bytes(),
                opening_frame=opening,
                encoder_state_bytes=device_session.encoder_state_bytes(),
                last_piece=last and not opening,
                first_of_block=position == 0 and (opening or first == sent_before_cut == 0),
                shows_controls=position == 0 and not rest_of_split,
                input_frame=input_frame,
            )
            pending.timer.end()
            emit(pending)
        device_session.block_started_at = None

    def _denoise_stoppable(self, device_session: DeviceSession, progress) -> BlockLatents | None:
        """The block's denoising forwards (as ``denoise_block``), or None once a stop was asked for (checked before
        each forward). On a GPU the host queues a forward only when the one before the last is done: the device
        never waits for the host, and a stop leaves at most two forwards to finish, not the rest of the block; the
        host then waits for them, so the device is free when the dispatch returns. A stopped block leaves the
        session as if it had not begun (its noise generator too): begun again, it is the block never stopped."""
        ahead = _OneAhead(self.pipeline.transformer.device)
        begun = progress.latents is None and progress.clean is None  # its noise is drawn from here
        start = progress.generator.get_state() if begun else None
        while True:
            if progress.clean is not None and progress.step_index >= self.pipeline.num_steps:
                return progress.clean  # denoised (the rest of a split first block; an input at strength 0)
            if device_session.stop_requested:
                break
            self.pipeline.denoise_step(device_session.kv, progress)
            ahead.queued()
        ahead.drain()
        progress.latents = progress.clean = None
        progress.step_index = 0
        if start is not None:  # begun again, it draws the noise it drew: as if it had never begun
            progress.generator.set_state(start)
        return None

    def _shown_input(self, device_session: DeviceSession, block_index: int) -> Callable[[int], int | None]:
        """For the block's frame at an offset, the number of the live frame it shows (None: none, or only a
        repeat of one shown before). A block shows its input frame for frame, aligned at its end: a live stream's
        first block needs fewer frames (``1 + 4 (n - 1)``) than a block of a running decoder shows (``4 n``), and
        its first frames then all come from the first one."""
        numbers, needed = device_session.block_inputs.get(block_index, ((), 0))
        shown = 4 * self.pipeline.frames_per_block
        if block_index == 0 and device_session.context is None:
            shown -= 3  # a content's first latent frame is one frame
        lead = shown - needed

        def number_at(offset: int) -> int | None:
            index = max(0, offset - lead)
            return numbers[index] if index < len(numbers) else None
        return number_at

    # --- taking blocks back (supersede, engine/undo.py) ---------------------------------------
    def _remember(self, device_session: DeviceSession, undo: BlockUndo) -> None:
        device_session.undo.append(undo)

    def _settle(self, device_session: DeviceSession, before: int) -> None:
        """Blocks before ``before`` will not be taken back: free what their records hold."""
        while device_session.undo and device_session.undo[0].block_index < before:
            device_session.kv.settle(device_session.undo.popleft().kv_journal)

    def _rewind(self, device_session: DeviceSession, rewind: Rewind) -> None:
        """Take the session back to the start of block ``rewind.block``; its next block is that one again."""
        records = list(device_session.undo)
        taken = [record for record in records if record.block_index >= rewind.block]
        if not taken or taken[0].block_index != rewind.block or device_session.progress.latents is not None:
            raise RuntimeError(f"block {rewind.block} cannot be taken back (records from "
                               f"{records[0].block_index if records else None})")
        oldest = take_back(taken, device_session.progress, device_session.kv, device_session.decode_state,
                           device_session.audio_state)
        for _ in taken:
            device_session.undo.pop()
        self.pipeline.history_changed()
        device_session.audio_samples_to_trim = oldest.audio_samples_to_trim
        device_session.audio_carry = oldest.audio_carry
        device_session.redo = ((oldest.clean_video, rewind.skip_latents, rewind.skip_frames)
                               if rewind.skip_latents or rewind.skip_frames else None)

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
        block, takes a block back and makes it again from its middle (where
        blocks can be taken back: the decoders' restored state is a new input to
        their compiled paths), and, where the codec can encode, restarts from an
        image and runs two blocks of live input — all through :meth:`execute`,
        the path real sessions take.
        Returns the device seconds of two more plain blocks at the full window, run once every shape
        has been met (they seed the engine's per-block cost estimate, so admission does not count the
        one-time compiles and graph captures of the first blocks).
        """
        first, second = "__warmup__", "__warmup_2__"
        spec = self.kv_manager.spec
        plain_blocks = max(blocks, self._blocks_past_eviction()) if transitions else blocks
        free_before = self.kv_manager.block_pool.num_free_blocks
        opening = OpenSession(seed=0, prompt="warmup", negative_prompt="")
        seconds = []

        def run(*work: SessionWork) -> None:
            result = self.execute(StepPlan(work=list(work), planned_at=now_ms()))
            if result.failures or result.fatal:
                raise WarmupFailed(f"warmup failed: {result.fatal or result.failures[0].message}",
                                   out_of_memory=any(failure.out_of_memory for failure in result.failures))

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
                if self.undo_blocks:  # supersede: a block taken back and made again from its middle
                    records = self.device_sessions[first].undo
                    while not records:  # (the restarted content's first block keeps none; a split one takes 2 works)
                        run(SessionWork(first, run=True))
                    run(SessionWork(first, prompt=PromptUpdate("warmup, superseded", "", "soft"), run=True,
                                    rewind=Rewind(records[-1].block_index, 1)))
                if self.encoder is not None:
                    self._warm_inputs(first, run)
            for session_id in (first, second):  # their slots for the batches' sessions
                self.release(session_id, "warmup_complete")
            batched = self._warm_batches(run)
            if batched:
                seconds = batched
        finally:
            for session_id in (first, second, *self._warm_batch_ids()):
                self.release(session_id, "warmup_complete")
        free_after = self.kv_manager.block_pool.num_free_blocks
        if free_after != free_before:
            raise RuntimeError(f"warmup did not restore the KV pool (free {free_before} -> {free_after})")
        return seconds

    def _blocks_past_eviction(self) -> int:
        """Blocks that fill a session's window and evict from it: every history length met."""
        spec = self.kv_manager.spec
        return -(-spec.resident_frames // spec.frames_per_block) + 1

    def _warm_batch_ids(self) -> list[str]:
        return [f"__warmup_batch_{index}__" for index in range(self.batch_sessions)]

    def _warm_batches(self, run) -> list[float]:
        """With ``batch_sessions``: every batch size from 2 meets every history length (its graphs captured here,
        not in a viewer's stream). Returns each session's share of the largest batch's last blocks (their
        seconds over the members): the engine's cost estimate then is a batched session's, which is what
        admitting the batch's members needs. Empty without batching (or with too few session slots: the
        activation probe's one)."""
        plain_blocks = self._blocks_past_eviction()
        largest = min(self.batch_sessions, self.kv_manager.max_sessions)
        shares: list[float] = []
        opening = OpenSession(seed=0, prompt="warmup", negative_prompt="")
        for size in range(2, largest + 1):
            members = self._warm_batch_ids()[:size]
            batches_before = self.batches
            for index in range(plain_blocks + STEADY_WARMUP_BLOCKS):
                started = time.perf_counter()
                run(*(SessionWork(member, open=opening if index == 0 else None, run=True) for member in members))
                shares.append((time.perf_counter() - started) / size)
            if self.batches == batches_before:
                raise RuntimeError(f"warm-up: {size} sessions' blocks were never batched")
            for member in members:
                self.release(member, "warmup_complete")
        return shares[-STEADY_WARMUP_BLOCKS:] if shares else []

    def _warm_inputs(self, session_id: str, run) -> None:
        """An image start (the one-frame commit pass, the encoder's opening group) and two live blocks (its
        steady groups) on a grey picture."""
        _, _, _, latent_height, latent_width = self.pipeline.latent_shape
        scale = self.decoder.spatial_upscale
        grey = np.full((1, latent_height * scale, latent_width * scale, 3), 128, dtype=np.uint8)
        run(SessionWork(session_id, reset=True, reset_context=InputContext(grey), run=True))
        frames = tuple(grey[0] for _ in range(4 * self.pipeline.frames_per_block))
        for _ in range(2):
            run(SessionWork(session_id, run=True, live=LiveFrames(self.pipeline.num_steps - 1, frames, 0)))


def runner_for(
    bundle, kv_manager: KVCacheManager, *, stepwise: bool = False, split_first_block: bool = False,
    undo_blocks: int = 0, stoppable: bool = False, batch_sessions: int = 1,
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
        audio_samples_per_frame=timing.samples_per_video_frame if timing is not None else 0,
        split_first_block=split_first_block,
        encoder=bundle.encoder,
        undo_blocks=undo_blocks,
        stoppable=stoppable,
        batch_sessions=batch_sessions,
    )


class _OneAhead:
    """The host queues device work at most one step ahead of the device: after each step is queued,
    :meth:`queued` waits until the step before it is done (on a GPU; the CPU runs each step as it is queued).
    So a stop asked for between steps leaves at most two to finish."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._events: deque = deque()

    def queued(self) -> None:
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
            self._events.append(event)
            if len(self._events) > 1:
                self._events.popleft().synchronize()

    def drain(self) -> None:
        """Wait until the device has done every step queued."""
        while self._events:
            self._events.popleft().synchronize()


class _WorkTimer:
    """One work item's controls, denoise and decode seconds, taken without making the host wait: CUDA events
    on a GPU (each part is timed from when the device reaches it, so device work still queued ahead of it
    does not count), the host's clock elsewhere (the CPU runs eagerly). Marks: start, controls done, denoised
    (only if the work made an output), end."""

    _MARKS = ("start", "controls", "denoised", "end")

    def __init__(self, cuda: bool, device: torch.device | None = None) -> None:
        self._cuda = cuda
        self.device = device
        self._marks: dict[str, "torch.cuda.Event | float"] = {}
        self._shared: tuple["_WorkTimer", int] | None = None  # (the batch's span, its members): see share()
        self._mark("start")

    @classmethod
    def start(cls, device: torch.device) -> "_WorkTimer":
        return cls(device.type == "cuda", device)

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

    def share(self, span: "_WorkTimer", members: int) -> None:
        """This work's block was made in a batch of ``members`` sessions timed by ``span`` (its start and end): its
        denoising is its share of the batch, whatever else ran before its own marks."""
        self._shared = (span, members)

    def denoise_seconds(self) -> float:
        """The block's part before its decode (all of it when the work made no output), after :meth:`wait`."""
        if self._shared is not None:
            span, members = self._shared
            return span._between("start", "end") / members
        return self._between("controls", "denoised" if "denoised" in self._marks else "end")

    def seconds(self) -> tuple[float, float, float]:
        """(controls, block, decode) seconds, after :meth:`wait`; block = denoise + decode."""
        controls = self._between("start", "controls")
        decode = self._between("denoised", "end") if "denoised" in self._marks else 0.0
        if self._shared is not None:
            return controls, self.denoise_seconds() + decode, decode
        return controls, self._between("controls", "end"), decode


def _joined(pieces: list[BlockOutput]) -> BlockOutput:
    """A block's pieces as one output (the synchronous :meth:`Runner.execute`)."""
    if len(pieces) == 1:
        return pieces[0]
    audio = [p.audio for p in pieces if p.audio is not None]
    last = pieces[-1]
    return BlockOutput(
        session_id=last.session_id,
        block_index=last.block_index,
        frames=np.concatenate([p.frames for p in pieces]),
        audio=np.concatenate(audio, axis=1) if audio else None,
        timings=ChunkTimings(started_at=pieces[0].timings.started_at, queued_ms=pieces[0].timings.queued_ms,
                             denoise_ms=pieces[0].timings.denoise_ms,
                             decode_ms=sum(p.timings.decode_ms for p in pieces)),
        decoder_state_bytes=last.decoder_state_bytes,
        opening_frame=False,
        encoder_state_bytes=last.encoder_state_bytes,
        last_piece=True,
        first_of_block=pieces[0].first_of_block,
        shows_controls=pieces[0].shows_controls,
        input_frame=pieces[0].input_frame,
    )


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of ``tensor`` that fills in when the device gets there (pinned memory, no wait)."""
    if tensor.device.type != "cuda":
        return tensor.contiguous()
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host
