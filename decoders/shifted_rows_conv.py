"""The Wan decoder's 3x3(x3) convolutions as one GEMM over shifted rows: a Triton kernel for CUDA.

Why: at 832x480 the Wan VAE's decode is ~40.6 TFLOP a 12-frame block, nearly all of it in 3x3x3 causal
convolutions of 96, 192 and 384 channels, and diffusers hands cuDNN NCDHW tensors, which it transposes to
channels-last and back around every call. Measured on an H100 (docs/BENCHMARKS.md, 2026-12-07): in bf16 this
kernel runs the 96-channel convolutions 1.26x faster than cuDNN's channels-last kernel and ties it at 192, and
the compiled decode with it needs none of the transposes: the engine's default on Hopper GPUs
(``decode_convs = auto``). With e4m3 operands (:func:`install` ``fp8=True``) it is 1.5-1.9x faster than cuDNN,
at a cost in quality that docs/FP8.md gives.

How: pad the input with zeros in H and W (the causal frames in T are already in front of it: the cache, or
zero frames), lay it out channels-last and number its positions ``(t, y, x)`` as rows of a ``[rows, C_in]``
matrix. With ``P = Hp * Wp`` rows a frame and ``Wp`` a line (``Hp, Wp`` the padded sizes), the output at
row ``m`` (the same numbering) reads, for kernel tap ``(dt, dy, dx)``, input row ``m + dt*P + dy*Wp + dx``:
each tap is a plain GEMM over a *contiguous* block of rows, and the convolution is the ``kt*kh*kw`` of them
summed into one accumulator. The ``kw`` taps of one ``(dt, dy)`` read ``kw`` consecutive rows, back to back in
memory, so the kernel reduces over each such run of ``kw * C_in`` values in chunks of its own width. Outputs are computed on the padded grid and the rows that fall in the padding
(0.7 % at 480x832) are dropped at the store, which writes the result channels-last and compact. The last
output row's largest tap reads exactly the last input row, so no load needs a bounds mask (only the last chunk
of a run that the chunk width does not divide masks its columns past the run).

* :func:`shifted_rows_conv_reference`: the same sum in torch (runs anywhere; the tests hold it to
  ``F.conv3d``), the kernel's reference.
* :func:`shifted_rows_conv`: the Triton kernel (CUDA; on the CPU only under ``TRITON_INTERPRET=1``).
* :func:`causal_conv3d` / :func:`same_conv2d`: the contracts of diffusers' ``WanCausalConv3d.forward`` and of
  the resample's ``nn.Conv2d(padding=1)``, computed by the kernel; :func:`install` gives a decoder's eligible
  convolutions these forwards.

Triton is imported when available, so the module imports on a CPU-only install.
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d, WanResidualBlock

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the module imports, the kernel's entry points raise
    triton = None

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn
WEIGHT_COLUMNS_ALIGN = 256  # packed weights' output columns are padded to this, so any block_n <= 256 reads in bounds
_INT32_LIMIT = 2**31


@dataclass(frozen=True)
class ConvKernelConfig:
    """Launch parameters of the kernel (``bench/shifted_rows_conv_gpu.py`` sweeps them)."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 32
    num_warps: int = 8
    num_stages: int = 4

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {value}")
        if self.block_n > WEIGHT_COLUMNS_ALIGN:
            raise ValueError(f"block_n must be <= {WEIGHT_COLUMNS_ALIGN}, got {self.block_n}")


# Per (C_in, C_out, taps[, "fp8"]): the configuration measured fastest at the Wan decoder's 832x480 shapes on an
# H100 (docs/BENCHMARKS.md, "The Wan decode's convolutions as one GEMM" and the thirty-first session's sweep with
# the reduction over each (dt, dy)'s run: the 3x3x3 rows); others get DEFAULT_CONFIG.
DEFAULT_CONFIG = ConvKernelConfig()
_WIDE_N = ConvKernelConfig(128, 256, 64, 8, 3)
_TALL_M = ConvKernelConfig(256, 128, 64, 8, 3)
_WIDE_K = ConvKernelConfig(128, 128, 128, 8, 3)
_TALL_WIDE_K = ConvKernelConfig(256, 128, 128, 8, 3)
MEASURED_CONFIGS: dict[tuple, ConvKernelConfig] = {
    (96, 96, 27): _TALL_M, (96, 96, 27, "fp8"): _WIDE_K,
    (192, 192, 27): _WIDE_N, (192, 192, 27, "fp8"): _TALL_WIDE_K,
    (192, 384, 27): _TALL_M, (192, 384, 27, "fp8"): _TALL_M,
    (384, 384, 27): _WIDE_K, (384, 384, 27, "fp8"): _TALL_WIDE_K,
    (192, 96, 9): _TALL_M, (384, 192, 9): _WIDE_N,
}


def config_for(c_in: int, c_out: int, taps: int, *fp8: str) -> ConvKernelConfig:
    """The launch configuration for one convolution's shape, ``(C_in, C_out, taps)`` or with ``"fp8"`` after
    them: a measured one as it is; else :data:`DEFAULT_CONFIG` with its ``block_k`` halved until it divides
    ``C_in`` (so no reduction chunk is part padding)."""
    config = MEASURED_CONFIGS.get((c_in, c_out, taps, *fp8))
    if config is not None:
        return config
    config = DEFAULT_CONFIG
    block_k = config.block_k
    while c_in % block_k and block_k > (32 if fp8 else 16):
        block_k //= 2
    return config if block_k == config.block_k else ConvKernelConfig(
        config.block_m, config.block_n, block_k, config.num_warps, config.num_stages)


# ---------------------------------------------------------------------------
# Geometry shared by the reference and the kernel


def _grid_sizes(padded: torch.Tensor, kernel_size: tuple[int, int, int]) -> tuple[int, int, int, int, int, int]:
    """``(T_out, H, W, P, Wp, M)`` for a ``[T_in, Hp, Wp, C]`` padded input: output sizes, rows a frame and a
    line, and ``M``, the rows computed (the last valid output row + 1)."""
    kt, kh, kw = kernel_size
    t_in, hp, wp, _ = padded.shape
    t_out, height, width = t_in - kt + 1, hp - kh + 1, wp - kw + 1
    if t_out < 1 or height < 1 or width < 1:
        raise ValueError(f"input {tuple(padded.shape)} is smaller than the kernel {kernel_size}")
    plane = hp * wp
    rows = (t_out - 1) * plane + (height - 1) * wp + width
    return t_out, height, width, plane, wp, rows


@dataclass(frozen=True)
class PackedWeight:
    """A convolution's weight as the kernel reads it.

    ``data``: bf16 / fp32 ``[taps * C_in, C_out_pad]``, or e4m3 ``[C_out_pad, taps * C_in]`` (the reduction axis
    contiguous: the only layout Hopper's fp8 ``wgmma`` takes for its second operand); rows (or columns) tap-major
    (``dt``, then ``dy``, then ``dx``), then input channel; the output channels zero-padded to
    :data:`WEIGHT_COLUMNS_ALIGN`. ``scale``: e4m3 only, float32 ``[C_out_pad]``, one per output channel.
    """

    data: torch.Tensor
    scale: torch.Tensor | None
    c_out: int
    kernel_size: tuple[int, int, int]

    @property
    def fp8(self) -> bool:
        return self.scale is not None

    def dequantized(self) -> torch.Tensor:
        """``[C_out, C_in, kt, kh, kw]`` float32: what the kernel multiplies by."""
        kt, kh, kw = self.kernel_size
        if self.fp8:
            rows = (self.data.float() * self.scale[:, None]).t()
        else:
            rows = self.data.float()
        c_in = rows.shape[0] // (kt * kh * kw)
        return rows[:, : self.c_out].reshape(kt, kh, kw, c_in, self.c_out).permute(4, 3, 0, 1, 2).contiguous()


def _padded_columns(c_out: int) -> int:
    return -(-c_out // WEIGHT_COLUMNS_ALIGN) * WEIGHT_COLUMNS_ALIGN


def _as_3d(weight: torch.Tensor) -> torch.Tensor:
    return weight.unsqueeze(2) if weight.ndim == 4 else weight  # a 2-D conv's weight: kt = 1


def pack_weight(weight: torch.Tensor) -> PackedWeight:
    """``[C_out, C_in, kt, kh, kw]`` (or a 2-D conv's ``[C_out, C_in, kh, kw]``) in its own dtype."""
    weight = _as_3d(weight)
    c_out, c_in, kt, kh, kw = weight.shape
    packed = weight.permute(2, 3, 4, 1, 0).reshape(kt * kh * kw * c_in, c_out)
    columns = _padded_columns(c_out)
    return PackedWeight(F.pad(packed, (0, columns - c_out)).contiguous(), None, c_out, (kt, kh, kw))


def pack_weight_fp8(weight: torch.Tensor) -> PackedWeight:
    """The weight in e4m3, one float32 scale per output channel (its largest magnitude maps to 448)."""
    weight = _as_3d(weight)
    c_out, c_in, kt, kh, kw = weight.shape
    rows = weight.permute(0, 2, 3, 4, 1).reshape(c_out, kt * kh * kw * c_in).float()
    scale = (rows.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    columns = _padded_columns(c_out)
    data = F.pad((rows / scale[:, None]).clamp(-FP8_MAX, FP8_MAX), (0, 0, 0, columns - c_out))
    return PackedWeight(data.to(FP8_DTYPE).contiguous(), F.pad(scale, (0, columns - c_out), value=1.0),
                        c_out, (kt, kh, kw))


def quantize_input(padded: torch.Tensor, input_scale: float) -> torch.Tensor:
    """``padded / input_scale`` in e4m3 (saturating; ``input_scale`` maps the input's bound to 448)."""
    return (padded.float() * (1.0 / input_scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def shifted_rows_conv_reference(
    padded: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The convolution as the kernel computes it, in torch: ``padded`` ``[T_in, Hp, Wp, C_in]``, ``weight``
    ``[C_out, C_in, kt, kh, kw]`` -> ``[T_out, H, W, C_out]`` (a valid, stride-1 convolution), float32 sums."""
    c_out, c_in, kt, kh, kw = weight.shape
    t_out, height, width, plane, wp, rows = _grid_sizes(padded, (kt, kh, kw))
    flat = padded.reshape(-1, c_in).float()
    packed = pack_weight(weight).data.float()[:, :c_out]
    out = torch.zeros(rows, c_out)
    tap = 0
    for dt in range(kt):
        for dy in range(kh):
            for dx in range(kw):
                shift = dt * plane + dy * wp + dx
                out += flat[shift : shift + rows] @ packed[tap * c_in : (tap + 1) * c_in]
                tap += 1
    if bias is not None:
        out += bias.float()
    # Back to the padded grid (rows past M are padding), then keep the valid positions.
    grid = F.pad(out, (0, 0, 0, t_out * plane - rows)).view(t_out, plane // wp, wp, c_out)
    return grid[:, :height, :width].to(padded.dtype)


# ---------------------------------------------------------------------------
# The kernel

if triton is not None:

    # The geometry changes with every shape; specialising on it (divisibility by 16) would compile per shape.
    @triton.jit(do_not_specialize=["rows", "plane", "line", "height", "width", "k_chunks", "steps", "a_scale"])
    def _shifted_rows_conv_kernel(
        x_ptr, w_ptr, b_ptr, w_scale_ptr, out_ptr,
        rows, c_in, c_out, w_stride_k, w_stride_n, plane, line, height, width, k_chunks, steps, a_scale,
        KT: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, HAS_BIAS: tl.constexpr, SCALED: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
        K_TAIL: tl.constexpr,
    ):
        n_tiles = tl.cdiv(c_out, BLOCK_N)
        pid = tl.program_id(0)
        pid_m = pid // n_tiles  # the output-channel tiles of one row block run side by side: its rows stay in L2
        pid_n = pid % n_tiles
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        # Rows past M (the last tile's tail) read row M-1 again instead of needing a mask: they are not stored.
        load_rows = tl.minimum(offs_m, rows - 1)
        # The KW taps of one (dt, dy) read KW consecutive input rows, which lie back to back in memory: row
        # m's operand for the pair is one contiguous run of KW * C_in values, so the reduction runs over it
        # in BLOCK_K chunks (not one C_in-wide chunk per tap: wider chunks at 96 channels).
        group_k = KW * c_in
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(steps):  # steps = KT * KH * k_chunks, k_chunks = cdiv(KW * C_in, BLOCK_K) (host)
            group = step // k_chunks
            k = (step - group * k_chunks) * BLOCK_K + offs_k
            dt = group // KH
            dy = group % KH
            shift = dt * plane + dy * line
            a_ptrs = x_ptr + (load_rows + shift)[:, None] * c_in + k[None, :]
            b_ptrs = w_ptr + (group * group_k + k)[:, None] * w_stride_k + offs_n[None, :] * w_stride_n
            if K_TAIL:  # KW * C_in not a multiple of BLOCK_K: the last chunk's columns past the run are zeros
                inside = k < group_k
                a = tl.load(a_ptrs, mask=inside[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=inside[:, None], other=0.0)
            else:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if SCALED:  # e4m3 operands: the input's one scale times each output channel's
            acc = acc * (tl.load(w_scale_ptr + offs_n) * a_scale)[None, :]
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=offs_n < c_out, other=0.0).to(tl.float32)[None, :]
        t = offs_m // plane
        y = (offs_m % plane) // line
        x = offs_m % line
        valid = (offs_m < rows) & (y < height) & (x < width)
        out_rows = (t * height + y) * width + x
        out_ptrs = out_ptr + out_rows[:, None] * c_out + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n < c_out)[None, :])


def _check_runnable(device: torch.device) -> None:
    if triton is None:
        raise RuntimeError("the shifted-rows convolution needs Triton, which is not installed")
    if device.type != "cuda" and type(_shifted_rows_conv_kernel).__name__ != "InterpretedFunction":
        raise ValueError(
            f"the shifted-rows convolution runs on CUDA, or on the CPU only under the Triton interpreter "
            f"(TRITON_INTERPRET=1 set before triton is imported); got a tensor on {device}")


# A custom op, so torch.compile (the decoder's compiled steady state) calls the kernel as one opaque node and
# fuses the padding, layout copy and e4m3 cast that feed it into the kernels before it.
@torch.library.custom_op("arstream::shifted_rows_conv", mutates_args=())
def _shifted_rows_conv_op(
    padded: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None, bias: torch.Tensor | None,
    kernel_size: list[int], c_out: int, launch: list[int], input_scale: float, out_dtype: torch.dtype,
) -> torch.Tensor:
    kt, kh, kw = kernel_size
    block_m, block_n, block_k, num_warps, num_stages = launch
    c_in = padded.shape[3]
    t_out, height, width, plane, line, rows = _grid_sizes(padded, (kt, kh, kw))
    scaled = weight_scale is not None
    stride_k, stride_n = (1, weight.shape[1]) if scaled else (weight.shape[1], 1)
    out = torch.empty(t_out, height, width, c_out, device=padded.device, dtype=out_dtype)
    grid = (triton.cdiv(rows, block_m) * triton.cdiv(c_out, block_n),)
    k_chunks = triton.cdiv(kw * c_in, block_k)
    _shifted_rows_conv_kernel[grid](
        padded, weight, bias if bias is not None else out, weight_scale if scaled else out, out,
        rows, c_in, c_out, stride_k, stride_n, plane, line, height, width,
        k_chunks, kt * kh * k_chunks, input_scale,
        KT=kt, KH=kh, KW=kw, HAS_BIAS=bias is not None, SCALED=scaled,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=padded.dtype == torch.float32,
        K_TAIL=(kw * c_in) % block_k != 0, num_warps=num_warps, num_stages=num_stages,
    )
    return out


@_shifted_rows_conv_op.register_fake
def _(padded, weight, weight_scale, bias, kernel_size, c_out, launch, input_scale, out_dtype):
    t_out, height, width, *_ = _grid_sizes(padded, tuple(kernel_size))
    return padded.new_empty(t_out, height, width, c_out, dtype=out_dtype)


def shifted_rows_conv(
    padded: torch.Tensor,
    weight: PackedWeight,
    bias: torch.Tensor | None,
    config: ConvKernelConfig | None = None,
    *,
    input_scale: float = 1.0,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The kernel: ``padded`` ``[T_in, Hp, Wp, C_in]`` contiguous -> ``[T_out, H, W, C_out]`` contiguous,
    float32 accumulation. With an e4m3 ``weight``, ``padded`` is e4m3 too (:func:`quantize_input`), the
    products are scaled by ``input_scale`` times each channel's weight scale, and ``out_dtype`` (default
    bf16) is the output's; otherwise the output has ``padded``'s dtype."""
    _check_runnable(padded.device)
    if padded.ndim != 4 or not padded.is_contiguous():
        raise ValueError(f"padded must be a contiguous [T, Hp, Wp, C]; got shape {tuple(padded.shape)}")
    kt, kh, kw = weight.kernel_size
    c_in = padded.shape[3]
    if weight.data.shape[1 if weight.fp8 else 0] != kt * kh * kw * c_in:
        raise ValueError(f"packed weight {tuple(weight.data.shape)} does not fit {weight.kernel_size} x {c_in} inputs")
    if weight.fp8 != (padded.dtype == FP8_DTYPE):
        raise ValueError(f"an e4m3 weight needs an e4m3 input and a {weight.data.dtype} weight a {weight.data.dtype} "
                         f"input; got {padded.dtype}")
    t_out, height, width, *_ = _grid_sizes(padded, weight.kernel_size)
    if padded.numel() >= _INT32_LIMIT or t_out * height * width * weight.c_out >= _INT32_LIMIT:
        raise ValueError("the shifted-rows convolution indexes with 32 bits: input or output too large")
    config = config or config_for(c_in, weight.c_out, kt * kh * kw)
    if weight.fp8 and config.block_k < 32:
        raise ValueError(f"an e4m3 product reduces 32 values a step: block_k must be >= 32, got {config.block_k}")
    if out_dtype is None:
        out_dtype = torch.bfloat16 if weight.fp8 else padded.dtype
    launch = [config.block_m, config.block_n, config.block_k, config.num_warps, config.num_stages]
    return _shifted_rows_conv_op(padded, weight.data, weight.scale, bias, [kt, kh, kw], weight.c_out, launch,
                                 float(input_scale), out_dtype)


# ---------------------------------------------------------------------------
# The decoder's convolutions

# Set on each module by install(), as plain attributes (what torch.compile traces without a break): the packed
# weight's tensors, and the launch's constants (kernel size, C_out, configuration, e4m3 input scale or None).
_WEIGHT, _WEIGHT_SCALE, _LAUNCH = "_shifted_rows_weight", "_shifted_rows_weight_scale", "_shifted_rows_launch"


def runs_in_fp8(module: torch.nn.Module) -> bool:
    """Whether :func:`install` gave ``module`` the kernel with e4m3 operands."""
    launch = getattr(module, _LAUNCH, None)
    return launch is not None and launch[3] is not None


def run_padded(module: torch.nn.Module, padded: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """An installed convolution on its padded, channels-last input ``[T_in, Hp, Wp, C_in]``: already in e4m3
    (scaled by the module's input scale) when it runs in e4m3; ``out_dtype`` is then the output's."""
    weight, weight_scale = getattr(module, _WEIGHT), getattr(module, _WEIGHT_SCALE)
    kernel_size, c_out, launch, input_scale = getattr(module, _LAUNCH)
    if weight.device != padded.device:
        raise RuntimeError("the convolution moved after install(): install it again")
    if input_scale is None:
        out_dtype = padded.dtype
    return _shifted_rows_conv_op(padded.contiguous(), weight, weight_scale, module.bias, kernel_size, c_out, launch,
                                 1.0 if input_scale is None else input_scale, out_dtype)


def _run(module: torch.nn.Module, padded: torch.Tensor) -> torch.Tensor:
    input_scale = getattr(module, _LAUNCH)[3]
    out_dtype = padded.dtype
    if input_scale is not None:
        padded = quantize_input(padded, input_scale)
    return run_padded(module, padded, out_dtype)


def causal_padded(conv: torch.nn.Module, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    """A ``WanCausalConv3d``'s input as the kernel reads it: the causal sequence (zero frames, then ``cache_x``,
    then ``x``, ``[1, C, T, H, W]``) zero-padded in H and W, channels-last ``[T_in, Hp, Wp, C]``."""
    pad_w, _, pad_h, _, pad_t, _ = conv._padding
    sequence = x
    if cache_x is not None and pad_t > 0:  # as diffusers: the cache replaces as many zero frames
        sequence = torch.cat([cache_x.to(x.device), x], dim=2)
        pad_t -= cache_x.shape[2]
    padded = F.pad(sequence[0].permute(1, 2, 3, 0), (0, 0, pad_w, pad_w, pad_h, pad_h, max(pad_t, 0), 0))
    if pad_t < 0:  # a cache longer than the causal padding: F.pad crops the front
        padded = padded[-pad_t:]
    return padded


def causal_conv3d(conv: torch.nn.Module, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    """``WanCausalConv3d.forward(x, cache_x)`` through the kernel, on :func:`causal_padded`'s input; the result
    ``[1, C_out, T', H, W]`` is a channels_last_3d view of the kernel's output."""
    if x.shape[0] != 1:
        raise ValueError(f"one stream per call: batch must be 1, got {x.shape[0]}")
    return _run(conv, causal_padded(conv, x, cache_x)).permute(3, 0, 1, 2).unsqueeze(0)


def same_conv2d(conv: torch.nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """``conv(x)`` for a stride-1 ``nn.Conv2d`` with symmetric zero padding, through the kernel (the batch axis
    as frames, ``kt = 1``); the result is a channels_last view."""
    pad_h, pad_w = conv.padding
    padded = F.pad(x.permute(0, 2, 3, 1), (0, 0, pad_w, pad_w, pad_h, pad_h))
    return _run(conv, padded).permute(0, 3, 1, 2)


def eligible(module: torch.nn.Module) -> bool:
    """Whether the kernel computes this convolution: a diffusers ``WanCausalConv3d`` or an ``nn.Conv2d`` with
    stride 1, no dilation or groups, zero padding that keeps the size (the 2-D ones), a window wider than 1x1
    (1x1 and 3x1x1 convolutions are plain GEMMs already) and channels the tensor cores' tiles take."""
    if not isinstance(module, (WanCausalConv3d, torch.nn.Conv2d)):
        return False
    plain = module.groups == 1 and module.padding_mode == "zeros" and all(s == 1 for s in module.stride) \
        and all(d == 1 for d in module.dilation)
    kh, kw = module.kernel_size[-2:]
    if isinstance(module, WanCausalConv3d):
        pad_w, _, pad_h, _, pad_t, _ = module._padding
        plain = plain and (pad_h, pad_w) == (kh // 2, kw // 2) and pad_t == module.kernel_size[0] - 1
    else:
        plain = plain and tuple(module.padding) == (kh // 2, kw // 2)
    return plain and kh > 1 and kw > 1 and module.in_channels % 16 == 0 and module.out_channels >= 16


def silu_rms_norm_bound(norm: torch.nn.Module) -> float:
    """The largest magnitude ``SiLU(norm(x))`` can take, for any ``x``, for a diffusers ``WanRMS_norm``.

    ``norm(x) = normalize(x) * sqrt(C) * gamma + bias`` over the channel axis: each normalised channel is at
    most 1 in magnitude (1 + 2^-8 after its bf16 rounding), so a channel's value is at most
    ``sqrt(C) * |gamma| + |bias|``; SiLU never increases a positive value and is above -0.2785 everywhere.
    """
    gamma = norm.gamma.detach().float().abs()
    bias = norm.bias.detach().float().abs() if torch.is_tensor(norm.bias) else torch.zeros_like(gamma)
    bound = (norm.scale * gamma * (1 + 2**-8) + bias).max().item()
    return max(bound, 0.2785)


def self_check(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why the kernel cannot serve on ``device`` (``None``: it can): one small causal 3x3x3 convolution through
    it, against ``F.conv3d`` in float32, launched with the measured configuration that needs the most shared
    memory (and a masked reduction tail). For the engine's default, which takes the kernel only where it was
    measured and falls back to cuDNN, with this reason logged, when a Triton build or a card does not run it."""
    config = max((c for key, c in MEASURED_CONFIGS.items() if "fp8" not in key),
                 key=lambda c: (c.block_m + c.block_n) * c.block_k * c.num_stages)
    try:
        generator = torch.Generator().manual_seed(0)
        weight = torch.randn(32, 32, 3, 3, 3, generator=generator) * 0.05
        x = torch.randn(1, 32, 3, 6, 10, generator=generator)
        padded = F.pad(x[0].permute(1, 2, 3, 0), (0, 0, 1, 1, 1, 1, 2, 0)).to(device, dtype).contiguous()
        got = shifted_rows_conv(padded, pack_weight(weight.to(device, dtype)), None, config).float().cpu()
        want = F.conv3d(F.pad(x, (1, 1, 1, 1, 2, 0)), weight)[0].permute(1, 2, 3, 0)
        error = ((got - want).abs().max() / want.abs().max()).item()
    except Exception as exc:  # noqa: BLE001 - any failure is a reason to keep cuDNN
        return f"{type(exc).__name__}: {str(exc)[:300]}"
    return None if error <= 0.02 else f"off by {error:.3g} of F.conv3d's largest output (allowed 0.02)"


def _fp8_convs(decoder: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """(conv, the RMS norm before it) for each residual block's convolution that can run in e4m3."""
    return [(conv, norm) for block in decoder.modules() if isinstance(block, WanResidualBlock)
            for conv, norm in ((block.conv1, block.norm1), (block.conv2, block.norm2))
            if eligible(conv) and conv.in_channels % 32 == 0]  # an fp8 dot's reduction step is 32


def packed_weight_bytes(decoder: torch.nn.Module, *, fp8: bool = False, element_size: int | None = None) -> int:
    """Device bytes :func:`install` adds to ``decoder`` (its own weights stay for the opening frames' eager
    calls), from the modules' shapes alone, so a decoder on the meta device gives the memory plan its figure.
    ``element_size``: bytes of the dtype the decoder will run in (default: its weights' own)."""
    in_fp8 = {conv for conv, _ in _fp8_convs(decoder)} if fp8 else set()
    total = 0
    for module in decoder.modules():
        if eligible(module):
            columns = _padded_columns(module.out_channels)
            elements = module.weight[0, 0].numel() * module.in_channels * columns
            element = element_size or module.weight.element_size()
            total += elements + 4 * columns if module in in_fp8 else elements * element
    return total


def fp8_input_scales(decoder: torch.nn.Module) -> dict[torch.nn.Module, float]:
    """The convolutions whose inputs have a bound known from the weights alone, with the e4m3 scale it gives:
    each residual block's two 3x3x3 convolutions (their input is ``SiLU(RMS norm)``), so quantizing needs no
    pass over the activations to find their range. The others (conv_in on latents, the upsamplers' on block
    outputs) stay in bf16."""
    return {conv: silu_rms_norm_bound(norm) / FP8_MAX for conv, norm in _fp8_convs(decoder)}


def install(
    decoder: torch.nn.Module,
    configs: dict[tuple[int, int, int], ConvKernelConfig] | None = None,
    *,
    fp8: bool = False,
) -> int:
    """Give ``decoder``'s eligible convolutions the kernel's forwards (instance-level bound methods, so a deep
    copy dispatches to its own weights); returns how many. The weights are packed now, in the module's device
    and dtype (install again after moving it). ``configs`` overrides :data:`MEASURED_CONFIGS` (the bench);
    ``fp8``: the residual blocks' convolutions in e4m3 (:func:`fp8_input_scales`). Every caller of these
    modules then runs the kernel: the engine's decoder owns its VAE's decoder half."""
    input_scales = fp8_input_scales(decoder) if fp8 else {}
    installed = 0
    for module in decoder.modules():
        if not eligible(module):
            continue
        taps = module.weight[0, 0].numel()
        in_fp8 = module in input_scales
        key = (module.in_channels, module.out_channels, taps) + (("fp8",) if in_fp8 else ())
        config = (configs or {}).get(key) or config_for(*key)
        weight = module.weight.detach()
        _check_runnable(weight.device)
        packed = pack_weight_fp8(weight) if in_fp8 else pack_weight(weight)
        setattr(module, _WEIGHT, packed.data)
        setattr(module, _WEIGHT_SCALE, packed.scale)
        launch = [config.block_m, config.block_n, config.block_k, config.num_warps, config.num_stages]
        setattr(module, _LAUNCH, (list(packed.kernel_size), packed.c_out, launch,
                                  input_scales[module] if in_fp8 else None))
        forward = causal_conv3d if isinstance(module, WanCausalConv3d) else same_conv2d
        module.forward = types.MethodType(forward, module)
        installed += 1
    return installed
