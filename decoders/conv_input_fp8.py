"""A Wan residual block's e4m3 convolution inputs in one pass: RMS norm, SiLU, causal frames, padding, e4m3 cast.

Why: with e4m3 decode convolutions (``decode_convs = triton_fp8``) each residual block runs, before each of its
two 3x3x3 convolutions, diffusers' ``WanRMS_norm`` over the channels, SiLU, a copy of the last two frames kept as
the next chunk's causal cache, the cache of the previous chunk put in front, zero padding in H and W, the
channels-last layout the kernel reads and the cast to e4m3. Compiled, that was several passes over the decoder's
largest tensors (the 96-channel stage at 480x832 is 150 M values a latent frame); here one Triton program reads
each input position's channels once and writes the padded e4m3 row (and the cache row, where it is one).

The arithmetic is diffusers' eager path, rounding for rounding: the norm in float32
(``F.normalize(x.float())``, rounded to the activation's dtype), times ``sqrt(C)``, times ``gamma`` (and plus
``bias``), SiLU, each rounded to that dtype as eager rounds them, then ``decoders.shifted_rows_conv.
quantize_input``'s cast with the convolution's static input scale. It differs from eager in two places:
the sum of squares is summed in another order, and the normalization multiplies by ``1 / norm`` where eager
divides. Either can move a value across a rounding tie: the cache values stay within one bf16 step of
eager's and the e4m3 values within one e4m3 step (tests/test_conv_input_fp8.py bounds both).

* :func:`conv_input_reference`: that eager path in torch (diffusers' modules), the kernel's reference.
* :func:`conv_input`: the kernel (CUDA; on the CPU under ``TRITON_INTERPRET=1``).
* :func:`install`: the residual blocks whose convolutions run in e4m3 take :func:`residual_block_forward`.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_wan import WanResidualBlock

from decoders import shifted_rows_conv as conv_kernel
from decoders.shifted_rows_conv import FP8_DTYPE, FP8_MAX

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the module imports; the decoder keeps diffusers' forward
    triton = None

CACHE_FRAMES = 2  # diffusers' CACHE_T: the causal frames a 3x3x3 convolution's next chunk needs
NORM_EPS = 1e-12  # F.normalize's default
MAX_CHANNELS = 1024  # one position's channels on chip
# A program's positions times its channel block, over its threads: 16 values a thread. At 96 channels (16 rows,
# 4 warps) measured on an H100 (docs/BENCHMARKS.md, thirty-sixth session); the wider stages take fewer rows, so
# a thread holds as many values there (16 rows at 384 channels were 64 a thread: 192 registers, two programs an
# SM). bench/conv_input_fp8_gpu.py sweeps the others.
VALUES_PER_THREAD = 16
DEFAULT_WARPS = 4

# The device scripts' before/after switch: False keeps diffusers' forward for every block (as before).
FUSED = True


def default_launch(channels: int) -> tuple[int, int]:
    """(padded positions, warps) a program for ``channels``: :data:`VALUES_PER_THREAD` values a thread."""
    rows = VALUES_PER_THREAD * 32 * DEFAULT_WARPS // (1 << (channels - 1).bit_length())  # the channel block
    return max(1, rows), DEFAULT_WARPS


def new_cache_frames(frames: int, cache_frames: int) -> int:
    """Frames of the cache diffusers keeps after a chunk of ``frames``: the last two of (cache, chunk), or the
    chunk's one frame when there was no cache."""
    return min(CACHE_FRAMES, frames + cache_frames)


def conv_input_reference(
    norm: torch.nn.Module, conv: torch.nn.Module, x: torch.Tensor, cache: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """diffusers' eager path for one of a residual block's convolutions, up to the kernel's input: ``x``
    ``[1, C, T, H, W]``, ``cache`` the previous chunk's ``[1, C, T_c, H, W]`` (or ``None``) -> (the padded e4m3
    input ``[pad_t + T, H + 2 pad_h, W + 2 pad_w, C]``, the new cache ``[1, C, T', H, W]``)."""
    act = F.silu(norm(x))
    new_cache = act[:, :, -CACHE_FRAMES:].clone()
    if new_cache.shape[2] < CACHE_FRAMES and cache is not None:
        new_cache = torch.cat([cache[:, :, -1:].to(new_cache.device), new_cache], dim=2)
    input_scale = getattr(conv, conv_kernel._LAUNCH)[3]
    padded = conv_kernel.causal_padded(conv, act, cache)
    return conv_kernel.quantize_input(padded, input_scale).contiguous(), new_cache


if triton is not None:

    # Every size varies with the stage and the chunk; specialising on them would compile per shape. The strides
    # are specialised (divisible by 16 or not: a variant or two): a position's channels then load as 16-byte
    # vectors, where unspecialised strides made every load one bf16 (tests/test_conv_input_fp8.py).
    @triton.jit(do_not_specialize=["positions", "height", "width", "zero_frames", "cache_frames", "keep_from"])
    def _conv_input_kernel(
        X, Cache, Gamma, Bias, Out, NewCache,
        positions, height, width, pad_h, pad_w, zero_frames, cache_frames, keep_from,
        sx_t, sx_h, sx_w, sx_c, sc_t, sc_h, sc_w, sc_c, norm_scale, inv_input_scale, eps,
        C: tl.constexpr, BLOCK_C: tl.constexpr, ROWS: tl.constexpr, HAS_BIAS: tl.constexpr,
        E4M3_MAX: tl.constexpr,
    ):
        # One program: ROWS consecutive positions of the padded output (frame, line, column), all channels.
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        line = width + 2 * pad_w
        plane = (height + 2 * pad_h) * line
        frame = rows // plane
        y = (rows % plane) // line - pad_h
        x = rows % line - pad_w
        inside = (rows < positions) & (y >= 0) & (y < height) & (x >= 0) & (x < width)
        step = frame - zero_frames  # position in the causal sequence: the cache's frames, then the chunk's
        from_cache = inside & (step >= 0) & (step < cache_frames)
        from_x = inside & (step >= cache_frames)
        cols = tl.arange(0, BLOCK_C)
        in_c = cols < C
        t = tl.maximum(step - cache_frames, 0).to(tl.int64)
        xv = tl.load(X + (t * sx_t + y * sx_h + x * sx_w)[:, None] + cols[None, :] * sx_c,
                     mask=from_x[:, None] & in_c[None, :], other=0.0)
        dtype = xv.dtype
        h = xv.to(tl.float32)
        # F.normalize in float32, rounded to the activation's dtype; then eager's products, each rounded.
        norm = tl.maximum(tl.sqrt_rn(tl.sum(h * h, 1)), eps)
        v = (h * tl.math.div_rn(1.0, norm)[:, None]).to(dtype).to(tl.float32)
        v = (v * norm_scale).to(dtype).to(tl.float32)
        gamma = tl.load(Gamma + cols, mask=in_c, other=0.0).to(tl.float32)
        v = (v * gamma[None, :]).to(dtype).to(tl.float32)
        if HAS_BIAS:
            v = (v + tl.load(Bias + cols, mask=in_c, other=0.0).to(tl.float32)[None, :]).to(dtype).to(tl.float32)
        act = (v / (1.0 + tl.exp(-v))).to(dtype)
        s = tl.maximum(step, 0).to(tl.int64)
        cached = tl.load(Cache + (s * sc_t + y * sc_h + x * sc_w)[:, None] + cols[None, :] * sc_c,
                         mask=from_cache[:, None] & in_c[None, :], other=0.0)
        value = tl.where(from_cache[:, None], cached, act)
        value = tl.where((from_x | from_cache)[:, None], value, tl.zeros_like(value))  # padding, zero frames
        quantized = tl.clamp(value.to(tl.float32) * inv_input_scale, -E4M3_MAX, E4M3_MAX).to(tl.float8e4nv)
        out_rows = rows.to(tl.int64)[:, None] * C + cols[None, :]
        tl.store(Out + out_rows, quantized, mask=(rows < positions)[:, None] & in_c[None, :])
        # The sequence's last frames are the next chunk's cache, channels-last and compact.
        kept = (from_x | from_cache) & (step >= keep_from)
        cache_rows = ((tl.maximum(step - keep_from, 0) * height + y) * width + x).to(tl.int64)
        tl.store(NewCache + cache_rows[:, None] * C + cols[None, :], value, mask=kept[:, None] & in_c[None, :])


def _interpreted() -> bool:
    return triton is not None and type(_conv_input_kernel).__name__ == "InterpretedFunction"


def available(x: torch.Tensor) -> bool:
    """Whether the kernel runs for ``x``: Triton, CUDA (or the interpreter, for tests), a float dtype."""
    if triton is None or x.shape[1] > MAX_CHANNELS or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    return x.is_cuda or (x.device.type == "cpu" and _interpreted())


# A custom op: torch.compile (the decoder's steady state) calls the kernel as one opaque node.
@torch.library.custom_op("arstream::conv_input_fp8", mutates_args=())
def _conv_input_op(
    x: torch.Tensor, cache: torch.Tensor | None, gamma: torch.Tensor, bias: torch.Tensor | None,
    padding: list[int], norm_scale: float, input_scale: float, launch: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    _, channels, frames, height, width = x.shape
    rows_per_program, num_warps = launch
    pad_t, pad_h, pad_w = padding
    cache_frames = 0 if cache is None else cache.shape[2]
    kept = new_cache_frames(frames, cache_frames)
    out = torch.empty(pad_t + frames, height + 2 * pad_h, width + 2 * pad_w, channels, device=x.device,
                      dtype=FP8_DTYPE)
    new_cache = torch.empty(kept, height, width, channels, device=x.device, dtype=x.dtype)
    source = cache if cache is not None else x
    positions = out.shape[0] * out.shape[1] * out.shape[2]
    if positions:
        _conv_input_kernel[(triton.cdiv(positions, rows_per_program),)](
            x, source, gamma, bias if bias is not None else gamma, out, new_cache,
            positions, height, width, pad_h, pad_w, pad_t - cache_frames, cache_frames,
            cache_frames + frames - kept,
            x.stride(2), x.stride(3), x.stride(4), x.stride(1),
            source.stride(2), source.stride(3), source.stride(4), source.stride(1),
            norm_scale, 1.0 / input_scale, NORM_EPS,
            C=channels, BLOCK_C=triton.next_power_of_2(channels), ROWS=rows_per_program,
            HAS_BIAS=bias is not None, E4M3_MAX=FP8_MAX, num_warps=num_warps,
            enable_fp_fusion=False,  # eager's separate products and sums
        )
    return out, new_cache


@_conv_input_op.register_fake
def _(x, cache, gamma, bias, padding, norm_scale, input_scale, launch):
    _, channels, frames, height, width = x.shape
    pad_t, pad_h, pad_w = padding
    kept = new_cache_frames(frames, 0 if cache is None else cache.shape[2])
    return (x.new_empty(pad_t + frames, height + 2 * pad_h, width + 2 * pad_w, channels, dtype=FP8_DTYPE),
            x.new_empty(kept, height, width, channels))


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(1) == 1 else x.contiguous(memory_format=torch.channels_last_3d)


def conv_input(
    norm: torch.nn.Module, conv: torch.nn.Module, x: torch.Tensor, cache: torch.Tensor | None,
    launch: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`conv_input_reference`'s two results from the kernel, the new cache a ``[1, C, T', H, W]`` view of a
    channels-last tensor. ``conv`` is installed in e4m3 (``shifted_rows_conv.install(fp8=True)``) and a cache
    is at most as long as the convolution's causal padding. ``launch``: (rows, warps) a program, powers of two
    (default :func:`default_launch`)."""
    launch = launch or default_launch(x.shape[1])
    if any(v < 1 or v & (v - 1) for v in launch):
        raise ValueError(f"launch (rows, warps) must be powers of two, got {launch}")
    pad_w, _, pad_h, _, pad_t, _ = conv._padding
    if x.ndim != 5 or x.shape[0] != 1:
        raise ValueError(f"one stream of [1, C, T, H, W] per call; got shape {tuple(x.shape)}")
    if cache is not None and (cache.shape[2] > pad_t or cache.shape[:2] != x.shape[:2]
                              or cache.shape[3:] != x.shape[3:]):
        raise ValueError(f"a cache {tuple(cache.shape)} does not precede {tuple(x.shape)} with {pad_t} causal frames")
    input_scale = getattr(conv, conv_kernel._LAUNCH)[3]
    gamma = norm.gamma.reshape(-1)
    bias = norm.bias.reshape(-1) if torch.is_tensor(norm.bias) else None
    # A program reads each position's channels as one row: channels-last, or its loads would not coalesce (a
    # copy where the producer left another layout; compiled, it fuses into that producer).
    x = _channels_last(x)
    cache = _channels_last(cache.to(x.dtype)) if cache is not None else None
    out, new_cache = _conv_input_op(x, cache, gamma.to(x.dtype),
                                    bias.to(x.dtype) if bias is not None else None, [pad_t, pad_h, pad_w],
                                    float(norm.scale), float(input_scale), list(launch))
    return out, new_cache.permute(3, 0, 1, 2).unsqueeze(0)


def _norm_silu_conv(norm, conv, x: torch.Tensor, feat_cache, feat_idx) -> torch.Tensor:
    """One of the block's ``norm -> SiLU -> causal convolution`` steps, diffusers' cache contract kept."""
    cache = feat_cache[feat_idx[0]] if feat_cache is not None else None
    padded, new_cache = conv_input(norm, conv, x, cache)
    out = conv_kernel.run_padded(conv, padded, x.dtype).permute(3, 0, 1, 2).unsqueeze(0)  # channels-last view
    if feat_cache is not None:
        feat_cache[feat_idx[0]] = new_cache
        feat_idx[0] += 1
    return out


def residual_block_forward(block: WanResidualBlock, x: torch.Tensor, feat_cache=None, feat_idx=[0]):  # noqa: B006
    """``WanResidualBlock.forward`` with each convolution's input from :func:`conv_input` (dropout is the
    identity at inference)."""
    if not available(x) or block.training:
        return type(block).forward(block, x, feat_cache, feat_idx)
    h = block.conv_shortcut(x)
    x = _norm_silu_conv(block.norm1, block.conv1, x, feat_cache, feat_idx)
    x = _norm_silu_conv(block.norm2, block.conv2, x, feat_cache, feat_idx)
    return x + h


def install(decoder: torch.nn.Module) -> int:
    """Give each residual block whose two convolutions run in e4m3 :func:`residual_block_forward`
    (instance-level); how many. Call after ``shifted_rows_conv.install(decoder, fp8=True)``."""
    if not FUSED or triton is None:
        return 0
    installed = 0
    for block in decoder.modules():
        if isinstance(block, WanResidualBlock) and all(
                conv_kernel.runs_in_fp8(conv) for conv in (block.conv1, block.conv2)):
            block.forward = types.MethodType(residual_block_forward, block)
            installed += 1
    return installed
