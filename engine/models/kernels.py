"""The elementwise work of a DiT forward, as small pure functions that can each be fused into one kernel.

Between its matrix products and attention, one Wan block makes many passes over
the hidden states: float32 upcasts, layer norms, per-frame modulation, gated
residuals, RMS norms of q and k, rotary rotation, downcasts. Eager, each is its
own kernel and its own round trip through device memory; at 1.3B / 480p they
cost about as much as the matrix products (docs/BENCHMARKS.md). Each function
here is one such run of passes written once; on CUDA it goes through
``torch.compile`` (one generated kernel, compiled once and reused by every
layer, since the functions take tensors, never modules). The eager function is
the reference: ``DeviceKernel.eager`` is what the equivalence checks compare
against, and what the CPU runs.

Shapes: hidden states ``[B, S, dim]`` with ``S = frames * tokens_per_frame``,
frame-major; per-frame modulation ``[B, frames, 1, dim]`` in float32.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.models import affine_norm

log = logging.getLogger("arstream.kernels")


def _per_frame(x: torch.Tensor, frames: int) -> torch.Tensor:
    batch, seq, dim = x.shape
    return x.view(batch, frames, seq // frames, dim)


def modulate_frames(normed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``normed * (1 + scale) + shift`` in float32 on ``[B, frames, tokens, dim]``, cast to ``dtype``.

    Framed, so that compiled only the frame count varies between calls: a token's frame is then its index
    divided by a constant, not by a runtime size (which kept these kernels far below memory bandwidth).
    """
    return (normed * (1 + scale) + shift).to(dtype)


def normalize_modulate_frames(
    x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor
) -> torch.Tensor:
    """:func:`modulate_frames` of ``(x - mean) * rstd``: a layer norm finished from its row statistics.

    ``(x - mean) * rstd`` in float32 is what torch's layer-norm kernel writes for a float32 input (a
    subtraction and a product: nothing to contract into a multiply-add), so with torch's own ``mean`` and
    ``rstd`` this is :func:`modulated_layer_norm` bit for bit, minus the float32 copy of ``x`` and the
    float32 round trip of the normalized rows. Framed: ``x [B, F, T, D]``, ``mean``/``rstd`` ``[B, F, T, 1]``.
    """
    return modulate_frames((x.float() - mean) * rstd, scale, shift, x.dtype)


def gated_residual_frames(hidden: torch.Tensor, update: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``hidden + update * gate`` in float32 on ``[B, frames, tokens, dim]``, back in ``hidden``'s dtype."""
    return (hidden.float() + update.float() * gate).to(hidden.dtype)


def modulate(normed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``normed * (1 + scale) + shift`` in float32, per frame, cast to ``dtype``: the modulation after a norm."""
    return modulate_frames(_per_frame(normed, scale.shape[1]), scale, shift, dtype).view_as(normed)


def modulated_layer_norm(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float
) -> torch.Tensor:
    """``(LayerNorm(x) * (1 + scale) + shift)`` in float32, per frame, back in ``x``'s dtype (norm1 / norm3)."""
    return modulate(F.layer_norm(x.float(), (x.shape[-1],), eps=eps), scale, shift, x.dtype)


def gated_residual(hidden: torch.Tensor, update: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """``hidden + update * gate`` in float32, per frame, back in ``hidden``'s dtype."""
    frames = gate.shape[1]
    return gated_residual_frames(_per_frame(hidden, frames), _per_frame(update, frames), gate).view_as(hidden)


def affine_layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """diffusers' ``FP32LayerNorm`` with weights (norm2), back in ``x``'s dtype."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps).to(x.dtype)


def normalize_affine(
    x: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor
) -> torch.Tensor:
    """:func:`affine_layer_norm` finished from the rows' statistics: ``(x - mean) * rstd * weight + bias``.

    In float32, the product rounded before the sum, as Inductor compiles it and as torch's CPU kernel computes
    it (bit for bit there: the CPU tests). torch's CUDA kernel contracts the product and sum into one
    multiply-add, so on CUDA the engine finishes norm2 with :mod:`engine.models.affine_norm` instead (this
    form differed in ~1e-5 of the bf16 outputs there). ``mean``/``rstd`` ``[..., 1]``.
    """
    return ((x.float() - mean) * rstd * weight.float() + bias.float()).to(x.dtype)


def gelu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The FFN's first half as diffusers runs it (``GELU(approximate="tanh")`` of ``nn.Linear``)."""
    return F.gelu(F.linear(x, weight, bias), approximate="tanh")


def residual_modulated_layer_norm(
    hidden: torch.Tensor, update: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``hidden + update`` (the cross-attention residual), and norm3's modulated layer norm of the sum."""
    hidden = hidden + update
    return hidden, modulated_layer_norm(hidden, scale, shift, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``torch.nn.RMSNorm`` over the last dim (Wan's q/k norm across heads)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs of ``x [..., S, H, D]`` (Wan's convention), in float32.

    ``cos``/``sin``: ``[S, 1, D // 2]``, one angle per rotated pair.
    """
    pairs = x.float().unflatten(-1, (-1, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)


def rotate_interleaved(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """:func:`rotate_pairs` as ``x * [cos, cos] + swap_pairs(x) * [-sin, sin]``, from interleaved full-width tables.

    Bit for bit the same arithmetic (the same products; a sum's addends swapped, a difference written as a
    sum with the negated product: both exact in IEEE arithmetic). Compiled it is one plain elementwise pass;
    the stack of two results in :func:`rotate_pairs` compiled to a kernel several times slower
    (bench/elementwise_gpu.py; docs/BENCHMARKS.md).
    """
    xf = x.float()
    swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (xf * cos2 + swapped * sin2).to(x.dtype)


def rms_norm_rotate(
    x: torch.Tensor, weight: torch.Tensor, eps: float, heads: int, cos: torch.Tensor, sin: torch.Tensor
) -> torch.Tensor:
    """RMS norm across heads, split into ``heads``, rotate: a query's whole path from its projection."""
    return rotate_pairs(rms_norm(x, weight, eps).unflatten(-1, (heads, -1)), cos, sin)


def compile_kernel(fn: Callable) -> Callable:
    """``torch.compile`` of one kernel function, rounding where the eager function rounds.

    Inductor keeps a fused chain's intermediates in float32 unless told otherwise; eager rounds each op's
    bf16 output (e.g. the RMS norm's before the rotation). ``emulate_precision_casts`` rounds at the same
    places (on the CPU a fused norm + rotation then matches eager to float32 noise, tests/test_fast_paths.py), and it also
    keeps ``a * b + c`` from becoming one fused multiply-add. With the norms fused too (``fuse_norms``) a 1.3B
    bf16 block still differs from the eager one (the norms reduce in another order); the engine's set,
    norms on torch's kernels, is bit-identical to eager there (docs/BENCHMARKS.md).
    """
    return torch.compile(fn, dynamic=None, options={"emulate_precision_casts": True})


class DeviceKernel:
    """``fn`` through ``torch.compile`` on CUDA tensors; eager elsewhere, or if compiling fails.

    Automatic dynamic shapes: the first call compiles for its shapes; a later
    call that changes a size recompiles once with that size dynamic, and that
    kernel then serves every value of it (history length, first block, recache
    groups): the warm-up meets them all, so none compiles after it. Sizes that
    never change (tokens per frame, heads, width) stay constants, which keeps
    the index arithmetic cheap (``dynamic=True`` made every size a runtime value
    and these memory-bound kernels ran far under bandwidth).
    """

    compile_on_cpu = False  # tests set this to run Inductor's CPU backend through the same objects
    _instances: "weakref.WeakSet[DeviceKernel]" = weakref.WeakSet()

    def __init__(self, fn: Callable) -> None:
        self.eager = fn
        self._compiled: Callable | None = None
        self._failed = False
        self._lock = threading.Lock()
        DeviceKernel._instances.add(self)

    @classmethod
    def forget_compiled(cls) -> None:
        """Drop every kernel's compiled form and dynamo's caches: the next calls compile afresh.

        For processes that run models of several sizes one after another (benchmarks): automatic dynamic
        shapes would otherwise serve the second model's sizes with a kernel generic in them, several times
        slower than one specialised for them. The engine runs one model and never calls this.
        """
        torch._dynamo.reset()
        for kernel in list(cls._instances):
            with kernel._lock:
                kernel._compiled, kernel._failed = None, False

    @classmethod
    def compiles_for(cls, tensor: torch.Tensor) -> bool:
        """Whether a kernel called on ``tensor`` runs compiled (CUDA, or the CPU in tests)."""
        return tensor.is_cuda or cls.compile_on_cpu

    def __call__(self, *args):
        # Inside a CUDA graph capture the compiled kernel runs too: the forward graphs run every shape
        # eagerly (compiling it) right before capturing it, so no compile happens during a capture.
        if self.compiles_for(args[0]) and not self._failed:
            try:
                return self._compiled_fn()(*args)
            except Exception:
                self._failed = True
                log.warning("fused kernel %s unavailable; running it eagerly", self.eager.__name__, exc_info=True)
        return self.eager(*args)

    def _compiled_fn(self) -> Callable:
        if self._compiled is None:
            with self._lock:  # importing the compiler costs the CPU-only path time: only on first CUDA use
                if self._compiled is None:
                    self._compiled = compile_kernel(self.eager)
        return self._compiled


# The FP8 modes' norms write their products' e4m3 rows directly, and with FP8 attention q and k theirs
# (Kernels.quantized_norms). Off: they write bf16 as the exact sets' do, for a benchmark's "before"
# (bench/fp8_linear_probe.py's "all/apart" mode, bench/device/run_norm_quantize.sh's "off" servers).
QUANTIZED_NORMS = True


@dataclass(frozen=True)
class Kernels:
    """The elementwise steps a forward runs: fused (compiled on CUDA) or the eager reference.

    ``fuse_norms=False`` (the engine's default) keeps every layer/RMS norm on the eager path's own kernel
    and fuses only the elementwise work around it (the modulation, gated residuals, the rotation): a
    fused norm reduces in another order than torch's, and in a bf16 model that one difference grows to a
    a visible relative difference per block (docs/BENCHMARKS.md); with the norms apart the fast path computes
    what the eager path computes.
    """

    fused: bool
    modulated_layer_norm: Callable
    gated_residual: Callable
    affine_layer_norm: Callable
    residual_modulated_layer_norm: Callable
    rms_norm: Callable
    rotate_pairs: Callable
    rms_norm_rotate: Callable
    gelu_linear: Callable
    fuse_norms: bool = False
    exact: bool = True  # every step computes the eager bf16 result bit for bit (see make)
    # Norms that feed FP8 products only write their e4m3 rows directly (engine/models/norm_quantize.py), and
    # under FP8 attention q and k theirs (engine/models/qk_quantize.py): reductions in another order than
    # torch's, so only in the sets that need not be exact.
    quantized_norms: bool = False

    @classmethod
    def make(
        cls, fused: bool, only: tuple[str, ...] | None = None, *, fuse_norms: bool = False, exact: bool = True
    ) -> "Kernels":
        """All steps fused (or eager); with ``only``, just those steps fused (for benchmarks of one step).

        ``fuse_norms``: the norms fused into their neighbours too (one kernel each, another reduction order).
        ``exact=False``: also the steps that round differently from eager (the FFN's GELU in its matrix
        product's epilogue: as far from float32 as eager, but not eager's bits; docs/BENCHMARKS.md; the norms
        writing their FP8 products' e4m3 rows, ``quantized_norms``); the FP8 modes take them, being measured
        against bf16 by their quality delta anyway.
        """
        if not fused:
            return cls(fused=False, **_EAGER)
        chosen = _FUSED_TABLES[fuse_norms, exact]
        table = {name: chosen[name] if only is None or name in only else fn for name, fn in _EAGER.items()}
        quantized_norms = QUANTIZED_NORMS and not exact and (only is None or "quantized_norms" in only)
        return cls(fused=True, fuse_norms=fuse_norms, exact=exact, quantized_norms=quantized_norms, **table)


_EAGER: dict[str, Callable] = {
    "modulated_layer_norm": modulated_layer_norm,
    "gated_residual": gated_residual,
    "affine_layer_norm": affine_layer_norm,
    "residual_modulated_layer_norm": residual_modulated_layer_norm,
    "rms_norm": rms_norm,
    "rotate_pairs": rotate_pairs,
    "rms_norm_rotate": rms_norm_rotate,
    "gelu_linear": gelu_linear,
}
# One compiled kernel per function for the process: every layer of every model reuses it.
_FUSED_NORMALIZE_MODULATE = DeviceKernel(normalize_modulate_frames)
_FUSED_GATED_RESIDUAL = DeviceKernel(gated_residual_frames)
_FUSED_NORMALIZE_AFFINE = DeviceKernel(normalize_affine)


def layer_norm_stats(x: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's mean and ``1 / sqrt(var + eps)`` in float32 ``[..., 1]``, from torch's own layer-norm kernel.

    On CUDA the kernel reads the bf16 rows themselves: it accumulates in float32 and, vectorised alike for
    both input types, returns the statistics it computes for the float32 copy the eager path normalizes
    (a GPU test and bench/bench_fast_paths.py's equivalence check hold it to bit-identity). Elsewhere, and
    for any input whose statistics come back in another dtype (the CPU rounds a bf16 input's to bf16), they
    are taken from the float32 copy as eager does.
    """
    if x.is_cuda:
        _, mean, rstd = torch.native_layer_norm(x, (x.shape[-1],), None, None, eps)
        if mean.dtype == torch.float32 and rstd.dtype == torch.float32:
            return mean, rstd
    _, mean, rstd = torch.native_layer_norm(x.float(), (x.shape[-1],), None, None, eps)
    return mean, rstd


def _modulated_layer_norm_apart(x, scale, shift, eps):
    frames = scale.shape[1]
    mean, rstd = layer_norm_stats(x, eps)
    framed = (_per_frame(t, frames) for t in (x, mean, rstd))
    return _FUSED_NORMALIZE_MODULATE(*framed, scale, shift).view_as(x)


def _affine_layer_norm_apart(x, weight, bias, eps):
    mean, rstd = layer_norm_stats(x, eps)
    if affine_norm.available(x):  # torch's own rounding (one multiply-add): bit-identical to the eager norm
        return affine_norm.normalize_affine_rows(x, mean, rstd, weight, bias)
    return _FUSED_NORMALIZE_AFFINE(x, mean, rstd, weight, bias)


def _gelu_linear_epilogue(x, weight, bias):
    """:func:`gelu_linear` with the GELU in the matrix product's epilogue on CUDA (cuBLASLt ``GELU_BIAS``).

    One pass fewer over the FFN's widest activation (``[tokens, 8960]`` at 1.3B): the GELU is applied to
    the float32 accumulator before its one rounding to bf16, where eager rounds the product first. On
    CUDA ``torch._addmm_activation``'s GELU is the tanh approximation (cuBLASLt's epilogue, and the same
    function where cuBLASLt is not used); on the CPU it is the exact erf form, so the CPU runs eager.
    """
    if not x.is_cuda or bias is None:
        return gelu_linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    out = torch._addmm_activation(bias, rows, weight.t(), use_gelu=True)
    return out.view(*x.shape[:-1], weight.shape[0])


def _gated_residual_apart(hidden, update, gate):
    frames = gate.shape[1]
    return _FUSED_GATED_RESIDUAL(_per_frame(hidden, frames), _per_frame(update, frames), gate).view_as(hidden)


def _residual_modulated_layer_norm_apart(hidden, update, scale, shift, eps):
    hidden = hidden + update
    return hidden, _modulated_layer_norm_apart(hidden, scale, shift, eps)


class _InterleavedRope:
    """Interleaved full-width copies of the rotary tables, one per table, for :func:`rotate_interleaved`.

    The callers pass row slices of the rotary module's cached tables (fixed for the engine's life); the
    copy is built once per table (holding the table, so its address is never another's) outside any CUDA
    graph capture, and sliced like the view it stands for. Anything else gets ``None``: the caller then
    rotates from the half tables.
    """

    MAX_TABLES = 256

    def __init__(self) -> None:
        self._tables: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def __call__(self, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        cos_base = cos if cos._base is None else cos._base
        sin_base = sin if sin._base is None else sin._base
        if cos_base.dim() != 3 or not cos_base.is_contiguous() or cos.stride() != cos_base.stride():
            return None
        if sin_base.shape != cos_base.shape or not sin_base.is_contiguous() or sin.stride() != sin_base.stride():
            return None
        start = cos.storage_offset() - cos_base.storage_offset()
        if start % cos_base.stride(0) or start != sin.storage_offset() - sin_base.storage_offset():
            return None
        key = (id(cos_base), id(sin_base))
        entry = self._tables.get(key)
        if entry is None or entry[0] is not cos_base or entry[1] is not sin_base:
            if len(self._tables) >= self.MAX_TABLES or (cos.is_cuda and torch.cuda.is_current_stream_capturing()):
                return None
            cos2 = torch.stack((cos_base, cos_base), -1).flatten(-2)
            sin2 = torch.stack((-sin_base, sin_base), -1).flatten(-2)
            entry = (cos_base, sin_base, cos2, sin2)
            self._tables[key] = entry
        row = start // cos_base.stride(0)
        return entry[2][row : row + cos.shape[0]], entry[3][row : row + cos.shape[0]]


_INTERLEAVED_ROPE = _InterleavedRope()
_FUSED_ROTATE_INTERLEAVED = DeviceKernel(rotate_interleaved)


_FUSED_ROTATE_PAIRS = DeviceKernel(rotate_pairs)


def _rotate_pairs_fast(x, cos, sin):
    tables = _INTERLEAVED_ROPE(cos, sin) if DeviceKernel.compiles_for(x) else None
    if tables is None:
        return _FUSED_ROTATE_PAIRS(x, cos, sin)
    return _FUSED_ROTATE_INTERLEAVED(x, *tables)


def _rms_norm_rotate_apart(x, weight, eps, heads, cos, sin):
    return _rotate_pairs_fast(rms_norm(x, weight, eps).unflatten(-1, (heads, -1)), cos, sin)


# The fused steps but the FFN's first half, in two sets: each function one compiled kernel, the norms included...
_NORMS_FUSED: dict[str, Callable] = {
    name: DeviceKernel(fn) for name, fn in _EAGER.items() if name not in ("rotate_pairs", "gelu_linear")
} | {"rotate_pairs": _FUSED_ROTATE_PAIRS}
# ... or the norms on torch's kernels and everything between them fused (the engine's).
_NORMS_APART: dict[str, Callable] = {
    "modulated_layer_norm": _modulated_layer_norm_apart,
    "gated_residual": _gated_residual_apart,
    "affine_layer_norm": _affine_layer_norm_apart,
    "residual_modulated_layer_norm": _residual_modulated_layer_norm_apart,
    "rms_norm": rms_norm,
    "rotate_pairs": _rotate_pairs_fast,
    "rms_norm_rotate": _rms_norm_rotate_apart,
}
# (fuse_norms, exact) -> every step. A matrix product is not compiled: the FFN's first half is eager where the
# set must round as eager does, and has its GELU in cuBLASLt's epilogue where it need not.
_FUSED_TABLES: dict[tuple[bool, bool], dict[str, Callable]] = {
    (fuse_norms, exact): {**steps, "gelu_linear": gelu_linear if exact else _gelu_linear_epilogue}
    for fuse_norms, steps in ((True, _NORMS_FUSED), (False, _NORMS_APART))
    for exact in (True, False)
}
EAGER_KERNELS = Kernels.make(False)
