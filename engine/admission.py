"""Admission: what taking a newcomer would take now, worked out without changing anything.

The one rule, asked by the engine core when it admits a session (and carries the plan out), when a
session turns pacing on at ``start``, and by its outlook, which a front end places sessions by::

    memory   no free slot     -> the least recently active idle session makes room, or refuse ("memory")
    time     a live newcomer  -> while the live sessions' costs with the newcomer's do not fit the device
                                 (RealtimePolicy), the least recently active idle live session makes room,
                                 or refuse ("time")

Idle means without a live client and detached or paused: a session with a live client is never evicted,
the newcomer is refused instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.controls import SessionState
from engine.realtime import RealtimePolicy
from engine.session_record import SessionRecord


@dataclass(frozen=True)
class Admission:
    evict: list[SessionRecord]  # idle sessions to end first, least recently active first
    remaining: list[SessionRecord]  # the open sessions once they have ended
    refused: str | None = None  # "memory" or "time": no eviction makes room


def evictable(record: SessionRecord) -> bool:
    """Detached, or paused, and without a live client."""
    return not record.attached and (record.detached_at is not None or record.state is SessionState.PAUSED)


def plan_admission(
    open_records: list[SessionRecord],
    *,
    slots_free: int | None,
    live: bool,
    policy: RealtimePolicy,
    cost_of: Callable[[SessionRecord], float],
    newcomer_cost_s: float | None,
) -> Admission:
    """``slots_free``: memory slots no open session holds (None: the newcomer holds one already);
    ``live``: the newcomer is paced; ``cost_of``: a session's expected device seconds per block;
    ``newcomer_cost_s``: the newcomer's (the engine-wide estimate; None before anything was measured)."""
    remaining = list(open_records)
    evict: list[SessionRecord] = []

    def evict_one(among: list[SessionRecord]) -> bool:
        candidates = [r for r in among if evictable(r)]
        if not candidates:
            return False
        victim = min(candidates, key=lambda r: r.last_active)
        remaining.remove(victim)
        evict.append(victim)
        return True

    if slots_free is not None and slots_free <= 0 and not evict_one(remaining):
        return Admission(evict, remaining, refused="memory")
    while live:
        live_records = [r for r in remaining if r.pace]
        if policy.admits([cost_of(r) for r in live_records], newcomer_cost_s):
            break
        if not evict_one(live_records):
            return Admission(evict, remaining, refused="time")
    return Admission(evict, remaining)
