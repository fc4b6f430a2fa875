"""FP8 (e4m3) flash-attention forward in Triton, for Hopper, as an option beside the bf16 cuDNN path.

Self-attention is the largest single cost of a forward at 1.3B / 480p (queries: the current 3 frames,
keys: history + current, up to 21 frames) and Hopper's fp8 tensor cores do twice bf16's FLOPs. Both
products run in fp8 here: ``QKᵀ`` on per-head-scaled q and k, and ``PV`` on the softmax probabilities
cast to e4m3 and per-head-scaled v; softmax statistics and the output accumulator stay float32.

* :func:`quantize_per_head`: bf16 ``[B, S, H, D]`` -> e4m3 plus a float32 scale per ``(B, H)``, on the
  device (no host synchronisation, so it can be captured in a CUDA graph). The engine quantizes its
  history K/V once per block and reuses them for every forward of that block.
* :func:`fp8_attention_quantized`: the kernel on quantized inputs; :func:`fp8_attention`: quantize,
  then the kernel.

Layout: q, k, out ``[B, S, H, D]`` with ``D`` contiguous (any other strides, e.g. a slice of a
``[2, S_max, H, D]`` buffer). On Hopper an fp8 ``wgmma`` takes its second operand K-major only,
i.e. contiguous along the reduction axis: for ``QKᵀ`` that is ``D`` (k's natural layout), for ``PV``
that is the key axis, so v is quantized *transposed* (``transpose=True``: storage ``[B, H, D, S_pad]``
with ``S`` contiguous, returned as a ``[B, S, H, D]`` view). A v with ``D`` contiguous also runs
(Blackwell takes either; on Hopper Triton may fall back to ``mma.sync``).

The key count needs no padding (it is a multiple of 1560, not of a block): full key blocks run
unmasked, the last partial block masks its keys to ``-inf``; query tails are masked on load and store.

Triton is imported when available, so the module imports on a CPU-only install; the kernel runs on
CUDA (sm_89+) or, for tests, on CPU under ``TRITON_INTERPRET=1`` (set before Triton is imported).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the module still imports, the kernel entry points raise
    triton = None

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn
_INVERSE_FP8_MAX = float(torch.tensor(1 / 448.0, dtype=torch.float32))  # 1/448 rounded to float32
HEAD_DIMS = (32, 64, 128)
LOG2E = 1.4426950408889634
# The transposed v's key axis is padded to this many elements so each of its rows starts 16-byte aligned
# (Triton only vectorises loads whose stride it knows is a multiple of 16).
V_ROW_ALIGN = 16


@dataclass(frozen=True)
class Fp8AttentionConfig:
    """Launch parameters of the kernel (the GPU bench sweeps them).

    ``p_shift``: P is computed as ``2**p_shift * softmax numerator`` (folded into the exponent, so free)
    before its e4m3 cast, keeping probabilities down to ``2**-(6 + p_shift)`` of the row max out of e4m3's
    subnormal range (below ``2**-6`` its relative precision drops, below ``2**-10`` values flush to 0); the
    factor cancels in the final division. 8 keeps ``P <= 256 < 448``.
    ``precise_pv``: ``max_num_imprecise_acc=block_n`` on the PV dot: on sm_90 Triton otherwise lets the fp8
    ``wgmma`` accumulate the whole key loop in the tensor core's reduced-precision accumulator; with it each
    block's product is added to the float32 accumulator separately (more registers, some FADDs).
    ``tail_split``: the query blocks of the last, partial wave of programs (``programs_per_sm`` resident on each
    SM) are split over their key blocks (:func:`tail_split`), each part a program of its own, and merged by
    :func:`_merge_parts`, so that the last wave is shorter instead of leaving SMs idle.
    ``programs_per_sm``: how many of the kernel's programs one SM holds at once (the cross-compiled head_dim-128
    configs: 255 registers x 128 threads and <= 106 KB of shared memory, so two).
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    p_shift: int = 8
    precise_pv: bool = False
    tail_split: bool = False
    programs_per_sm: int = 2

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.block_n < 32:
            raise ValueError(f"block_n must be >= 32 (the reduction axis of the fp8 PV dot), got {self.block_n}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be a power of two <= 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
        if not 0 <= self.p_shift <= 8:
            raise ValueError(f"p_shift must be in 0..8 (2**p_shift <= 448), got {self.p_shift}")
        if self.programs_per_sm < 1:
            raise ValueError(f"programs_per_sm must be >= 1, got {self.programs_per_sm}")


def tail_split(tiles: int, key_blocks: int, programs_per_wave: int, max_parts: int = 4) -> tuple[int, int]:
    """(whole query blocks, parts of each later one): the query blocks of the last, partial wave are split over
    their key blocks so that they fill that wave instead of leaving SMs idle for a whole block's time; ``(tiles,
    1)`` when the last wave is full or holds more than half a wave of blocks."""
    rest = tiles % programs_per_wave
    parts = min(programs_per_wave // rest, max_parts, key_blocks) if rest else 1
    return (tiles - rest, parts) if parts >= 2 else (tiles, 1)


# head_dim 128 (Wan 1.3B): the engine's two-segment kernel was swept over configs per key count
# (bench/fp8_attention_gpu.py --engine-sweep; figures in docs/BENCHMARKS.md): 64x128 / 4 warps / 3 stages won
# from the fast window's full context up, 128x64 / 4 / 4 below it. The other head dims are not measured:
# cross-compile choices (no spills).
_LONG_CONTEXT_KEYS = 16_000  # the fast window's full context (18,720 keys) and up take the long config
# The head_dim-128 configs split the last wave's query blocks (tail_split): at the engine's 4,680 queries x 12 heads
# their 888 programs are 3.36 waves of 264, and the partial fourth cost a whole one (H100, bench/
# fp8_attention_tail_gpu.py: 1.370 -> 1.220 ms at 32,760 keys, 0.802 -> 0.752 at 18,720; docs/FP8.md).
_TAIL_SPLIT = True
_CONFIG_128_LONG = Fp8AttentionConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, tail_split=_TAIL_SPLIT)
_CONFIG_128_SHORT = Fp8AttentionConfig(block_m=128, block_n=64, num_warps=4, num_stages=4, tail_split=_TAIL_SPLIT)
_DEFAULT_CONFIGS = {
    64: Fp8AttentionConfig(block_m=128, block_n=64, num_warps=4, num_stages=3),
    32: Fp8AttentionConfig(block_m=64, block_n=64, num_warps=4, num_stages=2),
}


def default_config(head_dim: int, num_keys: int | None = None) -> Fp8AttentionConfig:
    """The launch config for ``head_dim`` (for 128 by ``num_keys``: unknown counts get the long-context one)."""
    _check_head_dim(head_dim)
    if head_dim == 128:
        return _CONFIG_128_SHORT if num_keys is not None and num_keys < _LONG_CONTEXT_KEYS else _CONFIG_128_LONG
    return _DEFAULT_CONFIGS[head_dim]


def _check_head_dim(head_dim: int) -> None:
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"fp8 attention supports head_dim in {HEAD_DIMS}, got {head_dim}")


def _check_bshd(name: str, x: torch.Tensor) -> None:
    if x.ndim != 4:
        raise ValueError(f"{name} must be [batch, seq, heads, head_dim], got shape {tuple(x.shape)}")
    _check_head_dim(x.shape[-1])


def quantize_per_head(x: torch.Tensor, *, transpose: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [B, S, H, D]`` -> (e4m3 ``[B, S, H, D]``, float32 scale ``[B, H]``) with ``x ≈ x_fp8 * scale``.

    ``scale = amax / 448`` per (batch, head), 1 where a head is all zeros. Device ops only: nothing reads
    a value back to the host. ``transpose=True`` (for v): the result is a view of a ``[B, H, D, S_pad]``
    buffer, the key axis contiguous (see the module docstring); the padding is zero.
    """
    _check_bshd("x", x)
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    amax = torch.linalg.vector_norm(x, ord=math.inf, dim=(1, 3), dtype=torch.float32)  # [B, H], no |x| temporary
    nonzero = amax > 0
    # amax times the float32 1/448, not a division: torch on CUDA divides by a scalar that way (on the CPU it
    # divides), so written as a product the scale has the same bits on both, and in the Triton quantizer.
    scale = torch.where(nonzero, amax * _INVERSE_FP8_MAX, torch.ones_like(amax))
    inverse = torch.where(nonzero, FP8_MAX / amax, torch.ones_like(amax))  # |x| * inverse <= 448 (rounds to it)
    scaled = x * inverse[:, None, :, None]  # float32 by promotion
    if not transpose:
        return scaled.to(FP8_DTYPE), scale
    batch, seq, heads, head_dim = x.shape
    padded = -(-seq // V_ROW_ALIGN) * V_ROW_ALIGN
    storage = torch.empty(batch, heads, head_dim, padded, dtype=FP8_DTYPE, device=x.device)
    storage[..., seq:].zero_()
    storage[..., :seq].copy_(scaled.permute(0, 2, 3, 1))
    return storage[..., :seq].permute(0, 3, 1, 2), scale


def dequantize_per_head(x_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``x_fp8 * scale`` (the reference the kernel's products are exact on)."""
    return x_fp8.float() * scale[:, None, :, None]


if triton is not None:

    @triton.jit
    def _attend_block(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n, lo, hi, qk_scale, log2_v_factor, stride_ks, stride_vs,
        BLOCK_N: tl.constexpr, MASK: tl.constexpr, P_SHIFT: tl.constexpr, PRECISE_PV: tl.constexpr,
    ):
        """One step of the online softmax: the key block at ``start_n``, all of one segment's scalars.

        ``qk_scale``: the segment's ``q_scale * k_scale * sm_scale * log2(e)``; its v factor
        ``v_scale / v_scale_max`` (<= 1) rides in P's exponent as ``log2_v_factor`` (free) and is taken back
        out of the row sum (one scalar exp2 per block). ``MASK``: keys outside ``[lo, hi)`` are masked to ``-inf``.
        """
        start_n = tl.multiple_of(start_n, BLOCK_N)
        if MASK:
            keys = start_n + tl.arange(0, BLOCK_N)
            valid = (keys >= lo) & (keys < hi)
            kt = tl.load(k_ptrs + start_n * stride_ks, mask=valid[None, :], other=0.0)
        else:
            kt = tl.load(k_ptrs + start_n * stride_ks)
        qk = tl.dot(q, kt)  # [BLOCK_M, BLOCK_N] fp32; raw, scales applied below
        if MASK:
            qk = tl.where(valid[None, :], qk, float("-inf"))
        # log2 domain, scales folded: s = qk * qk_scale; one FMA per element below.
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        x = qk * qk_scale - (m_ij - P_SHIFT - log2_v_factor)[:, None]  # p = 2**x = 2**P_SHIFT e^(s-max) v_factor
        p = tl.math.exp2(x)
        alpha = tl.math.exp2(m_i - m_ij)
        # exp2(-log2_v_factor) is exactly 1 for the larger segment.
        l_i = l_i * alpha + tl.sum(p, 1) * tl.math.exp2(-log2_v_factor)
        acc = acc * alpha[:, None]
        if MASK:
            v = tl.load(v_ptrs + start_n * stride_vs, mask=valid[:, None], other=0.0)
        else:
            v = tl.load(v_ptrs + start_n * stride_vs)
        if PRECISE_PV:
            acc = tl.dot(p.to(tl.float8e4nv), v, acc, max_num_imprecise_acc=BLOCK_N)
        else:
            acc = tl.dot(p.to(tl.float8e4nv), v, acc)
        return acc, l_i, m_ij

    @triton.jit
    def _log2_v_factor(v_scale, v_scale_max):
        """log2(v_scale / v_scale_max): exactly 0 for the larger segment's scale (one segment: the old kernel)."""
        factor = tl.math.div_rn(v_scale, v_scale_max)
        return tl.where(factor == 1.0, 0.0, tl.math.log2(factor))

    @triton.jit(do_not_specialize=["SQ", "SK", "SH", "FULL", "KSPLIT"])  # one compile for every history length
    def _attn_fwd(
        Q, K, V, Out, QScale, KScaleH, KScaleC, VScaleH, VScaleC, Part, PartM, PartL,
        stride_qb, stride_qs, stride_qh,
        stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_ob, stride_os, stride_oh,
        H, SQ, SK, SH, sm_scale, FULL, KSPLIT,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        P_SHIFT: tl.constexpr, PRECISE_PV: tl.constexpr, TAIL_SPLIT: tl.constexpr,
    ):
        # One program a work unit on a 1-D grid: units [0, FULL) are whole query blocks, block t being query block
        # t % cdiv(SQ, BLOCK_M) of batch x head t // cdiv(SQ, BLOCK_M) (a head's blocks are adjacent programs, so
        # they share its K/V in L2); each later query block is split into KSPLIT parts over its key blocks, one
        # unit each, stored raw for _merge_parts (config.tail_split; without it FULL is every block, and the
        # split's code is not compiled in).
        pid = tl.program_id(0)
        if TAIL_SPLIT:
            split = pid >= FULL
            unit = tl.maximum(pid - FULL, 0)
            tile = tl.where(split, FULL + unit // KSPLIT, pid)
            part = tl.where(split, unit % KSPLIT, 0)
            parts = tl.where(split, KSPLIT, 1)
            last_part = (part == parts - 1).to(tl.int32)
        else:
            tile = pid
            part = 0
            parts = 1
            last_part = 1
        query_blocks = tl.cdiv(SQ, BLOCK_M)
        start_m = tile % query_blocks
        off_bh = tile // query_blocks
        off_b = (off_bh // H).to(tl.int64)
        off_h = (off_bh % H).to(tl.int64)
        offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < SQ

        q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + offs_m[:, None] * stride_qs + offs_d[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None], other=0.0)
        # kᵀ tile [HEAD_DIM, BLOCK_N], D contiguous: the K-major second operand of QKᵀ.
        k_ptrs = K + off_b * stride_kb + off_h * stride_kh + offs_n[None, :] * stride_ks + offs_d[:, None]
        # v tile [BLOCK_N, HEAD_DIM]; with the transposed layout (stride_vs == 1) it is K-major for PV.
        v_ptrs = V + off_b * stride_vb + off_h * stride_vh + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd

        # Keys [0, SH) are the history segment, [SH, SK) the current one, each with its own k and v scale.
        # A segment without keys may hold any scale, NaN included: only selects read it.
        q_scale = tl.load(QScale + off_bh)
        qk_scale_h = q_scale * tl.load(KScaleH + off_bh) * sm_scale * 1.4426950408889634  # log2(e): exp2 below
        qk_scale_c = q_scale * tl.load(KScaleC + off_bh) * sm_scale * 1.4426950408889634
        v_scale_h = tl.load(VScaleH + off_bh)
        v_scale_c = tl.load(VScaleC + off_bh)
        v_scale_max = tl.where(SH > 0, tl.where(SH < SK, tl.maximum(v_scale_h, v_scale_c), v_scale_h), v_scale_c)
        log2_v_factor_h = _log2_v_factor(v_scale_h, v_scale_max)
        log2_v_factor_c = _log2_v_factor(v_scale_c, v_scale_max)

        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        # Key blocks [0, h_full) are all history, [c_start, full) all current: one unmasked loop over both,
        # the segment's scalars picked per block (scalar selects). Two loops in all: cross-compiled for sm_90,
        # four loops (one unmasked + one masked per segment) spilled 800 bytes in the 4-warp configs, this
        # shape 8 (the single-scale kernel had 0 at 128x64, 728 at 64x128, this 552).
        h_full = (SH // BLOCK_N) * BLOCK_N
        c_start = tl.cdiv(SH, BLOCK_N) * BLOCK_N
        full = (SK // BLOCK_N) * BLOCK_N
        skip = c_start - h_full  # the boundary block, BLOCK_N wide when SH is not a multiple of BLOCK_N, else 0
        # A split query block's part takes its share of the unmasked key blocks; the last part the masked passes.
        unmasked = (h_full + tl.maximum(full - c_start, 0)) // BLOCK_N
        for n in range(part * unmasked // parts * BLOCK_N, (part + 1) * unmasked // parts * BLOCK_N, BLOCK_N):
            history = n < h_full
            acc, l_i, m_i = _attend_block(
                acc, l_i, m_i, q, k_ptrs, v_ptrs, tl.where(history, n, n + skip), 0, SK,
                tl.where(history, qk_scale_h, qk_scale_c), tl.where(history, log2_v_factor_h, log2_v_factor_c),
                stride_ks, stride_vs, BLOCK_N, False, P_SHIFT, PRECISE_PV,
            )
        # Then up to three masked passes, in this order: the boundary block's history keys, its current keys,
        # the last partial block (unless it is the boundary block). Only passes with keys run: a row never
        # meets an all-masked block before its first key (exp2(-inf + inf) would be NaN).
        boundary = (SH % BLOCK_N != 0).to(tl.int32)
        boundary_current = boundary * (SH < SK).to(tl.int32)
        tail = ((SK % BLOCK_N != 0) & (full >= c_start)).to(tl.int32)
        for i in range(0, (boundary + boundary_current + tail) * last_part):
            history = i < boundary
            tail_pass = i >= boundary + boundary_current
            acc, l_i, m_i = _attend_block(
                acc, l_i, m_i, q, k_ptrs, v_ptrs, tl.where(tail_pass, full, h_full),
                tl.where(history, 0, SH), tl.where(history, SH, SK),
                tl.where(history, qk_scale_h, qk_scale_c), tl.where(history, log2_v_factor_h, log2_v_factor_c),
                stride_ks, stride_vs, BLOCK_N, True, P_SHIFT, PRECISE_PV,
            )
        o_ptrs = Out + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :]
        if TAIL_SPLIT:  # nested, not `and`: without the split its branch must not be compiled at all
            if parts > 1:
                # A part: raw rows (times the v scale), their running max and row sum, for _merge_parts.
                rows = unit * BLOCK_M + tl.arange(0, BLOCK_M)
                tl.store(Part + rows[:, None] * HEAD_DIM + offs_d[None, :], acc * v_scale_max)
                tl.store(PartM + rows, m_i)
                tl.store(PartL + rows, l_i)
            else:
                tl.store(o_ptrs, (acc * (v_scale_max / l_i)[:, None]).to(Out.dtype.element_ty), mask=row_ok[:, None])
        else:
            tl.store(o_ptrs, (acc * (v_scale_max / l_i)[:, None]).to(Out.dtype.element_ty), mask=row_ok[:, None])

    @triton.jit
    def _merge_parts(Part, PartM, PartL, Out, stride_ob, stride_os, stride_oh, H, SQ, FULL, KSPLIT,
                     BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr):
        """One split query block (program ``t``: work units ``t * KSPLIT ..``): its parts' rows rescaled to their
        common max and summed, divided by the summed row sums (the online softmax's own merge), written out."""
        t = tl.program_id(0)
        tile = FULL + t
        query_blocks = tl.cdiv(SQ, BLOCK_M)
        start_m = tile % query_blocks
        off_bh = tile // query_blocks
        rows = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        first = t * KSPLIT * BLOCK_M
        m = tl.load(PartM + first + rows)
        for part in range(1, KSPLIT):
            m = tl.maximum(m, tl.load(PartM + first + part * BLOCK_M + rows))
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        l = tl.zeros([BLOCK_M], dtype=tl.float32)
        for part in range(0, KSPLIT):
            base = first + part * BLOCK_M
            weight = tl.math.exp2(tl.load(PartM + base + rows) - m)  # a part that met no key: m = -inf, weight 0
            l += tl.load(PartL + base + rows) * weight
            acc += tl.load(Part + (base + rows)[:, None] * HEAD_DIM + offs_d[None, :]) * weight[:, None]
        offs_m = start_m * BLOCK_M + rows
        o_ptrs = (Out + (off_bh // H).to(tl.int64) * stride_ob + (off_bh % H).to(tl.int64) * stride_oh
                  + offs_m[:, None] * stride_os + offs_d[None, :])
        tl.store(o_ptrs, (acc / l[:, None]).to(Out.dtype.element_ty), mask=(offs_m < SQ)[:, None])


def _interpreted() -> bool:
    return triton is not None and type(_attn_fwd).__name__ == "InterpretedFunction"


def _check_device(device: torch.device) -> None:
    if triton is None:
        raise RuntimeError("fp8 attention needs Triton, which is not installed")
    if device.type == "cuda":
        if torch.cuda.get_device_capability(device) < (8, 9):
            raise ValueError(f"fp8 attention needs e4m3 tensor cores (sm_89+), {device} is older")
        return
    if device.type == "cpu" and _interpreted():
        return
    raise ValueError(
        f"fp8 attention runs on CUDA, or on CPU only under the Triton interpreter "
        f"(TRITON_INTERPRET=1 set before triton is imported); got a tensor on {device}"
    )


def _check_scale(name: str, scale: torch.Tensor, batch: int, heads: int, device: torch.device) -> None:
    if not isinstance(scale, torch.Tensor) or scale.shape != (batch, heads) or scale.dtype != torch.float32 \
            or scale.device != device:
        got = f"{scale.dtype} {tuple(scale.shape)} on {scale.device}" if isinstance(scale, torch.Tensor) \
            else type(scale).__name__
        raise ValueError(f"{name} must be float32 [{batch}, {heads}] on {device}, got {got}")


def _segment_scales(name: str, scales) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale tensor (both segments) or a (history, current) pair."""
    if isinstance(scales, torch.Tensor):
        return scales, scales
    if isinstance(scales, (tuple, list)) and len(scales) == 2:
        return scales[0], scales[1]
    raise ValueError(f"{name} must be a float32 [B, H] tensor or a (history, current) pair of them")


def _launch(q_fp8, q_scale, k_fp8, k_scale, v_fp8, v_scale, out, config, history_tokens: int = 0,
            programs_per_wave: int | None = None):
    """Validate, launch; returns (out, the compiled kernel or None): the bench reads the kernel's PTX.

    ``k_scale`` / ``v_scale``: one ``[B, H]`` tensor, or a (history, current) pair for the keys
    ``[0, history_tokens)`` and ``[history_tokens, Sk)``.
    """
    for name, x in (("q", q_fp8), ("k", k_fp8), ("v", v_fp8)):
        _check_bshd(name, x)
        if x.dtype != FP8_DTYPE:
            raise ValueError(f"{name} must be {FP8_DTYPE} (see quantize_per_head), got {x.dtype}")
    batch, num_queries, heads, head_dim = q_fp8.shape
    num_keys = k_fp8.shape[1]
    if k_fp8.shape != (batch, num_keys, heads, head_dim) or v_fp8.shape != k_fp8.shape:
        raise ValueError(
            f"shape mismatch: q {tuple(q_fp8.shape)}, k {tuple(k_fp8.shape)}, v {tuple(v_fp8.shape)} "
            "(want q [B, Sq, H, D], k and v [B, Sk, H, D])"
        )
    if num_keys == 0:
        raise ValueError("attention over zero keys")
    if isinstance(history_tokens, bool) or not isinstance(history_tokens, int) \
            or not 0 <= history_tokens <= num_keys:
        raise ValueError(f"history_tokens must be a host int in [0, {num_keys}] (the key count), got {history_tokens!r}")
    device = q_fp8.device
    if k_fp8.device != device or v_fp8.device != device:
        raise ValueError(f"q, k, v on different devices: {device}, {k_fp8.device}, {v_fp8.device}")
    k_scale_h, k_scale_c = _segment_scales("k_scale", k_scale)
    v_scale_h, v_scale_c = _segment_scales("v_scale", v_scale)
    for name, scale in (("q_scale", q_scale), ("k_scale", k_scale_h), ("k_scale", k_scale_c),
                        ("v_scale", v_scale_h), ("v_scale", v_scale_c)):
        _check_scale(name, scale, batch, heads, device)
    if q_fp8.stride(-1) != 1 or k_fp8.stride(-1) != 1:
        raise ValueError("q and k need a contiguous head_dim (stride 1 on the last axis)")
    if v_fp8.stride(-1) != 1 and v_fp8.stride(1) != 1:
        raise ValueError("v needs a contiguous head_dim or key axis (quantize_per_head(v, transpose=True))")
    if out is None:
        out = torch.empty(q_fp8.shape, dtype=torch.bfloat16, device=device)
    elif out.shape != q_fp8.shape or out.dtype not in (torch.bfloat16, torch.float16, torch.float32) \
            or out.device != device or out.stride(-1) != 1:
        raise ValueError(f"out must be [B, Sq, H, D] with a contiguous last axis on {device}, like q")
    config = config or default_config(head_dim, num_keys)
    _check_device(device)
    if num_queries == 0:
        return out, None
    scales = (q_scale, k_scale_h, k_scale_c, v_scale_h, v_scale_c)
    tiles = triton.cdiv(num_queries, config.block_m) * batch * heads
    full, ksplit = tiles, 1
    if config.tail_split:
        if programs_per_wave is None:  # the CPU's interpreter has no SMs: only a test's explicit wave splits there
            programs_per_wave = torch.cuda.get_device_properties(device).multi_processor_count \
                * config.programs_per_sm if device.type == "cuda" else tiles
        full, ksplit = tail_split(tiles, triton.cdiv(num_keys, config.block_n), programs_per_wave)
    split_rows = (tiles - full) * ksplit * config.block_m
    if split_rows:  # the parts' raw rows, running maxima and row sums
        parts = (torch.empty(split_rows, head_dim, dtype=torch.float32, device=device),
                 torch.empty(split_rows, dtype=torch.float32, device=device),
                 torch.empty(split_rows, dtype=torch.float32, device=device))
    else:  # nothing split: never read or written, any float32 tensor serves
        parts = (q_scale, q_scale, q_scale)
    # Triton launches on the current device; offsets within one (batch, head) fit int32 up to ~1.4M keys.
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        kernel = _launch_kernel((full + (tiles - full) * ksplit,), q_fp8, k_fp8, v_fp8, out, scales, parts,
                                history_tokens, config, full, ksplit)
        if full < tiles:
            _merge_parts[(tiles - full,)](*parts, out, out.stride(0), out.stride(1), out.stride(2), heads,
                                          num_queries, full, ksplit, BLOCK_M=config.block_m, HEAD_DIM=head_dim,
                                          num_warps=4)
    return out, kernel


def _launch_kernel(grid, q_fp8, k_fp8, v_fp8, out, scales, parts, history_tokens, config, full, ksplit):
    _, num_queries, heads, head_dim = q_fp8.shape
    return _attn_fwd[grid](
        q_fp8, k_fp8, v_fp8, out, *(scale.contiguous() for scale in scales), *parts,
        q_fp8.stride(0), q_fp8.stride(1), q_fp8.stride(2),
        k_fp8.stride(0), k_fp8.stride(1), k_fp8.stride(2),
        v_fp8.stride(0), v_fp8.stride(1), v_fp8.stride(2), v_fp8.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        heads, num_queries, k_fp8.shape[1], history_tokens, 1.0 / math.sqrt(head_dim), full, ksplit,
        HEAD_DIM=head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        P_SHIFT=config.p_shift, PRECISE_PV=config.precise_pv, TAIL_SPLIT=config.tail_split,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def fp8_attention_quantized(
    q_fp8: torch.Tensor, q_scale: torch.Tensor,
    k_fp8: torch.Tensor, k_scale: torch.Tensor,
    v_fp8: torch.Tensor, v_scale: torch.Tensor,
    *, out: torch.Tensor | None = None, config: Fp8AttentionConfig | None = None,
) -> torch.Tensor:
    """Non-causal attention ``softmax(q kᵀ / sqrt(D)) v`` on :func:`quantize_per_head` outputs -> ``[B, Sq, H, D]``.

    ``out`` (bf16 unless given, written in place); ``config``: :func:`default_config` of the head dim and key
    count. One scale per (batch, head) for all keys; :func:`fp8_attention_segments` takes two.
    """
    return _launch(q_fp8, q_scale, k_fp8, k_scale, v_fp8, v_scale, out, config)[0]


def fp8_attention_segments(
    q_fp8: torch.Tensor, q_scale: torch.Tensor,
    k_fp8: torch.Tensor, k_scales: tuple[torch.Tensor, torch.Tensor],
    v_fp8: torch.Tensor, v_scales: tuple[torch.Tensor, torch.Tensor],
    history_tokens: int,
    *, out: torch.Tensor | None = None, config: Fp8AttentionConfig | None = None,
) -> torch.Tensor:
    """:func:`fp8_attention_quantized` over keys in two segments, each quantized with its own scales.

    Keys ``[0, history_tokens)`` (the history, quantized once per block) dequantize with
    ``k_scales[0]`` / ``v_scales[0]``, keys ``[history_tokens, Sk)`` (the current block, quantized per
    forward) with ``k_scales[1]`` / ``v_scales[1]``; each ``float32 [B, H]``. ``history_tokens`` is a host
    int, ``0 .. Sk``; a segment without keys is never read (its scales may hold anything). k and v are one
    tensor each over both segments (e.g. prefixes of the engine's fp8 mirror buffers).

    How: a score gets its key's ``k_scale`` (a scalar per key block, a per-column factor in the one block
    that straddles the boundary); v's per-key scale goes into P before P's e4m3 cast, as
    ``v_scale(key) / max(v_scales)`` (so P stays within its ``2**p_shift`` bound), and the output is
    multiplied by ``max(v_scales)``. With one segment this is the single-scale kernel exactly.
    """
    for name, scales in (("k_scales", k_scales), ("v_scales", v_scales)):
        if isinstance(scales, torch.Tensor) or len(scales) != 2:
            raise ValueError(f"{name} must be a (history, current) pair of float32 [B, H] tensors")
    return _launch(q_fp8, q_scale, k_fp8, tuple(k_scales), v_fp8, tuple(v_scales), out, config, history_tokens)[0]


def fp8_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, config: Fp8AttentionConfig | None = None
) -> torch.Tensor:
    """Quantize ``q, k, v [B, S, H, D]`` per head and run the fp8 kernel; bf16 ``[B, Sq, H, D]``."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_bshd(name, x)
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    _check_device(q.device)
    q_fp8, q_scale = quantize_per_head(q)
    k_fp8, k_scale = quantize_per_head(k)
    v_fp8, v_scale = quantize_per_head(v, transpose=True)
    return fp8_attention_quantized(q_fp8, q_scale, k_fp8, k_scale, v_fp8, v_scale, config=config)


# --- the fast quantizer: per-head amax, scale and e4m3 cast into a given destination -----------------------

_QUANT_BLOCK_S = 64  # rows (keys) per tile: [64, head_dim] bf16, 16 KB at head_dim 128
_QUANT_MAX_PARTS = 128  # programs per (batch, head): a head's partial maxima fit one load of the cast pass

if triton is not None:

    @triton.jit
    def _amax_partials(
        X, Partial, stride_xb, stride_xs, stride_xh, stride_xd, H, S, NUM_PARTS, ROWS_PER_PART,
        HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        """Pass 1: ``Partial[b*H + h, part]`` = max |x| over the rows ``[part * ROWS_PER_PART, ...)`` of head h."""
        part = tl.program_id(0)
        off_bh = tl.program_id(1)
        off_b = (off_bh // H).to(tl.int64)
        off_h = (off_bh % H).to(tl.int64)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, HEAD_DIM)
        base = X + off_b * stride_xb + off_h * stride_xh + offs_d[None, :] * stride_xd
        first = part * ROWS_PER_PART
        amax = tl.zeros([BLOCK_S, HEAD_DIM], dtype=tl.float32)
        for row in range(first, tl.minimum(first + ROWS_PER_PART, S), BLOCK_S):
            rows = row + offs_s
            x = tl.load(base + rows[:, None].to(tl.int64) * stride_xs, mask=(rows < S)[:, None], other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        tl.store(Partial + off_bh * NUM_PARTS + part, tl.max(tl.max(amax, 1), 0))

    @triton.jit
    def _cast_tile(x_base, y_base, row, ROW0, lo, hi, inverse, stride_xs, stride_ys, BLOCK_S: tl.constexpr,
                   MASK: tl.constexpr):
        """Dst rows ``[row, row + BLOCK_S)``, source rows less ``ROW0``; ``MASK``: only those in ``[lo, hi)``."""
        rows = row + tl.arange(0, BLOCK_S)
        keep = ((rows >= lo) & (rows < hi))[:, None]
        rows = rows[:, None].to(tl.int64)
        if MASK:
            x = tl.load(x_base + (rows - ROW0) * stride_xs, mask=keep, other=0.0)
            tl.store(y_base + rows * stride_ys, (x.to(tl.float32) * inverse).to(tl.float8e4nv), mask=keep)
        else:
            x = tl.load(x_base + (rows - ROW0) * stride_xs)
            tl.store(y_base + rows * stride_ys, (x.to(tl.float32) * inverse).to(tl.float8e4nv))

    @triton.jit(do_not_specialize=["ROW0"])
    def _quantize_cast(
        X, Dst, Partial, Scale,
        stride_xb, stride_xs, stride_xh, stride_xd,
        stride_yb, stride_ys, stride_yh, stride_yd,
        stride_sb, stride_sh, H, S, ROW0, NUM_PARTS, ROWS_PER_PART,
        HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr, INVERSE_MAX: tl.constexpr,
    ):
        """Pass 2: the head's amax from pass 1's partials, its scale (written by part 0), the e4m3 cast.

        Source row ``r`` goes to destination row ``ROW0 + r``; parts and tiles are on destination rows, tiles at
        multiples of ``BLOCK_S``, so every full tile stores unmasked (with ``Dst`` 16-byte aligned and the rows
        contiguous, 16-byte vectors; a mask ``rows < S`` would split them into byte stores unless S is a multiple
        of 16) and only a part's first and last tile, where ``[ROW0, ROW0 + S)`` starts or ends, are masked.

        The arithmetic is :func:`quantize_per_head`'s, rounding for rounding, so both give the same bits:
        ``scale = amax * INVERSE_MAX`` (the float32 ``1 / 448``: how torch divides by a scalar on CUDA), ``inverse = (1 / amax) * 448`` (torch computes
        ``448 / amax`` as ``amax.reciprocal() * 448``: two roundings, which differ from one division's in the
        last bit, enough to move a value across an e4m3 rounding boundary), ``x * inverse`` cast to e4m3 to
        nearest even; scale and inverse 1 for an all-zero head.
        """
        part = tl.program_id(0)
        off_bh = tl.program_id(1)
        off_b = (off_bh // H).to(tl.int64)
        off_h = (off_bh % H).to(tl.int64)
        offs_p = tl.arange(0, BLOCK_P)
        partials = tl.load(Partial + off_bh * NUM_PARTS + offs_p, mask=offs_p < NUM_PARTS, other=0.0)
        amax = tl.max(partials, 0)
        nonzero = amax > 0
        scale = tl.where(nonzero, amax * INVERSE_MAX, 1.0)
        inverse = tl.where(nonzero, tl.math.div_rn(1.0, tl.maximum(amax, 1e-30)) * 448.0, 1.0)
        tl.store(Scale + off_b * stride_sb + off_h * stride_sh, scale, mask=part == 0)
        offs_d = tl.arange(0, HEAD_DIM)
        x_base = X + off_b * stride_xb + off_h * stride_xh + offs_d[None, :] * stride_xd
        y_base = Dst + off_b * stride_yb + off_h * stride_yh + offs_d[None, :] * stride_yd
        # This part's destination rows [lo, hi); ROWS_PER_PART is a multiple of BLOCK_S, so only the first part
        # can start and only the last can end inside a tile.
        first = part * ROWS_PER_PART
        lo = tl.maximum(first, ROW0)
        hi = tl.minimum(first + ROWS_PER_PART, ROW0 + S)
        full_lo = tl.cdiv(lo, BLOCK_S) * BLOCK_S
        full_hi = (hi // BLOCK_S) * BLOCK_S
        for row in range(full_lo, full_hi, BLOCK_S):
            _cast_tile(x_base, y_base, tl.multiple_of(row, BLOCK_S), ROW0, lo, hi, inverse, stride_xs, stride_ys,
                       BLOCK_S, False)
        # Masked: the tile holding lo (if lo is inside one), then the one holding hi (unless it is the same).
        head = (lo < full_lo).to(tl.int32)
        tail = ((full_hi < hi) & (full_hi >= full_lo)).to(tl.int32)
        for i in range(0, head + tail):
            row = tl.where(i < head, full_lo - BLOCK_S, full_hi)
            _cast_tile(x_base, y_base, row, ROW0, lo, hi, inverse, stride_xs, stride_ys, BLOCK_S, True)


def _aligned_rows(dst: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(base, lead)``: ``dst`` is ``base``'s rows ``[lead, lead + S)``, ``base`` 16-byte aligned where that is possible.

    Triton vectorises a store only where it can prove 16-byte alignment, and specialises a pointer argument on it:
    a key-contiguous dst (the transposed V) whose slice starts off a 16-byte boundary (the current block at
    ``history_tokens``, a multiple of 1,560 keys: 8 bytes off for an odd multiple) is passed as the aligned
    address up to 15 keys below it (bytes of the same storage, never written). Other layouts, or a storage that
    itself starts unaligned: ``(dst, 0)``.
    """
    lead = dst.data_ptr() % 16 if dst.stride(1) == 1 else 0  # fp8: one byte per key
    if lead == 0 or lead > dst.storage_offset():
        return dst, 0
    return dst.as_strided(dst.shape, dst.stride(), dst.storage_offset() - lead), lead


def quantize_per_head_into(x: torch.Tensor, dst: torch.Tensor, scale: torch.Tensor) -> None:
    """:func:`quantize_per_head` of ``x [B, S, H, D]`` written into ``dst`` and ``scale``; two Triton launches.

    ``dst``: e4m3, shape ``[B, S, H, D]``, any strides: a slice of a bigger buffer (only its elements are
    written), e.g. rows of the engine's ``[S_max, H, D]`` K mirror, or a transposed V view (``stride(1) == 1``:
    ``buffer[..., start:end].permute(...)`` of ``[H, D, S_pad]`` storage, what ``transpose=True`` returns).
    ``scale``: float32 ``[B, H]`` (any strides) receives ``amax / 448`` per (batch, head), 1 for a zero head.
    No host synchronisation and no data-dependent launch: capturable in a CUDA graph. Pass 1 reads ``x`` for
    its per-head maxima (in up to 128 parts per head), pass 2 reads it again and writes ``dst``: about 2.5
    bytes of traffic per bf16 element. An ``x`` with ``S = 0`` writes scale 1.
    """
    _check_bshd("x", x)
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    if dst.shape != x.shape or dst.dtype != FP8_DTYPE or dst.device != x.device:
        raise ValueError(f"dst must be {FP8_DTYPE} {tuple(x.shape)} on {x.device}, got {dst.dtype} "
                         f"{tuple(dst.shape)} on {dst.device}")
    batch, seq, heads, head_dim = x.shape
    _check_scale("scale", scale, batch, heads, x.device)
    _check_device(x.device)
    if seq == 0:
        scale.fill_(1.0)
        return
    base, lead = _aligned_rows(dst)
    rows_per_part = _QUANT_BLOCK_S * triton.cdiv(lead + seq, _QUANT_BLOCK_S * _QUANT_MAX_PARTS)
    parts = triton.cdiv(seq, rows_per_part)  # pass 1's, over source rows
    cast_parts = triton.cdiv(lead + seq, rows_per_part)  # pass 2's, over destination rows
    partials = torch.empty((batch * heads, parts), dtype=torch.float32, device=x.device)
    common = dict(HEAD_DIM=head_dim, BLOCK_S=_QUANT_BLOCK_S, num_warps=4)
    with torch.cuda.device(x.device) if x.device.type == "cuda" else contextlib.nullcontext():
        _amax_partials[(parts, batch * heads)](x, partials, *x.stride(), heads, seq, parts, rows_per_part, **common)
        _quantize_cast[(cast_parts, batch * heads)](
            x, base, partials, scale, *x.stride(), *dst.stride(), *scale.stride(), heads, seq, lead, parts,
            rows_per_part, BLOCK_P=_QUANT_MAX_PARTS, INVERSE_MAX=_INVERSE_FP8_MAX, **common,
        )


ENGINE_MIN_CAPABILITY = (9, 0)  # the engine's FP8 attention: Hopper's fp8 wgmma (sm_89's mma.sync path is unmeasured)


def check_engine_support(device: torch.device, dtype: torch.dtype, head_dim: int) -> None:
    """Raise ``ValueError`` unless a model on ``device`` in ``dtype`` can run its self-attention through this kernel.

    CUDA needs compute capability 9.0+ (Hopper); the CPU only the Triton interpreter (tests: TRITON_INTERPRET=1
    set before Triton is imported). The model must be bf16 (the kernel writes bf16 for its output projection).
    """
    device = torch.device(device)
    if triton is None:
        raise ValueError("FP8 attention needs Triton, which is not installed")
    if dtype != torch.bfloat16:
        raise ValueError(f"FP8 attention needs a bfloat16 model, got {dtype}")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"FP8 attention supports head_dim in {HEAD_DIMS}, the model has {head_dim}")
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < ENGINE_MIN_CAPABILITY:
            raise ValueError(
                f"FP8 attention needs a Hopper GPU or newer (compute capability 9.0+, the Triton fp8 wgmma path); "
                f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}"
            )
        return
    if device.type == "cpu":
        if not _interpreted():
            raise ValueError(
                "FP8 attention on the CPU runs only under the Triton interpreter (tests): set TRITON_INTERPRET=1 "
                "before Triton is imported; use a Hopper GPU (--device cuda) to run it for real"
            )
        return
    raise ValueError(f"FP8 attention runs on CUDA (Hopper) only, got {device}")
