"""Where a new session goes: the worker with the most headroom, by each worker's own admission numbers.

Pure functions over the workers' last ``GET /internal/capacity`` answers. Placement only orders the
workers; the worker's own admission decides. The front end asks them in this order until one admits, so
a session is refused exactly when every ready worker refuses it, however stale these numbers are (they
are at most one poll old, and refreshed after every placement).

    try order:  admitting workers first
                → most headroom (free memory slots, and once a block was measured, free real-time room)
                → fewest open sessions → lowest utilisation → name (deterministic)
                then the ready workers that said they would refuse (the numbers may be a poll old)
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class WorkerLoad:
    """One worker's last capacity answer."""

    name: str
    generation: int
    ready: bool
    admitting: bool
    live_sessions: int
    live_headroom: int | None  # more live sessions it keeps in real time; None: nothing measured yet
    slots_free: int
    utilisation: float
    open_sessions: int
    retry_after_s: float | None = None

    @classmethod
    def from_answer(cls, name: str, generation: int, answer: dict) -> WorkerLoad:
        """From ``/internal/capacity`` JSON; fields beyond the shared interface are optional."""
        live_headroom = answer.get("live_headroom")
        retry_after = answer.get("retry_after_s")
        return cls(
            name=name,
            generation=generation,
            ready=answer.get("ready") is True,
            admitting=answer.get("admitting") is True,
            live_sessions=_count(answer.get("live_sessions")),
            live_headroom=_count(live_headroom) if live_headroom is not None else None,
            slots_free=_count(answer.get("slots_free")),
            utilisation=_finite(answer.get("utilisation")),
            open_sessions=_count(answer.get("open_sessions", answer.get("live_sessions"))),
            retry_after_s=_finite(retry_after) if retry_after is not None else None,
        )

    @property
    def headroom(self) -> int:
        """New sessions it could take now: memory slots, bounded by real-time room once that is known."""
        if self.live_headroom is None:
            return self.slots_free
        return min(self.slots_free, self.live_headroom)

    def after_placement(self) -> WorkerLoad:
        """This load with one more session placed on it: what placement assumes until the worker's next answer,
        so that sessions arriving one after another spread before the numbers catch up."""
        slots_free = max(0, self.slots_free - 1)
        live_headroom = max(0, self.live_headroom - 1) if self.live_headroom is not None else None
        placed = replace(self, live_sessions=self.live_sessions + 1, open_sessions=self.open_sessions + 1,
                         slots_free=slots_free, live_headroom=live_headroom)
        return replace(placed, admitting=self.admitting and placed.headroom > 0)


def placement_order(loads: Iterable[WorkerLoad]) -> list[WorkerLoad]:
    """The ready workers, in the order to ask them (module docstring); a worker not ready is never asked."""
    ready = [load for load in loads if load.ready]
    return sorted(
        ready, key=lambda w: (not w.admitting, -w.headroom, w.open_sessions, w.utilisation, w.name)
    )


def _count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _finite(value: object) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return 0.0
