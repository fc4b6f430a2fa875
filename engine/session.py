"""Host-side session records: state, conditioning, counters, clocks, output queue.

Everything here lives on the event loop. Device-side state (KV, decoder cache,
RNG) belongs to the runner and is reached only through the step plan.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import numpy as np


class SessionState(str, Enum):
    CREATED = "created"
    ACTIVE = "active"
    PAUSED = "paused"
    CLOSED = "closed"
    DRAINING = "draining"


def new_session_id() -> str:
    """128 random bits, URL-safe: knowing the id is the capability to control the session."""
    return base64.urlsafe_b64encode(secrets.token_bytes(16)).rstrip(b"=").decode("ascii")


def now_ms() -> float:
    return time.time() * 1000.0


@dataclass(frozen=True)
class ChunkTimings:
    started_at: float  # epoch ms when the block's denoising began
    queued_ms: float  # from the block's request (tick planned) to denoise start
    denoise_ms: float
    decode_ms: float


@dataclass(frozen=True)
class Chunk:
    """One AR block's decoded output: uint8 frames ``[F, H, W, 3]`` and optional audio ``[channels, samples]``."""

    session_id: str
    index: int  # 0-based, continues across reset
    pts: int  # first frame's index on the session timeline
    frames: np.ndarray
    audio: np.ndarray | None
    block_index: int  # block within the current content (restarts at 0 after reset)
    timings: ChunkTimings
    ready_at: float  # epoch ms when the chunk entered the session queue


@dataclass
class PromptChange:
    prompt: str
    negative_prompt: str
    policy: str  # soft | recache | reset


class ChunkQueue:
    """A bounded queue of chunks that can be ended; the consumer sees ``None`` once ended and drained."""

    def __init__(self, maxsize: int) -> None:
        self.maxsize = maxsize
        self._items: deque[Chunk] = deque()
        self._changed = asyncio.Event()
        self.ended = False

    def __len__(self) -> int:
        return len(self._items)

    @property
    def full(self) -> bool:
        return len(self._items) >= self.maxsize

    def put_nowait(self, chunk: Chunk) -> None:
        if self.full:
            raise RuntimeError("chunk queue full; the scheduler must not run a session without room")
        self._items.append(chunk)
        self._changed.set()

    def end(self) -> None:
        self.ended = True
        self._changed.set()

    def clear(self) -> None:
        self._items.clear()

    async def get(self) -> Chunk | None:
        while not self._items:
            if self.ended:
                return None
            self._changed.clear()
            await self._changed.wait()
        chunk = self._items.popleft()
        self._changed.set()
        return chunk


@dataclass
class Session:
    """One client's stream."""

    session_id: str
    seed: int
    pace: bool
    queue: ChunkQueue
    prompt: str | None = None
    negative_prompt: str = ""
    state: SessionState = SessionState.CREATED
    attached: bool = False
    created_at: float = field(default_factory=time.monotonic)
    last_active: float = field(default_factory=time.monotonic)
    detached_at: float | None = None
    started_at: float | None = None  # monotonic, when `start` was accepted
    close_reason: str | None = None
    error: str | None = None
    # device-side work the next plan must carry
    opened_on_device: bool = False
    pending_prompt: PromptChange | None = None
    pending_reset: bool = False
    # counters and clocks
    chunks_emitted: int = 0
    frames_emitted: int = 0
    blocks_since_reset: int = 0
    first_chunk_at: float | None = None  # monotonic; the playback clock starts here
    time_to_first_chunk_ms: float | None = None
    last_timings: ChunkTimings | None = None

    @property
    def is_open(self) -> bool:
        return self.state not in (SessionState.CLOSED,)

    def touch(self) -> None:
        self.last_active = time.monotonic()

    def media_seconds_ahead(self, now: float, fps: int) -> float:
        """How far the emitted media runs ahead of the playback clock (0 before the first chunk)."""
        if self.first_chunk_at is None:
            return 0.0
        return self.frames_emitted / fps - (now - self.first_chunk_at)
