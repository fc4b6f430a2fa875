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
HEAD_DIMS = (32, 64, 128)
LOG2E = 1.4426950408889634
# The transposed v's key axis is padded to this many elements so each of its rows starts 16-byte aligned
# (Triton only vectorises loads whose stride it knows is a multiple of 16).
_V_ROW_ALIGN = 16


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
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    p_shift: int = 8
    precise_pv: bool = False

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


# Until the GPU bench (bench/fp8_attention_gpu.py) says otherwise: for head_dim 128, cross-compiled for sm_90
# (its --compile-only), 128x64 with 8 warps takes 187 registers and no stack, 128x128 hits 255 and spills.
_DEFAULT_CONFIGS = {
    128: Fp8AttentionConfig(block_m=128, block_n=64, num_warps=8, num_stages=3),
    64: Fp8AttentionConfig(block_m=128, block_n=64, num_warps=4, num_stages=3),
    32: Fp8AttentionConfig(block_m=64, block_n=64, num_warps=4, num_stages=2),
}


def default_config(head_dim: int) -> Fp8AttentionConfig:
    _check_head_dim(head_dim)
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
    scale = torch.where(nonzero, amax / FP8_MAX, torch.ones_like(amax))
    inverse = torch.where(nonzero, FP8_MAX / amax, torch.ones_like(amax))  # |x| * inverse <= 448 (rounds to it)
    scaled = x * inverse[:, None, :, None]  # float32 by promotion
    if not transpose:
        return scaled.to(FP8_DTYPE), scale
    batch, seq, heads, head_dim = x.shape
    padded = -(-seq // _V_ROW_ALIGN) * _V_ROW_ALIGN
    storage = torch.empty(batch, heads, head_dim, padded, dtype=FP8_DTYPE, device=x.device)
    storage[..., seq:].zero_()
    storage[..., :seq].copy_(scaled.permute(0, 2, 3, 1))
    return storage[..., :seq].permute(0, 3, 1, 2), scale


def dequantize_per_head(x_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``x_fp8 * scale`` (the reference the kernel's products are exact on)."""
    return x_fp8.float() * scale[:, None, :, None]


if triton is not None:

    @triton.jit
    def _attend_block_range(
        acc, l_i, m_i, q, k_ptrs, v_ptrs, start, stop, SK, qk_scale,
        stride_ks, stride_vs,
        BLOCK_N: tl.constexpr, MASK: tl.constexpr, P_SHIFT: tl.constexpr, PRECISE_PV: tl.constexpr,
    ):
        """Online softmax over key blocks ``start..stop`` (``MASK``: the last, partial block)."""
        offs_n = tl.arange(0, BLOCK_N)
        for start_n in range(start, stop, BLOCK_N):
            start_n = tl.multiple_of(start_n, BLOCK_N)
            if MASK:
                valid = (start_n + offs_n) < SK
                kt = tl.load(k_ptrs + start_n * stride_ks, mask=valid[None, :], other=0.0)
            else:
                kt = tl.load(k_ptrs + start_n * stride_ks)
            qk = tl.dot(q, kt)  # [BLOCK_M, BLOCK_N] fp32; raw, scales applied below
            if MASK:
                qk = tl.where(valid[None, :], qk, float("-inf"))
            # log2 domain, scales folded: s = qk * qk_scale; one FMA per element below.
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            p = tl.math.exp2(qk * qk_scale - (m_ij - P_SHIFT)[:, None])  # 2**P_SHIFT * exp(s - max)
            alpha = tl.math.exp2(m_i - m_ij)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None]
            if MASK:
                v = tl.load(v_ptrs + start_n * stride_vs, mask=valid[:, None], other=0.0)
            else:
                v = tl.load(v_ptrs + start_n * stride_vs)
            if PRECISE_PV:
                acc = tl.dot(p.to(tl.float8e4nv), v, acc, max_num_imprecise_acc=BLOCK_N)
            else:
                acc = tl.dot(p.to(tl.float8e4nv), v, acc)
            m_i = m_ij
        return acc, l_i, m_i

    @triton.jit(do_not_specialize=["SQ", "SK"])  # one compile for every history length
    def _attn_fwd(
        Q, K, V, Out, QScale, KScale, VScale,
        stride_qb, stride_qs, stride_qh,
        stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_vd,
        stride_ob, stride_os, stride_oh,
        H, SQ, SK, sm_scale,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        P_SHIFT: tl.constexpr, PRECISE_PV: tl.constexpr,
    ):
        # Query blocks of one head are adjacent programs, so they share that head's K/V in L2.
        start_m = tl.program_id(0)
        off_bh = tl.program_id(1)
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

        q_scale = tl.load(QScale + off_bh)
        k_scale = tl.load(KScale + off_bh)
        v_scale = tl.load(VScale + off_bh)
        qk_scale = q_scale * k_scale * sm_scale * 1.4426950408889634  # log2(e): exp2 below

        m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        full = (SK // BLOCK_N) * BLOCK_N
        acc, l_i, m_i = _attend_block_range(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, 0, full, SK, qk_scale, stride_ks, stride_vs,
            BLOCK_N, False, P_SHIFT, PRECISE_PV,
        )
        acc, l_i, m_i = _attend_block_range(
            acc, l_i, m_i, q, k_ptrs, v_ptrs, full, SK, SK, qk_scale, stride_ks, stride_vs,
            BLOCK_N, True, P_SHIFT, PRECISE_PV,
        )
        out = acc * (v_scale / l_i)[:, None]
        o_ptrs = Out + off_b * stride_ob + off_h * stride_oh + offs_m[:, None] * stride_os + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])


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
    if scale.shape != (batch, heads) or scale.dtype != torch.float32 or scale.device != device:
        raise ValueError(
            f"{name} must be float32 [{batch}, {heads}] on {device}, "
            f"got {scale.dtype} {tuple(scale.shape)} on {scale.device}"
        )


def _launch(q_fp8, q_scale, k_fp8, k_scale, v_fp8, v_scale, out, config):
    """Validate, launch; returns (out, the compiled kernel or None): the bench reads the kernel's PTX."""
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
    device = q_fp8.device
    if k_fp8.device != device or v_fp8.device != device:
        raise ValueError(f"q, k, v on different devices: {device}, {k_fp8.device}, {v_fp8.device}")
    for name, scale in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale)):
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
    config = config or default_config(head_dim)
    _check_device(device)
    if num_queries == 0:
        return out, None
    grid = (triton.cdiv(num_queries, config.block_m), batch * heads)
    # Triton launches on the current device; offsets within one (batch, head) fit int32 up to ~1.4M keys.
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        kernel = _launch_kernel(grid, q_fp8, q_scale, k_fp8, k_scale, v_fp8, v_scale, out, config)
    return out, kernel


def _launch_kernel(grid, q_fp8, q_scale, k_fp8, k_scale, v_fp8, v_scale, out, config):
    _, num_queries, heads, head_dim = q_fp8.shape
    return _attn_fwd[grid](
        q_fp8, k_fp8, v_fp8, out, q_scale.contiguous(), k_scale.contiguous(), v_scale.contiguous(),
        q_fp8.stride(0), q_fp8.stride(1), q_fp8.stride(2),
        k_fp8.stride(0), k_fp8.stride(1), k_fp8.stride(2),
        v_fp8.stride(0), v_fp8.stride(1), v_fp8.stride(2), v_fp8.stride(3),
        out.stride(0), out.stride(1), out.stride(2),
        heads, num_queries, k_fp8.shape[1], 1.0 / math.sqrt(head_dim),
        HEAD_DIM=head_dim, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
        P_SHIFT=config.p_shift, PRECISE_PV=config.precise_pv,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


def fp8_attention_quantized(
    q_fp8: torch.Tensor, q_scale: torch.Tensor,
    k_fp8: torch.Tensor, k_scale: torch.Tensor,
    v_fp8: torch.Tensor, v_scale: torch.Tensor,
    *, out: torch.Tensor | None = None, config: Fp8AttentionConfig | None = None,
) -> torch.Tensor:
    """Non-causal attention ``softmax(q kᵀ / sqrt(D)) v`` on :func:`quantize_per_head` outputs -> ``[B, Sq, H, D]``.

    ``out`` (bf16 unless given, written in place); ``config``: :func:`default_config` of the head dim.
    """
    return _launch(q_fp8, q_scale, k_fp8, k_scale, v_fp8, v_scale, out, config)[0]


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
