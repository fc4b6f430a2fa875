"""A Wan residual block's e4m3 convolution inputs in one pass: RMS norm, SiLU, causal frames, padding, e4m3 cast.

Why: with e4m3 decode convolutions (``decode_convs = triton_fp8``) each residual block runs, before each of its
two 3x3x3 convolutions, diffusers' ``WanRMS_norm`` over the channels, SiLU, a copy of the last two frames kept as
the next chunk's causal cache, the cache of the previous chunk put in front, zero padding in H and W, the
channels-last layout the kernel reads and the cast to e4m3. Compiled, that was several passes over the decoder's
largest tensors (the 96-channel stage at 480x832 is 150 M values a latent frame); here one Triton pass reads
each input position's channels (twice: the norm's sum, then the values, the second time from L1) and writes the
padded e4m3 row (and the cache row, where it is one).

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
MAX_GROUP = 128  # channels a program computes at a time
MAX_GROUPS = 8  # channel groups a position (unrolled in the kernel): 96, 192 and 384 channels are 3 of 32, 64, 128
# A program: a run of one line's positions, GROUP channels of each at a time, 16 values a thread (64 positions at
# 96 channels, 32 at 192, 16 at 384, with 4 warps): measured on an H100 (11.5 ms a block, docs/BENCHMARKS.md,
# thirty-seventh session); the other launches not yet (bench/conv_input_fp8_gpu.py sweeps them).
VALUES_PER_THREAD = 16
DEFAULT_WARPS = 4
MAX_COLUMNS = 256

# The device scripts' before/after switch: False keeps diffusers' forward for every block (as before).
FUSED = True


def channel_group(channels: int) -> int:
    """The channels a program computes at a time: the largest power of two that divides ``channels``, at most
    :data:`MAX_GROUP` (a group is a power of two, and one that divides the channels masks no lane)."""
    return min(channels & -channels, MAX_GROUP)


def default_launch(channels: int) -> tuple[int, int]:
    """(positions of a line, warps) a program for ``channels``: :data:`VALUES_PER_THREAD` values a thread in
    each channel group."""
    columns = VALUES_PER_THREAD * 32 * DEFAULT_WARPS // channel_group(channels)
    return max(1, min(columns, MAX_COLUMNS)), DEFAULT_WARPS


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

    @triton.jit
    def _store_e4m3(Out, out_rows, ch, value, in_line, inv_input_scale, E4M3_MAX: tl.constexpr):
        quantized = tl.clamp(value.to(tl.float32) * inv_input_scale, -E4M3_MAX, E4M3_MAX).to(tl.float8e4nv)
        tl.store(Out + out_rows[:, None] + ch[None, :], quantized, mask=in_line[:, None])

    # Every size varies with the stage and the chunk; specialising on them would compile per shape. The strides
    # are specialised (divisible by 16 or not: a variant or two), so a position's channels load as 16-byte vectors.
    @triton.jit(do_not_specialize=["height", "width", "zero_frames", "cache_frames", "keep_from"])
    def _conv_input_kernel(
        X, Cache, Gamma, Bias, Out, NewCache,
        height, width, pad_h, pad_w, zero_frames, cache_frames, keep_from,
        sx_t, sx_h, sx_w, sc_t, sc_h, sc_w, norm_scale, inv_input_scale, eps,
        C: tl.constexpr, GROUP: tl.constexpr, COLS: tl.constexpr, HAS_BIAS: tl.constexpr,
        E4M3_MAX: tl.constexpr,
    ):
        # One program: COLS consecutive positions of one line of one frame of the padded output, all channels,
        # GROUP channels at a time (GROUP divides C: no lane computes a channel that is not there). The grid is
        # (column blocks, lines, frames): no position is divided back into its coordinates, and what a line is
        # (padding, a zero frame, a cached frame or the chunk's) is one branch for the whole program.
        step = tl.program_id(2) - zero_frames  # position in the causal sequence: the cache's frames, the chunk's
        y = tl.program_id(1) - pad_h
        out_width = width + 2 * pad_w
        cols = tl.program_id(0) * COLS + tl.arange(0, COLS)
        in_line = cols < out_width
        x = cols - pad_w
        inside = (x >= 0) & (x < width)
        ch = tl.arange(0, GROUP)
        out_rows = ((tl.program_id(2) * (height + 2 * pad_h) + tl.program_id(1)).to(tl.int64) * out_width + cols) * C
        keep = step >= keep_from  # the sequence's last frames are the next chunk's cache (channels-last, compact)
        cache_rows = ((tl.maximum(step - keep_from, 0) * height + y).to(tl.int64) * width + x) * C
        if (step >= 0) & (y >= 0) & (y < height):
            if step < cache_frames:  # the previous chunk's cached frame: cast as it is
                src = Cache + step.to(tl.int64) * sc_t + y * sc_h + x * sc_w
                for g in tl.static_range(C // GROUP):
                    c = g * GROUP + ch
                    value = tl.load(src[:, None] + c[None, :], mask=inside[:, None], other=0.0)
                    _store_e4m3(Out, out_rows, c, value, in_line, inv_input_scale, E4M3_MAX)
                    if keep:
                        tl.store(NewCache + cache_rows[:, None] + c[None, :], value, mask=inside[:, None])
            else:  # the chunk's frame: normalized and activated
                src = X + (step - cache_frames).to(tl.int64) * sx_t + y * sx_h + x * sx_w
                squares = tl.zeros([COLS], dtype=tl.float32)
                for g in tl.static_range(C // GROUP):
                    h = tl.load(src[:, None] + (g * GROUP + ch)[None, :], mask=inside[:, None], other=0.0)
                    squares += tl.sum(h.to(tl.float32) * h.to(tl.float32), 1)
                # F.normalize in float32, rounded to the activation's dtype; then eager's products, each rounded.
                inverse = tl.math.div_rn(1.0, tl.maximum(tl.sqrt_rn(squares), eps))[:, None]
                for g in tl.static_range(C // GROUP):  # the position's channels again (from L1), group by group
                    c = g * GROUP + ch
                    xv = tl.load(src[:, None] + c[None, :], mask=inside[:, None], other=0.0)
                    dtype = xv.dtype
                    v = (xv.to(tl.float32) * inverse).to(dtype).to(tl.float32)
                    v = (v * norm_scale).to(dtype).to(tl.float32)
                    v = (v * tl.load(Gamma + c).to(tl.float32)[None, :]).to(dtype).to(tl.float32)
                    if HAS_BIAS:
                        v = (v + tl.load(Bias + c).to(tl.float32)[None, :]).to(dtype).to(tl.float32)
                    act = (v / (1.0 + tl.exp(-v))).to(dtype)
                    act = tl.where(inside[:, None], act, tl.zeros_like(act))  # the padding columns
                    _store_e4m3(Out, out_rows, c, act, in_line, inv_input_scale, E4M3_MAX)
                    if keep:
                        tl.store(NewCache + cache_rows[:, None] + c[None, :], act, mask=inside[:, None])
        else:  # a padding line, or a causal frame nobody cached: zeros
            for g in tl.static_range(C // GROUP):
                zeros = tl.zeros([COLS, GROUP], dtype=tl.float32)
                _store_e4m3(Out, out_rows, g * GROUP + ch, zeros, in_line, inv_input_scale, E4M3_MAX)


def _interpreted() -> bool:
    return triton is not None and type(_conv_input_kernel).__name__ == "InterpretedFunction"


def available(x: torch.Tensor) -> bool:
    """Whether the kernel runs for ``x``: Triton, CUDA (or the interpreter, for tests), a float dtype."""
    if triton is None or x.shape[1] // channel_group(x.shape[1]) > MAX_GROUPS \
            or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    return x.is_cuda or (x.device.type == "cpu" and _interpreted())


def _output_shapes(x: torch.Tensor, cache: torch.Tensor | None, padding: list[int]) -> tuple[tuple, tuple]:
    """(the padded e4m3 input ``[pad_t + T, H + 2 pad_h, W + 2 pad_w, C]``, the new cache ``[T', H, W, C]``)."""
    _, channels, frames, height, width = x.shape
    pad_t, pad_h, pad_w = padding
    kept = new_cache_frames(frames, 0 if cache is None else cache.shape[2])
    return (pad_t + frames, height + 2 * pad_h, width + 2 * pad_w, channels), (kept, height, width, channels)


# A custom op: torch.compile (the decoder's steady state) calls the kernel as one opaque node.
@torch.library.custom_op("arstream::conv_input_fp8", mutates_args=())
def _conv_input_op(
    x: torch.Tensor, cache: torch.Tensor | None, gamma: torch.Tensor, bias: torch.Tensor | None,
    padding: list[int], norm_scale: float, input_scale: float, launch: list[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    _, channels, frames, height, width = x.shape
    columns, num_warps = launch
    pad_t, pad_h, pad_w = padding
    cache_frames = 0 if cache is None else cache.shape[2]
    out_shape, cache_shape = _output_shapes(x, cache, padding)
    out = torch.empty(out_shape, device=x.device, dtype=FP8_DTYPE)
    new_cache = torch.empty(cache_shape, device=x.device, dtype=x.dtype)
    kept = cache_shape[0]
    source = cache if cache is not None else x
    if x.stride(1) != 1 or source.stride(1) != 1:  # the kernel steps through channels one by one
        raise ValueError("the chunk and its cache must be channels-last (conv_input makes them so)")
    if out.numel():
        _conv_input_kernel[(triton.cdiv(out.shape[2], columns), out.shape[1], out.shape[0])](
            x, source, gamma, bias if bias is not None else gamma, out, new_cache,
            height, width, pad_h, pad_w, pad_t - cache_frames, cache_frames, cache_frames + frames - kept,
            x.stride(2), x.stride(3), x.stride(4), source.stride(2), source.stride(3), source.stride(4),
            norm_scale, 1.0 / input_scale, NORM_EPS,
            C=channels, GROUP=channel_group(channels), COLS=columns, HAS_BIAS=bias is not None, E4M3_MAX=FP8_MAX,
            num_warps=num_warps,
            enable_fp_fusion=False,  # eager's separate products and sums
        )
    return out, new_cache


@_conv_input_op.register_fake
def _(x, cache, gamma, bias, padding, norm_scale, input_scale, launch):
    out_shape, cache_shape = _output_shapes(x, cache, padding)
    return x.new_empty(out_shape, dtype=FP8_DTYPE), x.new_empty(cache_shape)


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(1) == 1 else x.contiguous(memory_format=torch.channels_last_3d)


def conv_input(
    norm: torch.nn.Module, conv: torch.nn.Module, x: torch.Tensor, cache: torch.Tensor | None,
    launch: tuple[int, int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`conv_input_reference`'s two results from the kernel, the new cache a ``[1, C, T', H, W]`` view of a
    channels-last tensor. ``conv`` is installed in e4m3 (``shifted_rows_conv.install(fp8=True)``) and a cache
    is at most as long as the convolution's causal padding. ``launch``: (positions of a line, warps) a program,
    powers of two (default :func:`default_launch`)."""
    launch = launch or default_launch(x.shape[1])
    if any(v < 1 or v & (v - 1) for v in launch):
        raise ValueError(f"launch (positions, warps) must be powers of two, got {launch}")
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
