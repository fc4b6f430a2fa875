"""The front end's session table: which worker each session lives on, and nothing else.

Sessions live on their worker for their whole life (pinned); the front end only needs to know where, so
that REST and re-attach for an id reach that worker. It learns an id from the worker itself (the ``201``
body of ``POST /v1/sessions``, the first ``session`` message of ``WS /v1/stream``) and forgets it:

- at once on ``DELETE`` (204) and when the worker answers 404 / 4404 for it;
- ``closed_retention_s`` after it saw the session end (a relayed ``closed``), like the worker does;
- when its worker is lost (every session of that generation is gone), or found replaced by a newer
  generation or absent (restarting) when the table is reconciled;
- when the worker's own list no longer has it (the periodic reconcile: sessions that ended on the
  worker while no socket was relayed, e.g. after a detached grace period).

Bounded: at most ``max_entries`` ids. Placing a session takes a reservation first; when the table is
full, ended entries go first (oldest first); when only open sessions are left, a new session is
refused (503 ``capacity``) rather than losing track of a live one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class SessionEntry:
    session_id: str
    worker: str
    generation: int
    address: str  # the client's address: per-client limits count over every worker
    added_at: float
    ended_at: float | None = None  # when the front end saw it end


class SessionTable:
    def __init__(self, max_entries: int, closed_retention_s: float) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.max_entries = max_entries
        self.closed_retention_s = closed_retention_s
        self._entries: dict[str, SessionEntry] = {}
        self._reserved = 0

    def __len__(self) -> int:
        return len(self._entries)

    # --- placing ------------------------------------------------------------------------------------
    def reserve(self) -> bool:
        """Room for one more session (making it by forgetting ended ones if need be); ``add`` or ``cancel`` it."""
        if len(self._entries) + self._reserved >= self.max_entries:
            self._drop_ended(len(self._entries) + self._reserved - self.max_entries + 1)
        if len(self._entries) + self._reserved >= self.max_entries:
            return False
        self._reserved += 1
        return True

    def cancel(self) -> None:
        self._reserved = max(0, self._reserved - 1)

    def add(self, session_id: str, worker: str, generation: int, address: str, now: float | None = None) -> None:
        """Record a placed session, using the reservation taken for it."""
        self.cancel()
        self._entries[session_id] = SessionEntry(
            session_id, worker, generation, address, time.monotonic() if now is None else now
        )

    # --- finding and forgetting -----------------------------------------------------------------------
    def lookup(self, session_id: str) -> SessionEntry | None:
        return self._entries.get(session_id)

    def ended(self, session_id: str, now: float | None = None) -> None:
        entry = self._entries.get(session_id)
        if entry is not None and entry.ended_at is None:
            entry.ended_at = time.monotonic() if now is None else now

    def forget(self, session_id: str) -> None:
        self._entries.pop(session_id, None)

    def forget_worker(self, worker: str, generation: int) -> list[str]:
        """Forget every session of that worker up to that generation; returns their ids."""
        gone = [e.session_id for e in self._entries.values() if e.worker == worker and e.generation <= generation]
        for session_id in gone:
            del self._entries[session_id]
        return gone

    def retain_generations(self, current: dict[str, int]) -> None:
        """Forget entries whose worker generation is no longer running (``current``: name → generation)."""
        for entry in list(self._entries.values()):
            if current.get(entry.worker) != entry.generation:
                del self._entries[entry.session_id]

    def reconcile(self, worker: str, generation: int, states: dict[str, str], listed_since: float,
                  now: float | None = None) -> None:
        """Match the worker's own list (``states``: id → state), fetched from ``listed_since`` on: an entry
        it no longer lists is forgotten (if it was added before the list was asked for), a closed one ends."""
        now = time.monotonic() if now is None else now
        for entry in list(self._entries.values()):
            if entry.worker != worker or entry.generation != generation:
                continue
            state = states.get(entry.session_id)
            if state is None:
                if entry.added_at < listed_since:
                    del self._entries[entry.session_id]
            elif state == "closed":
                self.ended(entry.session_id, now)

    def sweep(self, now: float | None = None) -> None:
        """Forget sessions that ended at least ``closed_retention_s`` ago."""
        now = time.monotonic() if now is None else now
        for entry in list(self._entries.values()):
            if entry.ended_at is not None and now - entry.ended_at >= self.closed_retention_s:
                del self._entries[entry.session_id]

    def open_sessions_of(self, address: str) -> int:
        return sum(1 for e in self._entries.values() if e.address == address and e.ended_at is None)

    def sessions_by_worker(self) -> dict[str, int]:
        """Open sessions per worker name, as the front end knows them."""
        counts: dict[str, int] = {}
        for entry in self._entries.values():
            if entry.ended_at is None:
                counts[entry.worker] = counts.get(entry.worker, 0) + 1
        return counts

    def _drop_ended(self, count: int) -> None:
        ended = sorted((e for e in self._entries.values() if e.ended_at is not None), key=lambda e: e.ended_at)
        for entry in ended[:count]:
            del self._entries[entry.session_id]
