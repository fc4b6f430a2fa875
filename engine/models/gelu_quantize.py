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


def row_parts(width: int) -> tuple[int, int, int]:
    """A row's width as up to three power-of-two parts, largest first, the last rounded up (masked past the
    width): 8,960 = 8,192 + 512 + 256, 1,536 = 1,024 + 512 + 0. A kernel block must be a power of two; one
    block of ``next_power_of_2(width)`` computed 16,384 lanes for the FFN's 8,960 values, and the kernel is bound
    by instruction issue, so the idle lanes cost as much as the rest (docs/BENCHMARKS.md, thirty-seventh
    session)."""
    first = 1 << (width.bit_length() - 1)
    rest = width - first
    second = 1 << (rest.bit_length() - 1) if rest else 0
    last = width - first - second
    return first, second, 1 << (last - 1).bit_length() if last else 0


if triton is not None:

    @triton.jit
    def _gelu_rounded(x):
        """GELU in float32, rounded to ``x``'s dtype as F.gelu's output is (0 where ``x`` is 0)."""
        h = x.to(tl.float32)
        u = 0.7978845608028654 * (h + 0.044715 * h * h * h)  # sqrt(2 / pi) * (h + 0.044715 h^3)
        # GELU(h) = h * sigmoid(2u), exp(-2u) = exp2(-2u / ln 2).
        return (h / (1.0 + tl.math.exp2(-2.8853900817779268 * u))).to(x.dtype).to(tl.float32)

    @triton.jit
    def _store_part(Q, cols, gelu, inverse, mask, E4M3_MAX: tl.constexpr):
        tl.store(Q + cols, tl.clamp(gelu * inverse, -E4M3_MAX, E4M3_MAX).to(tl.float8e4nv), mask=mask)

    @triton.jit
    def _gelu_quantize_rows(X, Q, Scale, stride_x, stride_q, WIDTH: tl.constexpr, PART0: tl.constexpr,
                            PART1: tl.constexpr, PART2: tl.constexpr, E4M3_MAX: tl.constexpr, FLOOR: tl.constexpr):
        # One program a row, held on chip as up to three power-of-two parts (row_parts): only the last may have
        # lanes past the width.
        row = tl.program_id(0).to(tl.int64)
        x_row = X + row * stride_x
        q_row = Q + row * stride_q
        cols0 = tl.arange(0, PART0)
        gelu0 = _gelu_rounded(tl.load(x_row + cols0))
        amax = tl.max(tl.abs(gelu0), 0)
        if PART1 > 0:
            cols1 = PART0 + tl.arange(0, PART1)
            gelu1 = _gelu_rounded(tl.load(x_row + cols1))
            amax = tl.maximum(amax, tl.max(tl.abs(gelu1), 0))
        if PART2 > 0:
            cols2 = PART0 + PART1 + tl.arange(0, PART2)
            gelu2 = _gelu_rounded(tl.load(x_row + cols2, mask=cols2 < WIDTH, other=0.0))
            amax = tl.maximum(amax, tl.max(tl.abs(gelu2), 0))
        amax = tl.maximum(amax, FLOOR)
        tl.store(Scale + row, tl.math.div_rn(amax, E4M3_MAX))
        inverse = tl.math.div_rn(E4M3_MAX, amax)
        _store_part(q_row, cols0, gelu0, inverse, None, E4M3_MAX)
        if PART1 > 0:
            _store_part(q_row, cols1, gelu1, inverse, None, E4M3_MAX)
        if PART2 > 0:
            _store_part(q_row, cols2, gelu2, inverse, cols2 < WIDTH, E4M3_MAX)


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
        parts = row_parts(width)
        _gelu_quantize_rows[(count,)](rows, quantized, scale, rows.stride(0), quantized.stride(0), WIDTH=width,
                                      PART0=parts[0], PART1=parts[1], PART2=parts[2], E4M3_MAX=FP8_MAX,
                                      FLOOR=AMAX_FLOOR, num_warps=max(4, min(16, parts[0] // 1024)))
    return quantized, scale
