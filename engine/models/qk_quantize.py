"""The FP8 attention's q and k from their projections in one Triton pass: RMS norm, rotation, e4m3 cast.

Wan normalizes q and k with an RMS norm across all heads (``[tokens, heads * head_dim]``, a weight per channel),
rotates them (interleaved pairs, per position), and the FP8 kernel then wants them in e4m3 with a scale per head.
The engine's other path makes six passes for the two: the norm, the rotation, and the per-head quantizer's two
(the head's amax over every token, then the cast) for each (docs/BENCHMARKS.md, thirty-fifth session).

The amax pass is what keeps those apart: a head's scale needs every token before any can be cast. It is not
needed, because the norm bounds its own output. Each normalized channel is ``x_i / rms(x) * w_i`` with
``|x_i| <= sqrt(C) * rms(x)`` (``C`` channels: one channel can hold all of the row's energy), so
``|y_i| <= sqrt(C) * |w_i|``; a rotation mixes the two channels of a pair and keeps their norm, so each rotated
value of head ``h`` is at most ``sqrt(C) * max |w|`` over that head's channels (and a bf16 rounding or two).
That bound, from the weights alone, is the head's scale (:func:`static_scales`): every token is cast as it
is normalized and rotated. The typical value then sits ~8x lower in e4m3's range than under the data's own
amax (~4.5 sigma where the bound is ~39 sigma at 1,536 channels), which costs nothing while it stays among
e4m3's normal numbers (3 bits of mantissa from 2^-6 to 448 alike): only values below ~1/700 of the typical one
turn subnormal. The error against float32 attention is measured beside the per-token-amax path's
(tests/test_qk_quantize.py, docs/FP8.md). The same bound already scales the decoder's e4m3 convolutions
(``decoders/shifted_rows_conv.py``, ``silu_rms_norm_bound``).

The arithmetic otherwise follows the eager path's: the RMS norm in float32, rounded to bf16 as ``F.rms_norm``
returns it; the rotation in float32 (``kernels.rotate_pairs``), rounded to bf16; then times the head's
``1 / scale``, clamped to +-448, cast to e4m3 to nearest even. The mean square is summed in another order than
torch's kernel (float32 noise: a value may land one e4m3 step away). With ``stage``, the normalized rows before
the rotation are written too, in bf16, for the commit pass's cache (stored unrotated).
"""

from __future__ import annotations

import math

import torch

from engine.models import kernels as K
from engine.models.e4m3 import FP8_DTYPE, FP8_MAX

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the engine then never calls the kernel
    triton = None

# Two bf16 roundings (the normalized value, the rotated one) may each add 2^-8 of its magnitude to the bound.
BOUND_SLACK = (1 + 2.0**-8) ** 2


if triton is not None:

    @triton.jit
    def _rms_rotate_quantize(
        X, W, Cos, Sin, InverseScale, Dst, Stage,
        stride_xs, stride_cs, stride_ds, stride_dh, stride_gs, stride_gh, eps,
        HEADS: tl.constexpr, BLOCK_H: tl.constexpr, HALF: tl.constexpr, STAGE: tl.constexpr,
        E4M3_MAX: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        heads = tl.arange(0, BLOCK_H)
        cols = tl.arange(0, 2 * HALF)
        keep = (heads < HEADS)[:, None]
        # [heads, head_dim] tiles: each thread's channels are contiguous, so rows load and store as 16-byte
        # vectors (a [heads, pairs, 2] tile made every access one pair: 4-byte loads, 2-byte e4m3 stores).
        channels = heads[:, None] * (2 * HALF) + cols[None, :]
        x = tl.load(X + row * stride_xs + channels, mask=keep, other=0.0)
        h = x.to(tl.float32)
        mean_square = tl.sum(tl.sum(h * h, 1), 0) / (HEADS * 2 * HALF)
        rstd = 1.0 / tl.sqrt_rn(mean_square + eps)
        w = tl.load(W + channels, mask=keep, other=0.0).to(tl.float32)
        normed = (h * rstd * w).to(x.dtype)  # F.rms_norm's output
        if STAGE:
            tl.store(Stage + row * stride_gs + heads[:, None] * stride_gh + cols[None, :], normed, mask=keep)
        # Channel 2i + j of a head: pair i, its even (j = 0) or odd (j = 1) side.
        even, odd = tl.split(tl.reshape(normed.to(tl.float32), [BLOCK_H, HALF, 2]))
        pairs = tl.arange(0, HALF)
        cos = tl.load(Cos + row * stride_cs + pairs)[None, :]
        sin = tl.load(Sin + row * stride_cs + pairs)[None, :]
        rotated = tl.join((even * cos - odd * sin).to(x.dtype), (even * sin + odd * cos).to(x.dtype))
        rotated = tl.reshape(rotated, [BLOCK_H, 2 * HALF])
        inverse = tl.load(InverseScale + heads, mask=heads < HEADS, other=1.0)[:, None]
        quantized = tl.clamp(rotated.to(tl.float32) * inverse, -E4M3_MAX, E4M3_MAX).to(tl.float8e4nv)
        tl.store(Dst + row * stride_ds + heads[:, None] * stride_dh + cols[None, :], quantized, mask=keep)


def _interpreted() -> bool:
    return triton is not None and type(_rms_rotate_quantize).__name__ == "InterpretedFunction"


def available(x: torch.Tensor) -> bool:
    """Whether the kernel runs for projections ``x``: CUDA (or the Triton interpreter, for tests), Triton
    installed, bf16 or fp16 rows."""
    if triton is None or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    return x.is_cuda or (x.device.type == "cpu" and _interpreted())


def static_scales(weight: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, 1 / scale), float32 ``[heads]``: each head's bound on its normalized, rotated values (see the
    module docstring) mapped to 448. ``weight``: the RMS norm's ``[heads * head_dim]``."""
    channels = weight.shape[-1]
    bound = weight.detach().float().abs().view(heads, -1).amax(1) * (math.sqrt(channels) * BOUND_SLACK)
    scale = torch.clamp(bound, min=1e-12) / FP8_MAX
    return scale, 1.0 / scale


def rms_rotate_quantize_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float, heads: int, cos: torch.Tensor, sin: torch.Tensor,
    inverse_scale: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager path the kernel stands for: (e4m3 ``[B, S, H, D]``, the normalized rows before the rotation,
    bf16 ``[B, S, H, D]``). ``x [B, S, H * D]``; ``cos``/``sin`` ``[S, 1, D // 2]``."""
    normed = K.rms_norm(x, weight, eps).unflatten(-1, (heads, -1))
    rotated = K.rotate_pairs(normed, cos, sin)
    scaled = rotated.float() * inverse_scale.view(heads, 1)
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), normed


def rms_rotate_quantize(
    x: torch.Tensor, weight: torch.Tensor, eps: float, heads: int, cos: torch.Tensor, sin: torch.Tensor,
    inverse_scale: torch.Tensor, dst: torch.Tensor, stage: torch.Tensor | None = None, num_warps: int = 4,
) -> None:
    """The kernel: ``x [1, S, H * D]`` (a projection's rows) normalized, rotated and cast into ``dst`` (e4m3
    ``[1, S, H, D]``, head_dim contiguous: e.g. rows of the FP8 mirror's K) with ``inverse_scale [H]``;
    ``stage`` (bf16 ``[S, H, D]``, head_dim contiguous) also receives the normalized rows, unrotated. No host
    synchronisation: runs inside CUDA graph captures."""
    if not available(x):
        raise ValueError(f"the fused q/k quantizer runs on CUDA with Triton, bf16 / fp16 rows; got {x.device} "
                         f"{x.dtype}")
    if x.ndim != 3 or x.shape[0] != 1 or x.shape[-1] % (2 * heads):
        raise ValueError(f"x must be [1, tokens, heads * head_dim] with an even head_dim; got {tuple(x.shape)}")
    tokens, channels = x.shape[1], x.shape[2]
    head_dim = channels // heads
    half = head_dim // 2
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    if dst.shape != (1, tokens, heads, head_dim) or dst.dtype != FP8_DTYPE or dst.stride(-1) != 1:
        raise ValueError(f"dst must be e4m3 [1, {tokens}, {heads}, {head_dim}] with head_dim contiguous; got "
                         f"{dst.dtype} {tuple(dst.shape)} strides {dst.stride()}")
    if stage is not None and (stage.shape != (tokens, heads, head_dim) or stage.dtype != x.dtype
                              or stage.stride(-1) != 1):
        raise ValueError(f"stage must be {x.dtype} [{tokens}, {heads}, {head_dim}] with head_dim contiguous; got "
                         f"{stage.dtype} {tuple(stage.shape)}")
    if cos.shape != (tokens, 1, half) or sin.shape != cos.shape or cos.stride() != sin.stride() \
            or cos.stride(-1) != 1:
        raise ValueError(f"cos / sin must be [{tokens}, 1, {half}] alike with unit last stride; got "
                         f"{tuple(cos.shape)}, {tuple(sin.shape)}")
    if tokens == 0:
        return
    rows = x[0] if x.stride(-1) == 1 else x[0].contiguous()
    _rms_rotate_quantize[(tokens,)](
        rows, weight.contiguous(), cos, sin, inverse_scale.contiguous(), dst,
        stage if stage is not None else rows,
        rows.stride(0), cos.stride(0), dst.stride(1), dst.stride(2),
        stage.stride(0) if stage is not None else 0, stage.stride(1) if stage is not None else 0, float(eps),
        HEADS=heads, BLOCK_H=triton.next_power_of_2(heads), HALF=half, STAGE=stage is not None,
        E4M3_MAX=FP8_MAX, num_warps=num_warps,
        enable_fp_fusion=False,  # eager's separate products and sums (a contracted a * b - c rounds once)
    )
