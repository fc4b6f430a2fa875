"""Sessions on the runner: isolation, determinism, one release path, fail-closed steps, prompt policies, CFG."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.kv_cache import KVCacheManager
from engine.models.attention import DenseContext
from engine.models.latents import BlockLatents
from engine.models.reference import block_causal_mask
from engine.plan import FinishedSession, OpenSession, PromptUpdate, SessionWork, StepPlan
from engine.runner import STEADY_WARMUP_BLOCKS, Runner, runner_for
from tests.engine_helpers import assert_lively, build_small, small_runner

pytestmark = pytest.mark.background  # computes only: runs on the idle core (tests/background_pytest.py)


def open_session(runner: Runner, session_id: str, seed: int = 1, prompt: str = "a fox", negative: str = "") -> None:
    result = runner.execute(StepPlan(work=[SessionWork(session_id, open=OpenSession(seed, prompt, negative))]))
    assert not result.failures


def run_blocks(runner: Runner, session_ids: list[str], blocks: int) -> dict[str, list[np.ndarray]]:
    """Run ``blocks`` blocks of every session, interleaved tick by tick; returns frames per session."""
    frames = {session_id: [] for session_id in session_ids}
    while min(len(v) for v in frames.values()) < blocks:
        result = runner.execute(StepPlan(work=[SessionWork(s, run=True) for s in session_ids if len(frames[s]) < blocks]))
        assert not result.failures, result.failures
        for output in result.outputs:
            frames[output.session_id].append(output.frames)
    return frames


def close(runner: Runner, session_id: str, reason: str = "client") -> None:
    runner.execute(StepPlan(finished=[FinishedSession(session_id, reason)]))


@pytest.fixture(scope="module")
def runner() -> Runner:
    return small_runner(max_sessions=4, sink_frames=3, window_frames=3)


def test_interleaved_sessions_produce_what_each_produces_alone(runner):
    open_session(runner, "fox-alone", seed=1, prompt="a fox")
    alone_fox = run_blocks(runner, ["fox-alone"], 3)["fox-alone"]
    close(runner, "fox-alone")
    open_session(runner, "owl-alone", seed=2, prompt="an owl")
    alone_owl = run_blocks(runner, ["owl-alone"], 3)["owl-alone"]
    close(runner, "owl-alone")

    for session_id, seed, prompt in (("fox", 1, "a fox"), ("owl", 2, "an owl"), ("fox-seed2", 2, "a fox")):
        open_session(runner, session_id, seed=seed, prompt=prompt)
    together = run_blocks(runner, ["fox", "owl", "fox-seed2"], 3)
    for ours, alone in zip(together["fox"], alone_fox):
        np.testing.assert_array_equal(ours, alone)
    for ours, alone in zip(together["owl"], alone_owl):
        np.testing.assert_array_equal(ours, alone)
    # different seed (same prompt) and different prompt (same seed) both change the frames
    assert not np.array_equal(together["fox"][0], together["fox-seed2"][0])
    assert not np.array_equal(together["owl"][0], together["fox-seed2"][0])
    assert [len(f) for f in together["fox"]] == [9, 12, 12]
    for block in together["fox"] + together["owl"]:
        assert_lively(block)
    for session_id in ("fox", "owl", "fox-seed2"):
        close(runner, session_id)


def test_stepwise_execution_equals_grouped_execution():
    config, bundle = build_small(sink_frames=3, window_frames=3)
    outputs = {}
    for stepwise in (False, True):
        manager = KVCacheManager(bundle.pipeline.kv_spec(), 1, "cpu")
        runner = runner_for(bundle, manager, stepwise=stepwise)
        open_session(runner, "s", seed=4)
        calls = 0
        frames = []
        while len(frames) < 3:
            result = runner.execute(StepPlan(work=[SessionWork("s", run=True)]))
            calls += 1
            frames += [o.frames for o in result.outputs]
        outputs[stepwise] = (frames, calls)
    assert outputs[False][1] == 3  # one call per block
    assert outputs[True][1] == 3 * (bundle.pipeline.num_steps + 1)  # 4 denoise steps + commit per block
    for grouped, stepped in zip(outputs[False][0], outputs[True][0]):
        np.testing.assert_array_equal(grouped, stepped)


def _baseline(runner: Runner) -> tuple[int, int]:
    manager = runner.kv_manager
    return manager.block_pool.num_free_blocks, manager.cross_cache.num_free_slots("text")


@pytest.mark.parametrize("ending", ["close", "evicted", "failed", "reset"])
def test_every_release_path_returns_pool_and_decoder_state_to_baseline(runner, ending):
    baseline = _baseline(runner)
    open_session(runner, "bystander", seed=9, prompt="a river")
    bystander_alone = run_blocks(runner, ["bystander"], 4)["bystander"]
    close(runner, "bystander")
    assert _baseline(runner) == baseline

    open_session(runner, "victim", seed=5)
    open_session(runner, "bystander", seed=9, prompt="a river")
    first = run_blocks(runner, ["victim", "bystander"], 3)  # past the window: eviction happened
    victim = runner.device_sessions["victim"]
    assert victim.decode_state.nbytes() > 0 and victim.audio_state.nbytes() > 0
    if ending == "close":
        close(runner, "victim", "client")
    elif ending == "evicted":
        close(runner, "victim", "evicted")
    elif ending == "failed":
        original = runner.pipeline.forward_branch

        def failing_forward(kv, progress, branch, latents, timestep, *, stage):
            if kv.session_id == "victim" and stage:
                raise RuntimeError("injected failure in the commit pass")
            return original(kv, progress, branch, latents, timestep, stage=stage)

        runner.pipeline.forward_branch = failing_forward
        try:
            result = runner.execute(StepPlan(work=[SessionWork("victim", run=True), SessionWork("bystander", run=True)]))
        finally:
            runner.pipeline.forward_branch = original
        assert [f.session_id for f in result.failures] == ["victim"]
        assert "injected failure" in result.failures[0].message
        assert [o.session_id for o in result.outputs] == ["bystander"]
        first["bystander"] += [result.outputs[0].frames]
    else:
        runner.execute(StepPlan(work=[SessionWork("victim", reset=True)]))
        assert runner.device_sessions["victim"].decode_state.nbytes() == 0
        after_reset = run_blocks(runner, ["victim"], 2)["victim"]
        for ours, original in zip(after_reset, first["victim"]):
            np.testing.assert_array_equal(ours, original)  # reset = a new session, same seed and prompt
        close(runner, "victim")
    assert "victim" not in runner.device_sessions
    assert victim.decode_state.nbytes() == 0 and victim.audio_state.nbytes() == 0
    assert victim.kv.closed
    assert not victim.progress.window_latents and victim.progress.latents is None
    # the bystander carries on exactly as if alone
    rest = run_blocks(runner, ["bystander"], 4 - len(first["bystander"]))["bystander"]
    for ours, alone in zip(first["bystander"] + rest, bystander_alone):
        np.testing.assert_array_equal(ours, alone)
    close(runner, "bystander")
    assert _baseline(runner) == baseline


def test_failed_commit_pass_commits_nothing_in_any_branch():
    config, bundle = build_small(guidance_scale=3.0, sink_frames=3, window_frames=3)
    pipeline = bundle.pipeline
    manager = KVCacheManager(pipeline.kv_spec(), 1, "cpu")
    kv = manager.open_session("s")
    progress = pipeline.new_progress(seed=2, prompt="a boat", negative_prompt="blurry")
    pipeline.run_block(kv, progress)
    before = {b: (kv.committed_frames(b), kv.resident_block_ids(b)) for b in ("cond", "uncond")}
    pool_before = manager.block_pool.storage.clone()
    original = pipeline.forward_branch

    def failing_forward(kv, progress, branch, latents, timestep, *, stage):
        out = original(kv, progress, branch, latents, timestep, stage=stage)
        if stage and branch == "uncond":  # cond's commit forward already ran and staged its K/V
            raise RuntimeError("injected")
        return out

    pipeline.forward_branch = failing_forward
    with pytest.raises(RuntimeError, match="injected"):
        pipeline.run_block(kv, progress)
    pipeline.forward_branch = original
    assert {b: (kv.committed_frames(b), kv.resident_block_ids(b)) for b in ("cond", "uncond")} == before
    assert torch.equal(manager.block_pool.storage, pool_before)


def test_cfg_branches_hold_their_own_blocks_and_free_together():
    config, bundle = build_small(guidance_scale=3.0, sink_frames=3, window_frames=3)
    manager = KVCacheManager(bundle.pipeline.kv_spec(), 2, "cpu")
    runner = runner_for(bundle, manager)
    free = manager.block_pool.num_free_blocks
    open_session(runner, "cfg", seed=3, negative="blurry")
    guided = run_blocks(runner, ["cfg"], 3)["cfg"]
    kv = runner.device_sessions["cfg"].kv
    cond, uncond = kv.resident_block_ids("cond"), kv.resident_block_ids("uncond")
    assert len(cond) == len(uncond) == 6 and not set(cond) & set(uncond)
    assert not torch.equal(manager.block_pool.storage[:, :, cond], manager.block_pool.storage[:, :, uncond])
    assert kv.is_cross_populated("cond", "text") and kv.is_cross_populated("uncond", "text")
    assert manager.block_pool.num_free_blocks == free - 12
    close(runner, "cfg")
    assert manager.block_pool.num_free_blocks == free
    assert manager.cross_cache.num_free_slots("text") == 2 * 2 + 1

    unguided_runner = small_runner(max_sessions=1, sink_frames=3, window_frames=3)
    open_session(unguided_runner, "plain", seed=3)
    plain = run_blocks(unguided_runner, ["plain"], 1)["plain"]
    assert not np.array_equal(plain[0], guided[0])  # guidance changes the picture


def _change_prompt(runner, session_id, prompt, policy):
    result = runner.execute(StepPlan(work=[SessionWork(session_id, prompt=PromptUpdate(prompt, "", policy))]))
    assert not result.failures, result.failures


def test_soft_prompt_change_keeps_self_kv_and_changes_the_next_block(runner):
    for session_id in ("soft", "twin"):
        open_session(runner, session_id, seed=6, prompt="a desert")
    run_blocks(runner, ["soft", "twin"], 2)
    kv = runner.device_sessions["soft"].kv
    ids = kv.resident_block_ids("cond")
    kept = runner.kv_manager.block_pool.storage[:, :, ids].clone()
    _change_prompt(runner, "soft", "a snowy forest", "soft")
    assert not kv.is_cross_populated("cond", "text")  # text K/V invalidated...
    assert kv.resident_block_ids("cond") == ids  # ...self-KV kept, untouched
    assert torch.equal(runner.kv_manager.block_pool.storage[:, :, ids], kept)
    nxt = run_blocks(runner, ["soft", "twin"], 1)
    assert not np.array_equal(nxt["soft"][0], nxt["twin"][0])
    assert kv.is_cross_populated("cond", "text")
    close(runner, "soft")
    close(runner, "twin")


def test_recache_recomputes_resident_kv_under_the_new_prompt(runner):
    open_session(runner, "re", seed=8, prompt="a city")
    run_blocks(runner, ["re"], 3)  # 9 frames committed; 6 resident (sink 3 + window 3)
    device_session = runner.device_sessions["re"]
    kv, progress = device_session.kv, device_session.progress
    ids = kv.resident_block_ids("cond")
    storage = runner.kv_manager.block_pool.storage
    before = storage[:, :, ids].clone()
    _change_prompt(runner, "re", "a harbour at dawn", "recache")
    assert kv.resident_block_ids("cond") == ids
    after = storage[:, :, ids]
    assert not torch.equal(after, before)

    # Independent recomputation: one dense block-causal forward over the resident clean frames.
    pipeline = runner.pipeline
    transformer = pipeline.transformer
    frames = BlockLatents.cat(progress.resident_latents())
    count, tokens = frames.frames, transformer.tokens_per_frame
    spec = pipeline.kv_spec()
    stage = torch.empty(spec.num_layers, 2, count * tokens, spec.num_kv_heads, spec.head_dim)
    cos, sin = transformer.rotary(count)
    mask = block_causal_mask(count, pipeline.frames_per_block, tokens, "cpu")
    context = DenseContext(cos=cos, sin=sin, stage=stage, attn_mask=mask)
    cross = transformer.project_text(pipeline.embed("a harbour at dawn"))[0]
    transformer(frames, torch.zeros(1, count), context, cross)
    expected = stage.unflatten(2, (count, tokens))
    assert (after - expected).abs().max() < 1e-5
    close(runner, "re")


def test_reset_policy_gives_a_new_sessions_frames(runner):
    open_session(runner, "fresh", seed=12, prompt="a glacier")
    fresh = run_blocks(runner, ["fresh"], 2)["fresh"]
    close(runner, "fresh")
    open_session(runner, "switch", seed=12, prompt="a volcano")
    run_blocks(runner, ["switch"], 2)
    _change_prompt(runner, "switch", "a glacier", "reset")
    after = run_blocks(runner, ["switch"], 2)["switch"]
    for ours, expected in zip(after, fresh):
        np.testing.assert_array_equal(ours, expected)
    close(runner, "switch")


def test_warmup_restores_the_pool(runner):
    baseline = _baseline(runner)
    runner.warmup(blocks=2)
    assert _baseline(runner) == baseline
    assert "__warmup__" not in runner.device_sessions


def test_warmup_meets_every_attention_shape_and_transition(runner):
    """Every history length, a second session, a recache and a reset are seen before any viewer is."""
    rope = runner.pipeline.transformer.rope
    spec = runner.kv_manager.spec
    widths, opened = set(), []
    original_for_frames, original_open = rope.for_frames, runner.open

    def recording_for_frames(num_frames, device):
        widths.add(num_frames)
        return original_for_frames(num_frames, device)

    def recording_open(session_id, request):
        opened.append(session_id)
        return original_open(session_id, request)

    rope.for_frames, runner.open = recording_for_frames, recording_open
    recaches_before = runner.pipeline.context_kv["cond"].loads
    try:
        seconds = runner.warmup(blocks=1)
    finally:
        rope.for_frames, runner.open = original_for_frames, original_open
    frames = spec.frames_per_block
    assert set(range(frames, spec.context_frames + 1, frames)) <= widths
    # Enough blocks to fill the window and evict, then the timed steady ones that seed the block cost.
    assert len(seconds) == STEADY_WARMUP_BLOCKS
    # The first session opened three times: at the start, by its reset and by its restart from an image (the
    # one-frame commit pass of a picture's context); the second joined.
    assert runner.encoder is not None and 1 in widths
    assert opened.count("__warmup__") == 3 and opened.count("__warmup_2__") == 1
    assert runner.pipeline.context_kv["cond"].loads > recaches_before
    assert not runner.device_sessions


def test_with_blocks_of_one_latent_frame_the_first_block_is_not_split_into_an_empty_rest():
    """A first block of one latent frame is its opening frame alone: asked to split it, the runner sends it
    whole, and every tick after makes a block (none is spent on an empty rest of the first)."""
    config, bundle = build_small(sink_frames=1, window_frames=3, frames_per_block=1)
    runner = runner_for(bundle, KVCacheManager(bundle.pipeline.kv_spec(), 1, "cpu"), split_first_block=True)
    open_session(runner, "s", seed=4, prompt="a lantern")
    ticks = []
    for _ in range(3):
        result = runner.execute(StepPlan(work=[SessionWork("s", run=True)]))
        assert not result.failures, result.failures
        ticks.append([(o.frames.shape[0], o.block_index) for o in result.outputs])
    assert ticks == [[(1, 0)], [(4, 1)], [(4, 2)]]


@pytest.mark.parametrize("stepwise", [False, True])
def test_split_first_block_sends_the_opening_frame_first_and_the_same_media(stepwise):
    """Opening frame ahead of the commit pass, then the rest: the same frames and audio as unsplit."""
    outputs = {}
    for split in (False, True):
        config, bundle = build_small(sink_frames=3, window_frames=3)
        manager = KVCacheManager(bundle.pipeline.kv_spec(), 1, "cpu")
        runner = runner_for(bundle, manager, stepwise=stepwise, split_first_block=split)
        open_session(runner, "s", seed=4, prompt="a lantern")
        produced = []
        while len(produced) < (4 if split else 3):
            result = runner.execute(StepPlan(work=[SessionWork("s", run=True)]))
            assert not result.failures, result.failures
            produced += result.outputs
        outputs[split] = produced
    whole, split = outputs[False], outputs[True]
    assert [o.frames.shape[0] for o in whole] == [9, 12, 12]
    assert [o.frames.shape[0] for o in split] == [1, 8, 12, 12]
    assert [o.opening_frame for o in split] == [True, False, False, False]
    assert [o.block_index for o in split] == [0, 0, 1, 2]
    assert split[0].audio is None
    np.testing.assert_array_equal(np.concatenate([o.frames for o in split]), np.concatenate([o.frames for o in whole]))
    if whole[0].audio is not None:
        np.testing.assert_array_equal(
            np.concatenate([o.audio for o in split[1:]], axis=1), np.concatenate([o.audio for o in whole], axis=1)
        )


def test_a_blocks_first_piece_is_queued_before_its_commit_pass():
    """The commit pass only adds the block's K/V to the history the next block reads: the first piece's decode
    goes before it (it leaves one forward sooner), the block's other pieces after it, and the frames are the
    stepwise runner's, whose commit comes first."""
    grouped, stepwise = small_runner(max_sessions=1), small_runner(max_sessions=1, stepwise=True)
    open_session(grouped, "s", seed=3)
    open_session(stepwise, "s", seed=3)
    progress = grouped.device_sessions["s"].progress
    pieces = []  # (block the piece belongs to, blocks committed when it was queued)

    def heard(pending) -> None:
        if pending.output is not None:
            pieces.append((pending.output.block_index, progress.block_index))

    for block in range(3):
        dispatch = grouped.dispatch(StepPlan(work=[SessionWork("s", run=True)]), on_pending=heard)
        assert not dispatch.failures
        outputs = [pending.wait()[0] for pending in dispatch.pending]
        frames = np.concatenate([output.frames for output in outputs])
        reference = run_blocks(stepwise, ["s"], 1)["s"][0]
        np.testing.assert_array_equal(frames, reference)
    per_block = grouped.pipeline.frames_per_block
    assert per_block >= 2  # several pieces per block, or there is no order to see
    for block in range(3):
        committed = [done for index, done in pieces if index == block]
        assert committed == [block] + [block + 1] * (per_block - 1)
