"""A restart stops its session's block between two forwards (``Runner.stop_block``, ``EngineCore.submit``).

A reset used to wait for the whole block its session had on the device, although a reset cuts that block's frames:
on an H100 the standard config's resets were cut 0.84-0.89 s ahead of the viewer for that, 0.60 s without a block
(docs/BENCHMARKS.md, twenty-first session). Now the block being dispatched stops before its next denoising forward
when the media ahead covers the new content's first block, and makes nothing. Real tiny models on the CPU; what is
checked is which forwards ran and which frames were streamed, never how long anything took.
"""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from engine.controls import Reset, SetPrompt
from engine.kv_cache import KVCacheManager
from engine.plan import OpenSession, PromptUpdate, SessionWork, StepPlan
from engine.runner import runner_for
from tests.engine_helpers import build_small, run_async, small_config, stepped_core

PROMPT = "a red circle"
NEW_PROMPT = "a blue square"


def _runner(bundle, stoppable: bool):
    device = bundle.pipeline.transformer.device
    return runner_for(bundle, KVCacheManager(bundle.pipeline.kv_spec(), 1, device), stoppable=stoppable)


def _frames(result) -> np.ndarray:
    assert not result.failures, result.failures
    return np.concatenate([output.frames for output in result.outputs])


def _blocks(runner, count: int) -> list[np.ndarray]:
    made = [_frames(runner.execute(StepPlan(work=[SessionWork("s", open=OpenSession(3, PROMPT, ""), run=True)])))]
    for _ in range(count - 1):
        made.append(_frames(runner.execute(StepPlan(work=[SessionWork("s", run=True)]))))
    return made


def test_a_stoppable_runner_makes_the_blocks_a_plain_one_makes():
    """The forwards queued one at a time are the block's forwards: the same frames, bit for bit."""
    bundle = build_small(window_frames=3, audio=False)[1]
    for ours, plain in zip(_blocks(_runner(bundle, True), 3), _blocks(_runner(bundle, False), 3)):
        np.testing.assert_array_equal(ours, plain)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_forwards_queued_one_ahead_make_the_same_blocks_and_stop():
    """On CUDA the host waits for a forward's event before queuing the one after the next (with CUDA graphs)."""
    cuda = build_small(device="cuda", window_frames=3, audio=False, cuda_graphs=True)[1]
    for ours, plain in zip(_blocks(_runner(cuda, True), 3), _blocks(_runner(cuda, False), 3)):
        np.testing.assert_array_equal(ours, plain)
    _check_stop(cuda)


def test_a_stopped_block_makes_nothing_and_the_restart_makes_a_fresh_content():
    _check_stop(build_small(window_frames=3, audio=False)[1])


def _check_stop(bundle) -> None:
    runner = _runner(bundle, True)
    first = _blocks(runner, 1)[0]
    forwards = []
    original = runner.pipeline.denoise_step

    def stop_after_the_first(kv, progress):
        forwards.append(progress.step_index)
        if stop_now:
            runner.stop_block("s", plan)  # as the engine's loop does while the plan is dispatched
        return original(kv, progress)

    runner.pipeline.denoise_step = stop_after_the_first
    stop_now, plan = True, StepPlan(work=[SessionWork("s", run=True)])
    dispatch = runner.dispatch(plan)
    assert forwards == [0], "the block went on after the stop"
    assert [(p.output, p.stopped) for p in dispatch.pending] == [(None, True)] and dispatch.device_idle
    # The restart that asked makes the content's first block again, as a fresh session does.
    stop_now = False
    restarted = _frames(runner.execute(StepPlan(work=[SessionWork("s", reset=True, run=True)])))
    np.testing.assert_array_equal(restarted, first)
    # A stop asked for a plan no longer dispatched reaches no later block.
    runner.stop_block("s", plan)
    forwards.clear()
    assert _frames(runner.execute(StepPlan(work=[SessionWork("s", run=True)]))).shape[0] == 12
    assert len(forwards) == runner.pipeline.num_steps


def test_a_block_stopped_then_made_under_a_new_prompt_is_what_a_session_that_changed_before_it_makes():
    """A stopped block leaves its session as if the block had never begun, its noise generator included (a session
    whose restart never came goes on as if nothing had been stopped)."""
    bundle = build_small(window_frames=3, audio=False)[1]
    change = SessionWork("s", prompt=PromptUpdate(NEW_PROMPT, "", "soft"), run=True)
    stopped = _runner(bundle, True)
    _blocks(stopped, 2)
    original = stopped.pipeline.denoise_step
    plan = StepPlan(work=[SessionWork("s", run=True)])

    def stop(kv, progress):
        stopped.stop_block("s", plan)
        return original(kv, progress)

    stopped.pipeline.denoise_step = stop
    assert stopped.dispatch(plan).pending[0].stopped
    stopped.pipeline.denoise_step = original
    ours = [_frames(stopped.execute(StepPlan(work=[change])))]
    ours.append(_frames(stopped.execute(StepPlan(work=[SessionWork("s", run=True)]))))
    plain = _runner(bundle, False)
    _blocks(plain, 2)
    theirs = [_frames(plain.execute(StepPlan(work=[change]))),
              _frames(plain.execute(StepPlan(work=[SessionWork("s", run=True)])))]
    for a, b in zip(ours, theirs):
        np.testing.assert_array_equal(a, b)


async def _control_during_block_one(seed: int, ahead_s: float, control=None):
    """A paced session streams block 0; a reset (or ``control``) comes during block 1's first forward, when the
    media made and in flight plays ``ahead_s`` from then (set there, as a GPU session's clock would be); everything
    after it is due at once. Returns the forwards block 1 ran, its dispatch, and the frames streamed (at least
    9 + 12)."""
    config = small_config(window_frames=3, fps=2, playout_margin_s=0.5, audio=False)
    async with stepped_core(config) as core:
        loop = asyncio.get_running_loop()
        record = core.admit(seed=seed, pace=True, negative_prompt="", prompt=PROMPT, start_on_attach=False)
        chunks = []

        async def take_all():
            while (chunk := await record.queue.get()) is not None:
                chunks.append(chunk)

        consumer = asyncio.create_task(take_all())
        dispatches, forwards = [], []
        dispatch, denoise_step = core.runner.dispatch, core.runner.pipeline.denoise_step

        def recording(plan, on_pending=None):
            dispatches.append(dispatch(plan, on_pending))
            return dispatches[-1]

        submitted = threading.Event()

        def reset_at_block_one(kv, progress):
            if progress.block_index == 1:
                forwards.append(progress.step_index)
                if len(forwards) == 1:
                    playout = record.playout
                    playout.anchor = time.monotonic() + ahead_s - playout.frames_made / playout.fps
                    loop.call_soon_threadsafe(
                        lambda: (core.submit(record.session_id, control or Reset()), submitted.set()))
                    assert submitted.wait(10)
            return denoise_step(kv, progress)

        core.runner.dispatch, core.runner.pipeline.denoise_step = recording, reset_at_block_one
        try:
            assert await core.step()  # block 0
            await core.delivered()
            while sum(chunk.frames.shape[0] for chunk in chunks) < 9:  # released at once: the clock starts
                await asyncio.sleep(0.01)
            record.playout.anchor = time.monotonic() - 60  # block 1 due now
            assert await core.step()
            stopped = dispatches[-1]
            deadline = loop.time() + 60
            while sum(chunk.frames.shape[0] for chunk in chunks) < 9 + 12:
                assert loop.time() < deadline, "the session did not stream on"
                record.playout.anchor = time.monotonic() - 60
                if not await core.step():
                    await asyncio.sleep(0.02)
            return list(forwards), stopped, chunks, core.runner.pipeline.num_steps
        finally:
            consumer.cancel()


def test_a_reset_stops_the_block_it_would_cut_and_the_new_content_follows_at_once():
    forwards, dispatch, chunks, steps = run_async(_control_during_block_one(seed=11, ahead_s=60.0))
    # Block 1 stopped after the forward under way: it sent nothing, and the device was free when it returned.
    assert forwards[:1 + steps] == [0, *range(steps)], forwards  # (then the new content's block 1, whole)
    assert [(p.output, p.stopped) for p in dispatch.pending] == [(None, True)] and dispatch.device_idle
    assert [chunk.pts for chunk in chunks] == list(np.cumsum([0] + [c.frames.shape[0] for c in chunks[:-1]]))
    streamed = np.concatenate([chunk.frames for chunk in chunks])
    # The new content (the same seed and prompt: block 0 again) follows block 0 directly.
    np.testing.assert_array_equal(streamed[9:18], streamed[:9])
    assert [chunk.block_index for chunk in chunks if chunk.pts < 18] == [0] * len([c for c in chunks if c.pts < 18])


def test_a_reset_lets_a_block_it_needs_finish():
    """When the media ahead plays too soon for the new content to follow it, block 1 is made and sent (the reset
    then shows after it): stopping it would leave the viewer without frames."""
    forwards, dispatch, chunks, steps = run_async(_control_during_block_one(seed=12, ahead_s=0.5))
    assert forwards[:steps] == list(range(steps)), forwards
    assert not any(p.stopped for p in dispatch.pending) and sum(p.frames for p in dispatch.pending) == 12
    assert [chunk.pts for chunk in chunks] == list(np.cumsum([0] + [c.frames.shape[0] for c in chunks[:-1]]))
    assert [chunk.block_index for chunk in chunks if 9 <= chunk.pts < 21] == [1] * len(
        [c for c in chunks if 9 <= c.pts < 21])


def test_a_soft_change_never_stops_a_block():
    """Begun again under the new prompt, a stopped block could show only after all the media made ahead; made whole,
    it lets the change be cut into it (docs/ENGINE.md, "A restart stops the block it would cut")."""
    forwards, dispatch, chunks, steps = run_async(_control_during_block_one(
        seed=13, ahead_s=60.0, control=SetPrompt(NEW_PROMPT, None, "soft")))
    assert forwards[:steps] == list(range(steps)), forwards
    assert not any(p.stopped for p in dispatch.pending) and sum(p.frames for p in dispatch.pending) == 12
