"""The engine core's record of one session: state machine, conditioning, counters, clocks, queue.

Only the engine core (``engine/core.py``) reads or writes these, on the event
loop; everyone else gets :class:`~engine.status.SessionStatus` snapshots.
Device-side state (KV, decoder caches, RNG) belongs to the runner and is
reached only through the step plan.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from engine.controls import Control, SessionState, SessionView, Start, applied
from engine.in_flight import InFlight
from engine.live_input import InputCounters, LiveInput
from engine.plan import InputContext, PromptUpdate, Rewind
from engine.playout import Piece, Playout
from engine.realtime import FrameRate, RunningCost
from engine.session import ChunkQueue, ChunkTimings, ControlMark

MAX_PENDING_CONTROLS = 32  # a session's controls not yet applied; the app rate-limits far below this
RECENT_CHUNKS = 8  # "below real time" looks at this many recent chunks
RECENT_CONTROLS = 32  # control latencies a session keeps for its status
MAX_MARKS = 64  # controls waiting to be shown, per session (bounded like the controls themselves)


@dataclass
class WaitingMark:
    """A control's mark until the first frames that show it are made: ``carrier`` is what will carry the control
    to the device (``prompt``, ``reset``, ``live``); ``tick``, once a plan carried it, that plan's tick."""

    mark: ControlMark
    carrier: str
    tick: int | None = None


@dataclass(frozen=True)
class CutPoint:
    """Where a session's media ahead can be cut: a piece's first frame ``at``, of block ``block`` (within the
    content) that begins at frame ``block_start``."""

    at: int
    block_start: int
    block: int


@dataclass(frozen=True)
class DeferredCut:
    """A cut of the lead at ``at``, a frame still in flight: :meth:`Playout.cut` once the media before it is made
    (``block_start``: the block made again there, as for a cut inside the lead)."""

    at: int
    block_start: int | None


@dataclass
class SessionRecord:
    session_id: str
    seed: int
    pace: bool
    queue: ChunkQueue
    cost: RunningCost  # device seconds per block, seeded with the engine-wide estimate
    playout: Playout  # the lead (made, not released), the playback clock, the timeline's counters
    prompt: str | None = None
    negative_prompt: str = ""
    start_on_attach: Start | None = None  # a start deferred until a consumer attaches
    state: SessionState = SessionState.CREATED
    controls: deque[Control] = field(default_factory=deque)  # submitted, applied at the next tick
    attached: bool = False
    created_at: float = field(default_factory=time.monotonic)
    created_at_epoch: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.monotonic)
    detached_at: float | None = None
    start_requested_at: float | None = None  # monotonic, when the control that starts it was submitted
    started_at: float | None = None  # monotonic, when `start` was applied (at the tick after it was submitted)
    ended_at: float | None = None
    close_reason: str | None = None
    error: str | None = None
    # device-side work the next plan must carry
    opened_on_device: bool = False  # set once, when a plan first carries the open; never unset
    pending_prompt: PromptUpdate | None = None
    pending_reset: bool = False
    pending_reset_context: InputContext | None = None  # with pending_reset: a new context (None: keep the old)
    start_context: object | None = None  # the frames `start` gave (np.ndarray), until the open is planned
    # live video input (None: off) and what the session's input did
    live: LiveInput | None = None
    inputs: InputCounters = field(default_factory=InputCounters)
    # counters and clocks
    blocks_since_reset: int = 0
    first_piece_cost: RunningCost = field(default_factory=RunningCost)  # device seconds to a block's first frames
    epoch: int = 0  # bumped by every cut: a piece of work planned before it and queued after it is dropped
    cut_pending: bool = False  # the lead was cut for a restart or a prompt change the device has not been given yet
    rewind: Rewind | None = None  # with a prompt change's cut: the block the runner takes the session back to
    undo_floor: int = 0  # blocks before this one (content index) were made under an earlier prompt: never made again
    content_start: int = 0  # the timeline frame the current content begins at: what is before it is never made again
    release_timer: asyncio.TimerHandle | None = None  # wakes the release of the lead's next piece
    marks: list[WaitingMark] = field(default_factory=list)  # controls not yet shown, oldest first
    control_latencies: deque[tuple[str, float]] = field(default_factory=lambda: deque(maxlen=RECENT_CONTROLS))
    time_to_first_chunk_ms: float | None = None
    last_timings: ChunkTimings | None = None
    deadline_misses: int = 0
    recent_misses: deque[bool] = field(default_factory=lambda: deque(maxlen=RECENT_CHUNKS))  # per chunk, newest last
    device_seconds_pending: float = 0.0  # device time spent since the last block (controls, stepwise steps)
    # dispatched to the device, not yet delivered (the runner queues a block before the previous one is done)
    works_in_flight: int = 0
    in_flight: InFlight = field(default_factory=InFlight)  # their pieces, and which a cut dropped
    deferred_cut: DeferredCut | None = None  # a cut inside the media in flight, made once what precedes it is made
    frame_rate: FrameRate = field(default_factory=FrameRate)
    decoder_state_bytes: int = 0
    encoder_state_bytes: int = 0

    @property
    def frames_in_flight(self) -> int:
        """Frames dispatched that will still be delivered (not those a cut dropped)."""
        return self.in_flight.frames

    @property
    def is_open(self) -> bool:
        return self.state is not SessionState.CLOSED

    def view(self) -> SessionView:
        """The session as its applied controls left it."""
        return SessionView(self.state, self.attached, self.detached_at is not None, self.prompt, self.negative_prompt,
                           self.seed, self.pace)

    def projected(self) -> SessionView:
        """The session once every queued control has applied: what snapshots show and new controls are checked on."""
        view = self.view()
        for control in self.controls:
            view = applied(view, control, starts_on_attach=self.start_on_attach is not None)
        return view

    def take(self, view: SessionView) -> None:
        """Hold what a control left (the consumer's timestamps are the core's to set)."""
        self.state, self.attached = view.state, view.attached
        self.prompt, self.negative_prompt, self.seed, self.pace = view.prompt, view.negative_prompt, view.seed, view.pace

    def touch(self) -> None:
        self.last_active = time.monotonic()

    def media_seconds_ahead(self, now: float) -> float:
        """How far the made and dispatched media runs ahead of the playback clock (0 while it is not running)."""
        return self.playout.seconds_ahead(now, self.frames_in_flight)

    def cut_points(self) -> list[CutPoint]:
        """Where the media ahead can be cut, in timeline order: each piece's start, made (the lead) or still in
        flight, and, last, the end of it all (a cut there drops nothing)."""
        points = [CutPoint(piece.pts, piece.block_start, piece.block_index) for piece in self.playout.pieces]
        points += [CutPoint(piece.pts, piece.block_start, piece.block_index) for piece in self.in_flight.kept()]
        end = self.playout.frames_made + self.frames_in_flight
        points.append(CutPoint(end, end, self.blocks_since_reset + self.works_in_flight))
        return points

    def restart_cut(self, ready: float | None) -> int | None:
        """Where a restart's new content starts: the first frame ahead (made and not released, or in flight) that
        plays at or after ``ready``, the monotonic time its first frames can be out (None: the first frame ahead,
        for a best-effort session or a clock not running). Any frame will do: new content needs no block or piece
        boundary (a piece the cut falls in keeps its frames before it). None when nothing ahead would be dropped
        (a cut waiting in flight already ends what is ahead: ``InFlight.drop_from`` counts only what stays)."""
        end = self.playout.frames_made + self.frames_in_flight
        at = self.playout.lead_start
        if ready is not None:
            at = max(at, self.playout.first_frame_playing_from(ready))
        return at if at < end else None

    def made(self, piece: Piece, now: float, *, tolerance_s: float) -> bool:
        """A piece joins the lead; returns whether it was a deadline miss (made after its frame should have
        played, beyond ``tolerance_s``). Best-effort sessions have no deadlines."""
        self.playout.add(piece)
        late = self.pace and self.playout.late(piece, now, tolerance_s)
        self.recent_misses.append(late)
        if late:
            self.deadline_misses += 1
        return late

    def first_release(self, now: float) -> None:
        """The session's first chunk left: time to first media, from the request (not the tick that applied it:
        the wait for that tick is part of first media)."""
        origin = self.start_requested_at if self.start_requested_at is not None else self.started_at
        if origin is not None and self.time_to_first_chunk_ms is None:
            self.time_to_first_chunk_ms = (now - origin) * 1000.0

    def next_deadline(self) -> float | None:
        """Monotonic time at which the next block to be dispatched starts playing (None: no clock yet). Blocks
        already dispatched come before it."""
        if not self.pace or not self.playout.clock_running:
            return None
        return self.playout.play_time(self.playout.frames_made + self.frames_in_flight)
