"""The engine API end to end on the event loop: admission, controls, isolation, death, pacing, timeouts."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import torch
import pytest

from engine.api import Engine, NotReady
from engine.errors import (
    AlreadyStarted,
    CapacityFull,
    EngineUnavailable,
    NotStarted,
    PromptTooLong,
    UnknownSession,
)
from engine.bundle import build_models
from engine.kv_cache import KVCacheManager
from engine.plan import LiveFrames, OpenSession, SessionWork, StepPlan
from engine.runner import Runner, runner_for
from tests.engine_helpers import build_small, small_config


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=120))


async def take(engine: Engine, session_id: str, count: int) -> list:
    chunks = []
    async for chunk in engine.chunks(session_id):
        chunks.append(chunk)
        if len(chunks) == count:
            break
    return chunks


async def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


def _measured_session_bytes(runner: Runner, session_id: str) -> int:
    """Bytes one session holds, summed over the tensors it actually owns (not the admission formula)."""
    device_session = runner.device_sessions[session_id]
    kv, progress = device_session.kv, device_session.progress
    storage = runner.kv_manager.block_pool.storage
    kv_bytes = sum(storage[:, :, i].nbytes for b in kv.branch_names for i in kv.resident_block_ids(b))
    cross_bytes = sum(kv.read_cross(b, "text").nbytes for b in kv.branch_names)
    decoder_bytes = device_session.decode_state.nbytes() + device_session.audio_state.nbytes()
    encoder_bytes = device_session.encode_state.nbytes()
    held = progress.resident_latents() + [progress.latents, progress.clean, progress.block_input, device_session.context]
    model_bytes = sum(x.nbytes for x in held if x is not None)
    return kv_bytes + cross_bytes + decoder_bytes + encoder_bytes + model_bytes


def test_admission_admits_exactly_what_the_budget_holds():
    config, bundle = build_small(sink_frames=3, window_frames=3, guidance_scale=2.0)
    runner = runner_for(bundle, KVCacheManager(bundle.pipeline.kv_spec(), 1, "cpu"), stepwise=True)
    # The most a session holds: a clip's full context kept for a reset, live input on its encoder stream and
    # in the block in flight.
    clip = np.random.default_rng(0).integers(0, 256, (1 + 4 * 5, config.resolved_height, config.resolved_width, 3),
                                             dtype=np.uint8)
    runner.execute(StepPlan(work=[SessionWork("probe", open=OpenSession(1, "probe", "", clip))]))
    live = LiveFrames(first_step=1, frames=tuple(clip[:12]), first_seq=0)
    steps = 3 * bundle.pipeline.num_steps + 1  # blocks of 3 steps + commit, then one step into the next block
    for _ in range(steps):
        assert not runner.execute(StepPlan(work=[SessionWork("probe", run=True, live=live)])).failures
    per_session = _measured_session_bytes(runner, "probe")

    async def scenario():
        engine = Engine(
            small_config(sink_frames=3, window_frames=3, guidance_scale=2.0, max_sessions=64,
                         kv_memory_budget_bytes=3 * per_session + per_session // 2, supersede=False),
            bundle=bundle,
        )
        await engine.start()
        try:
            admitted = []
            while True:
                result = engine.create_session(seed=len(admitted))
                if isinstance(result, CapacityFull):
                    break
                admitted.append(result)
                assert len(admitted) < 10
            assert len(admitted) == 3 == engine.capacity
            assert result.retry_after_s > 0
        finally:
            await engine.shutdown()

    run(scenario())


def test_chunks_flow_pause_resume_reset_close():
    async def scenario():
        engine = Engine(small_config(window_frames=3))
        await engine.start()
        try:
            with pytest.raises(UnknownSession):
                engine.start_session("nope", "x")
            session = engine.create_session(seed=5, pace=False)
            sid = session.session_id
            with pytest.raises(NotStarted):
                engine.pause(sid)
            engine.start_session(sid, "a canyon")
            with pytest.raises(AlreadyStarted):
                engine.start_session(sid, "again")
            with pytest.raises(PromptTooLong) as too_long:
                engine.set_prompt(sid, "x" * 2001)
            assert too_long.value.code == "prompt_too_long"
            first = await take(engine, sid, 3)
            assert [c.index for c in first] == [0, 1, 2]
            assert [c.pts for c in first] == [0, 9, 21]
            assert [c.frames.shape[0] for c in first] == [9, 12, 12]
            assert all(c.timings.denoise_ms > 0 and c.timings.decode_ms > 0 for c in first)

            engine.pause(sid)
            await asyncio.sleep(0.3)
            produced = engine.status(sid).counters.chunks
            await asyncio.sleep(0.5)
            assert engine.status(sid).counters.chunks == produced  # nothing generated while paused
            assert engine.status(sid).state == "paused"

            engine.reset(sid)  # while paused: no block of the old content is in flight to come out after it
            engine.resume(sid)
            after = await take(engine, sid, 3)
            # The one chunk of the old content that may already sit in the session's queue (released before the
            # pause, as its consumer's next chunk) still comes out; nothing of the old content after it does.
            previous = first[-1]
            if after[0].block_index != 0:
                previous, after = after[0], after[1:]
                assert previous.index == first[-1].index + 1 and previous.block_index == first[-1].block_index + 1
            assert after[0].index == previous.index + 1  # the timeline continues across reset...
            assert after[0].pts == previous.pts + previous.frames.shape[0]
            assert after[0].block_index == 0  # ...while the content restarts as a new session's
            np.testing.assert_array_equal(after[0].frames, first[0].frames)
            np.testing.assert_array_equal(after[1].frames, first[1].frames)

            engine.close(sid)
            # The iterator ends: at most what was already made before the close (the block asked for when
            # chunk 4 was taken may have finished by then) comes out first, in order.
            rest = await take(engine, sid, 4)
            assert len(rest) <= engine.config.lead_chunks
            assert [c.index for c in rest] == list(range(after[-1].index + 1, after[-1].index + 1 + len(rest)))
            await wait_for(lambda: engine.counters().kv_blocks_in_use == 0)
            assert engine.status(sid).close_reason == "client"
        finally:
            await engine.shutdown()

    run(scenario())


def test_a_failing_session_costs_no_other_session_anything():
    async def scenario():
        engine = Engine(small_config(window_frames=3))
        await engine.start()
        try:
            good = engine.create_session(seed=1, prompt="good", pace=False).session_id
            bad = engine.create_session(seed=2, prompt="bad", pace=False).session_id
            pipeline = engine.runner.pipeline
            original = pipeline.forward_branch

            def failing(kv, progress, branch, latents, timestep, *, stage):
                if kv.session_id == bad:
                    raise ValueError("injected forward failure")
                return original(kv, progress, branch, latents, timestep, stage=stage)

            pipeline.forward_branch = failing
            good_chunks, bad_chunks = await asyncio.gather(take(engine, good, 3), take(engine, bad, 1))
            assert len(good_chunks) == 3 and bad_chunks == []
            status = engine.status(bad)
            assert status.close_reason == "failed"
            assert "injected forward failure" in status.error
            assert engine.alive
            assert bad not in engine.runner.device_sessions
        finally:
            await engine.shutdown()

    run(scenario())


def test_readiness_says_why_new_sessions_are_refused_and_a_failed_start_is_final():
    async def scenario():
        engine = Engine(small_config(kv_memory_budget_bytes=1))  # a budget that holds no session: the build fails
        assert engine.not_ready() is NotReady.WARMING_UP and not engine.ready
        with pytest.raises(ValueError, match="holds no session"):
            await engine.start()
        try:
            assert engine.not_ready() is NotReady.FAILED_TO_START and engine.not_ready().final
            with pytest.raises(EngineUnavailable, match="failed to start"):
                engine.create_session()
            engine.begin_drain()
            assert engine.not_ready() is NotReady.DRAINING  # draining is said first, whatever else holds
        finally:
            await engine.shutdown()

    run(scenario())


def test_device_fatal_error_marks_the_engine_dead():
    async def scenario():
        engine = Engine(small_config(window_frames=3))
        await engine.start()
        a = engine.create_session(seed=1, prompt="a", pace=False).session_id
        b = engine.create_session(seed=2, prompt="b", pace=False).session_id
        pipeline = engine.runner.pipeline

        def fatal(*args, **kwargs):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        pipeline.forward_branch = fatal
        await asyncio.gather(take(engine, a, 1), take(engine, b, 1))
        assert not engine.alive and not engine.ready
        assert {engine.status(a).close_reason, engine.status(b).close_reason} == {"failed"}
        with pytest.raises(EngineUnavailable):
            engine.create_session()
        assert engine.runner.device_sessions == {}
        await engine.shutdown()

    run(scenario())


def test_eviction_takes_only_sessions_without_a_live_client():
    async def scenario():
        engine = Engine(small_config(window_frames=3, max_sessions=2))
        await engine.start()
        try:
            watched = engine.create_session(seed=1, prompt="a", pace=False).session_id
            engine.attach(watched)
            paused = engine.create_session(seed=2, prompt="b", pace=False).session_id
            engine.attach(paused)
            await take(engine, paused, 1)
            engine.pause(paused)
            assert isinstance(engine.create_session(), CapacityFull)  # both have live clients
            engine.detach(paused)
            newcomer = engine.create_session(seed=3)
            assert not isinstance(newcomer, CapacityFull)
            assert engine.status(paused).close_reason == "evicted"
            assert engine.status(watched).state == "active"
        finally:
            await engine.shutdown()

    run(scenario())


def test_detached_session_closes_after_its_grace_period():
    async def scenario():
        engine = Engine(small_config(window_frames=3, detach_grace_s=0.2))
        await engine.start()
        try:
            sid = engine.create_session(seed=1, prompt="a").session_id
            engine.attach(sid)
            engine.detach(sid)
            assert engine.status(sid).state == "detached"
            await wait_for(lambda: engine.status(sid).close_reason == "idle_timeout", timeout=3.0)
        finally:
            await engine.shutdown()

    run(scenario())


def test_what_superseding_keeps_per_session_stays_within_what_admission_reserves():
    """With supersede on, a session also keeps, for each of its last blocks, a copy of its decoders' state and the
    window frames the block evicted (engine/undo.py): the reservation counts them."""
    from engine.startup import build_engine

    config = small_config(sink_frames=3, window_frames=3, guidance_scale=2.0, max_sessions=1)
    built = build_engine(config, build_models(config))
    runner = built.runner
    assert runner.undo_blocks >= 2
    runner.execute(StepPlan(work=[SessionWork("probe", open=OpenSession(1, "probe", ""))]))
    for _ in range(6):  # past the window's evictions, every undo record filled
        assert not runner.execute(StepPlan(work=[SessionWork("probe", run=True)])).failures
    device_session = runner.device_sessions["probe"]
    assert len(device_session.undo) == runner.undo_blocks
    storage = runner.kv_manager.block_pool.storage
    held_kv = len(device_session.kv._held) * storage[:, :, 0].nbytes
    assert held_kv > 0
    copies = sum(t.nbytes for record in device_session.undo for state in (record.decode_state, record.audio_state or {})
                 for value in state.values() for t in (value if isinstance(value, list) else [value])
                 if torch.is_tensor(t))
    assert _measured_session_bytes(runner, "probe") + held_kv + copies <= built.per_session_bytes
    runner.release("probe", "test")
    assert runner.kv_manager.blocks_in_use == 0  # the held frames went back with the session


@pytest.mark.parametrize("blocks_in_flight, viewer_margin_s", [(1, None), (2, None), (1, 0.05)])
def test_a_paced_session_sends_each_piece_just_before_it_plays_and_makes_it_just_in_time(blocks_in_flight,
                                                                                         viewer_margin_s):
    """The lead lives on the server: each chunk leaves about the playout margin before it plays on the viewer's
    clock (never earlier), and its block was begun no more than ``lead_chunks`` blocks ahead of it (blocks
    dispatched ahead of their delivery count as made: the bound holds with two in flight too). A viewer that
    attaches with a margin of its own (a WebRTC peer: 0.05 s) gets each chunk no earlier than that."""

    async def scenario():
        config = small_config(window_frames=3, lead_chunks=2, blocks_in_flight=blocks_in_flight)
        engine = Engine(config)
        await engine.start()
        try:
            sid = engine.create_session(seed=1, prompt="paced", pace=True).session_id
            if viewer_margin_s is not None:
                engine.attach(sid, viewer_margin_s)
            margin_s = config.playout_margin_s if viewer_margin_s is None else viewer_margin_s
            chunks = await take(engine, sid, 12)
            first_ready = chunks[0].ready_at
            block_seconds = 4 * config.frames_per_block / config.fps
            assert [c.frames.shape[0] for c in chunks[:4]] == [1, 4, 4, 4]  # one latent frame's frames each
            for chunk in chunks[1:]:
                plays_at = chunk.pts / config.fps  # on the viewer's clock, from the first chunk's arrival
                released_ahead = plays_at - (chunk.ready_at - first_ready) / 1000.0
                assert released_ahead <= margin_s + 0.02
                begun_ahead = plays_at - (chunk.timings.started_at - first_ready) / 1000.0
                assert begun_ahead <= config.lead_chunks * block_seconds + 0.05
            # and pacing really held it back: 12 chunks of 45 frames play 2.8 s; they were not made in one go
            assert (chunks[-1].ready_at - first_ready) / 1000.0 >= chunks[-1].pts / config.fps - 0.5
        finally:
            await engine.shutdown()

    run(scenario())


@pytest.mark.parametrize("overlap", [True, False])
def test_next_block_may_run_while_the_previous_chunk_is_sent_only_with_overlap(overlap):
    """With overlap the consumer holding chunk N (encoding, sending) does not hold back block N+1; one chunk waits at most."""
    from engine.session import ChunkQueue

    async def scenario():
        queue = ChunkQueue(overlap=overlap)
        assert queue.accepts_next
        queue.put_nowait("chunk 0")
        assert not queue.accepts_next  # one chunk waits at most
        assert await queue.get() == "chunk 0"  # taken: now being encoded and sent
        assert queue.accepts_next is overlap
        queue.release()  # its media is on the wire
        assert queue.accepts_next

    asyncio.run(scenario())


def test_split_first_block_counts_time_to_first_media_at_the_opening_frame():
    async def scenario():
        engine = Engine(small_config(window_frames=3, split_first_block=True))
        await engine.start()
        try:
            sid = engine.create_session(seed=5, pace=True).session_id
            engine.start_session(sid, "a canyon")
            chunks = await take(engine, sid, 6)
            # The opening frame ahead of its block, then each latent frame's frames as they are decoded.
            assert [c.frames.shape[0] for c in chunks] == [1, 4, 4, 4, 4, 4]
            assert [c.pts for c in chunks] == [0, 1, 5, 9, 13, 17]
            status = engine.status(sid)
            # First media is the opening frame; the block's rest re-anchors playback, so it is no miss.
            assert status.time_to_first_chunk_ms is not None
            assert status.realtime.deadline_misses == 0
            assert status.counters.blocks_since_reset >= 2  # the opening frame is part of block 0, not a block
        finally:
            await engine.shutdown()

    run(scenario())
