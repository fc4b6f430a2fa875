"""A DiT block's layer norms writing their FP8 product's e4m3 input directly, in one Triton pass over each row.

With ``--fp8 linear | all`` every layer norm of a Wan block feeds FP8 products only: norm1 (modulated) the
self-attention's q, k and v, norm2 (affine) the cross-attention's q, norm3 (modulated) the FFN's first
product. The engine's other path makes four passes over the rows for each: torch's layer-norm kernel for the
row statistics (it writes a normalized copy nobody reads), a compiled kernel that normalizes and modulates
into bf16, a compiled quantizer that reads those bf16 rows for their amax and again to cast them (docs/
BENCHMARKS.md, thirty-fifth session). Here one program holds its rows on chip: the residual that precedes the
norm (norm2's gated one, norm3's plain one) is added and written out, the statistics, the normalization, the
affine or modulation, the bf16 rounding the eager activation has, the row's amax and the e4m3 cast all happen
in one read.

The arithmetic is the eager path's (``engine.models.kernels``: ``gated_residual``, ``affine_layer_norm``,
``modulated_layer_norm``, then ``engine.models.fp8_linear.quantize_rows``), in float32, operation for operation,
but for two differences. The mean and variance are summed in another order than torch's kernel: that float32
noise can move a normalized value across a bf16 rounding tie, so a value may land one e4m3 step from eager's,
and a row whose largest value moved has its scale one bf16 step away. And in the configuration the H100's sweep
chose (:data:`DEFAULT_CONFIG`), each value is multiplied by ``448 / amax`` where eager divides by ``amax / 448``
(one rounding apart: ~0.1 % of the values one e4m3 step away; ``divide=True`` divides as eager does, and then
no value of the tests' inputs or the tiny engine's moved). tests/test_norm_quantize.py bounds both.
:func:`norm_quantize_reference` is that eager path, and what runs where the kernel does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers.models.activations import GELU

from engine.models import kernels as K
from engine.models.e4m3 import AMAX_FLOOR, FP8_DTYPE, FP8_MAX
from engine.models.fp8_linear import FP8Linear, QuantizedRows, quantize_rows

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the engine then runs the reference
    triton = None

MAX_WIDTH = 8192  # one row on chip in float32 (Wan 1.3B: 1,536; 14B: 5,120)


@dataclass(frozen=True)
class NormQuantizeConfig:
    """The kernel's launch: rows a program, warps a program, and ``divide``: each value divided by its row's
    scale as eager divides (IEEE), or multiplied by ``448 / amax`` (one rounding apart: ~0.1 % of the values
    land one e4m3 step away; fewer instructions). ``bench/norm_quantize_gpu.py`` times them."""

    rows_per_program: int = 2
    num_warps: int = 4
    divide: bool = True

    def __post_init__(self) -> None:
        for name in ("rows_per_program", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 1, got {value}")


DEFAULT_CONFIG = NormQuantizeConfig(2, 2, divide=False)  # the fastest of bench/norm_quantize_gpu.py's sweep (H100)


if triton is not None:

    @triton.jit
    def _norm_quantize_rows(
        X, U, Gate, HOut, W, B, Scale, Shift, Q, QScale,
        rows, stride_x, stride_u, stride_h, stride_q, stride_mod, tokens_per_frame, eps,
        D: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, ONE_FRAME: tl.constexpr, DIVIDE: tl.constexpr,
        RESIDUAL: tl.constexpr, GATED: tl.constexpr, AFFINE: tl.constexpr, MODULATE: tl.constexpr,
        E4M3_MAX: tl.constexpr, FLOOR: tl.constexpr,
    ):
        first = tl.program_id(0) * ROWS
        row = first + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        in_row = cols < D
        keep = (row < rows)[:, None] & in_row[None, :]
        # The per-frame modulation's row: rows are [batch, frames * tokens] flattened, modulation [batch * frames].
        # ONE_FRAME: ROWS divides the tokens of a frame, so a program's rows share one frame and its vectors are
        # loaded once for all of them (per row they were most of the kernel's traffic).
        if ONE_FRAME:
            mod_offsets = ((first // tokens_per_frame).to(tl.int64) * stride_mod + cols)[None, :]
            mod_mask = in_row[None, :]
        else:
            mod_offsets = (row // tokens_per_frame).to(tl.int64)[:, None] * stride_mod + cols[None, :]
            mod_mask = keep
        offsets = row.to(tl.int64)[:, None]
        x = tl.load(X + offsets * stride_x + cols[None, :], mask=keep, other=0.0)
        if RESIDUAL:  # hidden + update (* gate), in float32, rounded to the hidden states' dtype and kept
            update = tl.load(U + offsets * stride_u + cols[None, :], mask=keep, other=0.0).to(tl.float32)
            if GATED:
                update = update * tl.load(Gate + mod_offsets, mask=mod_mask, other=0.0)
            x = (x.to(tl.float32) + update).to(x.dtype)
            tl.store(HOut + offsets * stride_h + cols[None, :], x, mask=keep)
        h = x.to(tl.float32)
        mean = tl.sum(h, 1) / D
        centered = tl.where(keep, h - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(centered * centered, 1) / D + eps)
        normed = centered * rstd[:, None]
        if AFFINE:  # torch's CUDA layer norm: one multiply-add
            w = tl.load(W + cols, mask=in_row, other=0.0).to(tl.float32)
            b = tl.load(B + cols, mask=in_row, other=0.0).to(tl.float32)
            normed = tl.fma(w[None, :], normed, b[None, :])
        if MODULATE:  # normed * (1 + scale) + shift, the frame's
            scale = tl.load(Scale + mod_offsets, mask=mod_mask, other=0.0)
            shift = tl.load(Shift + mod_offsets, mask=mod_mask, other=0.0)
            normed = normed * (1.0 + scale) + shift
        # The activation the eager path quantizes is the norm's output in the hidden states' dtype.
        normed = tl.where(keep, normed.to(x.dtype).to(tl.float32), 0.0)
        amax = tl.maximum(tl.max(tl.abs(normed), 1), FLOOR)
        scale = tl.math.div_rn(amax, E4M3_MAX)
        tl.store(QScale + row, scale, mask=row < rows)
        if DIVIDE:  # as eager divides
            quantized = tl.math.div_rn(normed, scale[:, None])
        else:  # one rounding apart: ~0.1 % of the values land one e4m3 step away
            quantized = normed * tl.math.div_rn(E4M3_MAX, amax)[:, None]
        quantized = tl.clamp(quantized, -E4M3_MAX, E4M3_MAX).to(tl.float8e4nv)
        tl.store(Q + offsets * stride_q + cols[None, :], quantized, mask=keep)


def _interpreted() -> bool:
    return triton is not None and type(_norm_quantize_rows).__name__ == "InterpretedFunction"


def available(x: torch.Tensor) -> bool:
    """Whether the kernel runs for hidden states ``x``: CUDA (or the Triton interpreter, for tests), Triton
    installed, a float dtype e4m3 rows can come from, rows of at most ``MAX_WIDTH``."""
    if triton is None or x.shape[-1] > MAX_WIDTH or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    return x.is_cuda or (x.device.type == "cpu" and _interpreted())


def takes_quantized_inputs(block: torch.nn.Module) -> bool:
    """Whether every product a Wan block's norms feed is an :class:`FP8Linear` and its norms are the layer norms
    this kernel computes: then the block can run on :func:`norm_quantize`'s rows (``causal_wan``)."""
    attn1, attn2, ffn = block.attn1, block.attn2, block.ffn
    if len(ffn.net) != 3 or not isinstance(ffn.net[0], GELU) or ffn.net[0].approximate != "tanh" or ffn.training:
        return False  # the FFN as causal_wan._feed_forward fuses it: GELU(tanh) inside the second product's input
    linears = (attn1.to_q, attn1.to_k, attn1.to_v, attn2.to_q, ffn.net[0].proj, ffn.net[2])
    return (
        all(type(linear) is FP8Linear for linear in linears)
        and len({linear.in_features for linear in linears[:5]}) == 1
        and isinstance(block.norm1, torch.nn.LayerNorm) and not block.norm1.elementwise_affine
        and isinstance(block.norm2, torch.nn.LayerNorm) and block.norm2.elementwise_affine
        and block.norm2.bias is not None
        and isinstance(block.norm3, torch.nn.LayerNorm) and not block.norm3.elementwise_affine
    )


def _check(x, update, gate, weight, bias, scale, shift) -> None:
    if x.ndim != 3:
        raise ValueError(f"hidden states must be [batch, tokens, dim], got shape {tuple(x.shape)}")
    if gate is not None and update is None:
        raise ValueError("a gate needs the update it scales")
    if (weight is None) != (bias is None) or (scale is None) != (shift is None):
        raise ValueError("weight and bias, and scale and shift, come in pairs")
    if weight is not None and scale is not None:
        raise ValueError("a norm is either affine (norm2) or modulated (norm1, norm3), not both")
    if update is not None and update.shape != x.shape:
        raise ValueError(f"update {tuple(update.shape)} does not match the hidden states {tuple(x.shape)}")
    for name, mod in (("gate", gate), ("scale", scale), ("shift", shift)):
        if mod is not None and (mod.ndim != 4 or mod.shape[0] != x.shape[0] or mod.shape[2] != 1
                                or mod.shape[3] != x.shape[2] or x.shape[1] % mod.shape[1]):
            raise ValueError(f"{name} must be per frame, [batch, frames, 1, dim] dividing the tokens; "
                             f"got {tuple(mod.shape)} for hidden states {tuple(x.shape)}")


def norm_quantize_reference(
    x: torch.Tensor, eps: float, *, update: torch.Tensor | None = None, gate: torch.Tensor | None = None,
    weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
    scale: torch.Tensor | None = None, shift: torch.Tensor | None = None,
) -> tuple[torch.Tensor, QuantizedRows]:
    """The eager path :func:`norm_quantize` stands for: (hidden states after the residual, the norm's output
    quantized per row). Bit for bit what the block computes without the kernel."""
    _check(x, update, gate, weight, bias, scale, shift)
    if update is not None:
        x = K.gated_residual(x, update, gate) if gate is not None else x + update
    if weight is not None:
        normed = K.affine_layer_norm(x, weight, bias, eps)
    elif scale is not None:
        normed = K.modulated_layer_norm(x, scale, shift, eps)
    else:
        normed = F.layer_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)
    values, row_scale = quantize_rows(normed.reshape(-1, x.shape[-1]))
    return x, QuantizedRows(values, row_scale, x.shape, x.dtype)


def _frames(mod: torch.Tensor | None) -> torch.Tensor | None:
    """``[B, F, 1, D]`` float32 as ``[B, F, D]`` whose frames (batch-major) lie one stride apart (a view of the
    block's modulation table where it is one), unit column stride."""
    if mod is None:
        return None
    frames = mod.float().squeeze(2)
    if frames.stride(-1) != 1 or frames.stride(0) != frames.shape[1] * frames.stride(1):
        frames = frames.contiguous()
    return frames


def norm_quantize(
    x: torch.Tensor, eps: float, *, update: torch.Tensor | None = None, gate: torch.Tensor | None = None,
    weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
    scale: torch.Tensor | None = None, shift: torch.Tensor | None = None,
    config: NormQuantizeConfig | None = None,
) -> tuple[torch.Tensor, QuantizedRows]:
    """One layer norm of a Wan block, its FP8 product's input written directly: ``x [B, S, D]`` hidden states;
    ``update`` (and ``gate``, per frame): the residual added first (``x + update * gate``, or ``x + update``);
    ``weight``/``bias``: an affine norm (norm2); ``scale``/``shift`` ``[B, F, 1, D]`` float32: a modulated one
    (norm1, norm3). Returns the hidden states after the residual (``x`` itself without one) and the norm's
    output as e4m3 rows with their scales. Where :func:`available` is false, the reference. No host
    synchronisation: runs inside CUDA graph captures."""
    if not available(x):
        return norm_quantize_reference(x, eps, update=update, gate=gate, weight=weight, bias=bias, scale=scale,
                                       shift=shift)
    _check(x, update, gate, weight, bias, scale, shift)
    batch, tokens, dim = x.shape
    x = x.contiguous()
    count = batch * tokens
    values = torch.empty((count, dim), dtype=FP8_DTYPE, device=x.device)
    row_scale = torch.empty((count, 1), dtype=torch.float32, device=x.device)
    hidden = torch.empty_like(x) if update is not None else x
    update = update.contiguous() if update is not None else None
    gate, scale, shift = (_frames(m) for m in (gate, scale, shift))
    mods = [m for m in (gate, scale, shift) if m is not None]
    if len({m.stride(1) for m in mods}) > 1:  # one frame stride for all: contiguous copies
        gate, scale, shift = (m.contiguous() if m is not None else None for m in (gate, scale, shift))
        mods = [m for m in (gate, scale, shift) if m is not None]
    frames = mods[0].shape[1] if mods else 1
    config = config or DEFAULT_CONFIG
    rows_per_program = config.rows_per_program
    if count:
        block = triton.next_power_of_2(dim)
        _norm_quantize_rows[(triton.cdiv(count, rows_per_program),)](
            x, update if update is not None else x, gate if gate is not None else row_scale, hidden,
            weight if weight is not None else row_scale, bias if bias is not None else row_scale,
            scale if scale is not None else row_scale, shift if shift is not None else row_scale,
            values, row_scale,
            count, dim, dim, dim, dim, mods[0].stride(1) if mods else 0, tokens // frames, float(eps),
            D=dim, BLOCK=block, ROWS=rows_per_program, ONE_FRAME=(tokens // frames) % rows_per_program == 0,
            DIVIDE=config.divide,
            RESIDUAL=update is not None, GATED=gate is not None,
            AFFINE=weight is not None, MODULATE=scale is not None, E4M3_MAX=FP8_MAX, FLOOR=AMAX_FLOOR,
            num_warps=config.num_warps,
            enable_fp_fusion=False,  # eager's separate products and sums (a contracted a * b + c rounds once)
        )
    return hidden, QuantizedRows(values, row_scale, x.shape, x.dtype)
