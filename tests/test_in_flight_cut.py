"""A control that arrives while the block it should change is still on the device (``engine/in_flight.py``).

On a GPU a session's next block is dispatched before the previous one is delivered, so about half the prompt
changes found the block they should change already in flight, and waited behind it (docs/BENCHMARKS.md, the
fifteenth session). Now a cut reaches into the media in flight: its pieces from the cut on are dropped, those
before it still arrive, and the block is made again (or the new content begins) behind them.

On the CPU a dispatch has finished its work by the time it returns, so these tests hold the core's completions
back to keep a block in flight, and step the core themselves. The session plays at 2 frames/s with a 5-s
release margin (its second block is dispatched at once, and every piece made is released), and its playback
clock is set so that the block in flight's first piece cannot be made again in time and its later ones can.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import pytest

from engine.controls import Reset, SetPrompt
from engine.plan import StepPlan
from engine.realtime import RunningCost
from engine.startup import build_engine
from tests.engine_helpers import run_async, small_config, stepped_core

CONFIG = dict(window_frames=3, blocks_in_flight=2, fps=2, playout_margin_s=5.0)


class GatedCompletions(ThreadPoolExecutor):
    """The core's completion thread, letting through only as many completions (one per dispatched piece) as the
    test allows: what is not let through stays in flight."""

    def __init__(self) -> None:
        super().__init__(max_workers=1, thread_name_prefix="test-completion")
        self._allowed = 0
        self.submitted = 0
        self._changed = threading.Condition()

    def allow(self, count: int) -> None:
        with self._changed:
            self._allowed = count
            self._changed.notify_all()

    def submit(self, fn, /, *args, **kwargs):
        index, self.submitted = self.submitted, self.submitted + 1

        def gated():
            with self._changed:
                self._changed.wait_for(lambda: self._allowed > index)
            return fn(*args, **kwargs)
        return super().submit(gated)


@dataclass
class Scene:
    """A paced session on a stepped core with completions held back: its block 1 on the device, not delivered."""

    core: object
    gate: GatedCompletions
    record: object
    plans: list[StepPlan]  # every plan the core dispatched, to be replayed on a second runner
    chunks: list  # what its consumer took, in order

    async def stream(self, frames: int) -> None:
        """Let everything through and stream until ``frames`` frames are released (no pacing: all is due)."""
        everything_due(self.record)
        self.gate.allow(10**9)
        await stream_until(self.core, self.record, self.chunks, frames)


@contextlib.asynccontextmanager
async def block_in_flight(seed: int, **config):
    """A :class:`Scene`; at the end its consumer stops and its completions are let through whatever happened."""
    gate = GatedCompletions()
    async with stepped_core(small_config(**{**CONFIG, **config}), completions=gate) as core:
        plans: list[StepPlan] = []
        dispatch = core.runner.dispatch

        def recording(plan, on_pending=None):
            plans.append(plan)
            return dispatch(plan, on_pending)

        core.runner.dispatch = recording
        record = core.admit(seed=seed, pace=True, negative_prompt="", prompt="a red circle", start_on_attach=False)
        chunks: list = []
        consumer = asyncio.create_task(take_all(record, chunks))
        try:
            await block_one_in_flight(core, gate, record)
            yield Scene(core, gate, record, plans, chunks)
        finally:
            consumer.cancel()
            gate.allow(10**9)


async def take_all(record, chunks: list) -> None:
    while (chunk := await record.queue.get()) is not None:
        chunks.append(chunk)


async def stream_until(core, record, chunks: list, frames: int) -> None:
    """Step the core (waiting on pacing as the engine loop would) until ``frames`` frames have been released."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while sum(chunk.frames.shape[0] for chunk in chunks) < frames:
        assert loop.time() < deadline, "the session did not stream on"
        if not await core.step():
            await asyncio.sleep(0.02)


async def block_one_in_flight(core, gate, record) -> None:
    """Block 0 made and released (the clock runs), block 1 dispatched and held on the device."""
    assert await core.step()
    gate.allow(gate.submitted)
    await core.delivered()
    assert record.playout.clock_running and record.playout.frames_made == 9
    assert await core.step()
    assert record.works_in_flight == 1 and record.frames_in_flight == 12
    # The viewer's clock, placed as a GPU session's would be: the block in flight's first piece plays exactly a
    # release margin from now (too soon to be made again), its second and third 2 and 4 s later (in time for a
    # block made again in under 2 or 4 s: the first blocks of this CPU took 0.1-2.5 s, so the cut is at one of
    # them). Left to itself, the clock would make the choice depend on how long this CPU took so far.
    playout = record.playout
    playout.anchor = time.monotonic() + playout.margin_s - 9 / playout.fps


def everything_due(record) -> None:
    """The viewer's clock far ahead: every piece is released and every block due at once (the rest of the test
    needs no pacing)."""
    record.playout.anchor = time.monotonic() - 60


def _timing(core, record) -> dict:
    """What a cut's choice depends on, for a failure's message."""
    now = time.monotonic()
    return {"points_play_in_s": [(p.at, round(record.playout.play_time(p.at) - now, 3)) for p in record.cut_points()],
            "backlog_s": core._backlog(now), "block_s": core.cost_of(record), "first_piece_s": core._first_piece_cost(record)}


def replay(plans: list[StepPlan]) -> list[np.ndarray]:
    """The same plans on a second runner, one call each: each work's frames (its pieces joined)."""
    built = build_engine(small_config(**CONFIG))
    outputs = []
    for plan in plans:
        result = built.runner.execute(plan)
        assert not result.failures, result.failures
        outputs.append(np.concatenate([output.frames for output in result.outputs]) if result.outputs
                       else np.zeros((0, 48, 64, 3), np.uint8))
    return outputs


def assert_streamed_what_was_made(chunks: list, plans: list[StepPlan], at: int, at_least: int):
    """The stream is one timeline, and it is what the same plans make on a second runner: block 0, block 1's
    pieces before the cut at ``at``, then whatever followed the cut (as far as both go: the core may have made
    more than it sent). Returns what was made, per work, and the stream's frames."""
    assert [chunk.pts for chunk in chunks] == list(np.cumsum([0] + [c.frames.shape[0] for c in chunks[:-1]]))
    made = replay(plans)
    assert [work.shape[0] for work in made[:2]] == [9, 12]
    expected = np.concatenate([made[0], made[1][:at - 9], *made[2:]])
    streamed = np.concatenate([chunk.frames for chunk in chunks])
    common = min(streamed.shape[0], expected.shape[0])
    assert common >= at_least, (streamed.shape, expected.shape)
    np.testing.assert_array_equal(streamed[:common], expected[:common])
    return made, streamed


def test_a_prompt_change_supersedes_a_block_still_on_the_device():
    async def scenario():
        async with block_in_flight(seed=5) as scene:
            record = scene.record
            timing = _timing(scene.core, record)
            scene.core.submit(record.session_id, SetPrompt("a blue square", None, "soft"))
            scene.core._apply_controls()
            # Cut inside the block in flight, at any frame after its first (a piece it falls inside is sent from
            # the cut on when made again): the rest of it is dropped, the block is to be made again.
            assert record.deferred_cut is not None, timing
            at = record.deferred_cut.at
            assert 9 < at < 21 and record.rewind is not None and record.rewind.block == 1, timing
            assert (record.rewind.skip_latents, record.rewind.skip_frames) == divmod(at - 9, 4)
            assert record.frames_in_flight == at - 9  # pacing counts only what will still arrive
            assert record.next_deadline() == record.playout.play_time(at)
            await scene.stream(9 + 12 + 12)
            return scene.plans, scene.chunks, at

    plans, chunks, at = run_async(scenario())
    # What the core streamed is what the runner made: block 1's pieces before the cut, then the block made again
    # from the cut on (the rewind's pieces), then the next block.
    made, streamed = assert_streamed_what_was_made(chunks, plans, at, 9 + 12 + 12)
    # The change did change the block: the dropped pieces are not what was streamed in their place.
    assert not np.array_equal(made[1][at - 9:], streamed[at:21])


def test_a_reset_cuts_into_a_block_still_on_the_device_and_the_new_content_follows_what_was_kept():
    async def scenario():
        async with block_in_flight(seed=6) as scene:
            record = scene.record
            timing = _timing(scene.core, record)
            scene.core.submit(record.session_id, Reset())
            scene.core._apply_controls()
            assert record.deferred_cut is not None, timing
            at = record.deferred_cut.at
            # New content needs no piece boundary: any frame of block 1 after its first piece's start; what comes
            # before it stays (the piece it falls in is cut when it is made), the rest is dropped, and pacing
            # counts only what stays.
            assert 9 < at < 21 and record.cut_pending, timing
            assert record.frames_in_flight == at - 9
            assert record.next_deadline() == record.playout.play_time(at)
            await scene.stream(at + 9)
            return scene.plans, scene.chunks, at, record

    plans, chunks, at, record = run_async(scenario())
    # Block 1's pieces before the cut, then the new content's first block (its opening frame and two pieces).
    made, _ = assert_streamed_what_was_made(chunks, plans, at, at + 9)
    assert next(work for work in made[2:] if work.shape[0]).shape[0] == 9  # the new content's first block
    with_audio = [chunk for chunk in chunks if chunk.audio is not None]  # the sound runs on across the cut
    assert len(with_audio) >= 2
    for before, after in zip(with_audio, with_audio[1:]):
        assert after.audio_start == before.audio_start + before.audio.shape[1]
    assert record.deferred_cut is None and record.frames_in_flight == sum(p.frames for p in record.in_flight.kept())


def test_a_block_is_not_made_again_from_its_middle_when_the_block_after_it_would_be_late():
    """A block made again from its third piece costs a whole block but gives only its last piece: with blocks that
    take 3 s here (as set), its last piece would be in time (9 s from now, ready at 5 + 3) but not the next
    block's first (11 s from now, ready at 5 + 3 + 3), so the change waits for the next block instead (an H100's
    standard config stalled without this rule: docs/BENCHMARKS.md, sixteenth session)."""
    async def scenario():
        async with block_in_flight(seed=7) as scene:
            record = scene.record
            record.cost, record.first_piece_cost = RunningCost(), RunningCost()
            record.cost.observe(3.0)
            record.first_piece_cost.observe(3.0)
            scene.core._device_free_at = time.monotonic()  # the CPU ran the block in flight as it was dispatched
            epoch = record.epoch
            scene.core.submit(record.session_id, SetPrompt("a blue square", None, "soft"))
            scene.core._apply_controls()
            return record.deferred_cut, record.rewind, record.epoch - epoch, record.frames_in_flight

    assert run_async(scenario()) == (None, None, 0, 12)


def test_a_reset_after_a_supersede_still_waiting_in_flight_starts_the_new_content_at_its_cut():
    """A supersede cut inside the block in flight, then a reset before the cut is made: the new content follows
    the pieces kept, and nothing of the block made again is streamed."""
    async def scenario():
        async with block_in_flight(seed=8) as scene:
            record = scene.record
            scene.core.submit(record.session_id, SetPrompt("a blue square", None, "soft"))
            scene.core._apply_controls()
            superseded = record.deferred_cut.at
            scene.core.submit(record.session_id, Reset())
            scene.core._apply_controls()
            at = record.deferred_cut.at
            assert record.deferred_cut.block_start is None and 9 < at <= superseded
            await scene.stream(at + 9)
            return scene.plans, scene.chunks, at

    plans, chunks, at = run_async(scenario())
    assert all(work.rewind is None for plan in plans[2:] for work in plan.work)  # the reset took the block made again's place
    made, _ = assert_streamed_what_was_made(chunks, plans, at, at + 9)
    assert next(work for work in made[2:] if work.shape[0]).shape[0] == 9  # the new content's first block


def test_a_prompt_change_after_a_reset_never_takes_back_the_old_contents_blocks():
    """A reset cut inside the block in flight and planned, the old block's pieces before the cut made and waiting in
    the lead; then a prompt change that could reach them in time: they are not the current content's (the runner
    keeps no record of them any more), so the change does not take them back; the session streams on."""
    async def scenario():
        async with block_in_flight(seed=9) as scene:
            record, core, gate = scene.record, scene.core, scene.gate
            core.submit(record.session_id, Reset())
            core._apply_controls()
            at = record.deferred_cut.at
            assert 9 < at < 21
            old_pieces = gate.submitted
            assert await core.step()  # the reset is planned and dispatched behind block 1
            assert not record.cut_pending and scene.plans[-1].work[0].reset
            record.playout.anchor += 30  # the viewer far behind: every piece ahead could be made again in time
            gate.allow(old_pieces)  # block 1's pieces arrive (the cut is made), the new content's stay on the device
            deadline = time.monotonic() + 30
            while record.deferred_cut is not None:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.01)
            assert record.playout.lead_start == 9 and record.playout.frames_made == at  # the old content's, ahead
            core.submit(record.session_id, SetPrompt("a blue square", None, "soft"))
            core._apply_controls()
            rewind = record.rewind
            await scene.stream(at + 9 + 12)
            return rewind, scene.chunks, record.error, record.is_open

    rewind, chunks, error, still_open = run_async(scenario())
    assert rewind is None  # (the new content's first block is not kept for taking back either)
    assert error is None and still_open
    assert [c.pts for c in chunks] == list(np.cumsum([0] + [c.frames.shape[0] for c in chunks[:-1]]))


def test_a_session_made_just_in_time_keeps_the_lead_a_block_made_again_needs():
    """Where a block takes most of its playback (here 4 s of 6, as the standard config's ~0.53 of 0.75 s on an H100),
    a session made just in time never had enough ahead for a block to be made again (the rule above: the block
    after it would be late), and every change waited for the next block to begin: half a block's playback on
    average. Its lead now holds one block's device time more (``supersede_reserve``): dispatched at its lead target,
    the block on the device is made again from the first frame the change can reach, the device's work, the
    block's first piece and the margin from now."""
    async def scenario(reserve: bool):
        async with block_in_flight(seed=10, supersede_reserve=reserve) as scene:
            record, core = scene.record, scene.core
            record.cost, record.first_piece_cost = RunningCost(), RunningCost()
            record.cost.observe(4.0)
            record.first_piece_cost.observe(3.0)
            now = time.monotonic()
            core._device_free_at = now + 4.0  # block 1 was just dispatched: the device has all of it still to do
            # Its lead target when it was due (nothing of the session on the device then): the first piece and the
            # margin, and, with the reserve, one block's device time. With block 1 on the device, the next block is
            # due by its deadline alone (the reserve is made one block at a time).
            due_at = 3.0 + 5.0 + (4.0 if reserve else 0.0)
            with_one_on_the_device = core.lead_target(record)
            playout = record.playout
            playout.anchor = now + due_at - 9 / playout.fps  # block 0's end plays that far from now
            core.submit(record.session_id, SetPrompt("a blue square", None, "soft"))
            core._apply_controls()
            rewind = record.rewind  # block 1 starts at frame 9: the cut is where its frames made again are sent from
            at = None if rewind is None else 9 + 4 * rewind.skip_latents + rewind.skip_frames
            return with_one_on_the_device, rewind, None if at is None else (at, playout.play_time(at) - now)

    with_one_on_the_device, rewind, cut = run_async(scenario(True))
    assert with_one_on_the_device == pytest.approx(3.0 + 5.0)
    assert rewind is not None and rewind.block == 1
    at, plays_in = cut
    assert at == 9 and plays_in == pytest.approx(4.0 + 3.0 + 5.0, abs=0.1)  # the device's work + first piece + margin

    _, rewind, cut = run_async(scenario(False))
    assert rewind is None and cut is None  # just in time: the change waits for the block after the one on the device


def test_the_reserve_is_due_only_while_nothing_of_the_session_is_on_the_device():
    """With nothing of the session on the device, its next block is due a block's device time earlier than just in
    time needs (the reserve); with one on the device, by its deadline alone, so a second block is never queued only
    to rebuild the reserve (a control would wait behind it)."""
    async def scenario():
        async with stepped_core(small_config(**CONFIG)) as core:
            record = core.admit(seed=11, pace=True, negative_prompt="", prompt="a red circle", start_on_attach=False)
            record.cost, record.first_piece_cost = RunningCost(), RunningCost()
            record.cost.observe(4.0)
            record.first_piece_cost.observe(3.0)
            idle = core.lead_target(record)
            record.works_in_flight = 1
            busy = core.lead_target(record)
            record.works_in_flight = 0
            return idle, busy

    idle, busy = run_async(scenario())
    assert idle == pytest.approx(3.0 + 5.0 + 4.0) and busy == pytest.approx(3.0 + 5.0)
