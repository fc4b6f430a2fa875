"""What the engine shows the outside: immutable snapshots, taken on the event loop.

The web layer and the CLI never hold the engine's session records; they read
these frozen copies, so nothing outside the engine core can change a session
behind its back, and a snapshot taken before a session ended still says what
it was.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from engine.session import ChunkTimings


class NotReady(Enum):
    """Why an engine admits no new session now. The one readiness rule is ``Engine.not_ready()``; every
    surface (``/readyz``, the stream sockets, REST, metrics, a cluster worker's health) asks it."""

    WARMING_UP = "engine warming up"
    DRAINING = "draining"
    DEAD = "engine dead"
    FAILED_TO_START = "engine failed to start"

    @property
    def final(self) -> bool:
        """The engine will never serve again (a process running it should exit, a worker be replaced)."""
        return self in (NotReady.DEAD, NotReady.FAILED_TO_START)


@dataclass(frozen=True)
class SessionCounters:
    """What a session has made so far."""

    chunks: int
    frames: int
    audio_samples: int  # the next chunk's audio starts here on the session timeline
    blocks_since_reset: int
    queue_depth: int
    decoder_state_bytes: int  # the session's streaming decoder caches (video + audio) on the device
    encoder_state_bytes: int = 0  # its streaming video encoder's state (live input) on the device


@dataclass(frozen=True)
class InputStatus:
    """A session's pictures and video in (docs/PROTOCOL.md): live input and what its frames did."""

    live: bool
    strength: float | None  # the noise level blocks take live input to (a point of the model's schedule)
    frames_received: int
    frames_used: int
    frames_dropped: int  # over the rate, or pushed out of a full buffer
    frames_invalid: int
    context_frames: int  # latent frames of the image or clip the content last started from


@dataclass(frozen=True)
class RealtimeStatus:
    """How a session keeps up with its playback clock (see docs/ENGINE.md, realtime admission)."""

    live: bool  # pacing on: it has a playback clock and deadlines
    block_cost_ms: float | None  # running estimate of device time per block, None before any was measured
    frames_per_second: float  # frames emitted per second over the last few chunks
    deadline_misses: int  # chunks emitted later than their playback time (+ tolerance); live sessions only
    below_realtime: bool  # the live sessions' measured demand exceeds the device and this one missed lately
    live_capacity: int | None  # the engine's: live sessions it keeps in real time (None before a block was measured)


@dataclass(frozen=True)
class ControlLatency:
    """A session's recent controls, from arrival to their first frame on the viewer's clock (seconds)."""

    count: int  # how many of the session's recent controls are timed here (the last RECENT_CONTROLS)
    last_s: float
    median_s: float
    p90_s: float
    max_s: float


@dataclass(frozen=True)
class SessionStatus:
    session_id: str
    state: str  # protocol state: created, active, paused, detached, closed, draining
    attached: bool
    seed: int
    pace: bool
    prompt_length: int
    prompt_unknown_words: int | None  # words of the prompt the model cannot read (None: it reads any text)
    counters: SessionCounters
    created_at: float  # epoch seconds
    started_at: float | None  # monotonic seconds when `start` was applied
    ended_at: float | None  # monotonic seconds when the session ended
    time_to_first_chunk_ms: float | None
    last_timings: ChunkTimings | None
    close_reason: str | None
    error: str | None
    realtime: RealtimeStatus
    input: InputStatus | None = None
    control_latency: ControlLatency | None = None  # None until a control was shown

    @property
    def is_open(self) -> bool:
        return self.state != "closed"


@dataclass(frozen=True)
class EngineCounters:
    ready: bool
    alive: bool
    draining: bool
    ticks: int
    blocks: int
    capacity: int  # sessions the memory holds
    live_capacity: int | None  # live sessions the device keeps in real time (None before a block was measured)
    realtime_admission: bool
    block_cost_ms: float | None  # the engine-wide running estimate
    realtime_utilisation: float  # live sessions' demand / device time (> 1: they fall behind)
    sessions_by_state: dict[str, int]
    live_sessions: int
    live_sessions_below_realtime: int
    deadline_misses: int  # over every session the engine has run, ended ones included
    refused_realtime: int  # admissions refused because the device had no time left for another live session
    kv_blocks_total: int
    kv_blocks_in_use: int
    decoder_state_bytes: int  # all sessions together
    queue_depths: tuple[int, ...]  # chunks waiting per open session (no ids: an id is a capability)
    session_frames_per_second: tuple[float, ...]  # per active session, in no particular order
    session_deadline_misses: tuple[int, ...]  # per open live session
    encoder_state_bytes: int = 0  # all sessions together
    input_frames: dict[str, int] | None = None  # live frames over every session's life: received, used, dropped, invalid
    live_input_sessions: int = 0  # open sessions with live input on
    device_memory_peak_bytes: int | None = None  # CUDA: the most torch's allocator has held since start
    device_memory_limit_bytes: int | None = None  # CUDA under gpu_memory_gib: the allocator's cap
    lead_seconds: tuple[float, ...] = ()  # media made and not yet released, per open session


@dataclass(frozen=True)
class AdmissionOutlook:
    """Would a live newcomer be admitted now, and how much room is left (read without admitting anyone)."""

    admitting: bool  # a live (paced) newcomer would be admitted now, evicting an idle session if need be
    slots_free: int  # memory slots not reserved by an open session
    open_sessions: int
    live_sessions: int  # open sessions with pacing on
    live_headroom: int | None  # more live sessions the device keeps in real time (None: nothing measured yet)
    utilisation: float  # the running live sessions' demand on the device (> 1: they fall behind)
    retry_after_s: float  # when refused: when the soonest blocking session must end on its own


@dataclass(frozen=True)
class Geometry:
    """What a client needs to know about the media the engine produces."""

    width: int
    height: int
    fps: int
    frames_per_block: int  # latent frames
    pixel_frames_per_block: int  # 4x temporal: 12 for 3 latent frames (the first block has 9)
    audio_sample_rate: int | None
    audio_channels: int | None = None

    @property
    def block_seconds(self) -> float:
        """Playback time of one steady-state block: the real-time budget of a live session per block."""
        return self.pixel_frames_per_block / self.fps
