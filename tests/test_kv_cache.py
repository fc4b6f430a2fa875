"""KV cache contracts: pool accounting, sink + window tables, atomic cross caches, reset and close."""

from __future__ import annotations

import pytest
import torch

from engine.kv_cache import BlockPool, BranchBlockTable, KVCacheManager, KVSpec

pytestmark = pytest.mark.background  # computes only: runs on the idle core (tests/background_pytest.py)


def spec(**overrides) -> KVSpec:
    values = dict(
        num_layers=2, num_kv_heads=2, head_dim=4, tokens_per_frame=3, frames_per_block=3,
        sink_frames=2, window_frames=4, branch_names=("cond",), cross_attention_lengths={"text": 5},
    )
    values.update(overrides)
    return KVSpec(**values)


def test_pool_allocation_is_all_or_nothing_and_double_free_is_refused():
    pool = BlockPool(spec(), 4, "cpu")
    assert pool.allocate(5) is None and pool.num_free_blocks == 4
    ids = pool.allocate(3)
    assert len(set(ids)) == 3 and pool.num_free_blocks == 1
    pool.free(ids[:1])
    with pytest.raises(RuntimeError, match="twice"):
        pool.free(ids[:1])
    assert pool.storage.shape == (2, 2, 4, 3, 2, 4)


def test_block_table_keeps_the_sink_and_a_ring_of_the_latest_frames():
    pool = BlockPool(spec(), 6, "cpu")
    table = BranchBlockTable(pool, sink_frames=2, window_frames=4)
    frame_of_block = {}
    for frame in range(11):
        frame_of_block[table.append_frame()[0]] = frame
    assert [frame_of_block[b] for b in table.history_block_ids()] == [0, 1, 7, 8, 9, 10]
    assert table.num_resident == 6 and pool.num_free_blocks == 0 and table.committed_frames == 11
    table.release()
    assert pool.num_free_blocks == 6 and table.num_resident == 0


def test_failed_cross_populate_leaves_the_previous_cache_visible():
    manager = KVCacheManager(spec(), 1, "cpu")
    state = manager.open_session("s")
    first = [(torch.full((5, 2, 4), float(i)), torch.full((5, 2, 4), -float(i))) for i in range(2)]
    state.populate_cross("cond", "text", first)
    published = state.read_cross("cond", "text").clone()
    free = manager.cross_cache.num_free_slots("text")

    def broken_layers():
        yield torch.ones(5, 2, 4), torch.ones(5, 2, 4)
        raise RuntimeError("projection failed")

    with pytest.raises(RuntimeError, match="projection failed"):
        state.populate_cross("cond", "text", broken_layers())
    assert torch.equal(state.read_cross("cond", "text"), published)
    assert manager.cross_cache.num_free_slots("text") == free
    with pytest.raises(ValueError, match="wrote 1 of 2"):
        state.populate_cross("cond", "text", iter(first[:1]))
    assert torch.equal(state.read_cross("cond", "text"), published)


def test_cross_cache_read_before_populate_is_an_error():
    state = KVCacheManager(spec(), 1, "cpu").open_session("s")
    with pytest.raises(RuntimeError, match="before it was populated"):
        state.read_cross("cond", "text")
    with pytest.raises(KeyError, match="unknown KV branch"):
        state.history("uncond")


def test_manager_full_is_none_and_close_and_reset_release_everything():
    manager = KVCacheManager(spec(branch_names=("cond", "uncond")), 2, "cpu")
    blocks, slots = manager.block_pool.num_free_blocks, manager.cross_cache.num_free_slots("text")
    a, b = manager.open_session("a"), manager.open_session("b")
    assert manager.open_session("c") is None
    layers = [(torch.zeros(5, 2, 4), torch.zeros(5, 2, 4))] * 2
    for branch in ("cond", "uncond"):
        a.populate_cross(branch, "text", layers)
        a.staging(branch).normal_()
        a.commit(branch, 3)
    assert a.nbytes() == 2 * (3 * manager.spec.block_bytes + manager.spec.cross_cache_bytes("text"))
    a.reset(keep_cross_attention=["text"])
    assert a.is_cross_populated("cond", "text") and a.num_resident_blocks("cond") == 0
    a.close()
    a.close()  # idempotent
    b.close()
    with pytest.raises(RuntimeError, match="closed"):
        a.history("cond")
    assert manager.block_pool.num_free_blocks == blocks
    assert manager.cross_cache.num_free_slots("text") == slots
    assert manager.open_session("c") is not None


def test_commit_copies_staged_frames_into_blocks():
    manager = KVCacheManager(spec(), 1, "cpu")
    state = manager.open_session("s")
    staged = state.staging("cond")
    staged.copy_(torch.arange(staged.numel(), dtype=staged.dtype).view_as(staged))
    state.commit("cond", 3)
    ids = state.resident_block_ids("cond")
    for frame, block_id in enumerate(ids):
        expected = staged[:, :, frame * 3 : (frame + 1) * 3]
        assert torch.equal(manager.block_pool.storage[:, :, block_id], expected)
    with pytest.raises(ValueError):
        state.commit("cond", 4)
