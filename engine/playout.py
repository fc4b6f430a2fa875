"""A session's media between the engine and its viewer: the lead, the playback clock, and when each piece leaves.

The runner hands a session's media over in *pieces*: the pixel frames of one latent frame (4 at 16 fps; a
content's opening latent frame decodes to 1), so a block of 3 latent frames arrives as three pieces, each as
soon as the streaming decoder has made it. A piece made and not yet handed to the session's consumer is part
of the session's **lead**, which lives here, on the server — not in the viewer's buffer:

* a **paced** session's piece is released ``margin_s`` before it plays on the viewer's clock (the playback
  clock below), so the viewer's player holds about that much, plus one piece, and no more;
* a **best-effort** session's pieces are released as soon as its consumer can take them;
* consecutive due pieces are released together, as one chunk (a consumer that fell behind catches up in a
  few large chunks rather than many small ones);
* with ``whole_blocks``, a block's pieces leave together once its last one is made (one chunk per block, as
  before pieces existed; the engine's ``media_granularity = "block"``).

Released media cannot change any more; the lead can. :meth:`Playout.cut` drops the lead from any frame on, so
a reset shows at that point instead of after everything made before it, and a prompt change can replace the
rest of a block already made from that frame on (the block made again, ``engine/undo.py``).

The **playback clock** models the viewer: frame ``pts`` plays at ``anchor + pts / fps``. It starts with the
first chunk released (that chunk plays on arrival), and restarts the same way after a resume or a new
consumer attaching (``reanchor``). A content's opening frame sent ahead of its block (the split first block,
or an image's frame) that *starts* the clock restarts it once more with the next chunk if that one comes after
its first frame was due (the viewer's player waited for it, so it plays on its arrival); one that comes in time
keeps the clock (the player played on: modelling a wait it did not have put every later frame up to a frame's
time later on the viewer's screen than the engine thought, seventeenth session). An opening frame in the middle
of a stream (after a reset) is an ordinary frame of the timeline.

Audio is made per block and trails the video's edge by its decoder's lookahead. Each piece carries the
audio of its own span of the timeline (what has been made of it); the last piece of a block carries whatever
of the block's audio is left. So a cut keeps audio and video in step: the audio kept ends at or before the
cut, and the gap to the cut (audio still held back in the decoder when the old content was dropped) is
filled with silence.

This module knows no sessions, devices or sockets: the engine core owns one :class:`Playout` per session
and calls it on the event loop.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from engine.session import ChunkTimings, ControlMark


@dataclass
class Piece:
    """Frames of one latent frame of a block (or several merged), with the audio of their span."""

    frames: np.ndarray  # uint8 [F, H, W, 3]
    block_index: int  # the block within its content (restarts at 0 after a reset)
    timings: ChunkTimings
    made_at: float  # monotonic
    audio: np.ndarray | None = None  # float32 [channels, samples]; as made: the block's, with its first piece
    last_of_block: bool = True  # the block's last piece: takes whatever is left of the block's audio
    opening: bool = False  # a content's opening frame sent ahead of its block
    first_of_block: bool = True  # its block's first frames
    marks: tuple[ControlMark, ...] = ()  # controls first shown in these frames
    input_frame: int | None = None  # the live frame its first frame shows (its number; None: not from live input)
    pts: int = 0  # the first frame's index on the session timeline (set by Playout.add)
    audio_start: int = 0  # the audio's first sample on the session timeline (set by Playout.add)
    block_start: int = 0  # the timeline index of its block's first frame (set by Playout.add)

    @property
    def num_frames(self) -> int:
        return int(self.frames.shape[0])

    @property
    def num_samples(self) -> int:
        return 0 if self.audio is None else int(self.audio.shape[1])


@dataclass
class Released:
    """What :meth:`Playout.release` hands over: the merged pieces, and whether the clock started with them."""

    piece: Piece
    started_clock: bool  # this chunk plays on arrival (the first one, the first after a resume or attach, or one
    # the viewer waited for behind a lone opening frame)


@dataclass
class Playout:
    fps: int
    margin_s: float  # a paced piece is released this long before it plays
    samples_per_frame: int = 0  # audio samples per video frame (0: no audio)
    audio_channels: int = 0  # the session's audio channels (silence filling a cut needs them)
    max_chunk_frames: int = 24  # the most frames one released chunk merges
    whole_blocks: bool = False  # release a block's pieces only together, once the block is complete
    anchor: float | None = None  # monotonic time at which frame 0 plays; set by the first release
    reanchor: bool = False  # the next release restarts the clock (resume, attach, after an opening frame)
    # After a lone opening frame started the clock: where it started. A player whose next frames come before they
    # are due plays on from there; only one that waited for them starts again later.
    _opening_anchor: float | None = None
    frames_made: int = 0  # the made timeline's end: the next piece's pts
    frames_released: int = 0
    audio_made: int = 0  # samples of the timeline made so far (attached to pieces or waiting in the buffer)
    audio_released: int = 0
    chunks_released: int = 0
    pieces: deque[Piece] = field(default_factory=deque)  # the lead: made, not released, oldest first
    _audio_buffer: np.ndarray | None = None  # made audio no piece has taken yet (it ends at audio_made)
    _audio_next: int | None = None  # after a cut: where on the timeline the next audio made starts
    _drop_next: int = 0  # samples of the next audio made that were made (and kept) before a cut
    _block_start: int = 0  # the block the next piece belongs to, unless it begins one
    _block_audio: dict[int, int] = field(default_factory=dict)  # a block's first frame -> where its audio started

    # --- the clock ----------------------------------------------------------------------------
    @property
    def clock_running(self) -> bool:
        return self.anchor is not None and not self.reanchor

    def play_time(self, pts: int) -> float | None:
        """Monotonic time at which frame ``pts`` plays on the viewer's clock (None while it is not running)."""
        return self.anchor + pts / self.fps if self.clock_running else None

    def first_frame_playing_from(self, when: float) -> int | None:
        """The first frame that plays at or after monotonic time ``when`` (None while the clock is not running)."""
        if not self.clock_running:
            return None
        return max(0, math.ceil(round((when - self.anchor) * self.fps, 6)))

    def restart_clock(self) -> None:
        """The viewer's player starts again (a resume, a consumer attaching): the next chunk plays on arrival."""
        self.reanchor = True
        self._opening_anchor = None

    def playing_frame(self, now: float) -> float | None:
        """The frame the viewer sees at ``now`` (fractional; None while the clock is not running)."""
        return (now - self.anchor) * self.fps if self.clock_running else None

    def seconds_ahead(self, now: float, frames_in_flight: int = 0) -> float:
        """How far the made (and dispatched) media runs ahead of the viewer (0 while the clock is not running)."""
        if not self.clock_running:
            return 0.0
        return (self.frames_made + frames_in_flight) / self.fps - (now - self.anchor)

    @property
    def lead_frames(self) -> int:
        return self.frames_made - self.frames_released

    # --- made --------------------------------------------------------------------------------
    def add(self, piece: Piece) -> Piece:
        """Append a made piece to the lead: it gets its place on the timeline and its span's audio."""
        piece.pts = self.frames_made
        if piece.first_of_block:
            self._block_start = piece.pts
        piece.block_start = self._block_start
        if piece.audio is not None and piece.audio.shape[1]:
            self._place_audio_next()
            if piece.first_of_block:
                self._block_audio[piece.pts] = self.audio_made
                for old in [start for start in self._block_audio if start < self.frames_released - 64]:
                    del self._block_audio[old]
            self._buffer(piece.audio)
        end = self.audio_made if piece.last_of_block else min(self.audio_made, (piece.pts + piece.num_frames)
                                                               * self.samples_per_frame)
        piece.audio, piece.audio_start = self._take_audio(end), self._buffered_from()
        if piece.audio is not None:
            piece.audio_start -= piece.num_samples
        self.frames_made += piece.num_frames
        self.pieces.append(piece)
        return piece

    def _place_audio_next(self) -> None:
        """After a cut, the next audio starts at ``_audio_next``: silence fills a gap before it; what was made of
        the same stretch already (kept, or released) goes first, so the incoming audio's start is dropped."""
        if self._audio_next is None:
            return
        gap, self._audio_next = self._audio_next - self.audio_made, None
        if gap > 0 and self.audio_channels:
            self._buffer(np.zeros((self.audio_channels, gap), np.float32))
        self._drop_next = max(0, -gap)

    def _buffered_from(self) -> int:
        """Timeline sample at which the audio buffer starts (it ends at ``audio_made``)."""
        return self.audio_made - (0 if self._audio_buffer is None else self._audio_buffer.shape[1])

    def _buffer(self, audio: np.ndarray) -> None:
        if self._drop_next:
            dropped = min(self._drop_next, audio.shape[1])
            audio, self._drop_next = audio[:, dropped:], self._drop_next - dropped
            if not audio.shape[1]:
                return
        buffered = self._audio_buffer
        self._audio_buffer = audio if buffered is None else np.concatenate([buffered, audio], axis=1)
        self.audio_made += int(audio.shape[1])

    def _take_audio(self, end: int) -> np.ndarray | None:
        """The buffered audio before timeline sample ``end`` (None if there is none)."""
        buffered = self._audio_buffer
        if buffered is None:
            return None
        take = min(buffered.shape[1], max(0, end - self._buffered_from()))
        if take == 0:
            return None
        taken, rest = buffered[:, :take], buffered[:, take:]
        self._audio_buffer = rest if rest.shape[1] else None
        return taken

    def late(self, piece: Piece, now: float, tolerance_s: float) -> bool:
        """The piece was made after its frame should have played (a paced session's deadline miss)."""
        playing = self.play_time(piece.pts)
        return playing is not None and now > playing + tolerance_s

    # --- released ----------------------------------------------------------------------------
    def _unit(self, start: int = 0) -> int:
        """How many pieces from ``start`` leave together: one, or with ``whole_blocks`` the rest of their block
        (0 while that block is not complete)."""
        if start >= len(self.pieces):
            return 0
        if not self.whole_blocks:
            return 1
        for offset in range(start, len(self.pieces)):
            piece = self.pieces[offset]
            if piece.last_of_block or piece.opening:
                return offset - start + 1
        return 0

    def due(self, now: float, *, paced: bool) -> bool:
        """The lead's oldest piece may leave now."""
        if not self._unit():
            return False
        playing = self.play_time(self.pieces[0].pts)
        return not paced or playing is None or playing - now <= self.margin_s

    def next_release_in(self, now: float, *, paced: bool) -> float | None:
        """Seconds until the oldest piece is due (0 if it is; None while none can leave)."""
        if not self._unit():
            return None
        playing = self.play_time(self.pieces[0].pts)
        if not paced or playing is None:
            return 0.0
        return max(0.0, playing - self.margin_s - now)

    def release(self, now: float, *, paced: bool) -> Released:
        """Hand over every due piece at the lead's front (at least one unit: call when :meth:`due`), merged."""
        stopped = not self.clock_running
        started = stopped
        taken = [self.pieces.popleft() for _ in range(self._unit())]
        if stopped:
            anchor = now - taken[0].pts / self.fps
            if self._opening_anchor is not None and self._opening_anchor >= anchor:
                # The rest of the block came in time after a lone opening frame: the player did not wait, and
                # this chunk plays on the clock the opening frame started (it does not restart it).
                anchor, started = self._opening_anchor, False
            self.anchor = anchor
            # The viewer may wait for the block behind a lone opening frame: then that next chunk restarts the clock.
            self.reanchor = len(taken) == 1 and taken[0].opening
            self._opening_anchor = self.anchor if self.reanchor else None
        frames = sum(piece.num_frames for piece in taken)
        while not self.reanchor:
            unit = self._unit()
            if not unit or not self.due(now, paced=paced):
                break
            size = sum(self.pieces[i].num_frames for i in range(unit))
            if frames + size > self.max_chunk_frames:
                break
            taken += [self.pieces.popleft() for _ in range(unit)]
            frames += size
        merged = _merge(taken)
        self.frames_released += merged.num_frames
        self.audio_released = max(self.audio_released, merged.audio_start + merged.num_samples)
        self.chunks_released += 1
        return Released(merged, started)

    # --- cut ---------------------------------------------------------------------------------
    @property
    def lead_start(self) -> int:
        """The lead's first frame (the made timeline's end when the lead is empty)."""
        return self.pieces[0].pts if self.pieces else self.frames_made

    def cut(self, at: int, *, block_start: int | None = None) -> int:
        """Drop the lead from frame ``at`` on, any frame of it (a piece it falls inside keeps its frames before
        it); the next piece made starts there. Returns the frames dropped.

        Without ``block_start`` the next media is a new content starting at ``at``: the audio kept ends at or
        before ``at`` and the gap up to it is silence. With it, the block beginning at frame ``block_start`` is
        made again (supersede; its first piece made again starts at ``at``: the runner sends a piece the cut
        falls inside from the cut on): its audio comes again from that block's start, and only what follows the
        audio kept is used."""
        if not self.lead_start <= at <= self.frames_made or (block_start is not None and block_start > at):
            raise ValueError(f"{at} is not a frame of the lead")
        dropped = 0
        while self.pieces and self.pieces[-1].pts >= at:
            dropped += self.pieces.pop().num_frames
        if self.pieces and self.pieces[-1].pts + self.pieces[-1].num_frames > at:
            split = self.pieces[-1]  # a cut inside a piece: its frames up to the cut stay
            keep = at - split.pts
            dropped += split.num_frames - keep
            split.frames = split.frames[:keep]
        self.frames_made = at
        limit = at * self.samples_per_frame
        kept_end = self.audio_released
        for piece in self.pieces:
            if piece.audio is not None:
                keep = max(0, min(piece.num_samples, limit - piece.audio_start))
                piece.audio = piece.audio[:, :keep] if keep else None
                if piece.audio is not None:
                    kept_end = max(kept_end, piece.audio_start + keep)
        self._audio_buffer = None
        self.audio_made = kept_end
        self._drop_next = 0
        if block_start is None:
            self._audio_next = limit
            self._block_start = at
        else:
            self._audio_next = self._block_audio.get(block_start, kept_end)
            self._block_start = block_start
        return dropped

    @property
    def open_block_start(self) -> int:
        """The first frame of the block the next piece made belongs to, unless that piece begins a block."""
        return self._block_start


def _merge(pieces: list[Piece]) -> Piece:
    """One piece of consecutive ones: frames and audio joined (the audio of consecutive pieces is contiguous)."""
    first = pieces[0]
    if len(pieces) == 1:
        return first
    audio = [p.audio for p in pieces if p.audio is not None]
    audio_start = next((p.audio_start for p in pieces if p.audio is not None), first.audio_start)
    marks = tuple(mark for p in pieces for mark in p.marks)
    return replace(
        first,
        frames=np.concatenate([p.frames for p in pieces]),
        audio=np.concatenate(audio, axis=1) if audio else None,
        audio_start=audio_start,
        marks=marks,
        last_of_block=pieces[-1].last_of_block,
        opening=False,
        timings=pieces[-1].timings,
    )
