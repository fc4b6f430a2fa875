"""Realtime admission and scheduling inside the engine: who is admitted, who runs first, what is a miss."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from engine.api import Engine
from engine.controls import Detach, SessionState
from engine.core import EngineCore
from engine.errors import CapacityFull
from engine.plan import PromptUpdate
from engine.realtime import RealtimePolicy, RunningCost
from engine.playout import Piece, Playout
from engine.scheduler import Scheduler
from engine.session import ChunkQueue, ChunkTimings
from engine.session_record import SessionRecord
from engine.startup import build_engine
from tests.engine_helpers import small_config

FPS = 16
BLOCK_S = 0.1  # a block's device time, as the core would estimate it


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=120))


MARGIN_S = 0.15  # the playout margin: a paced piece leaves this long before it plays


def _record(session_id: str, *, pace: bool, overlap: bool = True) -> SessionRecord:
    return SessionRecord(session_id=session_id, seed=1, pace=pace, queue=ChunkQueue(overlap=overlap),
                         cost=RunningCost(), playout=Playout(fps=FPS, margin_s=MARGIN_S))


def _running(session_id: str, *, pace: bool, now: float, deadline_in_s: float | None = None, ready: bool = True):
    """A started session on the device whose next chunk is due ``deadline_in_s`` from ``now`` (its first block of
    9 frames made and released)."""
    record = _record(session_id, pace=pace, overlap=False)
    record.prompt, record.state, record.opened_on_device = "p", SessionState.ACTIVE, True
    record.playout.frames_made = record.playout.frames_released = 9
    record.playout.chunks_released = 1
    if deadline_in_s is not None:
        record.playout.anchor = now + deadline_in_s - 9 / FPS
    record.queue.in_hand = not ready  # its consumer has not asked for the next chunk yet
    return record


def _plan(records, now, control_s=0.0, backlog_s=0.0, blocks_in_flight=1):
    scheduler = Scheduler(fps=FPS, frames_per_chunk=12, lead_chunks=2, blocks_in_flight=blocks_in_flight,
                          overlap=False)
    plan = scheduler.plan(records, [], now, block_cost=lambda r: BLOCK_S,
                          control_cost=lambda w: control_s if w.prompt else 0.0, backlog_s=backlog_s)
    return [work.session_id for work in plan.work]


def _dispatch_block(record) -> None:
    """A block of 12 frames dispatched for ``record`` and not yet delivered."""
    record.works_in_flight += 1
    record.in_flight.queue(frames_made=record.playout.frames_made, frames=12, block_index=1, first_of_block=True,
                           open_block_start=0)
    assert record.frames_in_flight == 12


def test_work_already_on_the_device_counts_before_a_tick():
    """A block dispatched ahead counts toward pacing and deadlines, and the device time queued before a tick
    (the backlog) can make a best-effort block wait."""
    now = time.monotonic()
    best_effort = _running("best", pace=False, now=now)
    live = _running("live", pace=True, now=now, deadline_in_s=0.35, ready=False)
    assert _plan([live, best_effort], now) == ["best"]
    assert _plan([live, best_effort], now, backlog_s=0.2) == []  # 0.2 + 0.1 best + 0.1 live > 0.35
    # One block of its own in flight: with room for two it may run again, with room for one it waits.
    ahead = _running("ahead", pace=False, now=now)
    _dispatch_block(ahead)
    assert _plan([ahead], now, blocks_in_flight=2) == ["ahead"]
    assert _plan([ahead], now, blocks_in_flight=1) == []
    # A paced session's frames in flight count as emitted: 9 + 12 frames run past its two-block lead at 16 fps
    # only after the in-flight ones are counted.
    paced = _running("paced", pace=True, now=now, deadline_in_s=1.0)
    assert _plan([paced], now, blocks_in_flight=2) == ["paced"]
    _dispatch_block(paced)
    assert _plan([paced], now, blocks_in_flight=2) == []
    # A lead of two blocks not yet taken (its consumer is slow) stops the session, whatever the room on the device.
    held = _running("held", pace=False, now=now)
    held.playout.frames_made += 24
    assert _plan([held], now, blocks_in_flight=2) == []


def test_live_sessions_run_nearest_deadline_first():
    now = time.monotonic()
    later = _running("later", pace=True, now=now, deadline_in_s=0.6)
    sooner = _running("sooner", pace=True, now=now, deadline_in_s=0.3)
    assert _plan([later, sooner], now) == ["sooner", "later"]


def test_a_best_effort_block_waits_while_it_would_make_a_live_session_miss():
    now = time.monotonic()
    best_effort = _running("best", pace=False, now=now)
    # The live session's consumer is still busy; its block starts after this tick and must end in 0.15 s.
    tight = _running("live", pace=True, now=now, deadline_in_s=0.15, ready=False)
    assert _plan([tight, best_effort], now) == []
    roomy = _running("live", pace=True, now=now, deadline_in_s=0.5, ready=False)
    assert _plan([roomy, best_effort], now) == ["best"]
    # A live session that is behind and runs this tick is not made later still...
    behind = _running("live", pace=True, now=now, deadline_in_s=-0.1)
    assert _plan([behind, best_effort], now) == ["live"]
    # ... but one that cannot run (its consumer is stalled) does not starve best effort forever.
    stalled = _running("live", pace=True, now=now, deadline_in_s=0.05, ready=False)
    assert _plan([stalled, best_effort], now) == ["best"]


def test_a_recache_waits_a_tick_when_it_would_make_another_live_session_miss():
    now = time.monotonic()
    urgent = _running("urgent", pace=True, now=now, deadline_in_s=0.15)
    recaching = _running("recaching", pace=True, now=now, deadline_in_s=1.0)
    recaching.pending_prompt = PromptUpdate("new", "", "recache")
    assert _plan([urgent, recaching], now, control_s=0.2) == ["urgent"]
    # Once its own deadline is near it runs anyway.
    recaching = _running("recaching", pace=True, now=now, deadline_in_s=0.35)
    recaching.pending_prompt = PromptUpdate("new", "", "recache")
    assert _plan([urgent, recaching], now, control_s=0.2) == ["urgent", "recaching"]


def test_admission_sums_live_costs_against_one_block_of_playback():
    policy = RealtimePolicy(block_seconds=0.75, headroom=1.5, enabled=True)  # 0.5 s of device time per block
    assert policy.admits([], 5.0)  # the first live session always gets in, even one too slow for real time
    assert policy.admits([0.125, 0.125], 0.25) and not policy.admits([0.125, 0.125], 0.26)
    assert policy.live_capacity([], 0.125) == 4 and policy.live_capacity([0.125, 0.125], 0.125) == 4
    assert policy.live_capacity([0.125] * 4, 0.125) == 4 and policy.live_capacity([0.375, 0.375], 0.375) == 1
    assert policy.admits([0.125, 0.125], None)  # nothing measured yet: no evidence to refuse on
    assert RealtimePolicy(block_seconds=0.75, headroom=1.25, enabled=False).admits([9.0], 9.0)


PLAYBACK_S = 12 / FPS  # one block of playback: the device time all live sessions share per block
HEADROOM = 1.1
DEADLINE_TOLERANCE_S = 0.05


@pytest.mark.parametrize("block_cost_s", [0.2, 0.13])
def test_admission_sums_the_measured_costs_and_its_outlook_agrees(block_cost_s):
    """An engine core whose block cost is given (as its warm-up would have measured it) admits live sessions
    while the sum of their costs fits one block of playback: exactly the policy's live capacity. Its outlook
    says beforehand what admit decides; best effort is not counted; an idle live session makes room."""
    config = small_config(fps=FPS, realtime_headroom=HEADROOM, max_sessions=16)
    built = dataclasses.replace(build_engine(config), warmup_block_s=(block_cost_s, block_cost_s))
    core = EngineCore(config, built, ThreadPoolExecutor(max_workers=1))

    def admit(seed: int, pace: bool = True):
        return core.admit(seed=seed, pace=pace, negative_prompt="", prompt="p", start_on_attach=False)

    expected = RealtimePolicy(PLAYBACK_S, HEADROOM, enabled=True).live_capacity([], block_cost_s)
    assert expected >= 2 and (expected + 1) * block_cost_s > PLAYBACK_S
    live = []
    while core.outlook().admitting:
        admitted = admit(len(live))
        assert not isinstance(admitted, CapacityFull)
        live.append(admitted)
        assert len(live) <= expected
    assert len(live) == expected and core.live_capacity() == expected and core.outlook().live_headroom == 0
    refused = admit(99)
    assert isinstance(refused, CapacityFull) and refused.live_capacity == expected and core.refused_realtime == 1
    assert refused.retry_after_s >= PLAYBACK_S
    assert not isinstance(admit(100, pace=False), CapacityFull)  # best effort takes what is left
    core.submit(live[0].session_id, Detach())  # an idle live session: the next newcomer evicts it
    assert not isinstance(admit(101), CapacityFull) and live[0].close_reason == "evicted"


def _simulated(live: int, block_cost_s: float, best_effort: int = 0, chunks: int = 40) -> list[SessionRecord]:
    """Sessions on a virtual device whose blocks all cost ``block_cost_s``: the scheduler plans each tick (a paced
    session's block just in time, by the engine's lead target: its own block, the other live sessions' and the
    playout margin), the device runs the tick's blocks one after another, each block's frames are made when it is
    done and released when due (to a consumer that takes them at once); virtual time only, so the machine's speed
    plays no part."""
    scheduler = Scheduler(fps=FPS, frames_per_chunk=12, lead_chunks=2)
    records = []
    for index in range(live + best_effort):
        record = _record(f"s{index}", pace=index < live)
        record.prompt, record.state, record.opened_on_device = "p", SessionState.ACTIVE, True
        records.append(record)
    by_id = {record.session_id: record for record in records}
    lead_s = live * block_cost_s + MARGIN_S

    def release(now: float) -> None:
        for record in records:
            while record.playout.due(now, paced=record.pace):
                record.playout.release(now, paced=record.pace)

    now = 0.0
    while min(record.playout.chunks_released for record in records) < chunks:
        release(now)
        plan = scheduler.plan(records, [], now, block_cost=lambda record: block_cost_s, control_cost=lambda work: 0.0,
                              lead_s=lambda record: lead_s)
        if plan.empty:
            releases = [r.playout.next_release_in(now, paced=r.pace) for r in records]
            now += min([scheduler.next_wakeup(records, now, lambda record: lead_s)]
                       + [max(wait, 1e-3) for wait in releases if wait is not None])
            continue
        for work in plan.work:
            now += block_cost_s
            record = by_id[work.session_id]
            frames = np.zeros((12, 1, 1, 3), np.uint8)
            record.made(Piece(frames, 0, ChunkTimings(0, 0, 0, 0), now), now, tolerance_s=DEADLINE_TOLERANCE_S)
            release(now)
    return records


@pytest.mark.parametrize("block_cost_s", [0.2, 0.13])
def test_the_live_sessions_admission_takes_keep_real_time_and_one_more_does_not(block_cost_s):
    """What admission promises, on a virtual device: the live sessions it admits miss no deadline, with a
    best-effort session streaming in what is left; one more live session than it takes (demand over the
    device) falls behind."""
    admitted = RealtimePolicy(PLAYBACK_S, HEADROOM, enabled=True).live_capacity([], block_cost_s)
    together = _simulated(admitted, block_cost_s, best_effort=1)
    assert [record.deadline_misses for record in together[:admitted]] == [0] * admitted
    assert together[-1].playout.chunks_released >= 40 and together[-1].deadline_misses == 0  # best effort has none
    overloaded = _simulated(admitted + 1, block_cost_s)
    assert sum(record.deadline_misses for record in overloaded) > 0


def test_a_second_live_session_is_refused_when_the_device_has_no_time_for_it():
    async def scenario(realtime_admission: bool):
        # 100x headroom: one block's playback time (0.75 s) holds 7.5 ms of device time, less than any block.
        engine = Engine(small_config(warmup_blocks=1, realtime_headroom=100.0, realtime_admission=realtime_admission))
        await engine.start()
        try:
            first = engine.create_session(seed=1, prompt="live", pace=True)
            assert not isinstance(first, CapacityFull)  # the first live session is always admitted
            second = engine.create_session(seed=2, prompt="live too", pace=True)
            best_effort = engine.create_session(seed=3, prompt="best effort", pace=False)
            assert not isinstance(best_effort, CapacityFull)  # best effort is not counted against real time
            counters = engine.counters()
            return second, counters
        finally:
            await engine.shutdown()

    refused, counters = run(scenario(True))
    assert isinstance(refused, CapacityFull) and refused.retry_after_s >= 0.75
    assert counters.refused_realtime == 1 and counters.live_capacity == 1 and counters.live_sessions == 1
    admitted, counters = run(scenario(False))
    assert not isinstance(admitted, CapacityFull) and counters.live_sessions == 2


def test_a_live_chunk_later_than_its_playback_time_is_a_deadline_miss_and_a_resume_is_not():
    async def take(engine, session_id, count):
        taken = []
        async for chunk in engine.chunks(session_id):
            taken.append(chunk)
            if len(taken) == count:
                return taken

    async def scenario():
        # Without overlap a consumer that holds its chunk holds back the session's next block.
        engine = Engine(small_config(window_frames=3, fps=FPS, overlap_encode=False))
        await engine.start()
        try:
            live = engine.create_session(seed=1, prompt="live", pace=True).session_id
            best = engine.create_session(seed=2, prompt="best", pace=False).session_id
            # The first block: the live session's in its three latent frames' pieces, the best-effort one's whole.
            opening, _ = await asyncio.gather(take(engine, live, 3), take(engine, best, 1))
            # Their consumers hold the last chunk 1 s: the live one's next block (due 9/16 s after
            # the first chunk) can only come late.
            await asyncio.sleep(1.0)
            late, _ = await asyncio.gather(take(engine, live, 2), take(engine, best, 2))
            missed = engine.status(live).realtime.deadline_misses
            engine.pause(live)
            await asyncio.sleep(1.0)  # the playback clock does not run while paused...
            engine.resume(live)
            resumed = await take(engine, live, 2)  # ... so resuming re-anchors it: no new miss
            # The chunk that (re)starts the clock says so (a WebRTC peer restarts its own there, no stall): the
            # first, and the first released after the resume (a chunk released before the pause may still have
            # been waiting in the queue); not a late one.
            starts = [c.starts_clock for c in opening[:1] + late], [c.starts_clock for c in resumed]
            return missed, engine.status(live).realtime, engine.status(best).realtime, starts
        finally:
            await engine.shutdown()

    missed, live, best, starts = run(scenario())
    assert starts[0] == [True, False, False] and starts[1] in ([True, False], [False, True])
    assert missed >= 1 and live.deadline_misses == missed and live.live
    assert best.deadline_misses == 0 and not best.live  # best effort has no deadlines
    assert live.block_cost_ms is not None and live.block_cost_ms > 0 and live.frames_per_second > 0


def test_the_first_live_session_is_admitted_even_below_real_time_and_reported_so():
    async def scenario():
        # 50 denoise steps per 4-frame block at 176x144 and 60 fps: a block costs several times its 67 ms of
        # playback (about 210 ms on a 2-core CPU).
        config = small_config(
            height=144, width=176, window_frames=3, fps=60, frames_per_block=1,
            timesteps=[1000.0 - 20.0 * i for i in range(50)], warmup_blocks=0,
            audio=False,
        )
        engine = Engine(config)
        await engine.start()
        try:
            first = engine.create_session(seed=1, prompt="too slow", pace=True)
            assert not isinstance(first, CapacityFull)
            async for chunk in engine.chunks(first.session_id):
                if chunk.index == 5:
                    break
            second = engine.create_session(seed=2, prompt="also live", pace=True)
            return engine.status(first.session_id).realtime, engine.counters(), second
        finally:
            await engine.shutdown()

    realtime, counters, second = run(scenario())
    assert realtime.below_realtime and realtime.deadline_misses > 0
    assert counters.realtime_utilisation > 1.0 and counters.live_sessions_below_realtime == 1
    assert counters.live_capacity == 1 and isinstance(second, CapacityFull)


def test_an_idle_loop_looks_again_soon_at_a_session_that_may_run():
    """A runnable live session is never left to the idle poll (a missed wake-up would stall its stream)."""
    from engine.scheduler import RECHECK_S

    now = time.monotonic()
    scheduler = Scheduler(fps=FPS, frames_per_chunk=12, lead_chunks=2, overlap=False)
    runnable = _running("live", pace=True, now=now, deadline_in_s=0.3)  # behind the lead: may run now
    assert scheduler.next_wakeup([runnable], now) == RECHECK_S
    ahead = _running("ahead", pace=True, now=now, deadline_in_s=2.0)  # 2 s of media ahead, lead 1.5 s
    assert scheduler.next_wakeup([ahead], now) == pytest.approx(0.5, abs=0.01)
    busy = _running("busy", pace=True, now=now, deadline_in_s=0.3, ready=False)  # its consumer holds a chunk
    assert scheduler.next_wakeup([busy], now) == float("inf")


def test_taking_a_chunk_wakes_the_engine_with_or_without_overlap():
    """With overlap the next block may run; either way a chunk held back behind the taken one may enter the queue."""
    woken = []

    async def scenario(overlap):
        queue = ChunkQueue(overlap=overlap, on_taken=lambda: woken.append(overlap))
        queue.put_nowait("chunk")
        await queue.get()

    asyncio.run(scenario(True))
    asyncio.run(scenario(False))
    assert woken == [True, False]
