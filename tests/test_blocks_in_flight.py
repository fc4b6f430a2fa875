"""Dispatch ahead: a session's next block is queued on the device before its previous chunk is delivered.

On a GPU this keeps the device busy between blocks; on the CPU the same
bookkeeping runs (``blocks_in_flight=2``), so these tests pin what it must not
change: the chunks themselves, their order, the bound on what a slow consumer
leaves waiting, the pool coming back whole when a session ends mid-flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from engine.api import Engine
from engine.core import EngineCore
from tests.engine_helpers import small_config, stepped_core


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=120))


async def stream(blocks_in_flight: int, count: int) -> list:
    engine = Engine(small_config(window_frames=3, blocks_in_flight=blocks_in_flight))
    await engine.start()
    try:
        sid = engine.create_session(seed=11, prompt="a lighthouse", pace=False).session_id
        chunks = []
        async for chunk in engine.chunks(sid):
            chunks.append(chunk)
            if len(chunks) == count:
                break
        return chunks
    finally:
        await engine.shutdown()


def test_two_in_flight_streams_the_same_chunks_as_one():
    """Past the window's first eviction: same frames, audio, order and timeline as dispatching one at a time."""
    serial, ahead = run(stream(1, 6)), run(stream(2, 6))
    assert [c.index for c in ahead] == list(range(6))
    assert [(c.pts, c.block_index, c.audio_start) for c in ahead] == [(c.pts, c.block_index, c.audio_start) for c in serial]
    for one, two in zip(serial, ahead):
        np.testing.assert_array_equal(two.frames, one.frames)
        np.testing.assert_array_equal(two.audio, one.audio)


class HeldCompletions(ThreadPoolExecutor):
    """The core's completion thread, held shut until the test opens it: on the CPU a block is finished by the
    time its dispatch returns, so without the hold its delivery would race the test's next look."""

    def __init__(self) -> None:
        super().__init__(max_workers=1, thread_name_prefix="test-completion")
        self.open = threading.Event()

    def submit(self, fn, /, *args, **kwargs):
        def held():
            self.open.wait()
            return fn(*args, **kwargs)
        return super().submit(held)


@contextlib.asynccontextmanager
async def core_with_two_in_flight(completions: HeldCompletions | None = None):
    """An engine core with two blocks in flight, stepped by the test itself (no engine loop); with ``completions``
    held, nothing dispatched is delivered until the test opens them (they are opened at the end in any case)."""
    async with stepped_core(small_config(window_frames=3, blocks_in_flight=2), completions=completions) as core:
        try:
            yield core
        finally:
            if completions is not None:
                completions.open.set()


def best_effort(core: EngineCore, seed: int, prompt: str):
    return core.admit(seed=seed, pace=False, negative_prompt="", prompt=prompt, start_on_attach=False)


async def run_while_it_may(core: EngineCore) -> None:
    """Tick back to back while a tick runs work (each plans before the previous tick's blocks are delivered,
    as the engine loop does when busy), then wait for the delivery of everything dispatched."""
    while await core.step():
        pass
    await core.delivered()


def test_a_stalled_consumer_holds_back_its_session_at_the_lead_bound_and_resumes_in_order():
    async def scenario():
        async with core_with_two_in_flight() as core:
            record = best_effort(core, 3, "a stall")
            assert await core.step()
            await core.delivered()
            first = await record.queue.get()  # the consumer takes chunk 0, then stops reading
            await run_while_it_may(core)
            # The session ran until one chunk waits in the queue and its lead holds lead_chunks blocks behind it.
            assert record.playout.chunks_released == 2 and len(record.queue) == 1
            assert record.playout.lead_frames == core.config.lead_chunks * 12
            assert record.works_in_flight == 0 and not await core.step()  # and nothing more runs
            rest = []
            while len(rest) < 4:  # the consumer reads again: the lead follows, and the session runs on
                rest.append(await record.queue.get())
                await run_while_it_may(core)
            assert [c.index for c in [first, *rest]] == [0, 1, 2, 3, 4]
            pts = [c.pts for c in [first, *rest]]
            assert all(b - a == c.frames.shape[0] for a, b, c in zip(pts, pts[1:], [first, *rest]))

    run(scenario())


def test_closing_a_session_with_blocks_in_flight_returns_the_pool_whole():
    async def scenario():
        held = HeldCompletions()
        async with core_with_two_in_flight(held) as core:
            record = best_effort(core, 4, "a close")
            sid = record.session_id
            assert await core.step() and await core.step()
            assert record.works_in_flight == 2  # both ticks' blocks are dispatched, neither delivered
            core.end_now(sid, "client")
            assert await core.step()  # the plan releases it; what it dispatched is still in flight
            assert record.works_in_flight == 2
            held.open.set()
            await core.delivered()
            assert core.kv.blocks_in_use == 0 and sid not in core.runner.device_sessions
            assert not record.playout.pieces and record.works_in_flight == 0 and record.frames_in_flight == 0
            # The engine goes on: a new session streams.
            other = best_effort(core, 5, "next")
            await run_while_it_may(core)
            assert (await other.queue.get()).index == 0

    run(scenario())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="queueing ahead of the device needs a CUDA device")
def test_a_steady_block_is_dispatched_without_a_host_sync_and_streams_what_a_synchronous_run_streams():
    """On the GPU the host must never wait inside a dispatch (else block N+1 cannot be queued while block N
    runs): torch's sync debug mode raises on any synchronising call. Dispatching block N+1 before block N's
    frames are waited for gives the frames a block-by-block synchronous run gives."""
    from engine.kv_cache import KVCacheManager
    from engine.plan import OpenSession, SessionWork, StepPlan
    from engine.runner import runner_for
    from tests.engine_helpers import build_small

    _, bundle = build_small(device="cuda", sink_frames=3, window_frames=3, cuda_graphs=True, audio=False)
    runner = runner_for(bundle, KVCacheManager(bundle.pipeline.kv_spec(), 2, "cuda"))
    opening = OpenSession(seed=7, prompt="a harbour", negative_prompt="")
    blocks = 6  # past the window's first eviction
    serial = [o.frames for b in range(blocks) for o in runner.execute(
        StepPlan(work=[SessionWork("serial", open=opening if b == 0 else None, run=True)])).outputs]
    runner.execute(StepPlan(work=[SessionWork("ahead", open=opening)]))
    pending = runner.dispatch(StepPlan(work=[SessionWork("ahead", run=True)])).pending  # shapes met above
    ahead = []

    def block_of(pieces) -> np.ndarray:  # a block's pieces (one per latent frame), waited for, joined
        return np.concatenate([piece.wait()[0].frames for piece in pieces])

    for _ in range(blocks - 1):
        torch.cuda.set_sync_debug_mode("error")
        try:
            dispatch = runner.dispatch(StepPlan(work=[SessionWork("ahead", run=True)]))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert not dispatch.failures, dispatch.failures
        ahead.append(block_of(pending))
        pending = dispatch.pending
    ahead.append(block_of(pending))
    assert len(serial) == len(ahead) == blocks
    for one, two in zip(serial, ahead):
        np.testing.assert_array_equal(two, one)
    runner.close_all("test")
