"""Which sessions run this tick: live sessions by deadline, best-effort sessions in what is left.

The scheduler reads the core's session records and cost estimates and returns
a :class:`StepPlan`; it changes nothing (the core marks what the plan carried).

A session runs at most one block per tick. It is skipped while paused, until
its consumer has taken its previous chunk and asked for the next (a slow client
pauses itself, not the engine; see ``ChunkQueue``), and, with pacing on, while
its media runs ``lead_chunks`` blocks ahead of its playback clock.

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

Best-effort sessions rotate so none is always served last.
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
        self, *, fps: int, frames_per_chunk: int, lead_chunks: int, ticks_per_block: int = 1, blocks_in_flight: int = 1
    ) -> None:
        self.fps = fps
        self.frames_per_chunk = frames_per_chunk
        self.lead_seconds = lead_chunks * frames_per_chunk / fps
        self.ticks_per_block = ticks_per_block  # stepwise mode: a block takes several ticks
        self.blocks_in_flight = blocks_in_flight
        self._cursor = 0

    def pacing_allows(self, session: SessionRecord, now: float) -> bool:
        return not session.pace or session.media_seconds_ahead(now, self.fps) < self.lead_seconds

    def next_wakeup(self, sessions: Sequence[SessionRecord], now: float) -> float:
        """Seconds until a paced session may run again (inf if none is waiting on pacing).

        A session that may run already (the tick that found nothing to do was planned before its
        consumer freed it, or the scheduler held it back) is looked at again within ``RECHECK_S``:
        never a whole idle poll, which would stall a live stream by up to a second.
        """
        waits = [
            session.media_seconds_ahead(now, self.fps) - self.lead_seconds
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
    ) -> StepPlan:
        """``backlog_s``: expected device seconds of work dispatched earlier and not yet done (this tick runs
        after it). ``conditioning_ready(prompt, negative_prompt)``: whether a prompt's embeddings are there (a
        session opens, or changes its prompt, only then; with text encoded in the background)."""
        start = now + backlog_s
        candidates = []
        for session in sessions:
            work = self._work_for(session, now, conditioning_ready)
            if work is None:
                continue
            extra = control_cost(work)
            cost = extra + (block_cost(session) / self.ticks_per_block if work.run else 0.0)
            candidates.append(_Candidate(session, work, cost, extra, session.next_deadline(self.fps)))
        live = sorted((c for c in candidates if c.record.pace), key=lambda c: -math.inf if c.deadline is None else c.deadline)
        best_effort = [c for c in candidates if not c.record.pace]
        if best_effort:
            first = self._cursor % len(best_effort)
            best_effort = best_effort[first:] + best_effort[:first]
            self._cursor += 1
        waiting_live = [
            s
            for s in sessions
            if s.pace and s.state is SessionState.ACTIVE and s.detached_at is None and s.next_deadline(self.fps) is not None
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
        for candidate in best_effort:
            members.append(candidate)
            if not self._fits(members, waiting_live, start, block_cost):
                members.pop()
        return StepPlan(finished=list(finished), work=[c.work for c in members], planned_at=now_ms())

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
            deadline = session.next_deadline(self.fps)
            own = block_cost(session)
            if session.session_id in in_tick:
                if tick_end > deadline:
                    return False
            elif tick_end + own > deadline and start + own <= deadline:
                return False
        return True

    def _work_for(
        self, session: SessionRecord, now: float, conditioning_ready: Callable[[str, str], bool]
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
        run = session.state is SessionState.ACTIVE and self._has_room(session) and self.pacing_allows(session, now)
        if open_request is None and not reset and prompt is None and not run:
            return None
        # Live input is offered, not taken: the runner says how many frames the block used (none when this
        # work does not begin a block), and the core drops exactly those.
        live = session.live.offer(self.frames_per_chunk) if run and session.live is not None else None
        return SessionWork(session.session_id, open=open_request, reset=reset,
                           reset_context=session.pending_reset_context if reset else None, prompt=prompt, run=run,
                           live=live)

    def _has_room(self, session: SessionRecord) -> bool:
        """Its consumer took the last chunk, none is held back, and fewer than ``blocks_in_flight`` works of it
        are on the device: a slow consumer pauses its own session."""
        return session.queue.accepts_next and session.held is None and session.works_in_flight < self.blocks_in_flight
