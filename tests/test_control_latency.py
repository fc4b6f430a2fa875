"""What a viewer does reaches their screen soon: the lead lives on the server, a reset cuts it, and every chunk
names the controls it first shows (docs/ENGINE.md, "The lead"). Real tiny engines on the CPU; the bounds are
about the timeline (which frames show a control), never about this machine's speed."""

from __future__ import annotations

import asyncio

import numpy as np

from engine.api import Engine
from engine.playout import Piece, Playout
from engine.realtime import RunningCost
from engine.session import ChunkQueue, ChunkTimings
from engine.session_record import SessionRecord
from tests.engine_helpers import run_async, small_config

FPS = 16


async def _viewer(engine: Engine, session_id: str, chunks: list, stop: asyncio.Event) -> None:
    """A consumer that takes every chunk as soon as it is released (what a socket's sender does)."""
    async for chunk in engine.chunks(session_id):
        chunks.append(chunk)
        if stop.is_set():
            return


async def _until(predicate, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _released_ahead(chunks) -> list[float]:
    """How long before its frame plays on the viewer's clock each chunk left (the first chunk starts the clock,
    the first after a lone opening frame restarts it: the viewer waited for it)."""
    anchor, ahead = None, []
    for index, chunk in enumerate(chunks):
        ready = chunk.ready_at / 1000.0
        restart = index == 1 and chunks[0].frames.shape[0] == 1 and chunks[0].block_index == 0
        if anchor is None or restart:
            anchor = ready - chunk.pts / FPS
        ahead.append(anchor + chunk.pts / FPS - ready)
    return ahead


def test_resets_never_let_a_paced_session_run_further_ahead_of_its_viewer():
    """The reset bug: with the first block split (as on a GPU) every reset's opening frame restarted the playback
    clock although the viewer's buffer still held the media made before it, so each reset let the session run
    about two more blocks ahead of its viewer (the latency of every later control grew by ~1.5 s per reset).
    Now a mid-stream opening frame is an ordinary frame: across resets no chunk leaves earlier than the margin."""

    async def scenario():
        config = small_config(window_frames=3, fps=FPS, split_first_block=True)
        engine = Engine(config)
        await engine.start()
        try:
            sid = engine.create_session(seed=1, prompt="resets", pace=True).session_id
            chunks, stop = [], asyncio.Event()
            viewer = asyncio.create_task(_viewer(engine, sid, chunks, stop))
            for index in range(4):
                await _until(lambda: len(chunks) >= 4 * (index + 1))
                engine.reset(sid, control_id=f"r{index}")
            await _until(lambda: sum("r3" == m.control_id for c in chunks for m in c.marks) == 1)
            count = len(chunks)
            await _until(lambda: len(chunks) >= count + 4)
            stop.set()
            await viewer
            return config, chunks
        finally:
            await engine.shutdown()

    config, chunks = run_async(scenario())
    assert [c.pts for c in chunks] == list(np.cumsum([0] + [c.frames.shape[0] for c in chunks[:-1]]))
    ahead = _released_ahead(chunks)
    assert max(ahead) <= config.playout_margin_s + 0.03, ahead
    # Each reset's first frames are an opening frame, named by the chunk that carries it.
    named = [c for c in chunks if c.marks]
    assert [m.control_id for c in named for m in c.marks] == ["r0", "r1", "r2", "r3"]
    assert all(c.frames.shape[0] == 1 and c.block_index == 0 for c in named)


def test_a_reset_cuts_what_was_made_ahead_and_the_timeline_and_audio_run_on_without_a_gap():
    """With a lead of over a second (a large playout margin), a reset does not wait behind it: the media made
    ahead is dropped from the first piece that can still be replaced, the restarted content's first frame comes
    next on the timeline, and the audio stays sample-continuous across the cut."""

    async def scenario(cut: bool):
        # Half the frame rate: a block plays 1.5 s, so the engine makes media well ahead of playback even on a
        # slow or busy machine (at 16 fps a busy 2-core one could not, and there was nothing made ahead to cut).
        config = small_config(window_frames=3, fps=FPS // 2, playout_margin_s=1.2, lead_chunks=3, cut_on_reset=cut)
        engine = Engine(config)
        await engine.start()
        try:
            sid = engine.create_session(seed=2, prompt="cut", pace=True).session_id
            record = engine._core.records[sid]
            chunks, stop = [], asyncio.Event()
            viewer = asyncio.create_task(_viewer(engine, sid, chunks, stop))
            await _until(lambda: record.playout.frames_made >= 2 * 12 + 9 and len(chunks) >= 2)
            made_at_reset = record.playout.frames_made + record.frames_in_flight
            engine.reset(sid, control_id="r")
            await _until(lambda: any(m.control_id == "r" for c in chunks for m in c.marks))
            count = len(chunks)
            await _until(lambda: len(chunks) >= count + 3)
            stop.set()
            await viewer
            return chunks, made_at_reset, engine.status(sid)
        finally:
            await engine.shutdown()

    for cut in (True, False):
        chunks, made_at_reset, status = run_async(scenario(cut))
        first_new = next(c for c in chunks if any(m.control_id == "r" for m in c.marks))
        if cut:
            assert first_new.pts < made_at_reset  # the reset did not wait behind what was made before it
        else:
            assert first_new.pts >= made_at_reset  # cut_on_reset off: it comes after everything made
        assert [c.pts for c in chunks] == list(np.cumsum([0] + [c.frames.shape[0] for c in chunks[:-1]]))
        with_audio = [c for c in chunks if c.audio is not None]
        for before, after in zip(with_audio, with_audio[1:]):
            assert after.audio_start == before.audio_start + before.audio.shape[1]
        assert status.control_latency is not None and status.control_latency.count == 1


def test_a_prompt_change_is_named_by_the_first_chunk_whose_frames_show_it():
    """The chunk that names a prompt change begins the first block made under the new prompt: the frames
    before it are what the old prompt made (equal to a session that never changed), its own differ."""

    async def scenario(change: bool, frames: int = 0):
        engine = Engine(small_config(window_frames=3, fps=FPS))
        await engine.start()
        try:
            sid = engine.create_session(seed=3, prompt="a red circle", pace=True).session_id
            chunks, stop = [], asyncio.Event()
            viewer = asyncio.create_task(_viewer(engine, sid, chunks, stop))
            await _until(lambda: len(chunks) >= 4)
            if change:
                engine.set_prompt(sid, "a blue square", "soft", control_id="p1")
                await _until(lambda: any(m.control_id == "p1" for c in chunks for m in c.marks))
            count = len(chunks)
            await _until(lambda: len(chunks) >= count + 4 and sum(c.frames.shape[0] for c in chunks) >= frames)
            stop.set()
            await viewer
            return chunks, engine.status(sid)
        finally:
            await engine.shutdown()

    changed, status = run_async(scenario(True))
    named = [c for c in changed if c.marks]
    unchanged, _ = run_async(scenario(False, frames=named[0].pts + named[0].frames.shape[0] if named else 0))
    assert len(named) == 1 and named[0].marks[0].kind == "prompt_soft" and named[0].block_index > 0
    # After the first block (9 frames): a block's first frame, or any frame in the middle of a block made again
    # under the new prompt (supersede) when its start had already left.
    assert named[0].pts >= 9
    timeline = np.concatenate([c.frames for c in unchanged])  # frame f at index f (chunks are contiguous from 0)
    for chunk in changed:
        if chunk.pts < named[0].pts:
            np.testing.assert_array_equal(chunk.frames, timeline[chunk.pts:chunk.pts + chunk.frames.shape[0]])
    span = named[0].frames.shape[0]
    assert not np.array_equal(named[0].frames, timeline[named[0].pts:named[0].pts + span])
    latency = status.control_latency
    assert latency.count == 1 and latency.last_s > 0 and latency.median_s == latency.last_s


def test_a_restart_cuts_at_the_first_frame_it_can_reach_made_or_in_flight():
    """Where a reset's new content starts (SessionRecord.restart_cut), on a virtual clock: at the first frame
    ahead that plays once its first frames can be out, inside the lead or inside media still in flight (new
    content needs no block or piece boundary: no wait for the next piece), nothing when even the end of it all
    plays too soon."""
    record = SessionRecord(session_id="s", seed=1, pace=True, queue=ChunkQueue(), cost=RunningCost(),
                           playout=Playout(fps=FPS, margin_s=0.15))
    playout = record.playout
    playout.frames_made = playout.frames_released = 9
    playout.chunks_released, playout.anchor = 1, 0.0  # frame f plays at f / FPS
    for index in range(3):  # the lead: frames 9-20, three pieces of a block
        playout.add(Piece(np.zeros((4, 2, 2, 3), np.uint8), 1, ChunkTimings(0.0, 0.0, 0.0, 0.0), 0.0,
                          last_of_block=index == 2, first_of_block=index == 0))
    for index in range(2):  # in flight: frames 21-28
        record.in_flight.queue(frames_made=playout.frames_made, frames=4, block_index=2, first_of_block=index == 0,
                               open_block_start=21)
    assert [point.at for point in record.cut_points()] == [9, 13, 17, 21, 25, 29]
    at = lambda frame: record.restart_cut(frame / FPS)  # noqa: E731 - ready when frame `frame` plays
    assert at(3) == 9 and at(9) == 9  # no earlier than the lead's first frame: the rest has left
    assert at(10.2) == 11 and at(14) == 14  # inside the lead's pieces, not at their next start (13, 17)
    assert at(21) == 21 and at(22.5) == 23  # inside the media in flight
    assert at(28) == 28 and at(28.5) is None  # only the end is left: the new content follows everything
    assert record.restart_cut(None) == 9  # best effort, or no clock: at the first frame ahead
    # A restart's cut waiting inside a piece in flight (frame 23): what is ahead ends there, for pacing and for
    # a later reset alike.
    assert record.in_flight.drop_from(23) == 6 and record.frames_in_flight == 2
    assert at(22) == 22 and at(23) is None
