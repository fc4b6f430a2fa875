"""The lead and the playback clock (engine/playout.py): when pieces leave, where a cut falls, how audio follows.

Pure bookkeeping on a virtual clock: no model, no device, no timing of this machine.
"""

from __future__ import annotations

import numpy as np
import pytest

from engine.playout import Piece, Playout
from engine.session import ChunkTimings

FPS = 16
SPF = 3000  # audio samples per video frame at 48 kHz
MARGIN = 0.15
TIMINGS = ChunkTimings(0.0, 0.0, 0.0, 0.0)


def _playout(**overrides) -> Playout:
    values = dict(fps=FPS, margin_s=MARGIN, samples_per_frame=SPF, audio_channels=2, max_chunk_frames=24)
    values.update(overrides)
    return Playout(**values)


def _piece(frames: int, *, audio: int | None = None, last: bool = True, opening: bool = False, fill: float = 0.0,
           block: int = 0) -> Piece:
    pcm = None if audio is None else np.full((2, audio), fill, np.float32)
    return Piece(np.zeros((frames, 2, 2, 3), np.uint8), block, TIMINGS, 0.0, audio=pcm, last_of_block=last,
                 opening=opening)


def _block(playout: Playout, sizes=(4, 4, 4), audio: int = 0, fill: float = 0.0, block: int = 0) -> None:
    """One block's pieces as the runner hands them over: the block's audio with its first piece."""
    for index, size in enumerate(sizes):
        playout.add(_piece(size, audio=audio if index == 0 else None, last=index == len(sizes) - 1, fill=fill,
                           block=block))


def test_a_paced_piece_leaves_the_margin_before_it_plays_a_best_effort_one_at_once():
    playout = _playout()
    _block(playout, sizes=(1, 4, 4))
    assert playout.due(0.0, paced=True)  # no clock yet: the first chunk leaves at once and starts it
    first = playout.release(0.0, paced=True)
    assert first.started_clock and first.piece.num_frames == 1 + 4  # frame 1 plays within the margin: merged
    assert playout.play_time(5) == pytest.approx(5 / FPS)
    assert not playout.due(5 / FPS - MARGIN - 0.01, paced=True)
    assert playout.next_release_in(0.0, paced=True) == pytest.approx(5 / FPS - MARGIN)
    assert playout.due(5 / FPS - MARGIN, paced=True)
    assert playout.release(5 / FPS - MARGIN, paced=True).piece.pts == 5
    # Best effort: whatever is made leaves as soon as the consumer can take it, merged up to the bound.
    best = _playout(max_chunk_frames=12)
    for _ in range(2):
        _block(best)
    assert [best.release(0.0, paced=False).piece.num_frames for _ in range(2)] == [12, 12]


def test_an_opening_frame_restarts_the_clock_only_when_it_starts_it():
    """The reset bug: an opening frame in the middle of a stream (a reset's, sent ahead of its block) is an
    ordinary frame of the timeline. Restarting the clock there told the engine the viewer was at the new
    content while its buffer still held what was made before, so every reset let the session run further ahead."""
    playout = _playout()
    playout.add(_piece(1, opening=True, last=False))
    assert playout.release(0.0, paced=True).started_clock
    assert playout.reanchor  # the viewer waits for the rest of the block: it plays on arrival
    _block(playout, sizes=(4, 4))
    rest = playout.release(0.5, paced=True)
    assert rest.started_clock and playout.anchor == pytest.approx(0.5 - 1 / FPS)
    # Mid-stream: a reset's opening frame keeps the clock.
    anchor = playout.anchor
    playout.add(_piece(1, opening=True, last=False))
    _block(playout, sizes=(4, 4))
    now = anchor + playout.frames_released / FPS
    while playout.pieces:
        released = playout.release(now, paced=True)
        assert not released.started_clock
        now = playout.play_time(playout.frames_released) - MARGIN if playout.pieces else now
    assert playout.anchor == anchor and not playout.reanchor


def test_after_an_opening_frame_the_clock_moves_only_if_the_viewer_had_to_wait():
    """A player shows the opening frame on arrival and plays on: if the rest of the block comes before frame 1
    is due, nothing waited and the clock stays where the opening frame put it (restarting it there put every
    later frame up to a frame's time later on the screen than the engine thought); if it comes later, the
    player waited and starts again from it."""
    for arrives, anchor, restarted in ((0.5 / FPS, 0.0, False), (3 / FPS, 2 / FPS, True)):
        playout = _playout()
        playout.add(_piece(1, opening=True, last=False))
        playout.release(0.0, paced=True)
        _block(playout, sizes=(4, 4))
        # A chunk that restarts the clock says so (a WebRTC peer restarts its own with it); one in time does not.
        assert playout.release(arrives, paced=True).started_clock is restarted
        assert playout.anchor == pytest.approx(anchor)
        assert playout.clock_running
    # A resume restarts the clock at its next chunk, whatever an opening frame did before.
    playout.restart_clock()
    released = playout.release(10.0, paced=True)
    assert released.started_clock and playout.anchor == pytest.approx(10.0 - released.piece.pts / FPS)


def test_a_cut_drops_the_lead_from_a_piece_on_and_keeps_audio_in_step():
    playout = _playout()
    _block(playout, audio=6 * SPF, fill=0.5)  # the block's audio trails its 12 frames by 6 frames' worth
    playout.release(0.0, paced=True)  # frames 0-3 (clock starts): 4 frames of audio with them
    assert playout.audio_released == 4 * SPF
    assert [piece.pts for piece in playout.pieces] == [4, 8]
    with pytest.raises(ValueError):
        playout.cut(2, block_start=0)  # released: it cannot change any more
    assert playout.cut(8) == 4  # frames 8-11 dropped; 4-7 stay
    assert playout.frames_made == 8 and [p.pts for p in playout.pieces] == [4]
    # The new content's audio starts at the cut: the gap is silence, waiting for the next piece.
    _block(playout, sizes=(1, 4, 4), audio=9 * SPF, fill=1.0)
    chunks = []
    while playout.pieces:
        chunks.append(playout.release(10.0, paced=True).piece)
    audio = np.concatenate([c.audio for c in chunks if c.audio is not None], axis=1)
    starts = [c.audio_start for c in chunks if c.audio is not None]
    assert starts[0] == 4 * SPF
    assert audio.shape[1] == (8 + 9) * SPF - 4 * SPF  # released audio runs to the new block's end, no gap
    assert np.all(audio[0, : 2 * SPF] == 0.5)  # the old content's audio made for the kept frames (4, 5)
    assert np.all(audio[0, 2 * SPF: 4 * SPF] == 0.0)  # silence for the rest of them (held back, then dropped)
    assert np.all(audio[0, 4 * SPF:] == 1.0)  # the new content, from the cut on


def test_a_restart_cuts_the_lead_at_any_frame_and_the_audio_follows():
    """New content needs no block boundary: a reset's cut may fall inside a piece of the lead, whose frames
    before it stay; never inside what was already released."""
    playout = _playout()
    _block(playout, audio=6 * SPF, fill=0.5)
    playout.release(0.0, paced=True)  # frames 0-3 leave and start the clock
    with pytest.raises(ValueError):
        playout.cut(3)  # released: it cannot change any more
    assert playout.first_frame_playing_from(playout.play_time(5) + 0.001) == 6
    assert playout.first_frame_playing_from(playout.play_time(6)) == 6
    assert playout.cut(6) == 6  # frames 6-11 dropped; 4-5 stay in their piece
    assert playout.frames_made == 6 and [(p.pts, p.num_frames) for p in playout.pieces] == [(4, 2)]
    _block(playout, sizes=(1, 4, 4), audio=9 * SPF, fill=1.0)
    chunks = []
    while playout.pieces:
        chunks.append(playout.release(10.0, paced=True).piece)
    assert [c.pts for c in chunks] == list(np.cumsum([4] + [c.num_frames for c in chunks[:-1]]))
    assert sum(c.num_frames for c in chunks) == 2 + 9
    audio = np.concatenate([c.audio for c in chunks if c.audio is not None], axis=1)
    assert [c.audio_start for c in chunks if c.audio is not None][0] == 4 * SPF
    assert audio.shape[1] == (6 + 9) * SPF - 4 * SPF  # no gap, no overlap: the new audio starts at frame 6
    assert np.all(audio[0, : 2 * SPF] == 0.5) and np.all(audio[0, 2 * SPF:] == 1.0)


def test_a_block_made_again_from_inside_a_piece_follows_the_frames_kept_and_its_audio_the_audio_kept():
    """A prompt change's cut may fall inside a piece too: the frames before it stay, the block made again is sent
    from the cut on (the runner trims its piece), and its audio, made again from the block's start, only after the
    audio kept."""
    playout = _playout()
    _block(playout, audio=12 * SPF, fill=0.5)  # block 0, frames 0-11
    _block(playout, audio=12 * SPF, fill=0.5, block=1)  # block 1, frames 12-23
    playout.release(0.0, paced=True)  # frames 0-3 leave and start the clock
    assert playout.cut(18, block_start=12) == 6  # frames 18-23 dropped; 12-17 stay (16-17 of the piece at 16)
    assert [(p.pts, p.num_frames) for p in playout.pieces] == [(4, 4), (8, 4), (12, 4), (16, 2)]
    # Block 1 made again from its second latent frame, that piece's first 2 frames not sent; the block's audio
    # with its first piece sent.
    for piece in (_piece(2, audio=12 * SPF, last=False, fill=1.0, block=1), _piece(4, last=True, block=1)):
        piece.first_of_block = False
        playout.add(piece)
    assert [p.pts for p in playout.pieces][-2:] == [18, 20] and playout.frames_made == 24
    assert all(p.block_start == 12 for p in list(playout.pieces)[-2:])  # the block made again
    chunks = []
    while playout.pieces:
        chunks.append(playout.release(100.0, paced=True).piece)
    audio = np.concatenate([c.audio for c in chunks if c.audio is not None], axis=1)
    assert [c.audio_start for c in chunks if c.audio is not None][0] == 4 * SPF
    assert audio.shape[1] == 24 * SPF - 4 * SPF  # contiguous to the block's end, no gap, no overlap
    kept = 18 * SPF - 4 * SPF  # the old audio up to the cut
    assert np.all(audio[0, :kept] == 0.5) and np.all(audio[0, kept:] == 1.0)


def test_every_sample_of_a_blocks_audio_leaves_once_in_order_whatever_the_pieces():
    playout = _playout()
    rng = np.random.default_rng(0)
    made = []
    for block, sizes in enumerate([(1, 4, 4), (4, 4, 4), (4, 4, 4)]):
        samples = int(rng.integers(6 * SPF, 12 * SPF))
        pcm = rng.standard_normal((2, samples)).astype(np.float32)
        made.append(pcm)
        for index, size in enumerate(sizes):
            piece = _piece(size, last=index == len(sizes) - 1, block=block)
            piece.audio = pcm if index == 0 else None
            playout.add(piece)
    released = []
    while playout.pieces:
        released.append(playout.release(100.0, paced=True).piece)
    audio = [c for c in released if c.audio is not None]
    np.testing.assert_array_equal(np.concatenate([c.audio for c in audio], axis=1), np.concatenate(made, axis=1))
    for before, after in zip(audio, audio[1:]):
        assert after.audio_start == before.audio_start + before.num_samples


def test_whole_blocks_leave_together_once_the_block_is_made():
    playout = _playout(whole_blocks=True)
    playout.add(_piece(4, last=False))
    playout.add(_piece(4, last=False))
    assert not playout.due(0.0, paced=False) and playout.next_release_in(0.0, paced=False) is None
    playout.add(_piece(4, last=True))
    assert playout.release(0.0, paced=False).piece.num_frames == 12
