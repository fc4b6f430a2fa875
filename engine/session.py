"""What a session hands its consumer: chunks, their timings, and the one-chunk queue between them.

The session records themselves belong to the engine core (``engine/core.py``);
the outside sees them only as snapshots (``engine/status.py``).
"""

from __future__ import annotations

import asyncio
import base64
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


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
class ControlMark:
    """A control a client sent, followed to the first frames that show it (``Chunk.marks``)."""

    control_id: str | None  # the client's message id (None: it gave none, e.g. over REST)
    kind: str  # prompt | reset | live
    arrived_at: float  # monotonic, when the control reached the server
    latency_s: float | None = None  # set when released: from arrival to those frames playing on the viewer's clock


@dataclass(frozen=True)
class Chunk:
    """Decoded frames of one or more latent frames of a block: uint8 ``[F, H, W, 3]``, optional audio
    ``[channels, samples]``."""

    session_id: str
    index: int  # 0-based, continues across reset
    pts: int  # first frame's index on the session timeline
    frames: np.ndarray
    audio: np.ndarray | None
    audio_start: int  # the audio's first sample on the session timeline (trails the video by the codec lookahead)
    block_index: int  # block within the current content (restarts at 0 after reset)
    timings: ChunkTimings
    ready_at: float  # epoch ms when the chunk entered the session queue
    marks: tuple[ControlMark, ...] = ()  # controls first shown in these frames
    # The session's playback clock (re)starts at this chunk: it plays on arrival (the first chunk; after a resume, a
    # socket attaching, or a lone opening frame when it came after its time). A gap before it is no stall.
    starts_clock: bool = False
    # The live input frame its first frame shows: the frame's number among those the session received (from 0,
    # dropped ones included; engine.core.EngineCore.admit_frame). None: not made from live input.
    input_frame: int | None = None


class ChunkQueue:
    """The hand-over of one session's chunks from the engine to its consumer.

    At most one chunk waits here, and a slow or absent consumer pauses its own
    session, never the engine (:attr:`accepts_next`). When the next block may start:

    * ``overlap=True`` (default): once the consumer has *taken* the previous
      chunk — block N+1 is made while chunk N is encoded and sent, so the
      CPU's encode overlaps the device's next block; the media of block N
      still never waits for block N+1;
    * ``overlap=False``: only once the consumer has come back for the next
      chunk, i.e. block N's media is on the wire before block N+1 starts.
    """

    def __init__(self, overlap: bool = True, on_taken: Callable[[], None] | None = None) -> None:
        """``on_taken``: called when the consumer takes a chunk — with overlap the session may run again, and
        a chunk held back behind this one may enter the queue (the engine core wakes its loop with it: nothing
        else would tell it)."""
        self.overlap = overlap
        self._on_taken = on_taken
        self._item: Chunk | None = None
        self._changed = asyncio.Event()
        self.in_hand = False  # the consumer holds a chunk and has not asked for the next
        self.ended = False

    def __len__(self) -> int:
        return 0 if self._item is None else 1

    @property
    def accepts_next(self) -> bool:
        return self._item is None and (self.overlap or not self.in_hand)

    def put_nowait(self, chunk: Chunk) -> None:
        if self._item is not None:
            raise RuntimeError("a chunk is already waiting; the scheduler must not run this session")
        self._item = chunk
        self._changed.set()

    def end(self) -> None:
        self.ended = True
        self._changed.set()

    def clear(self) -> None:
        """Forget a waiting chunk and any chunk in hand (a new consumer attaches)."""
        self._item = None
        self.in_hand = False

    def release(self) -> None:
        """The consumer is done with the chunk in hand (its media is on the wire)."""
        self.in_hand = False

    async def get(self) -> Chunk | None:
        """The next chunk (now in hand), or ``None`` once ended."""
        self.release()
        while self._item is None:
            if self.ended:
                return None
            self._changed.clear()
            await self._changed.wait()
        chunk, self._item = self._item, None
        self.in_hand = True
        if self._on_taken is not None:
            self._on_taken()
        return chunk


