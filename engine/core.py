"""The engine core: the one owner of every session, the scheduler and the runner.

``step()`` is the whole engine in three calls::

    apply queued controls, enforce timeouts
    release    → hand each session's due media (its lead, ``engine/playout.py``) to its consumer
    schedule   → a StepPlan (the only thing that crosses to the device thread)
    dispatch   → Runner.dispatch(plan) on the device thread: the plan's work is queued on the device
    complete   → as each piece of output finishes on the device (waited for on a second thread, so the
                 next tick can be dispatched meanwhile): add it to the session's lead, count costs and
                 deadlines, release what is due

Everything here runs on the event loop; the device thread sees only plans.
Controls (start, prompt, pause, resume, reset, close, attach, detach) are
validated when submitted and applied at the next tick, in order, by
:meth:`_apply` — the one place a session's state machine moves. Every way a
session ends goes through :meth:`_finish`, the one finish path: it marks the
record closed, ends its queue, returns its KV reservation, and hands its id to
the next plan so the runner releases its device state.

Admission asks two budgets, memory and time, through one planning function
(``engine/admission.py``) that :meth:`admit` carries out and :meth:`outlook`
only reads. Either refusal is a :class:`CapacityFull` value with the expected wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from engine.admission import Admission, plan_admission
from engine.conditioning import Conditioning
from engine.config import EngineConfig
from engine.controls import (
    Attach,
    Close,
    Control,
    Detach,
    Reset,
    Resume,
    SessionState,
    SetPrompt,
    Start,
    applied,
)
from engine.device_memory import allocator_limit_bytes
from engine.errors import (
    CapacityFull,
    NoRealtimeCapacity,
    NotLive,
    SessionClosed,
    TooManyControls,
    UnknownSession,
)
from engine import marks
from engine.live_input import LiveInput
from engine.plan import CONTROL_KINDS, FORWARD_CONTROL_KINDS, FinishedSession, PromptUpdate, Rewind, SessionWork, StepPlan
from engine.playout import Piece, Playout
from engine.realtime import RealtimePolicy, RunningCost, clamp_retry_after
from engine.runner import BlockOutput, Dispatch, PendingWork, WorkCost, is_device_fatal
from engine.scheduler import Scheduler
from engine.session import Chunk, ChunkQueue, ControlMark, new_session_id, now_ms
from engine.session_record import MAX_PENDING_CONTROLS, DeferredCut, SessionRecord
from engine.startup import BuiltEngine
from engine.snapshots import session_status, shown_state
from engine.status import AdmissionOutlook, EngineCounters, SessionStatus

log = logging.getLogger("arstream.engine")

RELEASE_RECHECK_S = 0.002  # the soonest the idle loop looks again for a piece due to leave
LOGGED_MISSES = 20  # deadline misses logged per session (each one counted)


class EngineCore:
    def __init__(
        self, config: EngineConfig, built: BuiltEngine, executor: ThreadPoolExecutor,
        draining: Callable[[], bool] = lambda: False, completions: ThreadPoolExecutor | None = None,
    ) -> None:
        """``draining``: whether the engine drains (its owner's flag; snapshots and the outlook show it);
        ``completions``: the one-thread executor that waits for the device's work (a test may pass one it holds)."""
        self.config = config
        self._draining = draining
        self.runner = built.runner
        self.kv = built.runner.kv_manager
        self.unknown_words = built.runner.pipeline.text_encoder.unknown_words  # what the model cannot read
        self.conditioning = Conditioning(built.runner.pipeline.embeddings, config.kv_branch_names)
        self.capacity = built.capacity
        self.undo_blocks = built.undo_blocks  # supersede: how many of a session's last blocks can be made again
        # Blocks until a content's attention window is full (its blocks cost more until then).
        self._window_fill_blocks = -(-(config.sink_frames + config.window_frames) // config.frames_per_block) + 1
        self.per_session_bytes = built.per_session_bytes
        self.geometry = built.geometry
        self._executor = executor
        self.records: dict[str, SessionRecord] = {}
        self._finished: list[FinishedSession] = []
        # Completions are waited for here, so the device thread is free to dispatch the next tick meanwhile;
        # one task delivers them in the order they were queued.
        self._completions = completions or ThreadPoolExecutor(max_workers=1, thread_name_prefix="arstream-completion")
        self._completion_queue: asyncio.Queue | None = None
        self._completer: asyncio.Task | None = None
        self._outstanding = 0  # pieces queued on the device and not yet delivered
        self._dispatching = False  # a plan is being dispatched (on the CPU: being run) on the device thread
        self._all_delivered = asyncio.Event()
        self._all_delivered.set()
        self._planned: dict[str, tuple[int, int]] = {}  # session -> (epoch, tick) of the plan being dispatched
        self._current_plan: StepPlan | None = None  # being dispatched, when its blocks can stop (Runner.stop_block)
        self._device_free_at = 0.0  # monotonic: when the device is expected to finish what was dispatched
        self.scheduler = Scheduler(
            fps=config.fps,
            frames_per_chunk=self.geometry.pixel_frames_per_block,
            lead_chunks=config.lead_chunks,
            ticks_per_block=built.ticks_per_block,
            blocks_in_flight=config.resolved_blocks_in_flight,
            overlap=config.overlap_encode,
            batch_sessions=config.batch_sessions,
        )
        self.policy = RealtimePolicy(
            block_seconds=self.geometry.block_seconds,
            headroom=config.realtime_headroom,
            enabled=config.realtime_admission,
        )
        self.block_cost = RunningCost(built.seed_block_cost_s)  # engine-wide, every session's blocks
        self.control_costs = {kind: RunningCost() for kind in CONTROL_KINDS}
        self.wake = asyncio.Event()
        self.ticks = 0
        self.blocks = 0
        self.deadline_misses = 0
        self.refused_realtime = 0
        self.input_totals = {"received": 0, "used": 0, "dropped": 0, "invalid": 0}  # over every session's life
        self.alive = True
        self.dead_reason: str | None = None

    # --- admission ----------------------------------------------------------------------------
    def admit(
        self, *, seed: int, pace: bool, negative_prompt: str, prompt: str | None, start_on_attach: bool
    ) -> SessionRecord | CapacityFull:
        """A new session in ``created`` (``active`` with a prompt, unless it starts on attach), or a refusal."""
        self._apply_controls()  # eviction and the budgets must see every accepted control
        plan = self._admission(live=pace)
        if plan.refused is not None:
            return self._refusal(plan)
        self._evict(plan)
        session_id = new_session_id()
        if self.kv.reserve(session_id) is None:
            raise RuntimeError("the admission plan left no memory slot free")
        taken = functools.partial(self._taken, session_id)
        geometry = self.geometry
        record = SessionRecord(
            session_id=session_id,
            seed=seed,
            pace=pace,
            queue=ChunkQueue(overlap=self.config.overlap_encode, on_taken=taken),
            cost=RunningCost(),
            playout=Playout(
                fps=geometry.fps,
                margin_s=self.config.playout_margin_s,
                samples_per_frame=(geometry.audio_sample_rate or 0) // geometry.fps,
                audio_channels=geometry.audio_channels or 0,
                max_chunk_frames=2 * geometry.pixel_frames_per_block,
            ),
            negative_prompt=negative_prompt,
        )
        self.records[session_id] = record
        if prompt is not None:
            self.conditioning.request(prompt, negative_prompt, self.wake)
            start = Start(prompt=prompt)
            if start_on_attach:
                record.prompt = prompt  # known now (its length is reported), generated once a consumer attaches
                record.start_on_attach = start
            else:
                self._apply(record, start)
        return record

    def _admission(self, *, live: bool, needs_slot: bool = True) -> Admission:
        """What admitting a newcomer takes now (``engine/admission.py``); ``needs_slot=False``: it holds one."""
        return plan_admission(
            self._open_records(),
            slots_free=self.capacity - self.kv.num_reserved if needs_slot else None,
            live=live,
            policy=self.policy,
            cost_of=self.cost_of,
            newcomer_cost_s=self.block_cost.seconds,
        )

    def _evict(self, plan: Admission) -> None:
        for record in plan.evict:
            self._finish(record, "evicted")

    def _refusal(self, plan: Admission) -> CapacityFull:
        if plan.refused == "memory":
            return CapacityFull(retry_after_s=self._expected_wait(plan.remaining))
        self.refused_realtime += 1
        return CapacityFull(
            retry_after_s=self._expected_wait([r for r in plan.remaining if r.pace]),
            message="no device time left for another live session; try again later, or stream with pace off",
            live_capacity=self.live_capacity(),
        )

    def outlook(self) -> AdmissionOutlook:
        """What :meth:`admit` would decide now for a live (paced) newcomer, without admitting it or evicting
        anyone: a front end placing sessions across engines reads it (``app/cluster``). Controls still queued
        are not applied first, so it may trail :meth:`admit` by up to one tick."""
        open_records = self._open_records()
        live = [r for r in open_records if r.pace]
        live_capacity = self.live_capacity()
        return AdmissionOutlook(
            admitting=self.alive and not self._draining() and self._admission(live=True).refused is None,
            slots_free=max(0, self.capacity - self.kv.num_reserved),
            open_sessions=len(open_records),
            live_sessions=len(live),
            live_headroom=max(0, live_capacity - len(live)) if live_capacity is not None else None,
            utilisation=self._utilisation(),
            retry_after_s=self._expected_wait(open_records),
        )

    def _expected_wait(self, blocking: list[SessionRecord]) -> float:
        """Seconds until the soonest of ``blocking`` must end on its own (grace, idle timeout, maximum duration)."""
        now, config = time.monotonic(), self.config
        ends = []
        for record in blocking:
            ends.append(record.created_at + config.max_session_s)
            if record.detached_at is not None:
                ends.append(record.detached_at + config.detach_grace_s)
            elif record.state in (SessionState.CREATED, SessionState.PAUSED):
                ends.append(record.last_active + config.idle_timeout_s)
        wait = min(ends) - now if ends else 0.0
        return clamp_retry_after(wait, self.geometry.block_seconds)

    # --- controls -------------------------------------------------------------------------------
    def submit(self, session_id: str, control: Control) -> SessionState:
        """Validate ``control`` against the session's state-to-be and queue it; returns that new state.

        ``Close`` and ``Detach`` of an ended session are accepted and do nothing.
        """
        record = self.record(session_id)
        projected = record.projected()
        new_state = applied(projected, control, starts_on_attach=record.start_on_attach is not None).state
        if not record.is_open or projected.state is SessionState.CLOSED:
            return new_state
        if isinstance(control, Start) and control.pace and not record.pace:
            plan = self._admission(live=True, needs_slot=False)  # it holds its slot: only time is asked
            if plan.refused is not None:
                self.refused_realtime += 1
                raise NoRealtimeCapacity("no device time left for another live session; start with pace off or try later")
            self._evict(plan)
        if len(record.controls) >= MAX_PENDING_CONTROLS:
            raise TooManyControls("too many controls waiting for this session; slow down")
        if isinstance(control, (Start, SetPrompt)):
            negative = control.negative_prompt if control.negative_prompt is not None else projected.negative_prompt
            self.conditioning.request(control.prompt, negative, self.wake)
        if projected.state is SessionState.CREATED and new_state is SessionState.ACTIVE:
            record.start_requested_at = time.monotonic()  # `start`, or the attach a deferred start waits for
        record.controls.append(control)
        if isinstance(control, Reset) or (isinstance(control, SetPrompt) and control.policy == "reset"):
            self._stop_block_for_restart(record)
        self.wake.set()
        return new_state

    def _stop_block_for_restart(self, record: SessionRecord) -> None:
        """A restart that comes while its session's block is being dispatched stops that block between two denoising
        forwards (``Runner.stop_block``) instead of waiting for the rest of it, when nothing is lost: the block's
        frames would be cut (they play after the new content can), and what is made and queued before it plays
        until the new content's first frames can follow (two forwards left on the device, the other sessions'
        work in this plan, the restart's own cost and the margin). Otherwise the restart waits for the block, as
        a control always did. (A `soft` change does not stop the block: begun again under the new prompt, the
        block shows only after all the media made ahead, where the block made whole lets the change be cut into
        it sooner: tried and measured, docs/BENCHMARKS.md.)"""
        playout, plan = record.playout, self._current_plan
        if (plan is None or not record.pace or not playout.clock_running or record.live is not None
                or not any(w.session_id == record.session_id and w.run and not w.control_kinds for w in plan.work)):
            return  # (a work that applies controls is never stopped: the runner makes its block whole)
        now = time.monotonic()
        block = self.cost_of(record)
        others = max(0.0, self._backlog(now) - block)
        two_forwards = 2 * block / max(1, self.runner.pipeline.num_steps)
        ready = now + others + two_forwards + self._restart_cost(record) + playout.margin_s
        if playout.play_time(playout.frames_made + record.frames_in_flight) >= ready:
            self.runner.stop_block(record.session_id, plan)

    def attach(self, session_id: str, margin_s: float | None = None) -> None:
        """Queue the attach; the hand-over queue is cleared now, so the consumer's timeline starts at the next chunk."""
        record = self.record(session_id)
        if record.projected().state is SessionState.CLOSED:
            raise SessionClosed(f"session is closed ({record.close_reason or 'closing'})")
        self.submit(session_id, Attach(margin_s))
        record.queue.clear()  # no replay: whatever waited belongs to the previous consumer

    def _apply_controls(self) -> None:
        for record in list(self.records.values()):
            while record.controls:
                self._apply(record, record.controls.popleft())

    def _apply(self, record: SessionRecord, control: Control) -> None:
        """The one place a session's state moves: what the control changes is ``applied``'s (``engine/controls.py``);
        here are its effects on the device work to come and on the clocks."""
        if not record.is_open:
            return
        now = time.monotonic()
        record.touch()
        if isinstance(control, Close):
            self._finish(record, control.reason)
            self.wake.set()
            return
        was = record.state
        record.take(applied(record.view(), control, starts_on_attach=record.start_on_attach is not None))
        if was is SessionState.CREATED and record.state is SessionState.ACTIVE:  # `start`, or the attach it waited for
            record.start_on_attach = None
            record.started_at = now
        if isinstance(control, Start) and control.context is not None:
            record.start_context = control.context
        if isinstance(control, (SetPrompt, Reset)) and record.pace:
            log.info("control applied", extra={
                "session_id": record.session_id, "control": type(control).__name__,
                "lead_s": round(record.playout.lead_frames / self.config.fps, 3),
                "ahead_s": round(record.media_seconds_ahead(now), 3), "in_flight": record.works_in_flight})
        if isinstance(control, SetPrompt):
            pending = record.pending_prompt
            # A reset still waiting to be applied must survive a later soft change.
            policy = "reset" if pending is not None and pending.policy == "reset" else control.policy
            record.pending_prompt = PromptUpdate(control.prompt, record.negative_prompt, policy)
            marks.wait_for(record, control.mark, "prompt")
            if policy == "reset":
                self._cut_for_restart(record, now)
            else:
                self._supersede(record, now, policy)
        elif isinstance(control, Resume) and was is SessionState.PAUSED:
            record.playout.restart_clock()  # the clock did not run while paused: the next chunk plays on arrival
        elif isinstance(control, Reset):
            record.pending_reset = True
            record.pending_prompt = None  # the reset restarts with the current prompt
            record.blocks_since_reset = 0
            if control.context is not None:  # a later plain reset keeps a new context still waiting
                record.pending_reset_context = control.context
            marks.restart_carries_prompts(record)
            marks.wait_for(record, control.mark, "reset")
            self._cut_for_restart(record, now)
        elif isinstance(control, Attach):
            record.detached_at = None
            record.playout.margin_s = self.config.playout_margin_s if control.margin_s is None else control.margin_s
            # A new viewer's playback starts at its first chunk.
            if record.playout.anchor is not None:
                record.playout.restart_clock()
        elif isinstance(control, Detach):
            record.detached_at = now
        self.wake.set()

    def _cut_for_restart(self, record: SessionRecord, now: float) -> None:
        """A reset (or a prompt change with policy ``reset``) shows as soon as its first frames can be made: the
        media made ahead and in flight is cut at the first of its frames that plays after that (a paced session),
        or at its start (a best-effort one, or a clock that is not running): ``SessionRecord.restart_cut``. When even the end of what is made and in flight plays too soon, nothing is
        cut: the new content follows it."""
        playout = record.playout
        # The new content follows what is ahead unless a cut below starts it sooner. (The old content's pieces still
        # ahead are never made again: the runner keeps no record of them past the restart.)
        record.content_start = playout.frames_made + record.frames_in_flight
        if not self.config.cut_on_reset or not record.opened_on_device:
            return
        ready = now + self._backlog(now) + self._restart_cost(record) + playout.margin_s
        at = record.restart_cut(ready if record.pace and playout.clock_running else None)
        if at is None:
            if record.deferred_cut is not None:  # a supersede's cut still waits in flight: the new content starts there
                record.deferred_cut = DeferredCut(record.deferred_cut.at, None)
                record.content_start = record.deferred_cut.at
            return  # nothing made or dispatched ahead to drop: the restart simply comes next
        record.content_start = at
        dropped = self._cut(record, at)
        record.cut_pending = True
        log.info("lead cut for a restart", extra={
            "session_id": record.session_id, "at": at, "in_flight_dropped": dropped,
            "ahead_s": round(playout.play_time(at) - now, 3) if playout.clock_running else None})

    def _supersede(self, record: SessionRecord, now: float, policy: str) -> None:
        """A soft or recache prompt change replaces what was made or dispatched ahead: the media is cut at the first
        of its frames that can be made again before it plays, and the runner takes the session back to that frame's
        block and makes it again under the new prompt (``engine/undo.py``) — also a block still on the device
        (its output is dropped from the cut on). Only blocks made since the session's last restart or prompt
        change, and within the runner's last ``undo_blocks``; otherwise the change simply comes with the next
        block."""
        playout = record.playout
        if (not self.undo_blocks or not record.pace or not playout.clock_running or record.cut_pending
                or record.rewind is not None or record.pending_reset or record.deferred_cut is not None):
            return
        start = now + self._backlog(now) + self._control_cost_of(policy) + playout.margin_s
        newest = record.blocks_since_reset - 1 + record.works_in_flight  # the newest block made or in flight
        per_latent = self.geometry.pixel_frames_per_block // self.geometry.frames_per_block
        points = record.cut_points()
        for point, following in zip(points, points[1:]):  # each piece ahead, from ``point.at`` to ``following.at``
            if point.at < record.content_start:
                continue  # an earlier content's (before a reset)
            # The piece's latent frame is made again (a piece a cut trimmed starts inside it) and sent from the
            # first frame it reaches in time: any frame (seventeenth session: a cut only at a piece's start waited
            # for the next one, 0.125 s on average at 16 frames/s).
            skip_latents = (point.at - point.block_start) // per_latent
            ready = start + self._remake_cost(record, skip_latents)
            at = max(point.at, playout.first_frame_playing_from(ready))
            # The block after it must be made in time too: a block made again from its middle costs a whole block
            # but gives only the frames from the cut on (measured on an H100: the standard config's next block was
            # late by up to 0.27 s when only the first rule held).
            block_end = point.block_start + self.geometry.pixel_frames_per_block
            if (at >= following.at
                    or playout.play_time(block_end) < start + self.cost_of(record) + self._first_piece_cost(record)):
                continue
            if point.block < max(1, record.undo_floor) or newest - point.block >= self.undo_blocks:
                return  # not a block the runner keeps (a content's first, one before a change, too old)
            skip_frames = at - point.block_start - skip_latents * per_latent
            dropped = self._cut(record, at, block_start=point.block_start)
            record.cut_pending = True
            record.rewind = Rewind(point.block, skip_latents, skip_frames)
            record.blocks_since_reset = point.block
            log.info("lead superseded", extra={"session_id": record.session_id, "at": at, "block": point.block,
                                                "skip_latents": skip_latents, "skip_frames": skip_frames,
                                                "in_flight_dropped": dropped,
                                                "ahead_s": round(playout.play_time(at) - now, 3)})
            return

    def _cut(self, record: SessionRecord, at: int, *, block_start: int | None = None) -> int:
        """Cut the session's media ahead at frame ``at`` (a block made again, ``block_start`` given: one of
        ``SessionRecord.cut_points``; new content: any frame ahead, ``SessionRecord.restart_cut``); returns the
        frames in flight it dropped. Inside the lead the lead is cut now and everything in flight is dropped (with a
        cut that was waiting in it); inside the media in flight the pieces that begin at ``at`` or later are
        dropped, and the lead is cut once the pieces before it are made (an earlier cut waiting there was later:
        this one replaces it)."""
        dropped = record.in_flight.drop_from(at)
        record.epoch += 1  # work planned before now and dispatched after it (no piece of it queued yet) is dropped too
        if at <= record.playout.frames_made:
            _cut_lead(record, at, block_start)
            record.deferred_cut = None
        else:
            record.deferred_cut = DeferredCut(at, block_start)
        return dropped

    @staticmethod
    def _make_deferred_cut(record: SessionRecord) -> None:
        """The cut waiting inside the media in flight, once all that precedes it is made (or failed). A restart's
        may fall inside the piece made last (its frames before the cut stay); if part of that piece has left
        already, the new content starts at the first frame that has not."""
        cut = record.deferred_cut
        if cut is not None and not record.in_flight.still_to_come_before(cut.at):
            record.deferred_cut = None
            playout = record.playout
            if not record.is_open:
                return
            if cut.block_start is None:
                _cut_lead(record, min(max(cut.at, playout.lead_start), playout.frames_made), None)
            elif playout.lead_start <= cut.at <= playout.frames_made:  # (a piece it falls inside keeps its start)
                _cut_lead(record, cut.at, cut.block_start)

    def _control_cost_of(self, kind: str) -> float:
        learned = self.control_costs.get(kind)
        return learned.seconds if learned is not None and learned.samples else 0.0

    def _restart_cost(self, record: SessionRecord) -> float:
        """Expected device seconds from a restart's work to its first frames: the reset itself, then a first piece."""
        learned = self.control_costs["reset"]
        reset_s = learned.seconds if learned.samples else 0.0
        return reset_s + self._first_piece_cost(record)

    def _remake_cost(self, record: SessionRecord, skip_latents: int) -> float:
        """Expected device seconds from a block made again to its frames from latent frame ``skip_latents`` on: to
        its first piece, then one piece's decode for each latent frame before the cut (decoded again, so the
        decoder's context is what the viewer saw). The pieces after it play a piece's length later each, and a
        piece decodes in less than that."""
        first = self._first_piece_cost(record)
        per_piece = max(0.0, self.cost_of(record) - first) / max(1, self.geometry.frames_per_block - 1)
        return first + skip_latents * per_piece

    def _first_piece_cost(self, record: SessionRecord) -> float:
        """Device seconds from a block's start to its first frames in host memory, as the lead must plan for them:
        the longest of the session's recent blocks (a margin against their jitter), and, while its attention
        window still fills (its first blocks are cheaper than the ones to come), at least a full-window block
        as the warm-up measured it."""
        measured = record.first_piece_cost.recent_peak
        filling = record.blocks_since_reset <= self._window_fill_blocks
        engine_estimate = self.block_cost.seconds or 0.0
        if measured is None:
            return max(self.cost_of(record), engine_estimate)
        return max(measured, engine_estimate) if filling else measured

    def _backlog(self, now: float) -> float:
        """Expected device seconds of work dispatched and not yet done."""
        return max(0.0, self._device_free_at - now) if self._outstanding or self._dispatching else 0.0

    def _settled_before(self, record: SessionRecord) -> int | None:
        """The session's content block before which nothing can be made again any more: the block of its oldest
        unreleased piece, made or in flight (or the next block to be made), so the runner lets go of what older
        blocks held."""
        if not self.undo_blocks:
            return None
        if record.rewind is not None:
            return record.rewind.block  # that block is about to be made again
        return record.cut_points()[0].block

    def lead_target(self, record: SessionRecord) -> float:
        """How far ahead of its viewer a paced session's made media runs before its next block is due: its next
        block's first frames (and the other live sessions' blocks, which may run first) must be made by the time
        they are released, the viewer's margin (``playout_margin_s`` unless its transport asked for another) before
        they play."""
        others = sum(self.cost_of(r) for r in self._open_records()
                     if r is not record and r.pace and r.state is SessionState.ACTIVE)
        return self._first_piece_cost(record) + others + record.playout.margin_s + self._supersede_reserve(record)

    def _supersede_reserve(self, record: SessionRecord) -> float:
        """The lead a prompt change needs to supersede whenever it comes: one block's device time. A block made again
        costs a whole block before the block after it can start, so that block's first piece is in time only if the
        media ahead covers both (``_supersede``'s second rule). Just in time, the media ahead runs from the next
        block's first piece plus the margin at its dispatch to that plus a block's playback less its cost: where a
        block takes most of its playback (the standard config, ~0.53 of 0.75 s) that never covers a second block,
        and a change waited for the next block boundary instead: half a block's playback on average. A live-input
        session's blocks wait for their camera frames, not for a lead. The reserve is made one block at a time: with a
        block of the session still on the device, the next is due by its deadline alone, so a control never waits
        behind a second block queued only to rebuild the reserve (on an H200 the standard config's resets were cut
        0.82-0.86 s ahead with it queued, 0.57-0.76 without the reserve)."""
        if (not self.config.supersede_reserve or not self.undo_blocks or record.live is not None
                or record.works_in_flight):
            return 0.0
        return self.cost_of(record)

    # --- the tick -------------------------------------------------------------------------------
    async def step(self) -> bool:
        """One tick: apply controls, release due media, schedule, dispatch on the device thread. False when idle."""
        self._apply_controls()
        now = time.monotonic()
        self._enforce_limits(now)
        self._release_due(now)
        finished, self._finished = self._finished, []
        plan = self.scheduler.plan(
            self._open_records(),
            finished,
            now,
            block_cost=self.cost_of,
            control_cost=self._control_cost,
            backlog_s=self._backlog(now),
            conditioning_ready=self.conditioning.ready,
            lead_s=self.lead_target,
            cut=lambda record: record.cut_pending,
            settled_before=self._settled_before,
        )
        if plan.empty:
            return False
        tick = self.ticks
        self._mark_planned(plan, tick)
        loop = asyncio.get_running_loop()
        self._start_completer()
        on_pending = functools.partial(loop.call_soon_threadsafe, self._queued)
        # The device is busy with this plan from now (on the CPU it runs it before the dispatch returns): a control
        # arriving meanwhile waits for it.
        expected = sum(self._control_cost(work) + (self.cost_of(self.records[work.session_id]) if work.run else 0.0)
                       for work in plan.work)
        self._device_free_at = max(self._device_free_at, now) + expected
        self._dispatching = True
        if self.runner.stoppable:  # (only where cut_on_reset: engine/startup.py)
            self._current_plan = plan
        try:
            dispatch = await loop.run_in_executor(self._executor, self.runner.dispatch, plan, on_pending)
        except Exception as error:  # the runner itself broke: nothing can be trusted
            log.exception("runner crashed")
            dispatch = Dispatch(fatal=f"runner crashed: {error!r}")
        finally:
            self._dispatching = False
            self._current_plan = None
        if not self._outstanding or dispatch.device_idle:  # (a stopped block's last forwards are done)
            self._device_free_at = time.monotonic()
        self.ticks += 1
        self._dispatched(dispatch)
        return True

    def _dispatched(self, dispatch: Dispatch) -> None:
        """After a plan's dispatch: what failed while it was queued ends its session (or the engine)."""
        for failure in dispatch.failures:
            record = self.records.get(failure.session_id)
            if record is not None:
                self._finish(record, "failed", error=failure.message)
        if dispatch.fatal is not None:
            self._die(dispatch.fatal)

    def _queued(self, pending: PendingWork) -> None:
        """A piece (or a work without one) is queued on the device (called on the loop, in dispatch order): count
        it in flight and have the completion thread wait for it."""
        record = self.records.get(pending.session_id)
        epoch, tick = self._planned.get(pending.session_id, (-1, self.ticks))
        piece = None
        if record is not None:
            if pending.first:
                self._took_input(record, pending)
                if pending.ran:
                    record.works_in_flight += 1
            queued = pending.output
            piece = record.in_flight.queue(
                frames_made=record.playout.frames_made, frames=pending.frames,
                block_index=queued.block_index if queued is not None else record.blocks_since_reset,
                first_of_block=queued is None or queued.first_of_block,
                open_block_start=record.playout.open_block_start, dropped=epoch != record.epoch)
        self._outstanding += 1
        self._all_delivered.clear()
        waited = asyncio.get_running_loop().run_in_executor(self._completions, pending.wait)
        self._completion_queue.put_nowait((pending, piece, waited, tick))

    def _start_completer(self) -> None:
        if self._completer is None:
            self._completion_queue = asyncio.Queue()
            self._completer = asyncio.get_running_loop().create_task(self._complete(), name="arstream-completer")

    async def _complete(self) -> None:
        """Deliver each piece as the device finishes it, in the order queued; a failure ends its session (or,
        device-fatal, the engine)."""
        while True:
            pending, piece, waited, tick = await self._completion_queue.get()
            try:
                output, cost = await waited
                error = None
            except Exception as failure:  # an asynchronous device error surfaces here
                output, cost, error = None, None, failure
            record = self.records.get(pending.session_id)
            if pending.stopped:
                log.info("block stopped for a restart", extra={"session_id": pending.session_id})
            if record is not None:
                if pending.ran and pending.last:
                    record.works_in_flight -= 1
                if piece is not None:
                    record.in_flight.done(piece)
            try:
                if error is not None:
                    raise error
                current = piece is not None and not piece.dropped  # (a stopped block's device time is the session's)
                # Work dropped by a cut is not part of any block the session streams: its device time does not
                # inflate the session's cost per block (which paces its next blocks and the lead).
                self._account(cost, record if current else None)
                if output is not None and current and record.is_open:
                    self._deliver(record, output, pending, tick)  # makes a cut waiting in flight, before release
                elif record is not None and record.deferred_cut is not None:
                    self._make_deferred_cut(record)  # a dropped, empty or failed piece may be the last before it
            except Exception as failure:
                log.warning("session work failed", extra={"session_id": pending.session_id,
                                                          "error": repr(failure)}, exc_info=failure)
                if is_device_fatal(failure):
                    self._die(str(failure))
                elif record is not None:
                    self._finish(record, "failed", error=f"{type(failure).__name__}: {failure}")
            self._outstanding -= 1
            if not self._outstanding:
                self._all_delivered.set()
                if not self._dispatching:
                    self._device_free_at = time.monotonic()  # nothing else in flight: the device is free now
            self.wake.set()  # room for the next block

    async def delivered(self) -> None:
        """Wait until every dispatched piece has completed and been delivered."""
        await self._all_delivered.wait()

    async def drain(self) -> None:
        """Wait for every dispatched work to complete (before a shutdown releases the sessions); no more come."""
        await self.delivered()
        if self._completer is not None:
            self._completer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._completer
        self._completions.shutdown(wait=True)

    def next_wakeup(self) -> float:
        """Seconds until a paced session's next block is due or a piece of its lead is to be released."""
        now = time.monotonic()
        records = self._open_records()
        wait = self.scheduler.next_wakeup(records, now, self.lead_target)
        for record in records:
            if len(record.queue) == 0:
                record.playout.whole_blocks = self.config.media_granularity == "block" or not record.pace
                release = record.playout.next_release_in(now, paced=record.pace)
                if release is not None:
                    wait = min(wait, max(release, RELEASE_RECHECK_S))
        return wait

    def _mark_planned(self, plan: StepPlan, tick: int) -> None:
        """What the plan carries is no longer pending (the one place ``opened_on_device`` is set)."""
        self._planned = {}
        for work in plan.work:
            record = self.records[work.session_id]
            self._planned[work.session_id] = (record.epoch, tick)
            marks.planned(record, work, tick)
            if work.open is not None:
                record.opened_on_device = True
                record.pending_prompt = None
                record.pending_reset = False
                record.pending_reset_context = None
                record.start_context = None  # the runner has the frames now
            if work.reset:
                record.pending_reset = False
                record.pending_reset_context = None
            if work.prompt is not None:
                record.pending_prompt = None
            if work.reset or work.open is not None or work.prompt is not None:
                # Blocks before a change are final: none is made again past it (a recache rewrites their K/V).
                if work.prompt is None or work.prompt.policy == "reset":
                    record.undo_floor = 0  # a new content
                elif work.rewind is not None:
                    record.undo_floor = work.rewind.block  # that block is made again under the new prompt
                else:
                    record.undo_floor = record.blocks_since_reset + record.works_in_flight
                record.cut_pending = False
                record.rewind = None

    def _took_input(self, record: SessionRecord, pending: PendingWork) -> None:
        """The live frames a dispatched block took leave the session's buffer (known at dispatch)."""
        if pending.live_first_seq is not None and pending.input_frames_taken and record.live is not None:
            used, dropped = record.live.consume(pending.live_first_seq, pending.input_frames_taken)
            self._count_input(record, "used", used)
            self._count_input(record, "dropped", dropped)
        if pending.context_frames is not None:
            record.inputs.context_frames = pending.context_frames

    # --- live input (on the event loop, not queued: a frame needs the buffer now) -------------------------
    def set_live(self, session_id: str, strength: float | None, first_step: int | None, *, capacity: int,
                 rate_per_s: float, burst: int, jitter_frames: int = 1, mark: ControlMark | None = None) -> None:
        """Live input on (or its strength changed: frames already waiting stay) or off (``strength`` None).

        Takes effect at once rather than at the tick: frames the client sends right after must find it on.
        ``mark``: follow the change to the first block it shows in."""
        record = self.record(session_id)
        if not record.is_open or record.projected().state is SessionState.CLOSED:
            raise SessionClosed(f"session is closed ({record.close_reason or 'closing'})")
        marks.wait_for(record, mark, "live")
        if strength is None:
            record.live = None
        elif record.live is not None:
            record.live.strength, record.live.first_step = strength, first_step
        else:
            record.live = LiveInput(strength=strength, first_step=first_step, capacity=capacity,
                                    rate_per_s=rate_per_s, burst=burst, jitter_frames=jitter_frames)
        record.touch()
        self.wake.set()

    def admit_frame(self, session_id: str) -> int | None:
        """A frame arrived for the session: its number if it is within the rate (decode it, then :meth:`push_frame`
        it with the number), None if it was dropped. Frames are numbered from 0 in the order they arrive over the
        session's life, dropped ones included: a client that counts the frames it sent while live input was on
        knows which one a chunk names (``Chunk.input_frame``)."""
        record = self.record(session_id)
        if not record.is_open:
            raise SessionClosed("session is closed")
        if record.live is None:
            raise NotLive("live input is off: send a live message first")
        self._count_input(record, "received")
        if record.live.admit(time.monotonic()):
            return record.inputs.frames_received - 1
        self._count_input(record, "dropped")
        return None

    def push_frame(self, session_id: str, frame, number: int | None = None) -> None:
        """A decoded frame joins the session's buffer (the oldest waiting one dropped when it is full)."""
        record = self.records.get(session_id)
        if record is None or not record.is_open or record.live is None:
            return  # ended or switched off while the frame was decoded: it is simply not used
        self._count_input(record, "dropped", record.live.push(frame, number))
        self.wake.set()

    def count_invalid_frame(self, session_id: str) -> None:
        self._count_input(self.records.get(session_id), "invalid")

    def _count_input(self, record: SessionRecord | None, outcome: str, frames: int = 1) -> None:
        """Live frames by outcome (received, used, dropped, invalid): the session's counter and the engine's."""
        if record is not None:
            record.inputs.add(outcome, frames)
        self.input_totals[outcome] += frames

    def _account(self, cost: WorkCost, record: SessionRecord | None) -> None:
        if record is not None:
            record.device_seconds_pending += cost.control_s + cost.block_s
            if cost.first_piece_s is not None and cost.first_piece_s > 0:
                record.first_piece_cost.observe(cost.first_piece_s)
        if cost.controls and cost.control_s > 0:  # costliest first: the time is learned for that kind
            self.control_costs[cost.controls[0]].observe(cost.control_s)

    def _die(self, reason: str) -> None:
        if not self.alive:
            return
        self.alive = False
        self.dead_reason = reason
        log.error("engine dead: device-fatal error", extra={"error": reason})
        for record in self._open_records():
            self._finish(record, "failed", error="the engine's device failed")
        self.wake.set()

    def _deliver(self, record: SessionRecord, output: BlockOutput, pending: PendingWork, tick: int) -> None:
        """A piece of output joins the session's lead (then whatever is due leaves)."""
        now = time.monotonic()
        if output.last_piece and not output.opening_frame:
            # A block's cost is observed once, whole, with its last piece (a split block's with its other frames).
            block_s, record.device_seconds_pending = record.device_seconds_pending, 0.0
            if block_s > 0:
                record.cost.observe(block_s)
                self.block_cost.observe(block_s)
        piece = Piece(
            frames=output.frames,
            block_index=output.block_index,
            timings=output.timings,
            made_at=now,
            audio=output.audio,
            last_of_block=output.last_piece,
            opening=output.opening_frame,
            first_of_block=output.first_of_block,
            marks=marks.shown(record, tick) if output.shows_controls else (),
            input_frame=output.input_frame,
        )
        if record.made(piece, now, tolerance_s=self.config.deadline_tolerance_s):
            self.deadline_misses += 1
            if record.deadline_misses <= LOGGED_MISSES:  # bounded: an overloaded device misses every block
                log.info("deadline missed", extra={
                    "session_id": record.session_id, "pts": piece.pts, "frames": piece.num_frames,
                    "late_s": round(now - record.playout.play_time(piece.pts), 3), "block": piece.block_index,
                    "denoise_ms": round(output.timings.denoise_ms, 1), "decode_ms": round(output.timings.decode_ms, 1),
                    "lead_target_s": round(self.lead_target(record), 3)})
        if output.last_piece:
            # From the block's own index (it restarts with the content), not a count.
            record.blocks_since_reset = output.block_index + 1
            self.blocks += 1
        record.last_timings = output.timings
        record.decoder_state_bytes = output.decoder_state_bytes
        record.encoder_state_bytes = output.encoder_state_bytes
        record.frame_rate.add(now, piece.num_frames)
        if record.deferred_cut is not None:
            self._make_deferred_cut(record)  # before the piece can leave: a restart's cut may fall inside it
        self._release(record, now)

    def _release_due(self, now: float) -> None:
        for record in self._open_records():
            self._release(record, now)

    def _taken(self, session_id: str) -> None:
        """The consumer took a chunk: its session may run again, and its next due piece may leave."""
        self.wake.set()
        record = self.records.get(session_id)
        if record is not None and record.is_open:
            self._release(record, time.monotonic())

    def _release(self, record: SessionRecord, now: float) -> None:
        """Hand the session's due media to its consumer once its queue has room (``engine/playout.py``), and arm a
        timer for the next piece: a piece leaves on time whatever the engine loop is waiting for (on the CPU a
        tick waits for its block)."""
        playout = record.playout
        if record.release_timer is not None:
            record.release_timer.cancel()
            record.release_timer = None
        # A best-effort session (a batch job, a benchmark) gets whole blocks: fewer, larger chunks.
        playout.whole_blocks = self.config.media_granularity == "block" or not record.pace
        if len(record.queue):
            return  # the consumer taking the chunk in it comes back here
        if playout.due(now, paced=record.pace):
            released = playout.release(now, paced=record.pace)
            piece = marks.stamp(record, released.piece, now)
            if released.started_clock:
                record.first_release(now)
            record.queue.put_nowait(Chunk(
                session_id=record.session_id,
                index=playout.chunks_released - 1,
                pts=piece.pts,
                frames=piece.frames,
                audio=piece.audio,
                audio_start=piece.audio_start,
                block_index=piece.block_index,
                timings=piece.timings,
                ready_at=now_ms(),
                marks=piece.marks,
                starts_clock=released.started_clock,
                input_frame=piece.input_frame,
            ))
            return
        wait = playout.next_release_in(now, paced=record.pace)
        if wait is not None:
            record.release_timer = asyncio.get_running_loop().call_later(
                wait, lambda: record.is_open and self._release(record, time.monotonic()))

    def _enforce_limits(self, now: float) -> None:
        """End sessions past their grace period, idle timeout or maximum duration."""
        config = self.config
        for record in self._open_records():
            if now - record.created_at > config.max_session_s:
                self._finish(record, "max_duration")
            elif record.detached_at is not None and now - record.detached_at > config.detach_grace_s:
                self._finish(record, "idle_timeout")
            elif record.state in (SessionState.CREATED, SessionState.PAUSED) and (
                now - record.last_active > config.idle_timeout_s
            ):
                self._finish(record, "idle_timeout")

    # --- the one finish path ---------------------------------------------------------------------
    def _finish(self, record: SessionRecord, reason: str, error: str | None = None) -> None:
        if not record.is_open:
            return
        record.state = SessionState.CLOSED
        record.close_reason = reason
        record.error = error
        record.ended_at = time.monotonic()
        record.controls.clear()
        record.pending_prompt = None
        record.pending_reset = False
        record.pending_reset_context = None
        record.start_context = None
        record.live = None  # its frames are released with it
        record.decoder_state_bytes = 0
        record.encoder_state_bytes = 0
        record.playout.pieces.clear()  # the lead goes with it
        record.marks.clear()
        if record.release_timer is not None:
            record.release_timer.cancel()
            record.release_timer = None
        record.queue.end()
        self.kv.unreserve(record.session_id)
        if record.opened_on_device:
            # The runner may have released it already (a failed step): releasing again is a no-op.
            self._finished.append(FinishedSession(record.session_id, reason))
        self.wake.set()

    def end_now(self, session_id: str, reason: str) -> None:
        """Apply the session's queued controls, then end it through the finish path (for callers that
        must forget it at once)."""
        record = self.record(session_id)
        while record.controls:
            self._apply(record, record.controls.popleft())
        self._finish(record, reason)

    def finish_all(self, reason: str) -> None:
        for record in self._open_records():
            self._finish(record, reason)

    def take_finished(self) -> list[FinishedSession]:
        finished, self._finished = self._finished, []
        return finished

    def forget(self, session_id: str) -> None:
        """Drop an ended session's record (whoever shows it to clients calls this after its retention)."""
        record = self.records.get(session_id)
        if record is not None and not record.is_open:
            del self.records[session_id]

    # --- reading --------------------------------------------------------------------------------
    def record(self, session_id: str) -> SessionRecord:
        record = self.records.get(session_id)
        if record is None:
            raise UnknownSession("unknown session")
        return record

    def _open_records(self) -> list[SessionRecord]:
        return [r for r in self.records.values() if r.is_open]

    def cost_of(self, record: SessionRecord) -> float:
        """Expected device seconds of the session's next block: its own estimate, else the engine's."""
        if record.cost.samples:
            return record.cost.seconds
        return self.block_cost.seconds or 0.0

    def _control_cost(self, work: SessionWork) -> float:
        """Expected device seconds of the work's controls that re-run forwards (a block each until learned)."""
        total = 0.0
        for kind in work.control_kinds:
            if kind in FORWARD_CONTROL_KINDS:
                learned = self.control_costs[kind]
                total += learned.seconds if learned.samples else (self.block_cost.seconds or 0.0)
        return total

    def live_capacity(self) -> int | None:
        live = [self.cost_of(r) for r in self._open_records() if r.pace]
        return self.policy.live_capacity(live, self.block_cost.seconds)

    def _utilisation(self) -> float:
        running = [r for r in self._open_records() if r.pace and r.state is SessionState.ACTIVE]
        return self.policy.utilisation([self.cost_of(r) for r in running])

    @staticmethod
    def _below_realtime(record: SessionRecord, utilisation: float) -> bool:
        """The live sessions' measured demand exceeds the device, and this one is missing deadlines because of it."""
        return utilisation > 1.0 and any(record.recent_misses)

    def status(self, session_id: str) -> SessionStatus:
        return self.statuses([self.record(session_id)])[0]

    def statuses(self, records: list[SessionRecord] | None = None) -> list[SessionStatus]:
        """Snapshots of ``records`` (default: every session the core knows, ended ones still kept included);
        the engine-wide figures they show are taken once."""
        utilisation, live_capacity, draining = self._utilisation(), self.live_capacity(), self._draining()
        return [
            session_status(record, draining=draining, below_realtime=self._below_realtime(record, utilisation),
                           live_capacity=live_capacity, unknown_words=self.unknown_words)
            for record in (self.records.values() if records is None else records)
        ]

    def counters(self, *, ready: bool) -> EngineCounters:
        by_state: dict[str, int] = {}
        draining = self._draining()
        for record in self.records.values():
            state = shown_state(record.projected(), draining=draining)
            by_state[state] = by_state.get(state, 0) + 1
        open_records = self._open_records()
        live = [r for r in open_records if r.pace]
        utilisation = self._utilisation()
        below = sum(1 for r in live if r.state is SessionState.ACTIVE and self._below_realtime(r, utilisation))
        cost = self.block_cost.seconds
        return EngineCounters(
            ready=ready,
            alive=self.alive,
            draining=draining,
            ticks=self.ticks,
            blocks=self.blocks,
            capacity=self.capacity,
            live_capacity=self.live_capacity(),
            realtime_admission=self.policy.enabled,
            block_cost_ms=cost * 1000.0 if cost is not None else None,
            realtime_utilisation=utilisation,
            sessions_by_state=by_state,
            live_sessions=len(live),
            live_sessions_below_realtime=below,
            deadline_misses=self.deadline_misses,
            refused_realtime=self.refused_realtime,
            kv_blocks_total=self.kv.block_pool.num_blocks,
            kv_blocks_in_use=self.kv.blocks_in_use,
            decoder_state_bytes=sum(r.decoder_state_bytes for r in open_records),
            encoder_state_bytes=sum(r.encoder_state_bytes for r in open_records),
            input_frames=dict(self.input_totals),
            live_input_sessions=sum(1 for r in open_records if r.live is not None),
            queue_depths=tuple(len(r.queue) for r in open_records),
            lead_seconds=tuple(r.playout.lead_frames / self.config.fps for r in open_records),
            session_frames_per_second=tuple(
                r.frame_rate.per_second() for r in open_records if r.state is SessionState.ACTIVE
            ),
            session_deadline_misses=tuple(r.deadline_misses for r in live),
            **self._device_memory(),
        )

    def _device_memory(self) -> dict[str, int | None]:
        device = torch.device(self.config.device)
        if device.type != "cuda":
            return {}
        return {"device_memory_peak_bytes": torch.cuda.max_memory_reserved(device),
                "device_memory_limit_bytes": allocator_limit_bytes(self.config)}


def _cut_lead(record: SessionRecord, at: int, block_start: int | None) -> None:
    """The session's lead cut at ``at`` (``Playout.cut``); the marks of the pieces it drops wait again
    (``marks.requeue_cut``)."""
    marks.requeue_cut(record, at)
    record.playout.cut(at, block_start=block_start)
