"""The FP8 mirror's history straight from the paged pool (engine/models/history_fp8.py) against the gather path
it replaces (the frames copied into the bf16 buffer, the keys rotated, quantize_per_head_into over the buffer):
byte for byte, through the real Triton kernels in the interpreter (a subprocess: ``TRITON_INTERPRET=1`` must
precede Triton's import), and through ``ContextKV.load`` both ways; the kernels' sm_90 cross-compile."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from engine.models import history_fp8
from engine.models.context_kv import HISTORY, ContextKV
from engine.models.kernels import rotate_pairs
from engine.models.rope import FrameRotaryEmbedding

try:
    import triton  # noqa: F401

    from tests.triton_interpreted import interpreter_checks, interpreter_job, patch_interpreter

    BACKGROUND_JOBS = (interpreter_job(__file__),)
except ImportError:  # no Triton: the interpreter checks skip
    BACKGROUND_JOBS = ()

LAYERS, BLOCKS, ROWS, COLS, HEADS, HEAD_DIM = 2, 7, 3, 5, 3, 32  # 15 tokens a frame: a tile straddles frames


def _pool(generator: torch.Generator) -> torch.Tensor:
    pool = torch.randn(LAYERS, 2, BLOCKS, ROWS * COLS, HEADS, HEAD_DIM, generator=generator)
    pool *= torch.linspace(0.5, 3.0, HEADS).view(1, 1, 1, 1, HEADS, 1)  # heads of different magnitudes
    pool[1, 1, :, :, 2] = 0  # an all-zero head: scale 1, zeros
    return pool.bfloat16()


def _workspace(fp8: bool = True) -> ContextKV:
    return ContextKV(num_layers=LAYERS, max_tokens=8 * ROWS * COLS, num_heads=HEADS, head_dim=HEAD_DIM,
                     tokens_per_frame=ROWS * COLS, dtype=torch.bfloat16, device=torch.device("cpu"),
                     fp8_attention=fp8)


def _mirror_bytes(workspace: ContextKV, tokens: int) -> dict:
    mirror = workspace.fp8
    return {"k": mirror.k[:, :tokens].view(torch.uint8).clone(), "v": mirror.v[..., :tokens].view(torch.uint8).clone(),
            "scales": mirror.scales[:, :, HISTORY].clone()}


def _same(a: dict, b: dict) -> dict:
    return {name: bool(torch.equal(a[name], b[name])) for name in a}


# --- run in the interpreter subprocess ------------------------------------------------------------------


def _interpreter_checks() -> dict:
    patch_interpreter()
    history_fp8.DIRECT_LOAD = True  # the default; set here so the checks hold whatever the default becomes
    assert history_fp8.available(torch.zeros(1)), "TRITON_INTERPRET=1 was not seen by triton"
    generator = torch.Generator().manual_seed(0)
    pool = _pool(generator)
    frames = [4, 0, 6, 2]
    tokens = len(frames) * ROWS * COLS
    cos, sin = FrameRotaryEmbedding(HEAD_DIM, ROWS, COLS, 8).for_frames(len(frames) + 1, "cpu")
    results = {}

    # The kernels alone against the gather path's own steps on a copy of the history.
    direct = _workspace()
    history_fp8.load_history(pool, torch.tensor(frames, dtype=torch.int32), tokens, cos, sin, direct.fp8, HISTORY)
    gathered = _workspace()
    history = pool[:, :, frames].flatten(2, 3)
    keys = torch.stack([rotate_pairs(history[layer, 0], cos[:tokens], sin[:tokens]) for layer in range(LAYERS)])
    gathered.fp8.quantize_layers(HISTORY, 0, keys, history[:, 1])
    results["kernels"] = _same(_mirror_bytes(direct, tokens), _mirror_bytes(gathered, tokens))
    results["zero_head_scale"] = float(direct.fp8.scales[1, 1, HISTORY, 0, 2])

    # ContextKV.load both ways: the direct path (the interpreter counts as a device) and the gather path.
    owner = ("session", "cond", tuple(frames), 0)
    loaded = _workspace()
    loaded.load(owner, pool, frames, cos, sin, rotate_pairs)
    available = history_fp8.available
    history_fp8.available = lambda pool: False
    try:
        reference = _workspace()
        reference.load(owner, pool, frames, cos, sin, rotate_pairs)
    finally:
        history_fp8.available = available
    results["load"] = _same(_mirror_bytes(loaded, tokens), _mirror_bytes(reference, tokens))
    results["load_ids"] = list(loaded.history_block_ids)
    results["load_tokens"] = loaded.history_tokens
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict:
    pytest.importorskip("triton")
    return interpreter_checks(__file__)


def test_the_direct_load_writes_the_gather_paths_mirror_byte_for_byte(interpreted):
    assert interpreted["kernels"] == {"k": True, "v": True, "scales": True}, interpreted
    assert interpreted["zero_head_scale"] == 1.0  # an all-zero head keeps scale 1, as quantize_per_head_into


def test_context_load_takes_the_direct_path_with_the_same_mirror(interpreted):
    assert interpreted["load"] == {"k": True, "v": True, "scales": True}, interpreted
    assert interpreted["load_ids"] == [4, 0, 6, 2] and interpreted["load_tokens"] == 4 * ROWS * COLS


def test_the_direct_load_refuses_ids_that_do_not_cover_the_history():
    pytest.importorskip("triton")
    pool = torch.zeros(LAYERS, 2, BLOCKS, ROWS * COLS, HEADS, HEAD_DIM, dtype=torch.bfloat16)
    cos, sin = FrameRotaryEmbedding(HEAD_DIM, ROWS, COLS, 8).for_frames(2, "cpu")
    with pytest.raises(ValueError, match="int32 block ids"):
        history_fp8.load_history(pool, torch.tensor([1], dtype=torch.int32), 2 * ROWS * COLS, cos, sin,
                                 _workspace().fp8, HISTORY)
    with pytest.raises(ValueError, match="int32 block ids"):
        history_fp8.load_history(pool, torch.tensor([1, 2]), 2 * ROWS * COLS, cos, sin, _workspace().fp8, HISTORY)


@pytest.mark.background  # compiles only: the idle core's work
def test_the_kernels_compile_for_sm90_as_launched_with_16_byte_accesses(monkeypatch):
    """Both passes for K (rotated) and V at Wan 1.3B's heads (12 of 128) and frames (1,560 tokens), launched by
    load_history and compiled for Hopper with the launcher's specialisation: no local memory, Hopper's e4m3
    conversion, and the pool's rows loaded and the mirror's rows stored as 16-byte vectors (a [rows, pairs, 2]
    tile, as landed in the thirty-fifth session, loaded one pair an instruction: 16 four-byte loads a thread,
    and the keys stored as 16 two-byte pairs). What loads narrow: a row's block id (one int32 a row a thread)
    and the partial maxima."""
    pytest.importorskip("triton")
    from tests.sm90 import compile_launch_for_sm90, narrow_accesses, record_launches

    passes = record_launches(monkeypatch, history_fp8, "_history_amax"), record_launches(monkeypatch, history_fp8,
                                                                                          "_history_cast")
    layers, blocks, frame, heads, head_dim = 1, 3, 1560, 12, 128
    pool = torch.zeros(layers, 2, blocks, frame, heads, head_dim, dtype=torch.bfloat16)
    workspace = ContextKV(num_layers=layers, max_tokens=3 * frame, num_heads=heads, head_dim=head_dim,
                          tokens_per_frame=frame, dtype=torch.bfloat16, device=torch.device("cpu"), fp8_attention=True)
    cos, sin = FrameRotaryEmbedding(head_dim, 30, 52, 8).for_frames(3, "cpu")
    history_fp8.load_history(pool, torch.tensor([2, 0], dtype=torch.int32), 2 * frame, cos, sin, workspace.fp8,
                             HISTORY)
    for recorder, e4m3 in zip(passes, (False, True)):
        for kv in (0, 1):  # K, then V
            accesses = compile_launch_for_sm90(recorder, kv, e4m3_cast=e4m3)
            assert narrow_accesses(accesses) <= 6, (recorder.fn.__name__, kv, accesses)
            assert (accesses.get("st.global.v4.b32", 0) == 2) == e4m3, (recorder.fn.__name__, kv, accesses)


if __name__ == "__main__" and sys.argv[1:] == ["--interpreter-checks"]:
    print(json.dumps(_interpreter_checks()))
