"""norm2 (diffusers' ``FP32LayerNorm`` with weights) finished from torch's row statistics, in one Triton pass.

The eager path copies the bf16 hidden states to float32 and runs torch's layer norm with weight and bias.
On CUDA torch's kernel computes each output as one fused multiply-add, ``fma(w, (x - mean) * rstd, b)``
(nvcc contracts ``w * n + b``); the engine takes the row statistics from torch's kernel on the bf16 rows
(:func:`engine.models.kernels.layer_norm_stats`, bit-identical to the float32 copy's) and finishes here with
the same ``fma``. Inductor's version of the same formula rounds the product before the sum (it keeps eager's
separate operations apart), and so differs from torch's in some bf16 outputs where this kernel differs in
none (``bench/affine_norm_gpu.py``; docs/BENCHMARKS.md). Elsewhere (the CPU) the caller runs the eager formula.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the engine then never calls this module
    triton = None


if triton is not None:

    @triton.jit
    def _normalize_affine_rows(X, Mean, Rstd, W, B, Y, stride_x, stride_y, D: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        keep = cols < D
        x = tl.load(X + row * stride_x + cols, mask=keep, other=0.0).to(tl.float32)
        normed = (x - tl.load(Mean + row)) * tl.load(Rstd + row)
        w = tl.load(W + cols, mask=keep, other=0.0).to(tl.float32)
        b = tl.load(B + cols, mask=keep, other=0.0).to(tl.float32)
        tl.store(Y + row * stride_y + cols, tl.fma(w, normed, b).to(Y.dtype.element_ty), mask=keep)


def available(x: torch.Tensor) -> bool:
    """Whether :func:`normalize_affine_rows` runs for ``x`` (CUDA, Triton installed)."""
    return triton is not None and x.is_cuda


def normalize_affine_rows(
    x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """``fma(weight, (x - mean) * rstd, bias)`` per row in float32, in ``x``'s dtype: ``x [..., D]`` on CUDA,
    ``mean`` / ``rstd`` float32 ``[..., 1]`` (torch's statistics of those rows), ``weight`` / ``bias`` ``[D]``.
    No host synchronisation: runs inside CUDA graph captures."""
    dim = x.shape[-1]
    rows = x.reshape(-1, dim)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty((rows.shape[0], dim), dtype=x.dtype, device=x.device)
    if rows.shape[0]:
        _normalize_affine_rows[(rows.shape[0],)](
            rows, mean.reshape(-1).contiguous(), rstd.reshape(-1).contiguous(), weight.contiguous(),
            bias.contiguous(), out, rows.stride(0), out.stride(0), D=dim, BLOCK=triton.next_power_of_2(dim),
        )
    return out.view(x.shape)
