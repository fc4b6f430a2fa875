"""Following a control to the first frames that show it: when a control's effect reaches the viewer's screen.

A control that changes what the session shows (a prompt change, a reset, live input turned on or its
strength changed) gets a :class:`~engine.session.ControlMark` when it arrives. The mark waits on the session
record until a plan carries the control to the device (its tick is noted then), goes with the first piece
of the first block that work (or a later one) makes, and is stamped when that piece is released: from the
control's arrival to the moment its first frame plays on the viewer's clock. Chunks name the marks they
carry (``chunk.controls`` on the wire), so a client can time control-to-screen without reading pixels.

The engine core calls these on the event loop; they read and change only the session record given.
"""

from __future__ import annotations

from dataclasses import replace

from engine.plan import SessionWork
from engine.playout import Piece
from engine.session import ControlMark
from engine.session_record import MAX_MARKS, SessionRecord, WaitingMark

CARRIED = -1  # a waiting mark's tick once its control is on its way whatever plan comes next (before every tick)


def wait_for(record: SessionRecord, mark: ControlMark | None, carrier: str) -> None:
    """``mark`` waits until a plan carries its control (``prompt``, ``reset`` or ``live``)."""
    if mark is None:
        return
    if len(record.marks) >= MAX_MARKS:
        record.marks.pop(0)  # the oldest is no longer worth timing
    record.marks.append(WaitingMark(mark, carrier))


def restart_carries_prompts(record: SessionRecord) -> None:
    """A reset drops a prompt change still waiting for the device: the reset carries its marks now."""
    for waiting in record.marks:
        if waiting.tick is None and waiting.carrier == "prompt":
            waiting.carrier = "reset"


def requeue_cut(record: SessionRecord, at: int) -> None:
    """The lead is about to be cut at frame ``at``: the marks of the pieces it drops whole never reached the screen
    with them, so they wait again, before every mark still waiting (they arrived first), for the first frames
    shown after the cut: the next piece that shows controls, whatever its tick (what is in flight past the cut is
    dropped, so that piece is the first made again, or the new content's). Without this a change superseded
    before its frames played lost its mark, and its client never heard that it was shown."""
    dropped = [mark for piece in record.playout.pieces if piece.pts >= at for mark in piece.marks]
    if not dropped:
        return
    record.marks[:0] = [WaitingMark(mark, "cut", CARRIED) for mark in dropped]
    del record.marks[:max(0, len(record.marks) - MAX_MARKS)]  # the oldest are no longer worth timing


def planned(record: SessionRecord, work: SessionWork, tick: int) -> None:
    """The plan of ``tick`` carries ``work``: its controls' marks are due with the next block it or a later one makes."""
    carried = set()
    if work.prompt is not None:
        carried.add("prompt")
    if work.reset or work.open is not None or (work.prompt is not None and work.prompt.policy == "reset"):
        carried.add("reset")
    if work.run:
        carried.add("live")  # live input's strength applies to the block this work begins
    for waiting in record.marks:
        if waiting.tick is None and waiting.carrier in carried:
            waiting.tick = tick


def shown(record: SessionRecord, tick: int) -> tuple[ControlMark, ...]:
    """The marks a block begun by the plan of ``tick`` shows first (taken off the record)."""
    taken = tuple(w.mark for w in record.marks if w.tick is not None and w.tick <= tick)
    if taken:
        record.marks = [w for w in record.marks if w.tick is None or w.tick > tick]
    return taken


def stamp(record: SessionRecord, piece: Piece, now: float) -> Piece:
    """A released piece's marks with their latency (arrival to the piece's first frame on the viewer's clock);
    the session keeps the recent ones."""
    if not piece.marks:
        return piece
    on_screen = max(now, record.playout.play_time(piece.pts) or now)
    stamped = []
    for mark in piece.marks:
        latency = max(0.0, on_screen - mark.arrived_at)
        record.control_latencies.append((mark.kind, latency))
        stamped.append(replace(mark, latency_s=latency))
    piece.marks = tuple(stamped)
    return piece
