"""Which sessions run this tick: fair round-robin, skipping paused, full and paced-ahead sessions."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

from engine.plan import FinishedSession, OpenSession, PromptUpdate, SessionWork, StepPlan
from engine.session import Session, SessionState, now_ms


class Scheduler:
    """Builds a :class:`StepPlan` from the session table; never touches device state.

    A session runs at most one block per tick. It is skipped while paused,
    until its consumer has taken its previous chunk and asked for the next (a
    slow client pauses itself, not the engine; see ``ChunkQueue``), and, with pacing on, while its media runs ``lead_chunks`` blocks
    ahead of its playback clock. The starting point of each tick rotates so no
    session is always served last.
    """

    def __init__(self, *, fps: int, frames_per_chunk: int, lead_chunks: int) -> None:
        self.fps = fps
        self.lead_seconds = lead_chunks * frames_per_chunk / fps
        self._cursor = 0

    def pacing_allows(self, session: Session, now: float) -> bool:
        return not session.pace or session.media_seconds_ahead(now, self.fps) < self.lead_seconds

    def next_wakeup(self, sessions: Sequence[Session], now: float) -> float:
        """Seconds until a paced session may run again (inf if none is waiting on pacing)."""
        waits = [
            session.media_seconds_ahead(now, self.fps) - self.lead_seconds
            for session in sessions
            if session.state is SessionState.ACTIVE and session.pace and session.queue.accepts_next
        ]
        positive = [w for w in waits if w >= 0]
        return max(min(positive), 0.001) if positive else math.inf

    def plan(self, sessions: Sequence[Session], finished: list[FinishedSession]) -> StepPlan:
        now = time.monotonic()
        work: list[SessionWork] = []
        if sessions:
            start = self._cursor % len(sessions)
            ordered = list(sessions[start:]) + list(sessions[:start])
            self._cursor += 1
        else:
            ordered = []
        for session in ordered:
            item = self._work_for(session, now)
            if item is not None:
                work.append(item)
        return StepPlan(finished=list(finished), work=work, planned_at=now_ms())

    def _work_for(self, session: Session, now: float) -> SessionWork | None:
        if session.state not in (SessionState.ACTIVE, SessionState.PAUSED) or session.prompt is None:
            return None
        open_request = None
        if not session.opened_on_device:
            open_request = OpenSession(session.seed, session.prompt, session.negative_prompt)
            session.opened_on_device = True
            session.pending_prompt = None  # the open already carries the current prompt
            session.pending_reset = False
        reset = session.pending_reset
        session.pending_reset = False
        prompt = None
        if session.pending_prompt is not None:
            change = session.pending_prompt
            prompt = PromptUpdate(change.prompt, change.negative_prompt, change.policy)
            session.pending_prompt = None
        run = (
            session.state is SessionState.ACTIVE
            and session.queue.accepts_next
            and self.pacing_allows(session, now)
        )
        if open_request is None and not reset and prompt is None and not run:
            return None
        return SessionWork(session.session_id, open=open_request, reset=reset, prompt=prompt, run=run)
