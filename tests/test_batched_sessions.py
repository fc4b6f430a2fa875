"""Sessions batched by the engine (``batch_sessions``): the runner runs a plan's plain blocks in one forward a
step, the scheduler lets live sessions due within a block join a tick's batch, the warm-up meets the batched
shapes and seeds the cost a batched session has.

The frames must be those the sessions get one at a time; a batch's device time is shared, not counted once per
member; a control runs its session alone; a failed batch fails its members and no one else.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from pydantic import ValidationError

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.plan import OpenSession, PromptUpdate, SessionWork, StepPlan
from engine.runner import runner_for
from engine.scheduler import Scheduler
from engine.startup import build_engine
from engine.session import now_ms
from tests.engine_helpers import build_small, small_config
from engine.controls import SessionState
from engine.playout import Piece
from engine.realtime import RealtimePolicy
from engine.session import ChunkTimings
from tests.test_realtime_scheduling import (BLOCK_S, DEADLINE_TOLERANCE_S, FPS, HEADROOM, MARGIN_S, PLAYBACK_S,
                                            _record, _running)

pytestmark = pytest.mark.background  # computes only: runs on the idle core (tests/background_pytest.py)

SESSIONS = ("a", "b", "c")


def _runner(batch: int):
    _, bundle = build_small(max_sessions=4, batch_sessions=batch)
    return runner_for(bundle, KVCacheManager(bundle.pipeline.kv_spec(), 4, "cpu"), batch_sessions=batch)


def _open(index: int) -> OpenSession:
    return OpenSession(seed=5 + index, prompt=f"a kite over dunes {index}", negative_prompt="")


def _stream(runner, blocks: int, works=None) -> tuple[dict[str, list[np.ndarray]], list]:
    """Every session's frames over ``blocks`` plans of one plain block each (``works(block)``: another plan's
    works), and each plan's (costs, seconds the plan took)."""
    frames = {session: [] for session in SESSIONS}
    ticks = []
    for block in range(blocks):
        plan = works(block) if works else [
            SessionWork(session, open=_open(index) if block == 0 else None, run=True)
            for index, session in enumerate(SESSIONS)]
        started = time.perf_counter()
        result = runner.execute(StepPlan(work=plan, planned_at=now_ms()))
        ticks.append((result.costs, time.perf_counter() - started))
        assert not result.failures and result.fatal is None, result.failures
        for output in result.outputs:
            frames[output.session_id].append(output.frames)
            if output.audio is not None:
                frames[output.session_id + ":audio"] = frames.get(output.session_id + ":audio", []) + [output.audio]
    return frames, ticks


def _max_frame_diff(ours, theirs) -> int:
    """The largest difference of any session's frames (uint8 steps); their audio (float32, the tiny preset's) must
    agree within float noise."""
    diffs = []
    for session in SESSIONS:
        a, b = np.concatenate(ours[session]), np.concatenate(theirs[session])
        assert a.shape == b.shape
        diffs.append(int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max()))
        audio_a, audio_b = (np.concatenate(made[session + ":audio"], axis=-1) for made in (ours, theirs))
        assert audio_a.shape == audio_b.shape and np.abs(audio_a - audio_b).max() <= 1e-4
    return max(diffs)


def test_batched_sessions_get_their_own_frames_and_share_the_batchs_device_time():
    alone, _ = _stream(_runner(1), 3)
    runner = _runner(3)
    together, ticks = _stream(runner, 3)
    # Block 0 runs alone (a first block may split and opens the content); each later plan is one batch of three.
    assert runner.batches == 2
    # float32 noise of the batched products can move a pixel by one step of uint8 (seen: at most 1)
    assert _max_frame_diff(together, alone) <= 1
    for costs, seconds in ticks[1:]:
        # Each member's block (its pieces' costs) is its share of the batch and its own decode: disjoint parts of
        # the plan's time (counted whole for each member, the three would add up to more).
        assert {cost.session_id for cost in costs} == set(SESSIONS)
        assert sum(cost.block_s for cost in costs) <= seconds


def test_a_control_runs_its_session_alone_and_the_others_still_batch():
    def works(block):
        plan = [SessionWork(session, open=_open(index) if block == 0 else None, run=True)
                for index, session in enumerate(SESSIONS)]
        if block == 1:
            plan[1] = SessionWork("b", prompt=PromptUpdate("a boat on a lake", "", "recache"), run=True)
        return plan

    alone, _ = _stream(_runner(1), 3, works)
    runner = _runner(3)
    together, _ = _stream(runner, 3, works)
    assert runner.batches == 2  # block 1 of a and c, block 2 of all three
    assert _max_frame_diff(together, alone) <= 1


def test_a_restart_stops_its_member_of_a_batch_and_the_others_go_on():
    """A stoppable runner (the engine's with ``stop_block_on_restart``): a stop asked for one member while its batch
    is dispatched takes it out before the next step; it makes nothing, and its next block is the one it makes
    alone; the others' blocks are theirs."""
    alone, _ = _stream(_runner(1), 3)
    _, bundle = build_small(max_sessions=4, batch_sessions=3)
    runner = runner_for(bundle, KVCacheManager(bundle.pipeline.kv_spec(), 4, "cpu"), batch_sessions=3,
                        stoppable=True)
    together, _ = _stream(runner, 2)
    plan = StepPlan(work=[SessionWork(session, run=True) for session in SESSIONS], planned_at=now_ms())
    original, calls = runner.pipeline._forward_batch, []

    def stop_b_after_a_step(*args, **kwargs):
        calls.append(len(args[0]))
        if len(calls) == 1:
            runner.stop_block("b", plan)  # as the engine's loop does while the plan is dispatched
        return original(*args, **kwargs)

    runner.pipeline._forward_batch = stop_b_after_a_step
    dispatch = runner.dispatch(plan)
    assert calls == [3, 2, 2, 2, 2]  # a step of three, then three steps and the commit of two
    stopped = [pending for pending in dispatch.pending if pending.session_id == "b"]
    assert [(p.output, p.stopped) for p in stopped] == [(None, True)] and not dispatch.device_idle
    outputs = {}
    for pending in dispatch.pending:
        output, _ = pending.wait()
        if output is not None:
            outputs.setdefault(pending.session_id, []).append(output.frames)
    for session in ("a", "c"):
        diff = np.abs(np.concatenate(outputs[session]).astype(np.int16) - alone[session][2].astype(np.int16))
        assert diff.max() <= 1
    runner.pipeline._forward_batch = original
    again = runner.execute(StepPlan(work=[SessionWork("b", run=True)], planned_at=now_ms()))
    diff = np.abs(np.concatenate([o.frames for o in again.outputs]).astype(np.int16) - alone["b"][2].astype(np.int16))
    assert diff.max() <= 1


def test_a_failed_batch_fails_its_members_and_no_one_else():
    runner = _runner(2)
    _stream(runner, 2)  # a and b batched once, c alone
    def fail(members, stopped=None):
        raise RuntimeError("injected batch failure")
    runner.pipeline.denoise_blocks = fail
    result = runner.execute(StepPlan(work=[SessionWork(s, run=True) for s in SESSIONS], planned_at=now_ms()))
    assert sorted(failure.session_id for failure in result.failures) == ["a", "b"]
    assert all("injected batch failure" in failure.message for failure in result.failures)
    assert [output.session_id for output in result.outputs] == ["c"] and result.fatal is None
    assert set(runner.device_sessions) == {"c"}


def test_live_sessions_due_within_a_block_join_a_tick_that_runs_a_live_block():
    now = time.monotonic()
    records = [_running("due", pace=True, now=now, deadline_in_s=0.3),
               _running("soon", pace=True, now=now, deadline_in_s=0.9),
               _running("later", pace=True, now=now, deadline_in_s=1.3),
               _running("best", pace=False, now=now)]

    def plan(batch: int) -> list[str]:
        scheduler = Scheduler(fps=FPS, frames_per_chunk=12, lead_chunks=2, overlap=False, batch_sessions=batch)
        made = scheduler.plan(records, [], now, block_cost=lambda r: BLOCK_S, control_cost=lambda w: 0.0,
                              lead_s=lambda r: 0.4)
        return [work.session_id for work in made.work]

    assert plan(1) == ["due", "best"]
    # A block's playback is 0.75 s: "soon" (0.9 s ahead) would be due within it, "later" (1.3 s) not.
    assert plan(3) == ["due", "soon", "best"]
    assert plan(2) == ["due", "soon", "best"]
    records[0].pending_prompt = PromptUpdate("new", "", "soft")  # the due block carries a control: no batch
    assert plan(3) == ["due", "best"]


# A device where one session's block alone takes longer than three live sessions can share (3 x 0.26 s > 0.75 s
# of playback), and a batch of three takes 0.22 s a session (the fast window's proportions on an H100: ~235 ms
# alone, ~215 batched, where 227 is the most three live viewers may cost with admission's margin).
BATCHED_S = {1: 0.28, 2: 0.26, 3: 0.22}  # seconds a session, in a batch of n
ALONE_S = BATCHED_S[1]


def _simulated_batches(scheduler_batch: int, device_batch: int = 3, chunks: int = 40,
                       joins_s=(0.0, 0.3, 0.55)) -> list:
    """Three live sessions joining at ``joins_s`` on a virtual device that makes a plan's blocks in batches of up
    to ``device_batch`` (as the runner does: a batch of n costs n times its share), paced just in time by the
    scheduler; virtual time only."""
    scheduler = Scheduler(fps=FPS, frames_per_chunk=12, lead_chunks=2, batch_sessions=scheduler_batch)
    records = []
    for index in range(3):
        record = _record(f"s{index}", pace=True)
        record.prompt, record.state, record.opened_on_device = "p", SessionState.PAUSED, True
        records.append(record)
    by_id = {record.session_id: record for record in records}
    cost = BATCHED_S[3]  # each session's estimate: its share in a batch of three
    lead_s = 3 * cost + MARGIN_S  # its own block, the other live sessions' and the margin (EngineCore.lead_target)

    def release(now: float) -> None:
        for record in records:
            while record.playout.due(now, paced=True):
                record.playout.release(now, paced=True)

    now, batch_sizes = 0.0, []
    while min(record.playout.chunks_released for record in records) < chunks:
        for record, join in zip(records, joins_s):
            if now >= join:
                record.state = SessionState.ACTIVE
        release(now)
        plan = scheduler.plan(records, [], now, block_cost=lambda record: cost, control_cost=lambda work: 0.0,
                              lead_s=lambda record: lead_s)
        if plan.empty:
            waits = [r.playout.next_release_in(now, paced=True) for r in records]
            waits += [join - now for join in joins_s if join > now]
            now += min([scheduler.next_wakeup(records, now, lambda record: lead_s)]
                       + [max(wait, 1e-3) for wait in waits if wait is not None])
            continue
        for start in range(0, len(plan.work), device_batch):
            batch = plan.work[start : start + device_batch]
            batch_sizes.append(len(batch))
            now += len(batch) * BATCHED_S[len(batch)]
            for work in batch:
                frames = np.zeros((12, 1, 1, 3), np.uint8)
                by_id[work.session_id].made(Piece(frames, 0, ChunkTimings(0, 0, 0, 0), now), now,
                                            tolerance_s=DEADLINE_TOLERANCE_S)
            release(now)
    return records, batch_sizes


def test_three_live_sessions_admitted_at_a_batched_cost_keep_real_time_in_batches():
    """Admission counts a batched session's cost (the warm-up's seed), where a block alone costs more than a third
    of the playback: three live sessions that join at different times stay in real time only because their blocks
    are batched; the scheduler batches them from their first blocks on (sessions that fall behind also end up
    due together, but only after running apart)."""
    assert RealtimePolicy(PLAYBACK_S, HEADROOM, enabled=True).live_capacity([], BATCHED_S[3]) == 3
    assert 3 * ALONE_S > PLAYBACK_S
    batched, sizes = _simulated_batches(3)
    assert [record.deadline_misses for record in batched] == [0, 0, 0], sizes
    assert sizes.count(3) >= 0.9 * len(sizes), sizes
    _, unpulled = _simulated_batches(1)  # the device batches a plan's blocks, the scheduler takes only those due
    assert unpulled.count(3) < 0.5 * len(unpulled), unpulled
    apart, _ = _simulated_batches(1, device_batch=1)  # nothing batched: the device's time runs out
    assert sum(record.deadline_misses for record in apart) > 0


def test_the_warm_up_meets_batched_shapes_and_seeds_a_batched_sessions_cost():
    _, bundle = build_small(max_sessions=2, batch_sessions=2, sink_frames=1, window_frames=2)
    manager = KVCacheManager(bundle.pipeline.kv_spec(), 2, "cpu")
    runner = runner_for(bundle, manager, batch_sessions=2)
    free = manager.block_pool.num_free_blocks
    loads = bundle.pipeline.context_kv["cond"].loads
    shares = runner.warmup(1, transitions=False)
    # Two sessions from their first block past the window's eviction (1 + 2 frames, 3 a block): blocks 1 to 3
    # batched, every history length met in slot 1 too; the last two blocks' shares seed the cost.
    assert runner.batches == 3 and not runner.device_sessions and manager.block_pool.num_free_blocks == free
    assert bundle.pipeline.context_kv["cond"].loads - loads >= 2 * 3
    assert len(shares) == 2 and all(share > 0 for share in shares)
    # The activation probe's runner (one session slot) has nothing to batch: its warm-up is one session's.
    probe = runner_for(bundle, KVCacheManager(bundle.pipeline.kv_spec(), 1, "cpu"), batch_sessions=2)
    assert len(probe.warmup(1, transitions=False)) == 1 and probe.batches == 0


def test_the_engine_streams_batched_sessions_their_own_frames():
    """Through the engine (core, scheduler, runner, delivery): three best-effort sessions' chunks with batching
    on are those they get with it off."""
    from engine.api import Engine
    from tests.engine_helpers import run_async, take_chunks

    async def stream(batch: int):
        engine = Engine(small_config(batch_sessions=batch, max_sessions=3, warmup_blocks=1))
        await engine.start()
        try:
            ids = [engine.create_session(seed=5 + i, prompt=f"a kite over dunes {i}", pace=False).session_id
                   for i in range(3)]
            chunks = [await take_chunks(engine, session_id, 4) for session_id in ids]
            return chunks, engine._core.runner.batches
        finally:
            await engine.shutdown()

    alone, _ = run_async(stream(1))
    together, batches = run_async(stream(3))
    assert batches > 0
    for ours, theirs in zip(together, alone):
        assert [chunk.block_index for chunk in ours] == [chunk.block_index for chunk in theirs]
        assert max(int(np.abs(a.frames.astype(np.int16) - b.frames.astype(np.int16)).max())
                   for a, b in zip(ours, theirs)) <= 1


def test_batching_needs_grouped_steps_over_gathered_contexts():
    with pytest.raises(ValidationError, match="batch_sessions=3 batches whole blocks"):
        EngineConfig(**{**small_config().model_dump(), "batch_sessions": 3, "step_mode": "stepwise"})
    with pytest.raises(ValidationError, match="batch_sessions=2 batches whole blocks"):
        EngineConfig(**{**small_config().model_dump(), "batch_sessions": 2, "gather_history_once": False})
    built = build_engine(small_config(max_sessions=2, batch_sessions=2, warmup_blocks=0))
    assert built.runner.batch_sessions == 2 and built.runner.pipeline.batch_slots == 2
    assert built.runner.kv_manager.staging_slots.shape[0] == 2
    _, bundle = build_small(max_sessions=2)
    with pytest.raises(ValueError, match="pipeline of as many batch slots"):
        runner_for(bundle, KVCacheManager(bundle.pipeline.kv_spec(), 2, "cpu"), batch_sessions=2)
