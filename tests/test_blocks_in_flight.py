"""Dispatch ahead: a session's next block is queued on the device before its previous chunk is delivered.

On a GPU this keeps the device busy between blocks; on the CPU the same
bookkeeping runs (``blocks_in_flight=2``), so these tests pin what it must not
change: the chunks themselves, their order, the bound on what a slow consumer
leaves waiting, the pool coming back whole when a session ends mid-flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import numpy as np
import pytest
import torch

from engine.api import Engine
from tests.engine_helpers import small_config


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


@contextlib.asynccontextmanager
async def streaming_with_two_in_flight(seed: int, prompt: str):
    """A started engine with two blocks in flight, one best-effort session of it, its chunk stream and the
    session's first chunk (taken): ``(engine, record, stream, first)``."""
    engine = Engine(small_config(window_frames=3, blocks_in_flight=2))
    await engine.start()
    try:
        sid = engine.create_session(seed=seed, prompt=prompt, pace=False).session_id
        stream = engine.chunks(sid)
        first = await anext(stream)
        yield engine, engine._core.sessions[sid], stream, first
    finally:
        await engine.shutdown()


def test_a_stalled_consumer_leaves_at_most_two_chunks_waiting_and_resumes_in_order():
    async def scenario():
        async with streaming_with_two_in_flight(3, "a stall") as (engine, record, stream, first):
            # The consumer stops reading: the session runs until a chunk waits in the queue and one is held.
            deadline = time.monotonic() + 30
            while not (record.held is not None and record.works_in_flight == 0):
                assert time.monotonic() < deadline, "the session never filled its queue"
                await asyncio.sleep(0.02)
            emitted = record.chunks_emitted
            await asyncio.sleep(0.5)  # several blocks' time: nothing more runs
            assert record.chunks_emitted == emitted == 3
            assert len(record.queue) == 1 and record.works_in_flight == 0
            rest = [await anext(stream) for _ in range(3)]
            assert [c.index for c in [first, *rest]] == [0, 1, 2, 3]
            pts = [c.pts for c in [first, *rest]]
            assert all(b - a == c.frames.shape[0] for a, b, c in zip(pts, pts[1:], [first, *rest]))

    run(scenario())


def test_closing_a_session_with_blocks_in_flight_returns_the_pool_whole():
    async def scenario():
        async with streaming_with_two_in_flight(4, "a close") as (engine, record, stream, _):
            core, sid = engine._core, record.session_id
            deadline = time.monotonic() + 30
            while record.works_in_flight == 0:  # catch it with work dispatched
                assert time.monotonic() < deadline
                if len(record.queue) or record.held is not None:  # it filled up before we looked: make room
                    await anext(stream)
                await asyncio.sleep(0)
            engine.close(sid)
            while core._completing or core.kv.blocks_in_use:
                assert time.monotonic() < deadline, "the pool did not come back"
                await asyncio.sleep(0.02)
            assert sid not in core.runner.device_sessions
            assert record.held is None and record.works_in_flight == 0 and record.frames_in_flight == 0
            # The engine goes on: a new session streams.
            other = engine.create_session(seed=5, prompt="next", pace=False).session_id
            assert (await anext(engine.chunks(other))).index == 0

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
    pending = [runner.dispatch(StepPlan(work=[SessionWork("ahead", run=True)])).pending[0]]  # shapes met above
    ahead = []
    for _ in range(blocks - 1):
        torch.cuda.set_sync_debug_mode("error")
        try:
            dispatch = runner.dispatch(StepPlan(work=[SessionWork("ahead", run=True)]))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert not dispatch.failures, dispatch.failures
        ahead.append(pending.pop(0).wait()[0].frames)
        pending.extend(dispatch.pending)
    ahead.append(pending.pop(0).wait()[0].frames)
    assert len(serial) == len(ahead) == blocks
    for one, two in zip(serial, ahead):
        np.testing.assert_array_equal(two, one)
    runner.close_all("test")
