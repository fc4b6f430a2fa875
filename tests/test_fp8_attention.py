"""FP8 attention (engine/models/fp8_attention.py) on CPU: the real Triton kernel through the Triton interpreter.

``TRITON_INTERPRET=1`` has to be set before Triton is imported, so the kernel runs in one subprocess (this file
run as a script) that reports its measurements as JSON; the tests here assert on them. Quantization, argument
checks and the import without Triton run in this process. Besides the single-scale kernel: the two-segment
kernel (history | current keys, each with its own scales: boundary inside a block, on a block edge, in the last
block, in the only block, no history, all history; against the emulation in the kernel's block order and float32
attention of the segments dequantized), and the Triton quantizer (``quantize_per_head_into``: its bits and scales
against ``quantize_per_head``'s, into slices of bigger buffers whose other bytes must stay untouched).

The subprocess patches two defects of Triton 3.6's interpreter (not of the GPU compiler):

* its float32 / float16 -> fp8 / bf16 casts drop the carry when rounding up crosses a power of two (0.121
  becomes 0.0625 in e4m3), so they are replaced by torch's round-to-nearest-even casts, which is what the sm_90
  kernel's ``cvt.rn.satfinite.e4m3x2.f32`` computes for the |P| <= 256 it casts (and
  ``cvt.rn.bf16`` for out);
* ``range()`` over a runtime bound calls ``int()`` on a 1-element array, which NumPy >= 2.4 refuses.

Error bounds, for i.i.d. Gaussian inputs (the worst case for relative error: the attention-weighted mean of
random v nearly cancels, so the output is as small as the rounding noise is relative to v). e4m3 keeps 3
mantissa bits: a rounded value's relative error is uniform within half an ulp, RMS ≈ 2^-3/√12 / 1.4 ≈ 2.6%.

* vs the kernel's own algorithm emulated in torch (same key blocks, same P scaling and e4m3 rounding): only
  float32 summation order differs, measured ~1e-7; 1e-3 leaves room for a few P values that round the other
  way and still catches any masking / scaling / indexing slip (those cost percents).
* vs exact float32 attention of the dequantized q, k, v: the one extra rounding is P's, ~2.6% per element
  (less on the row max, which is a power of two): measured 2.1%, bound 3.5%.
* vs exact attention of the original bf16 inputs: q and k's roundings perturb each logit by ≈ √2 · 2.6% of
  it (≈ 3.7% of a unit logit), v's and P's add 2.6% and 2.1%: ≈ 5% in all, measured 5.3%, bound 7%.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

import torch

from engine.models import fp8_attention as fa

from tests import background  # noqa: E402
from tests.background import Job  # noqa: E402
from tests.triton_interpreted import ROOT, interpreter_checks, interpreter_job, patch_interpreter  # noqa: E402


# --- run in the interpreter subprocess ------------------------------------------------------------------


def _float32_attention(q, k, v):
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    return torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1).matmul(v).transpose(1, 2)


def _kernel_block_order(num_keys: int, history_tokens: int, block_n: int) -> list[slice]:
    """The key ranges in the order the kernel visits them (it matters: P is rounded relative to the running max).

    The full blocks of the history, then of the current segment; then, masked, the block holding the segment
    boundary (its history keys, then its current keys) and the last partial block.
    """
    h_full = history_tokens // block_n * block_n
    c_start = -(-history_tokens // block_n) * block_n
    full = num_keys // block_n * block_n
    order = [slice(n, n + block_n) for n in [*range(0, h_full, block_n), *range(c_start, full, block_n)]]
    if history_tokens % block_n:
        order.append(slice(h_full, history_tokens))
        if history_tokens < num_keys:
            order.append(slice(history_tokens, min(c_start, num_keys)))
    if num_keys % block_n and full >= c_start:
        order.append(slice(full, num_keys))
    visited = [key for block in order for key in range(num_keys)[block]]
    assert sorted(visited) == list(range(num_keys)), (num_keys, history_tokens, block_n)  # each key exactly once
    return order


def _emulate_kernel(q8, q_scale, k8, k_scale, v8, v_scale, config, history_tokens=0):
    """The kernel's online softmax in torch float32: same key blocks, same P scaling and e4m3 rounding of P.

    ``k_scale`` / ``v_scale``: one ``[B, H]`` tensor, or a (history, current) pair for the keys before and from
    ``history_tokens`` (per key: the score times its k scale, P times ``v_scale(key) / max`` before its cast).
    """
    q, k, v = (x.float().transpose(1, 2) for x in (q8, k8, v8))
    num_keys = k.shape[2]
    history = (torch.arange(num_keys) < history_tokens)[None, None, None, :]
    k_h, k_c = k_scale if isinstance(k_scale, tuple) else (k_scale, k_scale)
    v_h, v_c = v_scale if isinstance(v_scale, tuple) else (v_scale, v_scale)
    v_max = v_c if history_tokens == 0 else v_h if history_tokens == num_keys else torch.maximum(v_h, v_c)
    column = lambda h, c: torch.where(history, h[:, :, None, None], c[:, :, None, None])  # noqa: E731
    c = q_scale[:, :, None, None] * column(k_h, k_c) / math.sqrt(q.shape[-1]) * fa.LOG2E  # [B, H, 1, Sk]
    v_factor = column(v_h, v_c) / v_max[:, :, None, None]
    m = torch.full((*q.shape[:3], 1), -math.inf)
    l = torch.zeros_like(m)
    acc = torch.zeros_like(q)
    for block in _kernel_block_order(num_keys, history_tokens, config.block_n):
        qk = q @ k[:, :, block].transpose(-1, -2)
        s = qk * c[..., block]
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        alpha = torch.exp2(m - m_new)
        p = torch.exp2(s - (m_new - config.p_shift))
        l = l * alpha + p.sum(-1, keepdim=True)
        p_v = p * v_factor[..., block]
        acc = acc * alpha + p_v.to(torch.float8_e4m3fn).float() @ v[:, :, block]
        m = m_new
    return (acc * v_max[:, :, None, None] / l).transpose(1, 2)


def _rel(out, ref) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def _case(batch, sq, sk, heads, head_dim, config, *, seed, q_gain=1.0, natural_v=False) -> dict:
    generator = torch.Generator().manual_seed(seed)
    q = (q_gain * torch.randn(batch, sq, heads, head_dim, generator=generator)).bfloat16()
    # K/V as the engine holds them: a prefix of a longer [2, S_max, H, D] buffer, strided over S.
    buffer = torch.randn(batch, 2, sk + 37, heads, head_dim, generator=generator).bfloat16()
    k, v = buffer[:, 0, :sk], buffer[:, 1, :sk]
    q8, qs = fa.quantize_per_head(q)
    k8, ks = fa.quantize_per_head(k)
    v8, vs = fa.quantize_per_head(v, transpose=not natural_v)
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)  # poisoned: every element must be written
    returned = fa.fp8_attention_quantized(q8, qs, k8, ks, v8, vs, out=out, config=config)
    emulated = _emulate_kernel(q8, qs, k8, ks, v8, vs, config)
    dequantized = [fa.dequantize_per_head(x, s) for x, s in ((q8, qs), (k8, ks), (v8, vs))]
    # out is bf16: compare the emulation rounded the same way.
    return {
        "nan_count": int(out.isnan().sum()),
        "returned_out": returned is out,
        "v_key_stride": v8.stride(1),
        "rel_vs_emulation": _rel(out, emulated.bfloat16()),
        "rel_vs_dequantized": _rel(out, _float32_attention(*dequantized)),
        "rel_vs_original": _rel(out, _float32_attention(q, k, v)),
        "out": out.float().flatten().tolist() if natural_v or sq * heads * head_dim <= 20000 else None,
    }


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype == fa.FP8_DTYPE else x


def _segment_case(batch, sq, sk, sh, heads, head_dim, config, *, seed, k_gain=3.0, v_gain=10.0,
                  programs_per_wave=None) -> dict:
    """Keys [0, sh) and [sh, sk) quantized separately (history K x k_gain, V x v_gain the current's), into one
    K tensor and one transposed V storage as the engine's mirror holds them; the unused segment's scales NaN.
    ``programs_per_wave``: launch with that wave size and ``config.tail_split`` (the CPU has no SMs to count),
    and compare with the unsplit launch."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, sq, heads, head_dim, generator=generator).bfloat16()
    buffer = torch.randn(batch, 2, sk + 37, heads, head_dim, generator=generator)
    buffer[:, 0, :sh] *= k_gain
    buffer[:, 1, :sh] *= v_gain
    buffer = buffer.bfloat16()
    k, v = buffer[:, 0, :sk], buffer[:, 1, :sk]
    q8, qs = fa.quantize_per_head(q)
    k8 = torch.zeros(k.shape, dtype=fa.FP8_DTYPE)
    storage = torch.zeros(batch, heads, head_dim, -(-sk // 16) * 16, dtype=fa.FP8_DTYPE)
    v8 = storage[..., :sk].permute(0, 3, 1, 2)
    k_scales, v_scales = [], []
    for lo, hi in ((0, sh), (sh, sk)):
        nan = torch.full((batch, heads), math.nan)
        if hi == lo:  # an empty segment: its scales must never be read
            k_scales.append(nan)
            v_scales.append(nan)
            continue
        k_part, k_scale = fa.quantize_per_head(k[:, lo:hi])
        v_part, v_scale = fa.quantize_per_head(v[:, lo:hi])
        _bits(k8[:, lo:hi]).copy_(_bits(k_part))
        _bits(v8[:, lo:hi]).copy_(_bits(v_part))
        k_scales.append(k_scale)
        v_scales.append(v_scale)
    k_scales, v_scales = tuple(k_scales), tuple(v_scales)
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16)  # poisoned: every element must be written
    if programs_per_wave is None:
        fa.fp8_attention_segments(q8, qs, k8, k_scales, v8, v_scales, sh, out=out, config=config)
    else:
        fa._launch(q8, qs, k8, k_scales, v8, v_scales, out, config, sh, programs_per_wave=programs_per_wave)
    emulated = _emulate_kernel(q8, qs, k8, k_scales, v8, v_scales, config, sh)
    history = (torch.arange(sk) < sh)[None, :, None, None]
    per_key = lambda pair: torch.where(history, pair[0][:, None, :, None], pair[1][:, None, :, None])  # noqa: E731
    dequantized = (fa.dequantize_per_head(q8, qs), k8.float() * per_key(k_scales), v8.float() * per_key(v_scales))
    result = {
        "nan_count": int(out.isnan().sum()),
        "rel_vs_emulation": _rel(out, emulated.bfloat16()),
        "rel_vs_dequantized": _rel(out, _float32_attention(*dequantized)),
        "rel_vs_original": _rel(out, _float32_attention(q, k, v)),
        "out": out.float().flatten().tolist(),
    }
    if programs_per_wave is not None:
        whole = fa.fp8_attention_segments(q8, qs, k8, k_scales, v8, v_scales, sh,
                                          config=dataclasses.replace(config, tail_split=False))
        result["rel_vs_unsplit"] = _rel(out, whole)
        result["rel_unsplit_vs_dequantized"] = _rel(whole, _float32_attention(*dequantized))
    if sh in (0, sk):  # one segment: the single-scale entry point on the same inputs
        segment = 1 if sh == 0 else 0
        single = fa.fp8_attention_quantized(q8, qs, k8, k_scales[segment], v8, v_scales[segment], config=config)
        result["equals_single_scale"] = torch.equal(out, single)
    return result


def _quantizer_case(batch, seq, heads, head_dim, *, seed, transpose, offset=50, unaligned_storage=False) -> dict:
    """quantize_per_head_into a slice of a bigger, sentinel-filled buffer vs quantize_per_head's result.

    ``offset``: the slice's first row (key) in the buffer; with the keys contiguous (``transpose``) an offset
    not a multiple of 16 starts the slice off a 16-byte boundary (the quantizer then shifts its rows).
    ``unaligned_storage``: the transposed buffer's own storage starts 3 bytes past a 16-byte boundary."""
    generator = torch.Generator().manual_seed(seed)
    source = torch.randn(batch, 2, seq + 23, heads, head_dim, generator=generator)
    source *= torch.logspace(-2, 1.5, heads)[None, None, None, :, None]  # heads of very different magnitude
    source[:, :, :, 0] = 0  # one all-zero head: scale 1, zeros
    x = source.bfloat16()[:, 0, :seq]  # strided over S, as the engine's K/V
    expected, expected_scale = fa.quantize_per_head(x, transpose=transpose)
    sentinel = torch.tensor(3.0).to(fa.FP8_DTYPE).view(torch.uint8)
    rows = offset + seq + 41
    if transpose:  # [B, H, D, S_pad] storage, keys contiguous; the view [B, S, H, D]
        shape = (batch, heads, head_dim, -(-rows // 16) * 16)
        if unaligned_storage:
            buffer = bytearray(math.prod(shape) + 16)
            shift = (3 - torch.frombuffer(buffer, dtype=torch.uint8).data_ptr()) % 16
            storage = torch.frombuffer(buffer, dtype=torch.uint8, offset=shift, count=math.prod(shape)).view(shape)
            assert storage.data_ptr() % 16 == 3 and storage.storage_offset() == 0
            storage.fill_(int(sentinel))
        else:
            storage = torch.full(shape, int(sentinel), dtype=torch.uint8)
        storage = storage.view(fa.FP8_DTYPE)
        dst = storage[..., offset:offset + seq].permute(0, 3, 1, 2)
    else:
        storage = torch.full((batch, rows, heads, head_dim), int(sentinel), dtype=torch.uint8).view(fa.FP8_DTYPE)
        dst = storage[:, offset:offset + seq]
    scales = torch.full((3, batch, heads), -7.0)
    fa.quantize_per_head_into(x, dst, scales[1])
    if transpose:
        outside = torch.cat([_bits(storage[..., :offset]).flatten(), _bits(storage[..., offset + seq:]).flatten()])
    else:
        outside = torch.cat([_bits(storage[:, :offset]).flatten(), _bits(storage[:, offset + seq:]).flatten()])
    return {
        "key_stride": dst.stride(1),
        "values_equal": torch.equal(_bits(dst.contiguous()), _bits(expected.contiguous())),
        "scales_equal": torch.equal(scales[1], expected_scale),
        "zero_head": bool((expected_scale[:, 0] == 1).all() and (dst[:, :, 0].float() == 0).all()),
        "outside_untouched": bool((outside == sentinel).all()),
        "other_scales_untouched": bool((scales[0] == -7).all() and (scales[2] == -7).all()),
    }


def _reciprocal_rounding_case() -> dict:
    """amax 3.75, x 0.3515625: x * (448 / 3.75) is 42.0 (a tie: e4m3 40) with one IEEE division, 42.0000038
    (e4m3 44) with quantize_per_head's reciprocal * 448; the quantizer must round as the latter."""
    x = torch.zeros(1, 70, 2, 32)
    x[0, 0, :, 0] = 3.75
    x[0, 1:, :, :] = 0.3515625 * torch.tensor([1.0, -1.0]).repeat(16)
    x = x.bfloat16()
    results = {}
    for transpose in (False, True):
        expected, expected_scale = fa.quantize_per_head(x, transpose=transpose)
        dst, scale = torch.empty_like(expected), torch.empty(1, 2)
        fa.quantize_per_head_into(x, dst, scale)
        results["transposed" if transpose else "natural"] = bool(
            torch.equal(dst.float(), expected.float()) and torch.equal(scale, expected_scale))
    results["expected_value"] = float(fa.quantize_per_head(x)[0][0, 1, 0, 0].float())
    return results


def _interpreter_checks() -> dict:
    patch_interpreter()
    assert fa._interpreted(), "TRITON_INTERPRET=1 was not seen by triton"
    C = fa.Fp8AttentionConfig
    tails = C(64, 32, 4, 2)
    results = {
        # Query tail (100 = 64 + 36) and key tail (300 = 9 * 32 + 12), batch 2, strided K/V.
        "tails": _case(2, 100, 300, 2, 32, tails, seed=1),
        "tails_natural_v": _case(2, 100, 300, 2, 32, tails, seed=1, natural_v=True),
        "keys_fewer_than_a_block": _case(1, 20, 20, 2, 32, tails, seed=2),
        "no_key_tail": _case(1, 64, 256, 2, 64, C(64, 64, 4, 2), seed=3),
        "head_dim_128_default_config": _case(1, 40, 200, 1, 128, fa.default_config(128), seed=4),
    }
    for shift in (0, 8):  # peaked softmax: many P far below the row max, where e4m3 runs out of exponent
        config = C(64, 64, 4, 2, p_shift=shift)
        results[f"peaked_p_shift_{shift}"] = _case(1, 64, 512, 2, 64, config, seed=5, q_gain=4.0)

    # Two segments (history | current), history V 10x, K 3x the current's unless said otherwise.
    results.update({
        "segments_boundary_inside_a_block": _segment_case(2, 100, 300, 107, 2, 32, tails, seed=11),
        "segments_current_v_larger": _segment_case(1, 64, 300, 107, 2, 32, tails, seed=12, k_gain=0.5, v_gain=0.1),
        "segments_boundary_on_a_block_edge": _segment_case(1, 70, 300, 128, 2, 64, C(64, 64, 4, 2), seed=13),
        "segments_boundary_in_the_last_block": _segment_case(1, 40, 300, 290, 2, 32, tails, seed=14),
        "segments_fewer_keys_than_a_block": _segment_case(1, 20, 20, 7, 2, 32, tails, seed=15),
        "segments_d128_long_context_config": _segment_case(1, 40, 300, 130, 1, 128, fa.default_config(128), seed=16),
        "segments_d128_short_context_config": _segment_case(1, 40, 300, 130, 1, 128, fa.default_config(128, 300),
                                                            seed=17),
        "segments_no_history": _segment_case(2, 100, 300, 0, 2, 32, tails, seed=18),
        "segments_all_history": _segment_case(2, 100, 300, 300, 2, 32, tails, seed=19),
    })
    # The last wave's query blocks split over their key blocks (config.tail_split): 8 query blocks on a wave of 6
    # leave 2, each split in 3 parts. The boundary inside a block (the last part's masked passes); then so few
    # unmasked key blocks (1) that two of the three parts meet no key at all.
    split = dataclasses.replace(tails, tail_split=True)
    results.update({
        "split_tail_boundary_inside_a_block": _segment_case(2, 100, 300, 107, 2, 32, split, seed=31,
                                                            programs_per_wave=6),
        "split_tail_parts_without_keys": _segment_case(2, 100, 70, 40, 2, 32, split, seed=32, programs_per_wave=6),
        "split_tail_d128_long_context_config": _segment_case(
            1, 200, 1000, 640, 2, 128, dataclasses.replace(fa.default_config(128), tail_split=True), seed=33,
            programs_per_wave=6),
    })
    results.update({
        "quantize_into_k_rows": _quantizer_case(1, 300, 4, 32, seed=21, transpose=False),
        "quantize_into_transposed_v": _quantizer_case(1, 300, 4, 64, seed=22, transpose=True),
        "quantize_into_reciprocal_rounding": _reciprocal_rounding_case(),
        # > 64 * 128 rows: several 64-row tiles per program (the long-context path), batch 2
        "quantize_into_many_parts": _quantizer_case(2, 8300, 2, 32, seed=23, transpose=True, offset=16),
        # The engine's current block (4,680 keys, not a multiple of 16) at 1,560 keys of history: V's slice starts
        # 8 bytes off a 16-byte boundary; K's rows are 16-byte aligned anyway.
        "quantize_into_transposed_v_4680_at_1560": _quantizer_case(1, 4680, 2, 32, seed=24, transpose=True,
                                                                   offset=1560),
        "quantize_into_k_rows_4680_at_1560": _quantizer_case(1, 4680, 2, 32, seed=25, transpose=False, offset=1560),
        # The shifted rows cross a part boundary (8,190 + 8 > 64 * 128: pass 2 has a part more than pass 1).
        "quantize_into_many_parts_shifted": _quantizer_case(1, 8190, 2, 32, seed=26, transpose=True, offset=1560),
        # Rows inside one tile (its first and last masked in one), exactly one full tile (nothing masked).
        "quantize_into_rows_inside_a_tile": _quantizer_case(1, 5, 2, 32, seed=27, transpose=True, offset=7),
        "quantize_into_one_full_tile": _quantizer_case(1, 64, 2, 32, seed=28, transpose=True, offset=64),
        # A storage that is itself off a 16-byte boundary: no shift possible, still the same bits.
        "quantize_into_unaligned_storage": _quantizer_case(1, 300, 2, 32, seed=29, transpose=True, offset=5,
                                                           unaligned_storage=True),
    })

    generator = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, s, 2, 64, generator=generator).bfloat16() for s in (50, 130, 130))
    out = fa.fp8_attention(q, k, v)
    results["end_to_end"] = {
        "dtype": str(out.dtype), "shape": list(out.shape), "nan_count": int(out.isnan().sum()),
        "rel_vs_original": _rel(out, _float32_attention(q, k, v)),
    }
    return results


# --- the tests --------------------------------------------------------------------------------------------


# The sm_90 cross-compile sweep (an empty Triton cache of its own) and the interpreter checks: one core's work
# each, started with the session and waited for here (tests/background.py).
SM90_SWEEP = Job((sys.executable, "bench/fp8_attention_gpu.py", "--compile-only"),
                 env=(("PYTHONPATH", str(ROOT)), ("TRITON_CACHE_DIR", "{scratch}")), unset=("TRITON_INTERPRET",))
BACKGROUND_JOBS = (SM90_SWEEP, interpreter_job(__file__))


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return interpreter_checks(__file__)


TAIL_CASES = ("tails", "keys_fewer_than_a_block", "no_key_tail", "head_dim_128_default_config")


@pytest.mark.parametrize("name", TAIL_CASES)
def test_kernel_writes_every_element_and_matches_its_emulation(interpreted, name):
    case = interpreted[name]
    assert case["nan_count"] == 0 and case["returned_out"]
    assert case["rel_vs_emulation"] < 1e-3, case


@pytest.mark.parametrize("name", TAIL_CASES)
def test_kernel_vs_float32_attention_of_the_dequantized_inputs(interpreted, name):
    assert interpreted[name]["rel_vs_dequantized"] < 0.035, interpreted[name]


@pytest.mark.parametrize("name", TAIL_CASES)
def test_kernel_vs_attention_of_the_original_inputs(interpreted, name):
    assert interpreted[name]["rel_vs_original"] < 0.07, interpreted[name]


def test_transposed_v_is_key_contiguous_and_computes_the_same(interpreted):
    assert interpreted["tails"]["v_key_stride"] == 1
    assert interpreted["tails_natural_v"]["v_key_stride"] != 1
    assert interpreted["tails_natural_v"]["out"] == interpreted["tails"]["out"]


def test_p_scaling_helps_a_peaked_softmax(interpreted):
    unscaled, scaled = interpreted["peaked_p_shift_0"], interpreted["peaked_p_shift_8"]
    assert scaled["nan_count"] == 0 and scaled["rel_vs_emulation"] < 1e-3
    assert scaled["rel_vs_dequantized"] < unscaled["rel_vs_dequantized"]


SEGMENT_CASES = (
    "segments_boundary_inside_a_block", "segments_current_v_larger", "segments_boundary_on_a_block_edge",
    "segments_boundary_in_the_last_block", "segments_fewer_keys_than_a_block", "segments_d128_long_context_config",
    "segments_d128_short_context_config", "segments_no_history", "segments_all_history",
)


@pytest.mark.parametrize("name", SEGMENT_CASES)
def test_two_segment_kernel_matches_attention_of_the_dequantized_segments(interpreted, name):
    """Each key dequantized with its own segment's scales: the kernel's emulation to float32 summation order
    (1e-3, as the single-scale cases), float32 attention of the dequantized segments to P's rounding (3.5 %).
    The v factor (<= 1) moves the smaller segment's P down by up to 10x here, still far above e4m3's subnormals
    for the P that matter. (No bound vs the original inputs: history keys 3x larger make logits 3x larger, and
    q and k's roundings with them, so the 7 % of unit-variance inputs does not apply; recorded, ~8 %.)"""
    case = interpreted[name]
    assert case["nan_count"] == 0, case
    assert case["rel_vs_emulation"] < 1e-3, case
    assert case["rel_vs_dequantized"] < 0.035, case


SPLIT_CASES = ("split_tail_boundary_inside_a_block", "split_tail_parts_without_keys",
               "split_tail_d128_long_context_config")


def test_tail_split_fills_the_last_wave():
    # The engine's shapes: 74 query blocks of 64 x 12 heads = 888 programs, two an SM on 132 SMs: 3 whole waves,
    # the 96 left split in two.
    assert fa.tail_split(888, 256, 264) == (792, 2)
    assert fa.tail_split(792, 256, 264) == (792, 1)  # whole waves: nothing to split
    assert fa.tail_split(200, 10, 132) == (200, 1)  # 68 left: more than half a wave, splitting gains nothing
    assert fa.tail_split(4, 3, 132) == (0, 3)  # never more parts than key blocks
    assert fa.tail_split(4, 100, 132) == (0, 4)  # nor than max_parts
    assert fa.tail_split(4, 1, 132) == (4, 1)


@pytest.mark.parametrize("name", SPLIT_CASES)
def test_split_query_blocks_merge_as_close_to_attention_as_whole_ones(interpreted, name):
    """Each part casts P to e4m3 against its own running max, so a merged block is not the whole one's bits: it is
    as close to float32 attention of the dequantized segments (3.5 %, and within 10 % of the whole block's error)
    and within P's rounding (3 %) of the whole block; every element written, parts without keys included."""
    case = interpreted[name]
    assert case["nan_count"] == 0, case
    assert case["rel_vs_dequantized"] < 0.035, case
    assert case["rel_vs_dequantized"] < case["rel_unsplit_vs_dequantized"] * 1.1 + 1e-3, case
    assert case["rel_vs_unsplit"] < 0.03, case


@pytest.mark.parametrize("name", ["segments_no_history", "segments_all_history"])
def test_one_segment_is_the_single_scale_kernel_and_never_reads_the_other_scales(interpreted, name):
    assert interpreted[name]["equals_single_scale"] is True  # bit for bit, with the unused scales NaN


QUANTIZER_CASES = (
    "quantize_into_k_rows", "quantize_into_transposed_v", "quantize_into_many_parts",
    "quantize_into_transposed_v_4680_at_1560", "quantize_into_k_rows_4680_at_1560", "quantize_into_many_parts_shifted",
    "quantize_into_rows_inside_a_tile", "quantize_into_one_full_tile", "quantize_into_unaligned_storage",
)


@pytest.mark.parametrize("name", QUANTIZER_CASES)
def test_fast_quantizer_writes_quantize_per_head_bits_into_its_slice_only(interpreted, name):
    case = interpreted[name]
    assert case["values_equal"] and case["scales_equal"] and case["zero_head"], case
    assert case["outside_untouched"] and case["other_scales_untouched"], case
    assert (case["key_stride"] == 1) == ("k_rows" not in name)


def test_fast_quantizer_passes_a_16_byte_aligned_destination():
    """The transposed V's slice at 1,560 keys (8 bytes off) goes to the cast as the aligned address 8 keys below,
    its rows shifted by 8 (the cross-compile test shows what that buys: 16-byte stores); K rows are not shifted."""
    storage = torch.zeros(1, 2, 32, 6256, dtype=fa.FP8_DTYPE)
    assert storage.data_ptr() % 16 == 0
    for start, lead in ((1560, 8), (3120, 0), (5, 5)):
        dst = storage[..., start:start + 4680 if start != 5 else start + 300].permute(0, 3, 1, 2)
        base, shift = fa._aligned_rows(dst)
        assert shift == lead and base.data_ptr() % 16 == 0 and base.data_ptr() == dst.data_ptr() - lead
        assert base.stride() == dst.stride() and base.shape == dst.shape
    rows = torch.zeros(1, 6240, 2, 32, dtype=fa.FP8_DTYPE)[:, 1560:]  # K rows: 64-byte rows, nothing to shift
    base, lead = fa._aligned_rows(rows)
    assert base is rows and lead == 0


def test_fast_quantizer_rounds_as_quantize_per_head_does(interpreted):
    case = interpreted["quantize_into_reciprocal_rounding"]
    assert case["expected_value"] == 44.0  # the case really sits where one division would round the other way
    assert case["natural"] and case["transposed"], case


def test_segments_argument_errors():
    q8, qs = fa.quantize_per_head(torch.randn(1, 8, 2, 32).bfloat16())
    k8, ks = fa.quantize_per_head(torch.randn(1, 12, 2, 32).bfloat16())
    with pytest.raises(ValueError, match="history_tokens"):
        fa.fp8_attention_segments(q8, qs, k8, (ks, ks), k8, (ks, ks), 13)
    with pytest.raises(ValueError, match="history_tokens"):
        fa.fp8_attention_segments(q8, qs, k8, (ks, ks), k8, (ks, ks), -1)
    with pytest.raises(ValueError, match="pair"):
        fa.fp8_attention_segments(q8, qs, k8, ks, k8, (ks, ks), 4)
    with pytest.raises(ValueError, match="k_scale"):
        fa.fp8_attention_segments(q8, qs, k8, (ks, ks[:, :1]), k8, (ks, ks), 4)
    x = torch.randn(1, 12, 2, 32).bfloat16()
    with pytest.raises(ValueError, match="dst"):
        fa.quantize_per_head_into(x, torch.empty(1, 11, 2, 32, dtype=fa.FP8_DTYPE), torch.empty(1, 2))
    with pytest.raises(ValueError, match="dst"):
        fa.quantize_per_head_into(x, torch.empty(1, 12, 2, 32), torch.empty(1, 2))
    with pytest.raises(ValueError, match="scale"):
        fa.quantize_per_head_into(x, torch.empty(1, 12, 2, 32, dtype=fa.FP8_DTYPE), torch.empty(2))


def test_default_config_picks_by_key_count():
    # Both split the last wave's query blocks (measured faster on an H100 through the service: docs/FP8.md).
    long = fa.Fp8AttentionConfig(64, 128, 4, 3, tail_split=True)
    short = fa.Fp8AttentionConfig(128, 64, 4, 4, tail_split=True)
    assert fa.default_config(128, 32760) == fa.default_config(128, 18720) == fa.default_config(128) == long
    assert fa.default_config(128, 14040) == fa.default_config(128, 4680) == short


def test_fp8_attention_end_to_end(interpreted):
    result = interpreted["end_to_end"]
    assert result["dtype"] == "torch.bfloat16" and result["shape"] == [1, 50, 2, 64]
    assert result["nan_count"] == 0 and result["rel_vs_original"] < 0.07


def test_quantize_per_head_roundtrip_and_scale():
    x = torch.randn(2, 50, 3, 32).bfloat16() * torch.tensor([0.01, 1.0, 30.0]).view(1, 1, 3, 1)
    x8, scale = fa.quantize_per_head(x)
    assert x8.dtype == torch.float8_e4m3fn and x8.shape == x.shape
    assert scale.shape == (2, 3) and scale.dtype == torch.float32
    amax = x.float().abs().amax(dim=(1, 3))
    torch.testing.assert_close(scale, amax / 448)
    assert torch.equal(x8.float().abs().amax(dim=(1, 3)), torch.full((2, 3), 448.0))  # amax maps to 448
    error = (fa.dequantize_per_head(x8, scale) - x.float()).abs()
    # Round to nearest: half an ulp, 2^-4 of |x| for normals; the subnormal step is 2^-9 * scale.
    bound = torch.maximum(x.float().abs() * 2**-4, scale[:, None, :, None] * 2**-10) * (1 + 1e-6)
    assert (error <= bound).all()
    assert _rel(fa.dequantize_per_head(x8, scale), x) < 0.035


def test_quantize_transposed_strided_input():
    buffer = torch.randn(2, 90, 2, 64).bfloat16()
    x = buffer[0, :70].unsqueeze(0)  # the engine's K/V: a strided prefix of a longer buffer
    plain, scale = fa.quantize_per_head(x.contiguous())
    transposed, scale_t = fa.quantize_per_head(x, transpose=True)
    assert transposed.shape == x.shape and transposed.stride(1) == 1
    assert transposed.stride(3) % 16 == 0  # each head_dim row of the buffer starts 16-byte aligned
    assert torch.equal(scale, scale_t) and torch.equal(transposed.float(), plain.float())


def test_quantize_zero_input_is_finite():
    x = torch.randn(1, 20, 2, 32).bfloat16()
    x[:, :, 1] = 0  # one all-zero head
    x8, scale = fa.quantize_per_head(x, transpose=True)
    assert torch.isfinite(scale).all() and scale[0, 1] == 1.0
    assert torch.isfinite(x8.float()).all() and (x8[:, :, 1].float() == 0).all()
    zeros8, zero_scale = fa.quantize_per_head(torch.zeros(1, 8, 2, 32))
    assert (zeros8.float() == 0).all() and (zero_scale == 1).all()


def test_bad_head_dims_raise():
    for head_dim in (48, 256):
        x = torch.randn(1, 8, 2, head_dim).bfloat16()
        with pytest.raises(ValueError, match="head_dim"):
            fa.quantize_per_head(x)
        with pytest.raises(ValueError, match="head_dim"):
            fa.fp8_attention(x, x, x)
    with pytest.raises(ValueError, match="head_dim"):
        fa.default_config(96)


def test_shape_and_argument_mismatches_raise():
    q, k = torch.randn(1, 8, 2, 32).bfloat16(), torch.randn(1, 12, 2, 32).bfloat16()
    with pytest.raises(ValueError, match="shape mismatch"):
        fa.fp8_attention(q, k, k[:, :10])
    with pytest.raises(ValueError, match="shape mismatch"):
        fa.fp8_attention(q, torch.randn(1, 12, 3, 32).bfloat16(), torch.randn(1, 12, 3, 32).bfloat16())
    with pytest.raises(ValueError, match=r"\[batch, seq, heads, head_dim\]"):
        fa.fp8_attention(q[0], k[0], k[0])
    q8, qs = fa.quantize_per_head(q)
    k8, ks = fa.quantize_per_head(k)
    v8, vs = fa.quantize_per_head(k, transpose=True)
    with pytest.raises(ValueError, match="float8"):
        fa.fp8_attention_quantized(q, qs, k8, ks, v8, vs)
    with pytest.raises(ValueError, match="k_scale"):
        fa.fp8_attention_quantized(q8, qs, k8, ks[:, :1], v8, vs)
    with pytest.raises(ValueError, match="shape mismatch"):
        fa.fp8_attention_quantized(q8, qs, k8[:, :5], ks, v8, vs)
    with pytest.raises(ValueError, match="block_n"):
        fa.Fp8AttentionConfig(64, 16, 4, 2)


def test_cpu_without_the_interpreter_raises_a_clear_error():
    if fa._interpreted():
        pytest.skip("this session runs Triton interpreted")
    q = torch.randn(1, 8, 2, 32).bfloat16()
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        fa.fp8_attention(q, q, q)


def test_the_sweep_compiles_for_sm90_with_wgmma():
    """No GPU needed: Triton cross-compiles for sm_90 (its wheel ships ptxas), so the GPU path is checked here."""
    sweep = background.result(SM90_SWEEP, timeout_s=300)
    assert sweep.returncode == 0, sweep.stderr[-3000:]
    rows = [json.loads(line) for line in sweep.stdout.splitlines()]
    assert len(rows) > 5 and all("error" not in row for row in rows), rows
    attention = [row for row in rows if row["kernel"] == "attention"]
    # Both products on Hopper's fp8 wgmma, none on the mma.sync fallback (v transposed or not; every head dim).
    assert {row["head_dim"] for row in attention} == {32, 64, 128}
    assert all(row["wgmma"] and not row["mma_sync"] for row in attention), rows
    key = lambda r: (r["head_dim"], r["block_m"], r["block_n"], r["num_warps"], r["num_stages"])  # noqa: E731
    by_config = {key(r): r for r in attention if r["v_layout"] == "transposed" and not r["precise_pv"]}
    # The defaults were picked by GPU timing (docs/FP8.md). Register use cross-compiled: the single-scale kernel
    # had 0 stack at 128x64 / 4 warps and 728 bytes at 64x128 / 4 warps (still the fastest at 32,760 keys); the
    # two-segment kernel must not spill more than that (it has 8 and 552).
    long, short = fa.default_config(128), fa.default_config(128, 4680)
    assert by_config[(128, long.block_m, long.block_n, long.num_warps, long.num_stages)]["stack_bytes"] <= 728
    assert by_config[(128, short.block_m, short.block_n, short.num_warps, short.num_stages)]["stack_bytes"] <= 16
    assert by_config[(128, 128, 64, 8, 3)]["stack_bytes"] == 0  # 8 warps: room to spare
    for head_dim in (32, 64):
        config = fa.default_config(head_dim)
        assert by_config[(head_dim, config.block_m, config.block_n, config.num_warps, config.num_stages)]
    quantize = [row for row in rows if row["kernel"] == "quantize"]
    assert {(row["layout"], row["head_dim"], row["rows"]) for row in quantize} == {
        (layout, d, s) for layout in ("natural", "transposed") for d, s in ((32, 4680), (128, 4680), (128, 28080))}
    assert all(row["stack_bytes"] == 0 and row["local_bytes"] == 0 for row in quantize), quantize
    # The full tiles' loop stores 16-byte vectors only, for q / K (head_dim contiguous) and the transposed V alike,
    # at 4,680 rows (not a multiple of 16) as at 28,080: at head_dim 128 a 64-row tile is 8 KB, four 16-byte
    # stores per thread. (Byte stores remain in the masked first / last tile of a head's rows.)
    assert all(row["cast_unmasked_stores"] == {"st.global.v4.b32": row["head_dim"] // 32} for row in quantize), quantize


def test_module_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "import torch\n"
        "import engine.models.fp8_attention as fa\n"
        "assert fa.triton is None\n"
        "x = torch.randn(1, 8, 2, 32).bfloat16()\n"
        "fa.quantize_per_head(x, transpose=True)\n"
        "try:\n    fa.fp8_attention(x, x, x)\nexcept RuntimeError as e:\n    assert 'Triton' in str(e)\n"
        "else:\n    raise SystemExit('no error without triton')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]


if __name__ == "__main__" and sys.argv[1:] == ["--interpreter-checks"]:
    print(json.dumps(_interpreter_checks()))
