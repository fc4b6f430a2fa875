"""Several sessions' blocks in one forward a step (``CausalWanPipeline.run_blocks``) against the same sessions
one at a time (``run_block``), on the same weights and seeds.

Each session of a batch keeps its own noise generator, prompt, history (a gathered-context slot of its own) and
commit staging slot, so its blocks must be the ones it makes alone: past the window's first eviction, with the
members' order changing between blocks (each slot reloads for its new owner), with a CFG branch, and for a
session that goes on alone after batches. What cannot batch is refused before anything changes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.kv_cache import KVCacheManager
from tests.engine_helpers import build_small

pytestmark = pytest.mark.background  # computes only: runs on the idle core (tests/background_pytest.py)

FLOAT32_TOLERANCE = 1e-5  # batched products sum in another order (float32 noise: ~1e-6 seen)
PROMPTS = ("a red kite over dunes", "a blue boat on a lake", "a green hill at dawn")


def _pipelines(slots: int = 3, **overrides):
    """(one session a forward, up to ``slots`` a forward) pipelines over one transformer."""
    _, bundle = build_small(sink_frames=3, window_frames=6, **overrides)
    serial = bundle.pipeline
    return serial, serial.variant(gather_history_once=True, batch_slots=slots)


def _sessions(pipeline, count: int = 3):
    manager = KVCacheManager(pipeline.kv_spec(), 4, "cpu")
    return [(manager.open_session(f"s{i}"), pipeline.new_progress(seed=11 + i, prompt=PROMPTS[i]))
            for i in range(count)]


def _diff(a, b) -> float:
    return a.float().max_abs_diff(b.float())


@pytest.mark.parametrize("guidance_scale, blocks", [(1.0, 5), (3.0, 2)])
def test_batched_blocks_are_each_sessions_own_blocks(guidance_scale, blocks):
    serial, batched = _pipelines(guidance_scale=guidance_scale)
    alone, together = _sessions(serial), _sessions(batched)
    assert batched.branch_names == (("cond", "uncond") if guidance_scale > 1 else ("cond",))
    diffs = []
    for block in range(blocks):  # 3 frames a block, window 6 after a sink of 3: the first eviction at block 3
        order = [(block + i) % 3 for i in range(3)]  # each slot changes owner: every load is the slot's own
        expected = [serial.run_block(*alone[i]) for i in order]
        made = batched.run_blocks([together[i] for i in order])
        diffs.extend(_diff(a, b) for a, b in zip(made, expected))
    assert together[0][0].committed_frames("cond") == 3 * blocks
    assert [progress.block_index for _, progress in together] == [blocks] * 3
    assert max(diffs) <= FLOAT32_TOLERANCE, diffs
    # A session goes on alone after batches (slot 0, a fresh load), another in a batch of two.
    tail = [serial.run_block(*alone[i]) for i in (1, 0, 2)]
    made = [batched.run_block(*together[1])] + batched.run_blocks([together[0], together[2]])
    assert max(_diff(a, b) for a, b in zip(made, tail)) <= FLOAT32_TOLERANCE


def test_each_slot_loads_once_per_block_and_commits_into_its_own_session():
    _, batched = _pipelines()
    together = _sessions(batched)
    workspace = batched.context_kv["cond"]
    batched.run_blocks(together)  # no history yet: nothing to load
    for _ in range(2):
        loads = workspace.loads
        batched.run_blocks(together)
        assert workspace.loads - loads == 3  # one load a slot for its 4 denoising forwards and the commit pass
    ids = [set(kv.resident_block_ids("cond")) for kv, _ in together]
    assert all(len(blocks) == 9 for blocks in ids) and not (ids[0] & ids[1] or ids[1] & ids[2] or ids[0] & ids[2])
    # The staging slot each session committed from held its own K/V: the pool rows differ between sessions.
    pool = together[0][0].pool
    firsts = [pool[:, :, together[i][0].resident_block_ids("cond")[0]] for i in range(3)]
    assert not torch.equal(firsts[0], firsts[1]) and not torch.equal(firsts[1], firsts[2])


def test_a_member_stopped_mid_batch_leaves_as_if_its_block_never_began_and_the_others_go_on():
    serial, batched = _pipelines()
    alone, together = _sessions(serial), _sessions(batched)
    for _ in range(2):
        expected = [serial.run_block(*member) for member in alone]
        assert max(_diff(a, b) for a, b in zip(batched.run_blocks(together), expected)) <= FLOAT32_TOLERANCE
    steps = []

    def stopped():  # before each step: the second member stops before step 2, the first before step 3
        steps.append(len(steps))
        return {2: [1], 3: [0]}.get(len(steps) - 1, [])

    before = together[1][1].generator.get_state()
    cleans = batched.denoise_blocks(together, stopped)
    assert steps == [0, 1, 2, 3] and cleans[0] is None and cleans[1] is None and cleans[2] is not None
    assert torch.equal(together[1][1].generator.get_state(), before) and together[1][1].latents is None
    made = batched.commit_blocks([together[2]])  # the one left: its block, committed alone
    assert _diff(made[0], serial.run_block(*alone[2])) <= FLOAT32_TOLERANCE
    # The stopped ones, begun again (together), make the blocks they make alone.
    expected = [serial.run_block(*alone[i]) for i in (0, 1)]
    assert max(_diff(a, b) for a, b in zip(batched.run_blocks(together[:2]), expected)) <= FLOAT32_TOLERANCE


def test_what_cannot_batch_is_refused_before_anything_changes():
    _, batched = _pipelines(slots=2)
    sessions = _sessions(batched)
    state = lambda: [(kv.committed_frames("cond"), progress.block_index, progress.generator.get_state())  # noqa: E731
                     for kv, progress in sessions]
    before = state()
    with pytest.raises(ValueError, match="batches 1 to 2"):
        batched.run_blocks(sessions)
    with pytest.raises(ValueError, match="twice"):
        batched.run_blocks([sessions[0], sessions[0]])
    assert all(torch.equal(a[2], b[2]) and a[:2] == b[:2] for a, b in zip(state(), before))
    batched.run_block(*sessions[0])  # one session ahead: 3 history frames where the others hold none
    with pytest.raises(ValueError, match="same number of history frames"):
        batched.run_blocks(sessions[:2])
    batched.run_block(*sessions[1])
    batched.denoise_step(*sessions[1])  # a block begun: its next forward is its second step
    with pytest.raises(ValueError, match="plain blocks"):
        batched.run_blocks(sessions[:2])
    batched.run_block(*sessions[1])
    other = _sessions(batched, count=1)  # another manager: other pool, other staging
    batched.run_block(*other[0])
    with pytest.raises(ValueError, match="one KV manager"):
        batched.run_blocks([sessions[0], other[0]])
    with pytest.raises(ValueError, match="batched forwards need gather_history_once"):
        batched.variant(gather_history_once=False, batch_slots=2)
    serial_kv = KVCacheManager(dataclasses.replace(batched.kv_spec(), staging_slots=1), 1, "cpu")
    assert serial_kv.staging_slots.shape[0] == 1 and batched.kv_spec().staging_slots == 2


# --- on the device machine --------------------------------------------------------------------------------

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)
FP8_BATCHED_BOUND = 1e-2  # the same e4m3 operands and scales; bf16 products summed in another order


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="the FP8 engine needs a Hopper GPU")
def test_cuda_batched_fp8_blocks_replay_graphs_and_match_one_at_a_time():
    """The tiny engine with ``fp8 all`` on the GPU, CUDA graphs on: the fused q / k pass per session into the
    mirror's slots, V's quantizer and the attention over the batch, one graph per batch size; each session's
    blocks as it makes them alone."""
    from tests.engine_helpers import small_dit_tiny_preset

    with small_dit_tiny_preset():
        _, bundle = build_small(dtype="bfloat16", fp8="all", device="cuda", cuda_graphs=True, sink_frames=3,
                                window_frames=6)
    serial = bundle.pipeline
    assert serial.transformer.kernels.quantized_norms
    batched = serial.variant(gather_history_once=True, cuda_graphs=True, batch_slots=3)

    def sessions(pipeline):
        manager = KVCacheManager(pipeline.kv_spec(), 3, "cuda")
        return [(manager.open_session(f"s{i}"), pipeline.new_progress(seed=11 + i, prompt=PROMPTS[i]))
                for i in range(3)]

    alone, together = sessions(serial), sessions(batched)
    errors = []
    for _ in range(5):
        expected = [serial.run_block(*member) for member in alone]
        made = batched.run_blocks(together)
        errors.extend(float((a.video.float() - b.video.float()).norm() / b.video.float().norm())
                      for a, b in zip(made, expected))
    assert batched.forwards.replays > 0 and batched.forwards.num_graphs > 0
    assert max(errors) <= FP8_BATCHED_BOUND, errors
