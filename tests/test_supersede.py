"""Supersede (engine/undo.py): a prompt change takes back blocks already made and makes them again.

Compared with a session that changed its prompt before those blocks, on the same tiny real model (float32, CPU):
the blocks made again are the same latents, bit for bit (same history, same noise), so is every block after them;
the frames sent from the middle of a block (a latent frame's, or any frame's) are what decoding the viewer's actual
sequence gives (the old block's first latent frames, then the new block's rest), and nothing is left held in the
pools.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from engine.kv_cache import KVCacheManager
from engine.plan import OpenSession, PromptUpdate, Rewind, SessionWork, StepPlan
from engine.runner import runner_for
from tests.engine_helpers import build_small, small_config

UNDO_BLOCKS = 3


@pytest.fixture(scope="module")
def bundle():
    return build_small(sink_frames=1, window_frames=3, audio=False)[1]


def _runner(bundle):
    spec = bundle.pipeline.kv_spec()
    spec = dataclasses.replace(spec, held_frames=UNDO_BLOCKS * spec.frames_per_block)
    return runner_for(bundle, KVCacheManager(spec, 1, bundle.pipeline.transformer.device), undo_blocks=UNDO_BLOCKS)


def _latents_of(runner):
    """Record every block's clean latents, in order, as the pipeline makes them."""
    made = []
    original = runner.pipeline.denoise_block

    def recording(kv, progress):
        clean = original(kv, progress)
        made.append(clean.video.clone())
        return clean

    runner.pipeline.denoise_block = recording
    return made


def _frames(runner, *work: SessionWork) -> list[np.ndarray]:
    result = runner.execute(StepPlan(work=list(work)))
    assert not result.failures, result.failures
    return [output.frames for output in result.outputs]


@pytest.mark.parametrize("blocks_back, skip_latents, skip_frames", [(1, 1, 0), (1, 2, 0), (2, 0, 0), (1, 1, 3),
                                                                   (2, 0, 2)])
def test_blocks_made_again_equal_a_session_that_changed_its_prompt_before_them(bundle, blocks_back, skip_latents,
                                                                               skip_frames):
    """``skip_frames``: the cut falls inside a piece, whose frames before it the viewer has (sent from the cut on)."""
    _check_made_again(bundle, blocks_back, skip_latents, skip_frames)


def test_with_blocks_of_two_a_block_taken_back_mid_block_equals_the_changed_session():
    """The shipped tiny weights are served with blocks of 2 latent frames: a take-back at the block's second
    latent frame holds there too."""
    _check_made_again(build_small(sink_frames=1, window_frames=3, audio=False, frames_per_block=2)[1], 1, 1)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_blocks_made_again_equal_a_session_that_changed_its_prompt_before_them():
    """The same on CUDA with the engine's fast paths (gathered history, fused kernels, CUDA graphs): the history
    taken back must not be read from a stale gathered context or a graph's buffer."""
    cuda = build_small(device="cuda", sink_frames=1, window_frames=3, audio=False, cuda_graphs=True)[1]
    for blocks_back, skip_latents, skip_frames in [(1, 1, 0), (2, 0, 0), (1, 1, 2)]:
        _check_made_again(cuda, blocks_back, skip_latents, skip_frames)


def _check_made_again(bundle, blocks_back: int, skip_latents: int, skip_frames: int = 0) -> None:
    opening = OpenSession(seed=11, prompt="a red circle bouncing", negative_prompt="")
    change = PromptUpdate("a yellow square drifting", "", "soft")
    made = 5  # blocks 0-4 under the old prompt, then blocks from `target` on are taken back
    target = made - blocks_back

    superseding = _runner(bundle)
    latents = _latents_of(superseding)
    old_frames = _frames(superseding, SessionWork("s", open=opening))
    for _ in range(made):
        old_frames += _frames(superseding, SessionWork("s", run=True))
    old_latents = list(latents)
    rewind = Rewind(target, skip_latents, skip_frames)
    again = _frames(superseding, SessionWork("s", prompt=change, run=True, rewind=rewind))
    again += _frames(superseding, SessionWork("s", run=True))
    superseding.pipeline.denoise_block = type(superseding.pipeline).denoise_block.__get__(superseding.pipeline)
    new_latents = latents[made:]

    reference = _runner(bundle)
    ref_latents = _latents_of(reference)
    _frames(reference, SessionWork("r", open=opening))
    for _ in range(target):
        _frames(reference, SessionWork("r", run=True))
    _frames(reference, SessionWork("r", prompt=change, run=True))
    _frames(reference, SessionWork("r", run=True))
    reference.pipeline.denoise_block = type(reference.pipeline).denoise_block.__get__(reference.pipeline)

    # The model: the block made again, and the next, are the reference's latents exactly.
    torch.testing.assert_close(new_latents[0], ref_latents[target], rtol=0, atol=0)
    torch.testing.assert_close(new_latents[1], ref_latents[target + 1], rtol=0, atol=0)
    assert not torch.equal(new_latents[0], old_latents[target])  # and the change did change them
    # The frames: the old blocks up to the cut, then the new ones, decoded as one stream (what the viewer saw).
    decoder = superseding.decoder
    state = decoder.new_state("viewer")
    sequence = old_latents[:target] + [old_latents[target][:, :, :skip_latents]] + [
        new_latents[0][:, :, skip_latents:], new_latents[1]]
    viewer = decoder.to_uint8_tensor(decoder.decode_chunk(decoder.denormalize(torch.cat(sequence, dim=2)), state))
    sent_again = np.concatenate(again)
    per_block = bundle.pipeline.frames_per_block
    assert sent_again.shape[0] == 4 * (per_block - skip_latents) - skip_frames + 4 * per_block
    np.testing.assert_array_equal(sent_again, viewer.cpu().numpy()[-sent_again.shape[0]:])
    # Nothing is left held: closing returns the pool whole.
    superseding.release("s", "test")
    assert superseding.kv_manager.blocks_in_use == 0


def test_a_block_not_kept_any_more_cannot_be_taken_back(bundle):
    runner = _runner(bundle)
    _frames(runner, SessionWork("s", open=OpenSession(seed=1, prompt="p", negative_prompt="")))
    for _ in range(UNDO_BLOCKS + 2):
        _frames(runner, SessionWork("s", run=True))
    result = runner.execute(StepPlan(work=[SessionWork("s", prompt=PromptUpdate("q", "", "soft"), run=True,
                                                       rewind=Rewind(1, 0))]))
    assert result.failures and "cannot be taken back" in result.failures[0].message
    assert runner.kv_manager.blocks_in_use == 0  # the failed session was released whole


def test_the_warm_up_takes_a_block_back_with_the_first_block_split_as_on_a_gpu():
    """The warm-up makes a block again (so a decoder's compiled path meets its restored state before the first
    viewer does: on the H200 the first one took 0.9-1.3 s and stalled the stream); with the first block split
    in two works, as on a GPU, the blocks it can take back are not where an unsplit session has them."""
    from engine.startup import build_engine
    from tests.engine_helpers import small_config

    for split in (True, False):
        built = build_engine(small_config(split_first_block=split, warmup_blocks=1, window_frames=3))
        assert built.undo_blocks >= 2 and built.runner.kv_manager.blocks_in_use == 0


def test_a_paced_session_supersedes_with_the_first_block_split_and_streams_on(bundle):
    """Through the engine: the first block split as on a GPU, soft changes superseding what was made ahead again
    and again: every change is shown and the timeline has no gap.

    Made just in time, a session's media runs at most about a block past its release margin, and only then can a
    change take any of it back: each change is sent as a block was just made, at 8 frames/s (a block is 1.5 s of
    video), so taking back is possible whenever the machine makes a block in under ~1 s (this 2-core CPU: ~0.1 s),
    not only on a fast one."""
    import asyncio
    import time

    from engine.api import Engine
    from tests.engine_helpers import run_async, small_config

    async def scenario():
        engine = Engine(small_config(window_frames=3, split_first_block=True, fps=8, lead_chunks=3))
        await engine.start()
        try:
            sid = engine.create_session(seed=4, prompt="a red circle", pace=True).session_id
            record = engine._core.records[sid]
            playout = record.playout
            chunks = []

            async def viewer():
                async for chunk in engine.chunks(sid):
                    chunks.append(chunk)

            async def block_just_made(after_frames: int) -> None:
                """Past ``after_frames``, wait for a new block to be made (the most media made ahead)."""
                deadline = time.monotonic() + 60
                while playout.frames_made <= after_frames or not playout.clock_running or record.cut_pending:
                    assert time.monotonic() < deadline, "no block made in 60 s"
                    await asyncio.sleep(0.002)

            task = asyncio.create_task(viewer())
            for index in range(3):
                await block_just_made(max(24, playout.frames_made))
                engine.set_prompt(sid, f"a {'blue' if index % 2 else 'green'} square", "soft", control_id=f"p{index}")
            while sum(len(c.marks) for c in chunks) < 3:
                await asyncio.sleep(0.01)
            status = engine.status(sid)
            engine.close(sid)
            await task
            return chunks, status, record
        finally:
            await engine.shutdown()

    chunks, status, record = run_async(scenario())
    assert [m.control_id for c in chunks for m in c.marks] == ["p0", "p1", "p2"]
    pts = [c.pts for c in chunks]
    assert pts == list(np.cumsum([0] + [c.frames.shape[0] for c in chunks[:-1]]))
    # At least one change took media back. (Whether a block made again is ready before it is due depends on the
    # machine's speed: stalls are the benchmark's to count, bench/control_to_screen.py, not a test's.)
    assert record.epoch >= 1, status.realtime


def test_supersede_is_on_by_default_where_the_kept_decoder_states_are_small_or_fit_an_eighth_of_the_gpu():
    from engine.startup import supersede_blocks

    gib = 2**30
    wan_state = int(1.8 * gib)  # the Wan VAE's streaming state at 832x480
    cuda = small_config(blocks_in_flight=2)  # as on CUDA: two blocks in flight, three blocks kept
    assert supersede_blocks(small_config(), 3 * 2**20) == 2  # the tiny codec on the CPU
    assert supersede_blocks(cuda, wan_state, 141 * gib) == 3  # an H200
    assert supersede_blocks(cuda, wan_state, 80 * gib) == 3  # an H100
    assert supersede_blocks(cuda, wan_state, 24 * gib) == 0  # the 24 GiB mode: 7.2 GiB of kept states is too much
    assert supersede_blocks(small_config(blocks_in_flight=2, supersede=False), 3 * 2**20, 141 * gib) == 0
    assert supersede_blocks(small_config(blocks_in_flight=2, supersede=True), wan_state, 24 * gib) == 3


def test_marks_of_pieces_a_cut_drops_wait_for_the_first_frames_after_it():
    """A change superseded before its frames played: the cut that drops its piece gives its mark back, and the
    first piece shown after the cut carries it, before the marks of later changes (the supersede test above hung
    on this when two changes came a piece apart: the first one's mark went with the dropped piece)."""
    from engine import marks
    from engine.session import ChunkTimings, ControlMark
    from engine.playout import Piece
    from tests.test_realtime_scheduling import _record

    record = _record("s", pace=True)
    frames = np.zeros((4, 1, 1, 3), np.uint8)
    first, superseded, later = (ControlMark(name, "prompt", 0.0) for name in ("p0", "p1", "p2"))
    for index, shown in enumerate(((first,), (superseded,), ())):
        record.made(Piece(frames, 1, ChunkTimings(0, 0, 0, 0), 0.0, marks=shown, first_of_block=index == 0), 0.0,
                    tolerance_s=0.05)
    marks.wait_for(record, later, "prompt")  # the change that cuts: its mark waits for its plan
    marks.requeue_cut(record, 4)  # the pieces from frame 4 on are dropped: p1's with them
    record.playout.cut(4, block_start=0)
    assert [piece.marks for piece in record.playout.pieces] == [(first,)]
    marks.planned(record, SessionWork("s", prompt=PromptUpdate("x", "", "soft"), run=True), tick=7)
    assert marks.shown(record, 7) == (superseded, later) and not record.marks
