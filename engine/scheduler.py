"""Which sessions run this tick: live sessions by deadline, best-effort sessions in what is left.

The scheduler reads the core's session records and cost estimates and returns
a :class:`StepPlan`; it changes nothing (the core marks what the plan carried).

A session runs at most one block per tick. It is skipped while paused, while
its lead — media made and not yet handed to its consumer (``engine/playout.py``)
— holds ``lead_chunks`` blocks (a slow client pauses itself, not the engine),
and, with pacing on, until its next block is due: a paced session's block runs
*just in time*, once the media made runs less than its lead target (``lead_s``:
the time its next block's first frames take to make, other live sessions' blocks
that may run first, and the playout margin) ahead of its playback clock. So a
control waits behind as little made media as keeps the viewer's playback smooth.

A session may have ``blocks_in_flight`` works dispatched and not yet delivered
(2 on a GPU: block N+1 is queued while the device still runs block N, so the
GPU never waits for the host between blocks); their frames count as emitted
for pacing, and the device time still queued ahead of a tick (``backlog_s``)
delays its end. A tick's blocks finish one after another on the device; the
scheduler plans as if the tick's blocks were delivered together at its end
(every block of a tick waits for the others — an upper bound). Hence:

* live sessions (pacing on) run when due, nearest deadline first; one that
  is ahead of its clock waits a tick when its block would make a more
  urgent one miss (the tick ends later with every block it holds);
* a best-effort session (pacing off) joins a tick only if, with its block
  added, every live session still meets its next deadline — this tick's
  members at the tick's end (a late member blocks it), the others one block
  after it. Best-effort sessions are what slows down first;
* so does a live session's expensive control (a ``recache`` prompt change, a
  reset, counted in its cost), unless waiting would make its own session miss.

Best-effort sessions rotate so none is always served last. With ``batch_sessions`` > 1 a tick that runs a live
session's plain block also takes live sessions due within one more block (``_fill_batch``), so their blocks
share one batched forward (engine/runner.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.controls import SessionState
from engine.plan import FinishedSession, OpenSession, SessionWork, StepPlan
from engine.session import now_ms
from engine.session_record import SessionRecord


@dataclass
class _Candidate:
    record: SessionRecord
    work: SessionWork
    cost_s: float  # expected device time of this work
    extra_s: float  # of which controls (open, reset, prompt)
    deadline: float | None


RECHECK_S = 0.005  # the soonest an idle loop looks again at a session that may run


class Scheduler:
    def __init__(
        self, *, fps: int, frames_per_chunk: int, lead_chunks: int, ticks_per_block: int = 1, blocks_in_flight: int = 1,
        overlap: bool = True, batch_sessions: int = 1,
    ) -> None:
        self.fps = fps
        self.frames_per_chunk = frames_per_chunk
        self.lead_frames = lead_chunks * frames_per_chunk  # the most a session's lead and work in flight hold
        self.lead_seconds = self.lead_frames / fps
        self.ticks_per_block = ticks_per_block  # stepwise mode: a block takes several ticks
        self.blocks_in_flight = blocks_in_flight
        self.overlap = overlap  # False: a block only once the previous one's media is on the wire
        self.batch_sessions = batch_sessions  # > 1: live sessions due within a block join a tick's batch
        self._cursor = 0

    def pacing_allows(self, session: SessionRecord, now: float, lead_s: float) -> bool:
        """A paced session's next block is due: its made media runs less than ``lead_s`` ahead of its viewer."""
        return not session.pace or session.media_seconds_ahead(now) < min(lead_s, self.lead_seconds)

    def next_wakeup(self, sessions: Sequence[SessionRecord], now: float,
                    lead_s: Callable[[SessionRecord], float] = lambda session: math.inf) -> float:
        """Seconds until a paced session's next block is due (inf if none is waiting on pacing).

        A session that may run already (the tick that found nothing to do was planned before its
        consumer freed it, or the scheduler held it back) is looked at again within ``RECHECK_S``:
        never a whole idle poll, which would stall a live stream by up to a second.
        """
        waits = [
            session.media_seconds_ahead(now) - min(lead_s(session), self.lead_seconds)
            for session in sessions
            if session.state is SessionState.ACTIVE and session.pace and self._has_room(session)
        ]
        if not waits:
            return math.inf
        return max(min(waits), RECHECK_S)

    def plan(
        self,
        sessions: Sequence[SessionRecord],
        finished: list[FinishedSession],
        now: float,
        *,
        block_cost: Callable[[SessionRecord], float],
        control_cost: Callable[[SessionWork], float],
        backlog_s: float = 0.0,
        conditioning_ready: Callable[[str, str], bool] = lambda prompt, negative_prompt: True,
        lead_s: Callable[[SessionRecord], float] = lambda session: math.inf,
        cut: Callable[[SessionRecord], bool] = lambda session: False,
        settled_before: Callable[[SessionRecord], int | None] = lambda session: None,
    ) -> StepPlan:
        """``backlog_s``: expected device seconds of work dispatched earlier and not yet done (this tick runs
        after it). ``conditioning_ready(prompt, negative_prompt)``: whether a prompt's embeddings are there (a
        session opens, or changes its prompt, only then; with text encoded in the background). ``lead_s``: a
        paced session's lead target (seconds of made media its next block is due below). ``cut``: whether the
        session's lead was cut for the restart or prompt change it waits to carry (nothing else runs before it).
        ``settled_before``: the session's block before which nothing will be made again (told to the runner)."""
        start = now + backlog_s
        candidates = []
        for session in sessions:
            work = self._work_for(session, now, conditioning_ready, lead_s(session), cut(session),
                                  settled_before(session))
            if work is None:
                continue
            extra = control_cost(work)
            cost = extra + (block_cost(session) / self.ticks_per_block if work.run else 0.0)
            candidates.append(_Candidate(session, work, cost, extra, session.next_deadline()))
        live = sorted((c for c in candidates if c.record.pace), key=lambda c: -math.inf if c.deadline is None else c.deadline)
        best_effort = [c for c in candidates if not c.record.pace]
        if best_effort:
            first = self._cursor % len(best_effort)
            best_effort = best_effort[first:] + best_effort[:first]
            self._cursor += 1
        waiting_live = [
            s
            for s in sessions
            if s.pace and s.state is SessionState.ACTIVE and s.detached_at is None and s.next_deadline() is not None
        ]

        members: list[_Candidate] = []
        for candidate in live:
            members.append(candidate)
            if len(members) > 1 and not self._fits(members, waiting_live, start, block_cost):
                # Its block (or its costly control) would make a more urgent member miss: it waits a
                # tick if it can afford to, i.e. still makes its own deadline one tick later.
                can_wait = candidate.deadline is not None and (
                    start + self._length(members[:-1]) + candidate.cost_s <= candidate.deadline
                )
                if can_wait and self._fits(members[:-1], waiting_live, start, block_cost):
                    members.pop()
        if self.batch_sessions > 1:
            self._fill_batch(members, sessions, now, conditioning_ready, lead_s, cut, settled_before, waiting_live,
                             start, block_cost)
        for candidate in best_effort:
            members.append(candidate)
            if not self._fits(members, waiting_live, start, block_cost):
                members.pop()
        return StepPlan(finished=list(finished), work=[c.work for c in members], planned_at=now_ms())

    def _fill_batch(self, members: list[_Candidate], sessions: Sequence[SessionRecord], now: float,
                    conditioning_ready, lead_s, cut, settled_before, waiting_live, start: float, block_cost) -> None:
        """Batching on: a tick that runs a live session's plain block takes other live sessions whose next block
        would be due within one more block's playback, up to ``batch_sessions`` plain blocks, if every live
        session still makes its deadline: the runner makes their blocks in one forward a step, each at its
        share of the batch's cost, where apart they would take turns. Without this, live sessions' deadlines
        drift apart and their blocks seldom meet in one tick. A joining session's lead grows by one block at most
        (and stays within ``lead_chunks``)."""
        plain = sum(1 for c in members if c.record.pace and c.work.plain_block)
        if not plain or plain >= self.batch_sessions:
            return
        taken = {c.record.session_id for c in members}
        block_s = self.frames_per_chunk / self.fps
        for session in sessions:
            if plain >= self.batch_sessions:
                return
            if session.session_id in taken or not session.pace or session.state is not SessionState.ACTIVE:
                continue
            work = self._work_for(session, now, conditioning_ready, lead_s(session) + block_s, cut(session),
                                  settled_before(session))
            if work is None or not work.plain_block:
                continue
            members.append(_Candidate(session, work, block_cost(session) / self.ticks_per_block, 0.0,
                                      session.next_deadline()))
            if self._fits(members, waiting_live, start, block_cost):
                plain += 1
            else:
                members.pop()

    @staticmethod
    def _length(members: list[_Candidate]) -> float:
        return sum(c.cost_s for c in members)

    def _fits(
        self, members: list[_Candidate], live: list[SessionRecord], start: float, block_cost: Callable[[SessionRecord], float]
    ) -> bool:
        """Every live session still makes its next deadline with this tick.

        A live member of the tick that is late already must not be made later still. A live session
        outside the tick counts only while it can still be saved (it runs one block after the tick);
        one that cannot — its consumer stalled, say — must not hold the others back forever.
        """
        tick_end = start + self._length(members)
        in_tick = {c.record.session_id for c in members if c.work.run}
        for session in live:
            deadline = session.next_deadline()
            own = block_cost(session)
            if session.session_id in in_tick:
                if tick_end > deadline:
                    return False
            elif tick_end + own > deadline and start + own <= deadline:
                return False
        return True

    def _work_for(
        self, session: SessionRecord, now: float, conditioning_ready: Callable[[str, str], bool], lead_s: float,
        cut: bool, settled_before: int | None,
    ) -> SessionWork | None:
        if session.state not in (SessionState.ACTIVE, SessionState.PAUSED) or session.prompt is None:
            return None
        open_request = None
        if not session.opened_on_device:
            if not conditioning_ready(session.prompt, session.negative_prompt):
                return None  # its prompt is still being encoded: nothing of it runs before that
            open_request = OpenSession(session.seed, session.prompt, session.negative_prompt, session.start_context)
        # The open already carries the current prompt and a fresh start.
        reset = session.pending_reset and open_request is None
        prompt = session.pending_prompt if open_request is None else None
        if prompt is not None and not conditioning_ready(prompt.prompt, prompt.negative_prompt):
            prompt = None  # the session goes on with its current prompt until the new one is encoded
        run = session.state is SessionState.ACTIVE and self._has_room(session) and self.pacing_allows(session, now, lead_s)
        if open_request is None and not reset and prompt is None and not run:
            return None
        # Live input is offered, not taken: the runner says how many frames the block used (none when this
        # work does not begin a block), and the core drops exactly those.
        live = session.live.offer(self.frames_per_chunk) if run and session.live is not None else None
        restarts = reset or (prompt is not None and prompt.policy == "reset")
        carried = restarts or (prompt is not None and session.rewind is not None)
        if cut and not carried and open_request is None:
            return None  # its lead was cut for a control still waiting (its prompt being encoded): nothing else first
        return SessionWork(session.session_id, open=open_request, reset=reset,
                           reset_context=session.pending_reset_context if reset else None, prompt=prompt, run=run,
                           live=live, cut=cut and restarts, rewind=session.rewind if prompt is not None else None,
                           settled_before=settled_before)

    def _has_room(self, session: SessionRecord) -> bool:
        """Its lead and its work in flight hold less than ``lead_chunks`` blocks, and fewer than
        ``blocks_in_flight`` works of it are on the device: a slow consumer pauses its own session. Without
        overlap, the previous media must be on the wire first (nothing waits, nothing is in the consumer's hand)."""
        if not self.overlap and (session.playout.lead_frames or not session.queue.accepts_next):
            return False
        return (session.playout.lead_frames + session.frames_in_flight < self.lead_frames
                and session.works_in_flight < self.blocks_in_flight)
