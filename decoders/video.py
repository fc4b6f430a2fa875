"""Streaming video decode: latent frames -> pixels, with the causal cache owned by the session.

diffusers' ``AutoencoderKLWan._decode`` already decodes one latent frame at a
time while a temporal cache (``_feat_map``) carries the last ``CACHE_T`` slices
of every causal convolution's input. It clears that cache at the start and end
of every call and keeps it on the module, so it can only decode a whole clip,
and two sessions sharing the module would overwrite each other's context.

Here the cache lives in :class:`StreamingDecodeState`, one per session, threaded
through :meth:`WanStreamingDecoder.decode_chunk`. The module's own ``_feat_map``
is never read or written, so one VAE serves any number of sessions.

Frame arithmetic (4x temporal compression)::

    latent frames   f0 | f1  f2 | f3  f4  f5 | ...
    pixel frames     1 |  4   4 |  4   4   4 | ...
    first block of 3 latent frames -> 1 + 4 + 4 = 9 pixel frames, later blocks 12

``first_chunk`` belongs to the session's opening latent frame, not to a call.
Every latent frame goes through the decoder alone (as ``_decode`` does), so the
tensor shapes seen by every kernel are the same however a session is chunked:
chunked decode equals one-call decode bit for bit.

CPU fast path: PyTorch's CPU ``conv3d`` is several times slower than ``conv2d``
at the 4-32 channels of a small VAE, and the RMS norm's channel reduction is
slow on NCDHW tensors. A causal ``kt x kh x kw`` conv over frames
``[t-kt+1 .. t]`` is one ``conv2d`` over those frames stacked on the channel
axis, so :func:`causal_conv3d_as_conv2d` computes ``WanCausalConv3d`` that way,
in channels-last memory that the ops between convs inherit. Measured on the
2-core CPU, 12-frame block at 256x144, tiny VAE: ~1.1-1.3 s eager, ~0.22-0.25 s
fast (bench/bench_video_decode.py). Off by default on GPUs, where cuDNN's
conv3d is the right kernel.
"""

from __future__ import annotations

import functools
import logging
import threading
import types
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_wan import (
    CACHE_T,
    AutoencoderKLWan,
    WanCausalConv3d,
    WanResample,
    WanUpsample,
    unpatchify,
)

log = logging.getLogger("arstream.video")

# Resident decoder-state bytes per output pixel in fp32, measured once with
# measure_bytes_per_pixel (decode 2 latent frames, then state.nbytes() / (H * W)),
# so admission needs no decode. Tests keep them in step with the configs.
#   tiny (engine.models.presets.TINY_VAE_CONFIG): torch 2.13, CPU; same at 64x64 and 256x144.
TINY_VAE_STATE_BYTES_PER_PIXEL_FP32 = 280.0
#   Wan2.1 VAE (diffusers' AutoencoderKLWan defaults, base_dim 96): torch 2.13, CPU;
#   x 832 x 480 x 2 bytes (bf16) = 1801.1 MiB, the per-session cache measured in DESIGN.md §8.
WAN_2_1_VAE_STATE_BYTES_PER_PIXEL_FP32 = 9458.0


def _decoder_architecture(vae: AutoencoderKLWan) -> tuple:
    """The config fields that fix the decoder's cache geometry (weights do not)."""
    config = vae.config
    return (
        config.decoder_base_dim or config.base_dim,
        config.z_dim,
        tuple(config.dim_mult),
        config.num_res_blocks,
        tuple(config.temperal_downsample),
        config.is_residual,
        config.patch_size,
    )


def spatial_upscale(vae: AutoencoderKLWan) -> int:
    """Output pixels per latent pixel along each side: one 2x upsample per level below the top."""
    return 2 ** (len(vae.config.dim_mult) - 1) * (vae.config.patch_size or 1)


@dataclass
class StreamingDecodeState:
    """One session's temporal decoder cache.

    ``feat_map`` has one slot per causal convolution of the decoder: ``None``
    before that convolution has run, the string ``"Rep"`` that diffusers' first
    temporal-upsample step leaves behind, or a tensor of at most ``CACHE_T``
    frames. The cache cannot be rebuilt from anything else: releasing it ends
    the stream and the next decode starts a new one.
    """

    session_id: str
    feat_map: list[Any]
    owner: object = field(repr=False, compare=False)
    conv_idx: list[int] = field(default_factory=lambda: [0])
    frames_decoded: int = 0
    chunks_decoded: int = 0

    def nbytes(self) -> int:
        """Resident bytes of the cache's tensors (the ``"Rep"`` marker costs nothing)."""
        return sum(t.numel() * t.element_size() for t in self.feat_map if torch.is_tensor(t))

    @property
    def started(self) -> bool:
        return self.frames_decoded > 0

    def release(self) -> None:
        """Drop the cache; the next decode starts the session's stream afresh."""
        self.feat_map = [None] * len(self.feat_map)
        self.conv_idx = [0]
        self.frames_decoded = 0
        self.chunks_decoded = 0


# ---------------------------------------------------------------------------
# CPU fast path


def causal_conv3d_as_conv2d(conv: WanCausalConv3d, x: torch.Tensor, cache_x: torch.Tensor | None = None) -> torch.Tensor:
    """``conv(x, cache_x)`` computed with ``conv2d``; same contract as ``WanCausalConv3d.forward``.

    The input sequence is what ``WanCausalConv3d.forward`` builds: causal zero
    frames, then ``cache_x``'s frames, then ``x``'s. Time is unfolded into the
    batch: output frame ``i`` is one 2-D conv over input frames
    ``[i*st, i*st + kt)`` stacked on the channel axis, frame-major (channel
    ``k * C + c``), with the weight reordered to match. Frames are copied
    straight into the stacked buffer, so the cache concat and the zero padding
    cost no extra pass.

    Everything is channels-last: mkldnn's conv2d is fastest on NHWC at a few
    channels, and the RMS norms between convs reduce over channels, which is
    slow on NCDHW. The result is ``[B, C_out, T', H', W']`` in channels_last_3d memory.
    """
    pad_w, _, pad_h, _, pad_t, _ = conv._padding
    kt, kh, kw = conv.kernel_size
    st, sh, sw = conv.stride
    batch, channels, _, height, width = x.shape
    if cache_x is not None and pad_t > 0:  # as in WanCausalConv3d.forward: the cache replaces zero frames
        cache_x = cache_x.to(x.device)
        pad_t -= cache_x.shape[2]
    else:
        cache_x = None
    if kt == 1 and st == 1 and pad_t == 0:
        # Nothing to stack: a per-frame 2-D conv, and only a view when x is
        # already channels-last (the output of every conv on this path).
        out_frames = x.shape[2]
        stacked = x.permute(0, 2, 3, 4, 1).reshape(batch * out_frames, height, width, channels)
    else:
        stacked = _stack_frame_windows(cache_x, x, pad_t, kt, st)
        out_frames = stacked.shape[0] // batch
    stacked = stacked.permute(0, 3, 1, 2)
    weight = conv.weight.transpose(1, 2).reshape(conv.out_channels, kt * channels, kh, kw)
    out = F.conv2d(stacked, weight, conv.bias, stride=(sh, sw), padding=(pad_h, pad_w))  # NHWC memory
    out = out.permute(0, 2, 3, 1).reshape(batch, out_frames, out.shape[2], out.shape[3], out.shape[1])
    return out.permute(0, 4, 1, 2, 3)


def _stack_frame_windows(
    cache_x: torch.Tensor | None, x: torch.Tensor, pad_t: int, kt: int, st: int
) -> torch.Tensor:
    """``[B * T', H, W, kt * C]``: row ``b * T' + i`` holds input frames ``[i*st, i*st + kt)``, frame-major.

    The input sequence is ``pad_t`` zero frames (cropped from the front when
    negative, as ``F.pad`` does), then ``cache_x``'s frames, then ``x``'s.
    """
    batch, channels, _, height, width = x.shape
    # One entry per input frame, a [B, H, W, C] view; None is a causal zero frame.
    sources: list[torch.Tensor | None] = [None] * max(pad_t, 0)
    for clip in (cache_x, x):
        if clip is not None:
            sources += list(clip.permute(0, 2, 3, 4, 1).unbind(1))
    if pad_t < 0:
        sources = sources[-pad_t:]
    out_frames = (len(sources) - kt) // st + 1

    stacked = x.new_empty(batch, out_frames, height, width, kt, channels)
    for i in range(out_frames):
        for k in range(kt):
            source = sources[i * st + k]
            if source is None:
                stacked[:, i, :, :, k].zero_()
            else:
                stacked[:, i, :, :, k].copy_(source)
    return stacked.view(batch * out_frames, height, width, kt * channels)


# The fast path is switched on per thread, for the duration of one decode, so a
# VAE shared with other users (diffusers' own decode, another decoder built with
# fast_path=False, another thread) keeps diffusers' conv3d.
_fast_path_switch = threading.local()


def _causal_conv_forward(conv: WanCausalConv3d, x: torch.Tensor, cache_x: torch.Tensor | None = None):
    if getattr(_fast_path_switch, "on", False):
        return causal_conv3d_as_conv2d(conv, x, cache_x)
    return type(conv).forward(conv, x, cache_x)


def _upsample_forward(upsample: WanUpsample, x: torch.Tensor) -> torch.Tensor:
    # diffusers' temporal upsample interleaves frames into an NCDHW tensor; turning
    # it channels-last at the low resolution keeps the nearest upsample, the 2-D
    # conv after it and the norms of the next block on the fast layout (~12 %).
    if getattr(_fast_path_switch, "on", False):
        x = x.contiguous(memory_format=torch.channels_last)
    return type(upsample).forward(upsample, x)


def _install_fast_path(vae: AutoencoderKLWan) -> None:
    """Give the causal convs and spatial upsamples the decoder runs instance-level forwards that honour the switch.

    Idempotent; the classes are left alone. Bound methods (not closures) so a
    deep-copied VAE dispatches to its own weights.
    """
    for module in [*vae.decoder.modules(), vae.post_quant_conv]:
        if "forward" in module.__dict__:
            continue
        if isinstance(module, WanCausalConv3d):
            if module.groups == 1 and tuple(module.dilation) == (1, 1, 1) and module.padding_mode == "zeros":
                module.forward = types.MethodType(_causal_conv_forward, module)
        elif isinstance(module, WanUpsample):
            module.forward = types.MethodType(_upsample_forward, module)


@contextmanager
def _fast_path_on() -> Iterator[None]:
    previous = getattr(_fast_path_switch, "on", False)
    _fast_path_switch.on = True
    try:
        yield
    finally:
        _fast_path_switch.on = previous


# ---------------------------------------------------------------------------
# Compiled steady state (CUDA)

# After this many latent frames every cache slot holds a tensor of its final
# shape (see measure_bytes_per_pixel), so one compiled graph serves every later frame.
STEADY_STATE_FRAMES = 2


def _resample_forward(resample: WanResample, x: torch.Tensor, feat_cache=None, feat_idx=[0]) -> torch.Tensor:  # noqa: B006
    """diffusers' temporal upsample, with its cache already a tensor (every steady frame) taken without a test.

    diffusers asks ``feat_cache[idx] == "Rep"`` of a tensor; torch.compile before 2.13 cannot trace a tensor
    compared with a string, so it split the steady decode into 14 graphs at the two temporal upsamples
    (and the recompiles that followed sent parts of it back to eager). Any other call (the opening frames'
    ``None`` and ``"Rep"`` slots, no cache, the spatial modes) goes to diffusers' own forward.
    """
    if resample.mode != "upsample3d" or feat_cache is None or not isinstance(feat_cache[feat_idx[0]], torch.Tensor):
        return type(resample).forward(resample, x, feat_cache, feat_idx)
    b, c, t, h, w = x.shape
    idx = feat_idx[0]
    cache_x = x[:, :, -CACHE_T:].clone()
    if cache_x.shape[2] < 2:  # one new frame: keep the last one of the previous chunk beside it
        cache_x = torch.cat([feat_cache[idx][:, :, -1:].to(cache_x.device), cache_x], dim=2)
    x = resample.time_conv(x, feat_cache[idx])
    feat_cache[idx] = cache_x
    feat_idx[0] += 1
    x = x.reshape(b, 2, c, t, h, w)
    x = torch.stack((x[:, 0], x[:, 1]), 3).reshape(b, c, t * 2, h, w)  # the two outputs interleaved in time
    x = x.permute(0, 2, 1, 3, 4).reshape(b * t * 2, c, h, w)
    x = resample.resample(x)
    return x.view(b, t * 2, x.size(1), x.size(2), x.size(3)).permute(0, 2, 1, 3, 4)


def _install_steady_resample(decoder: torch.nn.Module) -> int:
    """Give the decoder's temporal upsamples :func:`_resample_forward` (instance-level, idempotent); how many."""
    installed = 0
    for module in decoder.modules():
        if isinstance(module, WanResample) and module.mode == "upsample3d":
            if "forward" not in module.__dict__:
                module.forward = types.MethodType(_resample_forward, module)
            installed += 1
    return installed


def _decode_one_frame(decoder, frame: torch.Tensor, cache: list[torch.Tensor | None]):
    """The decoder on one latent frame as a pure function: the new cache is returned, the old one is not touched."""
    feat_cache = list(cache)
    out = decoder(frame, feat_cache=feat_cache, feat_idx=[0], first_chunk=False)
    return out, feat_cache


class SteadyStateDecode:
    """``torch.compile`` of the decoder for frames after the session's opening ones.

    The opening frames (cache slots still empty or diffusers' ``"Rep"``
    marker) run eagerly; from then on the cache's shapes never change, so one
    graph is compiled, at the first steady frame (the engine's warm-up). A
    failed compile falls back to eager for good. The function is pure, so a
    failure leaves the session's state as it was.
    """

    def __init__(self, decoder: torch.nn.Module) -> None:
        _install_steady_resample(decoder)  # one graph, not 14 (see _resample_forward)
        self._compiled = torch.compile(functools.partial(_decode_one_frame, decoder), dynamic=False)
        self.failed = False
        self.calls = 0

    def decode(self, frame: torch.Tensor, state: StreamingDecodeState) -> torch.Tensor | None:
        if self.failed or any(isinstance(t, str) for t in state.feat_map):  # diffusers' "Rep": still opening
            return None
        try:
            out, cache = self._compiled(frame, state.feat_map)
        except Exception:
            self.failed = True
            log.warning("compiled VAE decode unavailable; decoding eagerly", exc_info=True)
            return None
        state.feat_map = list(cache)
        self.calls += 1
        return out


# ---------------------------------------------------------------------------
# The decoder


def frames_to_uint8_tensor(frames: torch.Tensor) -> torch.Tensor:
    """``[1, 3, T, H, W]`` in ``[-1, 1]`` -> ``[T, H, W, 3]`` uint8 (``round((x + 1) / 2 * 255)``) on the frames'
    device; every video decoder's output."""
    if frames.ndim != 5 or frames.shape[0] != 1 or frames.shape[1] != 3:
        raise ValueError(f"frames must be [1, 3, T, H, W]; got shape {tuple(frames.shape)}")
    scaled = ((frames[0].float() + 1.0) / 2.0 * 255.0).round().clamp(0, 255)
    return scaled.to(torch.uint8).permute(1, 2, 3, 0).contiguous()


def frames_to_uint8(frames: torch.Tensor) -> np.ndarray:
    """:func:`frames_to_uint8_tensor` in host memory (waits for the device)."""
    return frames_to_uint8_tensor(frames).cpu().numpy()



class WanStreamingDecoder:
    """Streaming decode over a diffusers ``AutoencoderKLWan``, one state per session.

    ``bytes_per_pixel``: resident state bytes per output pixel in fp32, as
    measured by :func:`measure_bytes_per_pixel`; when ``None``, the measured
    constant for a known architecture is used, else it is measured on first use.
    ``fast_path``: compute the decoder's causal convs with ``conv2d``
    (:func:`causal_conv3d_as_conv2d`); default on when the VAE is on the CPU.
    ``conv_kernel``: compute the decoder's 3x3(x3) convolutions with the Triton kernel of
    ``decoders/shifted_rows_conv.py`` (CUDA; the VAE's decoder half then runs it for every caller);
    ``conv_kernel_fp8``: its residual blocks' convolutions in e4m3.
    """

    def __init__(
        self,
        vae: AutoencoderKLWan,
        *,
        bytes_per_pixel: float | None = None,
        fast_path: bool | None = None,
        compile_steady_state: bool = False,
        conv_kernel: bool = False,
        conv_kernel_fp8: bool = False,
    ) -> None:
        if not isinstance(vae, AutoencoderKLWan):
            raise TypeError(f"WanStreamingDecoder needs a diffusers AutoencoderKLWan, got {type(vae).__name__}")
        self.vae = vae
        parameter = next(vae.parameters())
        self.device = parameter.device
        self.dtype = parameter.dtype
        self.num_causal_convs = int(vae._cached_conv_counts["decoder"])
        self.fast_path = self.device.type == "cpu" if fast_path is None and not conv_kernel else bool(fast_path)
        if self.fast_path and conv_kernel:
            raise ValueError("fast_path (conv2d on the CPU) and conv_kernel (Triton on CUDA) exclude each other")
        if self.fast_path:
            _install_fast_path(vae)
        self.conv_kernel = bool(conv_kernel)
        self.kernel_convs = 0  # how many of the decoder's convolutions the kernel computes
        self.fused_conv_inputs = 0  # residual blocks whose e4m3 inputs come from decoders/conv_input_fp8.py
        if self.conv_kernel:
            from decoders import shifted_rows_conv

            self.kernel_convs = shifted_rows_conv.install(vae.decoder, fp8=conv_kernel_fp8)
            if conv_kernel_fp8:
                from decoders import conv_input_fp8

                self.fused_conv_inputs = conv_input_fp8.install(vae.decoder)
        if bytes_per_pixel is None:
            bytes_per_pixel = _KNOWN_BYTES_PER_PIXEL_FP32.get(_decoder_architecture(vae))
        self._bytes_per_pixel = bytes_per_pixel
        self.steady_state = SteadyStateDecode(vae.decoder) if compile_steady_state else None
        config = vae.config
        self._latents_mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1)
        self._latents_std = torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1)
        # (device, dtype) -> (mean, 1 / std) there: copied once, since a host-to-device copy per block would
        # make the host wait for the device mid-block.
        self._denormalizers: dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def spatial_upscale(self) -> int:
        """Output pixels per latent pixel along each side."""
        return spatial_upscale(self.vae)

    # -- session lifecycle -------------------------------------------------

    def new_state(self, session_id: str) -> StreamingDecodeState:
        if not isinstance(session_id, str) or not session_id:
            raise ValueError("session_id must be a non-empty string")
        return StreamingDecodeState(session_id=session_id, feat_map=[None] * self.num_causal_convs, owner=self)

    def release(self, state: StreamingDecodeState) -> None:
        self._check_owner(state)
        state.release()

    # -- decode ------------------------------------------------------------

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """Model-space latents -> VAE-space latents, exactly as diffusers' WanPipeline does."""
        key = (str(latents.device), latents.dtype)
        if key not in self._denormalizers:
            mean = self._latents_mean.to(latents.device, latents.dtype)
            self._denormalizers[key] = (mean, 1.0 / self._latents_std.to(latents.device, latents.dtype))
        mean, inverse_std = self._denormalizers[key]
        return latents / inverse_std + mean

    @torch.inference_mode()
    def decode_chunk(self, latents: torch.Tensor, state: StreamingDecodeState) -> torch.Tensor:
        """Decode ``latents`` as the continuation of ``state``'s session; advances ``state``.

        ``latents``: ``[1, z_dim, T, h, w]`` already denormalised (see :meth:`denormalize`).
        Returns ``[1, 3, T', 8h, 8w]`` in ``[-1, 1]``, ``T' = 4T``, or ``4T - 3``
        when the chunk opens the session. If it raises mid-chunk, the state is
        part-advanced and must be released.
        """
        self._check_owner(state)
        if latents.ndim != 5:
            raise ValueError(f"latents must be [1, C, T, h, w]; got shape {tuple(latents.shape)}")
        if latents.shape[0] != 1:
            # One state is one session's temporal context; a batch would run
            # several streams through one cache.
            raise ValueError(f"one session per call: batch must be 1, got {latents.shape[0]}")
        if latents.shape[1] != self.vae.config.z_dim:
            raise ValueError(f"latents must have {self.vae.config.z_dim} channels, got {latents.shape[1]}")
        if latents.shape[2] == 0:
            raise ValueError("latents carry no frames")

        latents = latents.to(self.device, self.dtype)
        pixel_frames = []
        with _fast_path_on() if self.fast_path else nullcontext():
            for index in range(latents.shape[2]):
                state.conv_idx[0] = 0
                # post_quant_conv is 1x1x1: per frame equals whole-clip, and it
                # keeps every kernel's input shape independent of the chunking.
                frame = self.vae.post_quant_conv(latents[:, :, index : index + 1])
                decoded = None
                if self.steady_state is not None and state.frames_decoded >= STEADY_STATE_FRAMES:
                    decoded = self.steady_state.decode(frame, state)
                if decoded is None:
                    decoded = self.vae.decoder(
                        frame,
                        feat_cache=state.feat_map,
                        feat_idx=state.conv_idx,
                        first_chunk=not state.started,
                    )
                pixel_frames.append(decoded)
                state.frames_decoded += 1
        state.chunks_decoded += 1
        out = torch.cat(pixel_frames, dim=2)
        if self.vae.config.patch_size is not None:
            out = unpatchify(out, patch_size=self.vae.config.patch_size)
        return out.clamp(-1.0, 1.0)

    to_uint8 = staticmethod(frames_to_uint8)
    to_uint8_tensor = staticmethod(frames_to_uint8_tensor)  # on the device: the runner copies it without a wait

    # -- admission ---------------------------------------------------------

    def declared_state_bytes(self, height: int, width: int, dtype: torch.dtype) -> int:
        """Resident decoder-state bytes of one session at this output size, once it has started.

        Every cached tensor is ``[1, C, CACHE_T, H / s, W / s]`` for a level's
        scale ``s``, so the total is a constant times ``height * width``; the
        constant is measured, not derived. Exact for every size this decoder can
        output (multiples of :func:`spatial_upscale`, 8 for Wan2.1).
        """
        upscale = spatial_upscale(self.vae)
        if height <= 0 or width <= 0 or height % upscale or width % upscale:
            raise ValueError(f"height and width must be positive multiples of {upscale}; got {height}x{width}")
        if self._bytes_per_pixel is None:
            self._bytes_per_pixel = measure_bytes_per_pixel(self.vae)
        element_ratio = torch.empty((), dtype=dtype).element_size() / 4
        return round(self._bytes_per_pixel * height * width * element_ratio)

    def _check_owner(self, state: StreamingDecodeState) -> None:
        if not isinstance(state, StreamingDecodeState):
            raise ValueError(f"expected a StreamingDecodeState, got {type(state).__name__}")
        if state.owner is not self:
            raise ValueError(f"decode state of session {state.session_id!r} belongs to another decoder")


def measure_bytes_per_pixel(vae: AutoencoderKLWan, latent_height: int = 4, latent_width: int = 4) -> float:
    """Resident decode-state bytes per output pixel in fp32 for this VAE's architecture.

    Decodes 2 random latent frames (after which every cache slot holds its full
    ``CACHE_T`` frames) through a throw-away state on the VAE's own device and
    dtype, and scales the element size to fp32.
    """
    decoder = WanStreamingDecoder(vae, bytes_per_pixel=0.0, fast_path=False)
    state = decoder.new_state("measure-bytes-per-pixel")
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, vae.config.z_dim, 2, latent_height, latent_width, generator=generator)
    decoder.decode_chunk(latents, state)
    pixels = latent_height * latent_width * spatial_upscale(vae) ** 2
    return state.nbytes() / pixels * 4 / torch.empty((), dtype=decoder.dtype).element_size()


# Keyed by _decoder_architecture: (decoder base dim, z_dim, dim_mult, num_res_blocks,
# temperal_downsample, is_residual, patch_size).
_KNOWN_BYTES_PER_PIXEL_FP32: dict[tuple, float] = {
    (4, 16, (1, 2, 4, 4), 1, (False, True, True), False, None): TINY_VAE_STATE_BYTES_PER_PIXEL_FP32,
    (96, 16, (1, 2, 4, 4), 2, (False, True, True), False, None): WAN_2_1_VAE_STATE_BYTES_PER_PIXEL_FP32,
}
