"""The engine core: the one owner of every session, the scheduler and the runner.

``step()`` is the whole engine in three calls::

    apply queued controls, enforce timeouts
    schedule   → a StepPlan (the only thing that crosses to the device thread)
    dispatch   → Runner.dispatch(plan) on the device thread: the plan's work is queued on the device
    complete   → as each work finishes on the device (waited for on a second thread, so the next
                 tick can be dispatched meanwhile): deliver its chunk, count costs and deadlines

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
from engine.live_input import LiveInput
from engine.plan import CONTROL_KINDS, FORWARD_CONTROL_KINDS, FinishedSession, PromptUpdate, SessionWork, StepPlan
from engine.realtime import RealtimePolicy, RunningCost, clamp_retry_after
from engine.runner import BlockOutput, Dispatch, PendingWork, WorkCost, is_device_fatal
from engine.scheduler import Scheduler
from engine.session import Chunk, ChunkQueue, new_session_id, now_ms
from engine.session_record import MAX_PENDING_CONTROLS, SessionRecord
from engine.startup import BuiltEngine
from engine.snapshots import session_status, shown_state
from engine.status import AdmissionOutlook, EngineCounters, SessionStatus

log = logging.getLogger("arstream.engine")


class EngineCore:
    def __init__(
        self, config: EngineConfig, built: BuiltEngine, executor: ThreadPoolExecutor,
        draining: Callable[[], bool] = lambda: False,
    ) -> None:
        """``draining``: whether the engine drains (its owner's flag; snapshots and the outlook show it)."""
        self.config = config
        self._draining = draining
        self.runner = built.runner
        self.kv = built.runner.kv_manager
        self.unknown_words = built.runner.pipeline.text_encoder.unknown_words  # what the model cannot read
        self.conditioning = Conditioning(built.runner.pipeline.embeddings, config.kv_branch_names)
        self.capacity = built.capacity
        self.per_session_bytes = built.per_session_bytes
        self.geometry = built.geometry
        self._executor = executor
        self.records: dict[str, SessionRecord] = {}
        self._finished: list[FinishedSession] = []
        # Completions are waited for here, so the device thread is free to dispatch the next tick meanwhile.
        self._completions = ThreadPoolExecutor(max_workers=1, thread_name_prefix="arstream-completion")
        self._completing: set[asyncio.Task] = set()
        self._device_free_at = 0.0  # monotonic: when the device is expected to finish what was dispatched
        self.scheduler = Scheduler(
            fps=config.fps,
            frames_per_chunk=self.geometry.pixel_frames_per_block,
            lead_chunks=config.lead_chunks,
            ticks_per_block=built.ticks_per_block,
            blocks_in_flight=config.resolved_blocks_in_flight,
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
        record = SessionRecord(
            session_id=session_id,
            seed=seed,
            pace=pace,
            queue=ChunkQueue(overlap=self.config.overlap_encode, on_taken=self.wake.set),
            cost=RunningCost(),
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
        self.wake.set()
        return new_state

    def attach(self, session_id: str) -> None:
        """Queue the attach; the hand-over queue is cleared now, so the consumer's timeline starts at the next chunk."""
        record = self.record(session_id)
        if record.projected().state is SessionState.CLOSED:
            raise SessionClosed(f"session is closed ({record.close_reason or 'closing'})")
        self.submit(session_id, Attach())
        record.queue.clear()  # no replay: whatever waited belongs to the previous consumer
        record.held = None

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
        if isinstance(control, SetPrompt):
            pending = record.pending_prompt
            # A reset still waiting to be applied must survive a later soft change.
            policy = "reset" if pending is not None and pending.policy == "reset" else control.policy
            record.pending_prompt = PromptUpdate(control.prompt, record.negative_prompt, policy)
        elif isinstance(control, Resume) and was is SessionState.PAUSED:
            record.reanchor = True  # the clock did not run while paused: the next chunk plays on arrival
        elif isinstance(control, Reset):
            record.pending_reset = True
            record.pending_prompt = None  # the reset restarts with the current prompt
            record.blocks_since_reset = 0
            if control.context is not None:  # a later plain reset keeps a new context still waiting
                record.pending_reset_context = control.context
        elif isinstance(control, Attach):
            record.detached_at = None
            record.reanchor = record.playback_anchor is not None  # a new viewer's playback starts at its first chunk
        elif isinstance(control, Detach):
            record.detached_at = now
        self.wake.set()

    # --- the tick -------------------------------------------------------------------------------
    async def step(self) -> bool:
        """One tick: apply controls, schedule, dispatch on the device thread. False when idle."""
        self._apply_controls()
        self._release_held()
        now = time.monotonic()
        self._enforce_limits(now)
        finished, self._finished = self._finished, []
        plan = self.scheduler.plan(
            self._open_records(),
            finished,
            now,
            block_cost=self.cost_of,
            control_cost=self._control_cost,
            backlog_s=max(0.0, self._device_free_at - now) if self._completing else 0.0,
            conditioning_ready=self.conditioning.ready,
        )
        if plan.empty:
            return False
        self._mark_planned(plan)
        loop = asyncio.get_running_loop()
        try:
            dispatch = await loop.run_in_executor(self._executor, self.runner.dispatch, plan)
        except Exception as error:  # the runner itself broke: nothing can be trusted
            log.exception("runner crashed")
            dispatch = Dispatch(fatal=f"runner crashed: {error!r}")
        self.ticks += 1
        self._dispatched(dispatch, now)
        return True

    def _dispatched(self, dispatch: Dispatch, planned_at: float) -> None:
        for failure in dispatch.failures:
            record = self.records.get(failure.session_id)
            if record is not None:
                self._finish(record, "failed", error=failure.message)
        if dispatch.fatal is not None:
            self._die(dispatch.fatal)
        if not dispatch.pending:
            return
        expected = 0.0
        for pending in dispatch.pending:
            record = self.records.get(pending.session_id)
            if record is not None:
                self._took_input(record, pending)
            if record is not None and pending.ran:
                record.works_in_flight += 1
                record.frames_in_flight += pending.frames
                expected += self.cost_of(record)
        self._device_free_at = max(self._device_free_at, planned_at) + expected
        # Every wait is submitted now, in dispatch order: the completion thread runs them first in, first out,
        # so a session's chunks are delivered in order even when two ticks are in flight.
        loop = asyncio.get_running_loop()
        waits = [loop.run_in_executor(self._completions, pending.wait) for pending in dispatch.pending]
        task = loop.create_task(self._complete(dispatch.pending, waits))
        self._completing.add(task)
        task.add_done_callback(self._completing.discard)

    async def _complete(self, pending: list[PendingWork], waits: list[asyncio.Future]) -> None:
        """Deliver each work's chunk as the device finishes it; a failure ends its session (or, device-fatal,
        the engine)."""
        for work, wait in zip(pending, waits):
            try:
                output, cost = await wait
                error = None
            except Exception as failure:  # an asynchronous device error surfaces here
                output, cost, error = None, None, failure
            record = self.records.get(work.session_id)
            if record is not None and work.ran:
                record.works_in_flight -= 1
                record.frames_in_flight -= work.frames
            try:
                if error is not None:
                    raise error
                self._account(cost)
                if output is not None and record is not None and record.is_open:
                    self._deliver(record, output)
            except Exception as failure:
                log.warning("session work failed", extra={"session_id": work.session_id, "error": repr(failure)},
                            exc_info=failure)
                if is_device_fatal(failure):
                    self._die(str(failure))
                elif record is not None:
                    self._finish(record, "failed", error=f"{type(failure).__name__}: {failure}")
        if not self._completing - {asyncio.current_task()}:
            self._device_free_at = time.monotonic()  # nothing else in flight: the device is free now
        self.wake.set()  # room for the next block

    async def delivered(self) -> None:
        """Wait until every dispatched work has completed and its chunk was delivered."""
        while self._completing:
            await asyncio.gather(*self._completing, return_exceptions=True)

    async def drain(self) -> None:
        """Wait for every dispatched work to complete (before a shutdown releases the sessions); no more come."""
        await self.delivered()
        self._completions.shutdown(wait=True)

    def next_wakeup(self) -> float:
        return self.scheduler.next_wakeup(self._open_records(), time.monotonic())

    def _mark_planned(self, plan: StepPlan) -> None:
        """What the plan carries is no longer pending (the one place ``opened_on_device`` is set)."""
        for work in plan.work:
            record = self.records[work.session_id]
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
                 rate_per_s: float, burst: int) -> None:
        """Live input on (or its strength changed: frames already waiting stay) or off (``strength`` None).

        Takes effect at once rather than at the tick: frames the client sends right after must find it on."""
        record = self.record(session_id)
        if not record.is_open or record.projected().state is SessionState.CLOSED:
            raise SessionClosed(f"session is closed ({record.close_reason or 'closing'})")
        if strength is None:
            record.live = None
        elif record.live is not None:
            record.live.strength, record.live.first_step = strength, first_step
        else:
            record.live = LiveInput(strength=strength, first_step=first_step, capacity=capacity,
                                    rate_per_s=rate_per_s, burst=burst)
        record.touch()
        self.wake.set()

    def admit_frame(self, session_id: str) -> bool:
        """A frame arrived for the session: within its rate (decode it, then :meth:`push_frame`) or dropped."""
        record = self.record(session_id)
        if not record.is_open:
            raise SessionClosed("session is closed")
        if record.live is None:
            raise NotLive("live input is off: send a live message first")
        self._count_input(record, "received")
        if record.live.admit(time.monotonic()):
            return True
        self._count_input(record, "dropped")
        return False

    def push_frame(self, session_id: str, frame) -> None:
        """A decoded frame joins the session's buffer (the oldest waiting one dropped when it is full)."""
        record = self.records.get(session_id)
        if record is None or not record.is_open or record.live is None:
            return  # ended or switched off while the frame was decoded: it is simply not used
        self._count_input(record, "dropped", record.live.push(frame))
        self.wake.set()

    def count_invalid_frame(self, session_id: str) -> None:
        self._count_input(self.records.get(session_id), "invalid")

    def _count_input(self, record: SessionRecord | None, outcome: str, frames: int = 1) -> None:
        """Live frames by outcome (received, used, dropped, invalid): the session's counter and the engine's."""
        if record is not None:
            record.inputs.add(outcome, frames)
        self.input_totals[outcome] += frames

    def _account(self, cost: WorkCost) -> None:
        record = self.records.get(cost.session_id)
        if record is not None:
            record.device_seconds_pending += cost.control_s + cost.block_s
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

    def _release_held(self) -> None:
        """A chunk held back for a slow consumer enters its queue once the consumer took the one before."""
        for record in self._open_records():
            if record.held is not None and len(record.queue) == 0:
                chunk, record.held = record.held, None
                record.queue.put_nowait(chunk)

    def _deliver(self, record: SessionRecord, output: BlockOutput) -> None:
        now = time.monotonic()
        if not output.opening_frame:  # a split block's cost is observed once, whole, with its other frames
            block_s, record.device_seconds_pending = record.device_seconds_pending, 0.0
            if block_s > 0:
                record.cost.observe(block_s)
                self.block_cost.observe(block_s)
        timings = output.timings
        chunk = Chunk(
            session_id=record.session_id,
            index=record.chunks_emitted,
            pts=record.frames_emitted,
            frames=output.frames,
            audio=output.audio,
            audio_start=record.audio_samples_emitted,
            block_index=output.block_index,
            timings=timings,
            ready_at=now_ms(),
        )
        if record.keep_time(chunk.pts, now, fps=self.config.fps, tolerance_s=self.config.deadline_tolerance_s):
            self.deadline_misses += 1
        if output.opening_frame:
            # A preview ahead of its block: playback (and deadlines) start with the block's other frames.
            record.reanchor = True
        record.chunks_emitted += 1
        record.frames_emitted += int(output.frames.shape[0])
        if output.audio is not None:
            record.audio_samples_emitted += int(output.audio.shape[1])
        if not output.opening_frame:
            # From the block's own index (it restarts with the content), not a count: chunks of the old content
            # that were on the device when a reset applied still arrive after it.
            record.blocks_since_reset = output.block_index + 1
            self.blocks += 1
        record.last_timings = timings
        record.decoder_state_bytes = output.decoder_state_bytes
        record.encoder_state_bytes = output.encoder_state_bytes
        record.frame_rate.add(now, int(output.frames.shape[0]))
        if len(record.queue) == 0 and record.held is None:
            record.queue.put_nowait(chunk)
        elif record.held is None:  # the previous chunk still waits for its consumer (dispatched before it was taken)
            record.held = chunk
        else:
            raise RuntimeError("a chunk is already held back; the scheduler must not run this session")

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
        record.held = None
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
