"""A session's pieces dispatched to the device and not yet delivered, and where each will land on the timeline.

On a GPU the runner queues a session's next block before the previous one is delivered (``blocks_in_flight``,
docs/ENGINE.md), so a control can arrive while the block it should change is already on the device. Device work
cannot be called back, but its output need not be used: a cut *drops* the dispatched pieces from a frame on (they
are still waited for, then thrown away), the pieces before that frame still join the lead, and what replaces the
dropped ones is made behind them (a restart's new content, or the block made again: ``engine/undo.py``).

This keeps, per session, its dispatched pieces in dispatch order with their future place on the timeline (the
made timeline's end plus the frames dispatched before them) and whether a cut dropped them. The engine core owns
one per session and calls it on the event loop; pacing counts only the frames not dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class DispatchedPiece:
    """One piece of a dispatched work (frames 0: a work that makes no media, controls alone)."""

    pts: int  # its first frame's index on the session timeline, once delivered
    frames: int
    block_index: int  # its block within the content
    block_start: int  # the timeline index of its block's first frame
    dropped: bool = False  # a cut dropped it: waited for, never delivered


@dataclass
class InFlight:
    pieces: deque[DispatchedPiece] = field(default_factory=deque)  # dispatch order (= delivery order)
    frames: int = 0  # frames of the pieces not dropped: the media still to come

    def queue(self, *, frames_made: int, frames: int, block_index: int, first_of_block: bool,
              open_block_start: int, dropped: bool = False) -> DispatchedPiece:
        """A piece was dispatched; ``frames_made``: the made timeline's end, ``open_block_start``: the block the
        next made piece belongs to unless it begins one (the playout's). ``dropped``: from work a cut already
        made stale."""
        pts = frames_made + self.frames
        if first_of_block:
            block_start = pts
        else:
            before = self._last_kept()
            block_start = before.block_start if before is not None else open_block_start
        piece = DispatchedPiece(pts, frames, block_index, block_start, dropped)
        self.pieces.append(piece)
        if not dropped:
            self.frames += frames
        return piece

    def done(self, piece: DispatchedPiece) -> None:
        """The device is done with ``piece`` (delivered, dropped or failed): it is no longer in flight."""
        self.pieces.remove(piece)
        if not piece.dropped:
            self.frames -= piece.frames

    def drop_from(self, at: int) -> int:
        """Drop the media from timeline frame ``at`` on: every piece that begins there or later, and of a piece
        ``at`` falls inside (a restart's cut) the frames from it on, which the lead cuts when the piece is made:
        it counts only the frames that will stay. Returns the frames dropped."""
        dropped = 0
        for piece in self.pieces:
            if piece.dropped or not piece.frames:
                continue
            if piece.pts >= at:
                piece.dropped = True
                dropped += piece.frames
            elif piece.pts + piece.frames > at:
                dropped += piece.pts + piece.frames - at
                piece.frames = at - piece.pts
        self.frames -= dropped
        return dropped

    def kept(self) -> list[DispatchedPiece]:
        """The pieces with media that will still be delivered, in timeline order."""
        return [piece for piece in self.pieces if piece.frames and not piece.dropped]

    def still_to_come_before(self, at: int) -> bool:
        """Media before frame ``at`` is still to be delivered."""
        return any(piece.pts < at for piece in self.kept())

    def _last_kept(self) -> DispatchedPiece | None:
        kept = self.kept()
        return kept[-1] if kept else None
