"""FP8 (e4m3) weights and activations for a DiT block's matrix products: ``--fp8 linear``.

A converted ``nn.Linear`` keeps its weight as ``float8_e4m3fn`` with one float32
scale per output channel (``amax / 448`` over the input dim), quantized once at
build time; the bf16 weight is dropped. Each forward quantizes its activation
per row (token) with a dynamic scale (``amax / 448`` over the last dim) and runs
``torch._scaled_mm`` with both rowwise scales, bias added in its epilogue, the
output in the activation's dtype. Rowwise scales keep one outlier token or one
large output channel from crushing the others' precision. ``fast_accum``
(``fp8_fast_accum``): the product accumulates in the tensor cores' own precision,
without the periodic promotion of partial sums to float32 (``use_fast_accum``;
the CPU's product ignores it); docs/FP8.md measures what that costs and gives.

On CUDA the activation's quantization (amax, scale, cast) is one compiled kernel
(:class:`~engine.models.kernels.DeviceKernel`), the FFN's GELU input's a one-pass Triton
kernel (:mod:`engine.models.gelu_quantize`); :func:`quantize_rows` is their eager
reference and what the CPU runs. Nothing here synchronises with the host or
branches on tensor values: the forward runs inside CUDA graph captures.

Only bf16 models are converted (the engine refuses other dtypes with FP8): on
CUDA rowwise ``_scaled_mm`` writes bf16 only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.models import gelu_quantize
from engine.models.e4m3 import AMAX_FLOOR, FP8_DTYPE, FP8_MAX
from engine.models.kernels import DeviceKernel

# _scaled_mm on CUDA needs the inner (K) and output (N) dims to be multiples of 16.
ALIGNMENT = 16

# The linears every forward of a Wan block runs; attn2.to_k / to_v project the text once per prompt, stay bf16.
BLOCK_LINEARS = (
    "attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0",
    "attn2.to_q", "attn2.to_out.0",
    "ffn.net.0.proj", "ffn.net.2",
)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> (``float8_e4m3fn [M, K]``, float32 scale ``[M, 1]``) with ``x ≈ q * scale`` per row.

    The clamp guards the cast: division can land a hair above 448, and e4m3fn has no infinity.
    """
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(AMAX_FLOOR)
    scale = amax / FP8_MAX
    quantized = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scale


def gelu_quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows` of ``GELU(x)`` (tanh form, as Wan's FFN): compiled, one kernel reads ``x`` and writes
    the e4m3 rows, where the separate GELU wrote the activation out in bf16 and the quantizer read it back."""
    return quantize_rows(torch.nn.functional.gelu(x, approximate="tanh"))


# One compiled kernel per (function, row width) for the process (eager off CUDA): each keeps its width a constant,
# so its reduction is specialised; only the token count varies between calls (kernels.DeviceKernel).
_QUANTIZERS: dict[tuple[str, int], DeviceKernel] = {}
_ROW_FUNCTIONS = {"rows": quantize_rows, "gelu_rows": gelu_quantize_rows}


def _quantizer(width: int, kind: str = "rows") -> DeviceKernel:
    kernel = _QUANTIZERS.get((kind, width))
    if kernel is None:
        kernel = _QUANTIZERS.setdefault((kind, width), DeviceKernel(_ROW_FUNCTIONS[kind]))
    return kernel


def _gelu_quantize(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`gelu_quantize_rows` of ``rows [M, K]``: on CUDA the one-pass Triton kernel (the row on chip, the tanh
    once: 2.1x faster than Inductor's two-pass reduction on an H100, docs/BENCHMARKS.md), else the compiled / eager
    form (the CPU's, and its reference)."""
    if rows.is_cuda and gelu_quantize.available(rows):
        return gelu_quantize.gelu_quantize_rows(rows)
    return _quantizer(rows.shape[-1], "gelu_rows")(rows)


@dataclass(frozen=True)
class QuantizedRows:
    """An activation already quantized for the FP8 products that read it, in the activation's place: e4m3
    ``values [M, K]`` and float32 row ``scale [M, 1]`` (as :func:`quantize_rows` makes them) for an activation
    of ``shape [..., K]`` and ``dtype`` (the products' output dtype). :meth:`FP8Linear.forward` and
    :func:`project_shared` take it as they take a tensor; the norms that write it directly are
    :mod:`engine.models.norm_quantize`'s."""

    values: torch.Tensor
    scale: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype

    def __post_init__(self) -> None:
        rows = math.prod(self.shape[:-1])
        if self.values.shape != (rows, self.shape[-1]) or self.scale.shape != (rows, 1):
            raise ValueError(f"quantized rows {tuple(self.values.shape)} with scales {tuple(self.scale.shape)} do "
                             f"not stand for an activation of shape {tuple(self.shape)}")


def fits_fp8(linear: nn.Linear) -> bool:
    """Whether ``_scaled_mm`` takes this layer's shape (the same rule on every device, so CPU tests match CUDA)."""
    return linear.in_features % ALIGNMENT == 0 and linear.out_features % ALIGNMENT == 0


class FP8Linear(nn.Module):
    """An ``nn.Linear`` with e4m3 weights (per-output-channel scale) and per-token e4m3 activations.

    Layers whose in/out features are not multiples of 16 cannot run through
    ``_scaled_mm`` on CUDA: :func:`quantize_linears` leaves those in bf16
    (:func:`fits_fp8`); :meth:`from_linear` refuses them.
    """

    def __init__(self, weight_fp8: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None, *,
                 fast_accum: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_fp8.shape
        self.fast_accum = fast_accum
        # Buffers, not parameters: nothing trains them. See _apply for why .to(dtype) leaves the first two alone.
        self.register_buffer("weight_fp8", weight_fp8)  # [N, K] row-major: .t() is the column-major mat2
        self.register_buffer("weight_scale", weight_scale)  # [1, N] float32
        self.register_buffer("bias", bias)  # [N] in the activation dtype, or None

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, *, fast_accum: bool = False) -> "FP8Linear":
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"FP8Linear.from_linear needs an nn.Linear, got {type(linear).__name__}")
        if not fits_fp8(linear):
            raise ValueError(
                f"Linear({linear.in_features}, {linear.out_features}): FP8 needs in and out features that are "
                f"multiples of {ALIGNMENT} (torch._scaled_mm on CUDA)"
            )
        weight = linear.weight
        if not weight.is_floating_point() or weight.dtype == FP8_DTYPE:
            raise TypeError(f"FP8Linear.from_linear needs a float weight, got {weight.dtype}")
        # Per output channel = per row of the [N, K] weight: the same function as the activations' per-token scale.
        weight_fp8, scale = quantize_rows(weight)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls(weight_fp8.contiguous(), scale.reshape(1, -1).contiguous(), bias, fast_accum=fast_accum)

    def _apply(self, fn, recurse=True):
        """Device moves apply to every buffer; a dtype cast (``.to(bf16)``, ``.float()``) only to the bias.

        A cast would otherwise upcast the fp8 weight (float8 counts as floating point) and round the
        float32 scales, and ``_scaled_mm`` would then refuse the weight.
        """
        weight, scale = self.weight_fp8, self.weight_scale
        super()._apply(fn, recurse)
        self.weight_fp8 = weight.to(self.weight_fp8.device)
        self.weight_scale = scale.to(self.weight_scale.device)
        return self

    @property
    def weight_bytes(self) -> int:
        """Bytes of the quantized weight and its scales (the bias is the same as the bf16 layer's)."""
        return self.weight_fp8.nbytes + self.weight_scale.nbytes

    def dequantized_weight(self) -> torch.Tensor:
        """The float32 weight this layer multiplies by (``q * scale``): the reference for tests."""
        return self.weight_fp8.float() * self.weight_scale.t()

    def forward(self, x: torch.Tensor | QuantizedRows) -> torch.Tensor:
        if isinstance(x, QuantizedRows):
            return self.forward_quantized(x, x.values, x.scale)
        return self.forward_quantized(x, *self.quantize_input(x))

    def forward_gelu(self, x: torch.Tensor) -> torch.Tensor:
        """``self(GELU(x))`` (tanh form) with the GELU inside the input's quantizer: no bf16 GELU output."""
        return self.forward_quantized(x, *self.quantize_input(x, gelu=True))

    def quantize_input(self, x: torch.Tensor, *, gelu: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [..., in_features]`` -> (e4m3 rows ``[M, in_features]``, float32 row scales ``[M, 1]``): what
        :meth:`forward_quantized` takes. Layers that read the same input (q, k and v) can share one result."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"FP8Linear expects {self.in_features} input features, got shape {tuple(x.shape)}")
        # _scaled_mm is 2-D and wants a row-major mat1: flatten batch/sequence dims (a no-op copy when contiguous).
        rows = x.reshape(-1, self.in_features).contiguous()
        if gelu:
            return _gelu_quantize(rows)
        return _quantizer(self.in_features)(rows)

    def forward_quantized(
        self, x: torch.Tensor | QuantizedRows, quantized: torch.Tensor, scale: torch.Tensor
    ) -> torch.Tensor:
        """The product on :meth:`quantize_input`'s result for ``x`` (read for its shape and dtype only)."""
        if x.shape[-1] != self.in_features or quantized.shape != (math.prod(x.shape[:-1]), self.in_features):
            raise ValueError(f"FP8Linear({self.in_features}): quantized rows {tuple(quantized.shape)} do not match "
                             f"the input {tuple(x.shape)}")
        out = torch._scaled_mm(
            quantized,
            self.weight_fp8.t(),
            scale_a=scale,
            scale_b=self.weight_scale,
            bias=self.bias,
            out_dtype=x.dtype,
            use_fast_accum=self.fast_accum,
        )
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"fp8=e4m3fn, fast_accum={self.fast_accum}")


@dataclass
class FP8Conversion:
    """What :func:`quantize_linears` did: layers converted, layers left bf16 (by name, and why), bytes saved."""

    converted: int = 0
    bytes_saved: int = 0
    kept: list[str] = field(default_factory=list)


def _parent_and_name(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent, _, name = path.rpartition(".")
    return (root.get_submodule(parent) if parent else root), name


@torch.no_grad()
def quantize_linears(transformer_blocks: Iterable[nn.Module], names: tuple[str, ...] = BLOCK_LINEARS, *,
                     fast_accum: bool = False) -> FP8Conversion:
    """Replace, in every Wan transformer block, the linears at ``names`` by :class:`FP8Linear`, in place
    (``fast_accum``: theirs, see the module docstring).

    The bf16 weights are released (the blocks hold the fp8 ones only), so
    memory measured after this sees the smaller model. A layer whose shape
    ``_scaled_mm`` cannot take stays bf16 and is listed in ``kept``; a name a
    block lacks, or that is not an ``nn.Linear``, is an error (a Wan variant
    this code does not know).
    """
    result = FP8Conversion()
    for index, block in enumerate(transformer_blocks):
        for path in names:
            parent, name = _parent_and_name(block, path)
            linear = parent.get_submodule(name)
            if isinstance(linear, FP8Linear):
                raise ValueError(f"block {index} {path}: already FP8 (quantize_linears ran twice)")
            if not isinstance(linear, nn.Linear):
                raise TypeError(f"block {index} {path}: expected an nn.Linear, found {type(linear).__name__}")
            if not fits_fp8(linear):
                result.kept.append(f"blocks.{index}.{path} ({linear.in_features}->{linear.out_features})")
                continue
            fp8 = FP8Linear.from_linear(linear, fast_accum=fast_accum)
            result.bytes_saved += linear.weight.nbytes - fp8.weight_bytes
            result.converted += 1
            # ModuleList children are named "0", "1", ...: setattr replaces them as it does attributes.
            setattr(parent, name, fp8)
    return result


def project_shared(x: torch.Tensor | QuantizedRows, *linears: nn.Module) -> tuple[torch.Tensor, ...]:
    """``tuple(linear(x) for linear in linears)``, with ``x`` quantized once where every layer is an
    :class:`FP8Linear` of the same width (the self-attention's q, k and v): the same rows and scales each layer
    would compute for itself, so the same products. ``x`` already quantized (:class:`QuantizedRows`): every
    layer must be an :class:`FP8Linear`."""
    if isinstance(x, QuantizedRows):
        if not all(type(linear) is FP8Linear for linear in linears):
            raise TypeError("quantized rows feed FP8 linears only")
        return tuple(linear.forward_quantized(x, x.values, x.scale) for linear in linears)
    if len(linears) > 1 and all(type(linear) is FP8Linear for linear in linears) \
            and len({linear.in_features for linear in linears}) == 1:
        quantized, scale = linears[0].quantize_input(x)
        return tuple(linear.forward_quantized(x, quantized, scale) for linear in linears)
    return tuple(linear(x) for linear in linears)
