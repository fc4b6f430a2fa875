"""The FFN's GELU and its second FP8 product's input quantization in one pass over each row, in Triton.

``--fp8 linear`` quantizes ``GELU(h)`` per row (``h``: the FFN's first product, ``[tokens, 8960]`` at 1.3B)
before the second product (:meth:`engine.models.fp8_linear.FP8Linear.forward_gelu`). The compiled form of that
(:func:`engine.models.fp8_linear.gelu_quantize_rows` through Inductor) is a two-pass row reduction: it reads the
row for its amax, then again to cast, and computes the tanh on both passes; on an H100 it moves ~0.8 TB/s,
a quarter of the card's bandwidth (docs/BENCHMARKS.md, thirty-second session; the recomputed tanh is the
likely cost, not measured). Here one program holds its row on chip: one
read, the GELU once, the amax, one write of e4m3 rows and their scales.

The arithmetic follows the eager path's: the GELU (tanh form, written as ``x * sigmoid(2u)``,
``u = sqrt(2/pi) * (x + 0.044715 x^3)``) in float32, rounded to the input's dtype as ``F.gelu`` returns it;
``amax`` floored at ``AMAX_FLOOR``, ``scale = amax / 448``; each value times ``448 / amax`` (one rounding where
eager divides by the scale: a value on an e4m3 tie can land one step away), clamped to ±448, cast to e4m3 to
nearest even.

What ``FP8Linear.forward_gelu`` runs on CUDA (:func:`engine.models.fp8_linear._gelu_quantize`): on an H100 at
4,680 x 8,960, 163 -> 77 µs a call against the compiled form, within one e4m3 step of eager
(``bench/gelu_quantize_gpu.py``, docs/BENCHMARKS.md, thirty-third session).
"""

from __future__ import annotations

import torch

from engine.models.e4m3 import AMAX_FLOOR, FP8_DTYPE, FP8_MAX

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the engine then never calls this module
    triton = None

MAX_WIDTH = 16384  # one row on chip: 16,384 float32 over 16 warps is 32 registers a thread


if triton is not None:

    @triton.jit
    def _gelu_quantize_rows(X, Q, Scale, stride_x, stride_q, WIDTH: tl.constexpr, BLOCK: tl.constexpr,
                            E4M3_MAX: tl.constexpr, FLOOR: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        keep = cols < WIDTH
        x = tl.load(X + row * stride_x + cols, mask=keep, other=0.0)
        h = x.to(tl.float32)
        u = 0.7978845608028654 * (h + 0.044715 * h * h * h)  # sqrt(2 / pi) * (h + 0.044715 h^3)
        # GELU(h) = h * sigmoid(2u), exp(-2u) = exp2(-2u / ln 2); rounded to the input dtype as F.gelu's output
        # is; 0 in the masked lanes.
        gelu = (h / (1.0 + tl.math.exp2(-2.8853900817779268 * u))).to(x.dtype).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(gelu), 0), FLOOR)
        tl.store(Scale + row, tl.math.div_rn(amax, E4M3_MAX))
        inverse = tl.math.div_rn(E4M3_MAX, amax)
        quantized = tl.clamp(gelu * inverse, -E4M3_MAX, E4M3_MAX).to(tl.float8e4nv)
        tl.store(Q + row * stride_q + cols, quantized, mask=keep)


def available(x: torch.Tensor) -> bool:
    """Whether :func:`gelu_quantize_rows` runs for ``x``: CUDA (or the Triton interpreter in tests), Triton
    installed, rows of at most ``MAX_WIDTH``."""
    if triton is None or x.shape[-1] > MAX_WIDTH:
        return False
    return x.is_cuda or (x.device.type == "cpu" and _interpreted())


def _interpreted() -> bool:
    return triton is not None and type(_gelu_quantize_rows).__name__ == "InterpretedFunction"


def gelu_quantize_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows [M, K]`` (bf16 / fp16 / float32) -> (e4m3 ``GELU(rows)`` ``[M, K]``, float32 scales ``[M, 1]``), as
    :func:`engine.models.fp8_linear.gelu_quantize_rows` computes them (see the module docstring for the one
    rounding that may differ). No host synchronisation: runs inside CUDA graph captures."""
    if rows.ndim != 2 or not rows.is_floating_point():
        raise ValueError(f"rows must be a 2-D floating-point tensor, got {rows.dtype} {tuple(rows.shape)}")
    if not available(rows):
        raise ValueError(f"the one-pass GELU quantizer runs on CUDA with Triton, rows of at most {MAX_WIDTH}; "
                         f"got {rows.device}, width {rows.shape[-1]}")
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    count, width = rows.shape
    quantized = torch.empty((count, width), dtype=FP8_DTYPE, device=rows.device)
    scale = torch.empty((count, 1), dtype=torch.float32, device=rows.device)
    if count:
        block = triton.next_power_of_2(width)
        _gelu_quantize_rows[(count,)](rows, quantized, scale, rows.stride(0), quantized.stride(0), WIDTH=width,
                                      BLOCK=block, E4M3_MAX=FP8_MAX, FLOOR=AMAX_FLOOR,
                                      num_warps=max(4, min(16, block // 1024)))
    return quantized, scale
