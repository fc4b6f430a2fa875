"""Streaming video encode over the Wan VAE: pixels -> latent frames, with the causal cache owned by the session.

The mirror of :mod:`decoders.video`. diffusers' ``AutoencoderKLWan._encode`` already encodes a clip one
latent group at a time (its first frame alone, then 4 frames per latent frame) while a cache
(``_enc_feat_map``) carries the last ``CACHE_T`` slices of every causal convolution's input; it clears
that cache at the start and end of every call and keeps it on the module. Here the cache lives in
:class:`WanEncodeState`, one per session, so a session's input (a live camera, block by block) is encoded
as one causal stream, and one VAE serves any number of sessions. The module's own ``_enc_feat_map`` is
never touched.

Frame arithmetic (the decoder's, mirrored)::

    input frames   v0 | v1 v2 v3 v4 | v5 ...
    latent frames  z0 | z1          | z2 ...      1 + 4 (N - 1) frames -> N latents

Frames of a group not yet complete wait in the state (at most 3). Every group goes through the encoder
alone, as ``_encode`` runs it, so encoding in any chunks equals encoding in one call. The latents are the
posterior's mode (its mean), what diffusers' Wan image-to-video pipeline takes; :meth:`normalize` maps them
to model space exactly as the decoder's ``denormalize`` maps back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan, patchify

from decoders.taehv_encoder import FRAMES_PER_LATENT, frames_from_uint8
from decoders.video import spatial_upscale

# Resident encoder-state bytes per input pixel in fp32, the largest over a stream's first groups (by the third
# every cache slot holds its final shape), measured with measure_encoder_bytes_per_pixel; torch 2.13, CPU.
#   tiny toy Wan VAE (engine.models.presets.TINY_VAE_CONFIG):
TINY_VAE_ENCODER_BYTES_PER_PIXEL_FP32 = 141.0
#   Wan2.1 VAE (diffusers' AutoencoderKLWan defaults, base_dim 96); x 832 x 480 x 2 bytes (bf16) = 1069.5 MiB,
#   against 1801 MiB for its decoder's cache (same at 32x32 and 32x64):
WAN_2_1_VAE_ENCODER_BYTES_PER_PIXEL_FP32 = 5616.0


def _encoder_architecture(vae: AutoencoderKLWan) -> tuple:
    """The config fields that fix the encoder's cache geometry (weights do not)."""
    config = vae.config
    return (config.base_dim, config.z_dim, tuple(config.dim_mult), config.num_res_blocks,
            tuple(config.temperal_downsample), config.is_residual, config.patch_size)


_KNOWN_BYTES_PER_PIXEL_FP32: dict[tuple, float] = {
    (4, 16, (1, 2, 4, 4), 1, (False, True, True), False, None): TINY_VAE_ENCODER_BYTES_PER_PIXEL_FP32,
    (96, 16, (1, 2, 4, 4), 2, (False, True, True), False, None): WAN_2_1_VAE_ENCODER_BYTES_PER_PIXEL_FP32,
}


@dataclass
class WanEncodeState:
    """One session's input stream: the encoder's causal cache (one slot per causal convolution: ``None``
    before it ran, else a tensor of at most ``CACHE_T`` frames) and the frames of a latent group not yet
    complete (``[1, 3, k, H, W]``, ``k < 4``). Releasing it ends the stream."""

    session_id: str
    feat_map: list[Any]
    owner: object = field(repr=False, compare=False)
    pending: torch.Tensor | None = None
    frames_encoded: int = 0  # input frames taken, pending ones included
    latents_encoded: int = 0

    def nbytes(self) -> int:
        held = [t for t in self.feat_map if torch.is_tensor(t)] + ([self.pending] if self.pending is not None else [])
        return sum(t.numel() * t.element_size() for t in held)

    @property
    def started(self) -> bool:
        return self.frames_encoded > 0

    def release(self) -> None:
        self.feat_map = [None] * len(self.feat_map)
        self.pending = None
        self.frames_encoded = 0
        self.latents_encoded = 0


class WanStreamingEncoder:
    """Streaming encode over a diffusers ``AutoencoderKLWan``, one state per session.

    ``bytes_per_pixel``: resident state bytes per input pixel in fp32 (:func:`measure_encoder_bytes_per_pixel`);
    ``None``: the measured constant of a known architecture, else measured on first use.
    """

    frames_per_latent = FRAMES_PER_LATENT

    def __init__(self, vae: AutoencoderKLWan, *, bytes_per_pixel: float | None = None) -> None:
        if not isinstance(vae, AutoencoderKLWan):
            raise TypeError(f"WanStreamingEncoder needs a diffusers AutoencoderKLWan, got {type(vae).__name__}")
        self.vae = vae
        parameter = next(vae.parameters())
        self.device = parameter.device
        self.dtype = parameter.dtype
        self.num_causal_convs = int(vae._cached_conv_counts["encoder"])
        if bytes_per_pixel is None:
            bytes_per_pixel = _KNOWN_BYTES_PER_PIXEL_FP32.get(_encoder_architecture(vae))
        self._bytes_per_pixel = bytes_per_pixel
        config = vae.config
        self._latents_mean = torch.tensor(config.latents_mean).view(1, config.z_dim, 1, 1, 1)
        self._latents_std = torch.tensor(config.latents_std).view(1, config.z_dim, 1, 1, 1)
        self._normalizers: dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def spatial_downscale(self) -> int:
        """Input pixels per latent pixel along each side."""
        return spatial_upscale(self.vae)

    # -- session lifecycle -------------------------------------------------

    def new_state(self, session_id: str) -> WanEncodeState:
        if not isinstance(session_id, str) or not session_id:
            raise ValueError("session_id must be a non-empty string")
        return WanEncodeState(session_id=session_id, feat_map=[None] * self.num_causal_convs, owner=self)

    def release(self, state: WanEncodeState) -> None:
        self._check_owner(state)
        state.release()

    def frames_needed(self, latents: int, state: WanEncodeState) -> int:
        """Input frames that complete ``latents`` more latent frames of ``state``'s stream."""
        pending = 0 if state.pending is None else state.pending.shape[2]
        opening = 0 if state.started else FRAMES_PER_LATENT - 1
        return max(0, FRAMES_PER_LATENT * latents - opening - pending)

    # -- encode ------------------------------------------------------------

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        """VAE-space latents -> model space, exactly as diffusers' Wan pipelines do (the decoder's
        ``denormalize`` inverted)."""
        key = (str(latents.device), latents.dtype)
        if key not in self._normalizers:  # on the device once, not a host copy per block
            self._normalizers[key] = (self._latents_mean.to(latents.device, latents.dtype),
                                      1.0 / self._latents_std.to(latents.device, latents.dtype))
        mean, inverse_std = self._normalizers[key]
        return (latents - mean) * inverse_std

    def from_uint8(self, frames: np.ndarray) -> torch.Tensor:
        return frames_from_uint8(frames, self.device, self.dtype)

    @torch.inference_mode()
    def encode_chunk(self, frames: torch.Tensor, state: WanEncodeState) -> torch.Tensor:
        """Encode ``frames`` (``[1, 3, T, H, W]`` in ``[-1, 1]``) as the continuation of ``state``'s stream.

        Returns the latents (the posterior's mean) of every group the frames complete, ``[1, z_dim, n, h, w]``
        (``n`` may be 0). After an error the state is part-advanced: release it.
        """
        self._check_owner(state)
        if frames.ndim != 5 or frames.shape[0] != 1 or frames.shape[1] != 3:
            raise ValueError(f"frames must be [1, 3, T, H, W]; got {tuple(frames.shape)}")
        scale = self.spatial_downscale
        height, width = frames.shape[3], frames.shape[4]
        if height == 0 or width == 0 or height % scale or width % scale:
            raise ValueError(f"height and width must be positive multiples of {scale}; got {height}x{width}")
        x = frames.to(self.device, self.dtype)
        if state.pending is not None:
            if state.pending.shape[3:] != x.shape[3:]:
                raise ValueError(f"frames of {height}x{width} continue a stream of another size")
            x = torch.cat([state.pending, x], dim=2)
        state.frames_encoded += int(frames.shape[2])
        groups = []
        start = 0
        if state.latents_encoded == 0 and x.shape[2] >= 1:
            groups.append(x[:, :, :1])  # the stream's first frame is a latent group of its own
            start = 1
        while start + FRAMES_PER_LATENT <= x.shape[2]:
            groups.append(x[:, :, start : start + FRAMES_PER_LATENT])
            start += FRAMES_PER_LATENT
        state.pending = x[:, :, start:].clone() if start < x.shape[2] else None
        z_dim = self.vae.config.z_dim
        latents = []
        for group in groups:
            if self.vae.config.patch_size is not None:
                group = patchify(group, patch_size=self.vae.config.patch_size)
            out = self.vae.encoder(group, feat_cache=state.feat_map, feat_idx=[0])
            # quant_conv is 1x1x1: per group equals whole-clip, and keeps every kernel's shape chunk-independent.
            latents.append(self.vae.quant_conv(out)[:, :z_dim])
            state.latents_encoded += 1
        if not latents:
            return x.new_zeros(1, z_dim, 0, height // scale, width // scale)
        return torch.cat(latents, dim=2)

    # -- admission ---------------------------------------------------------

    def declared_state_bytes(self, height: int, width: int, dtype: torch.dtype) -> int:
        """Resident encoder-state bytes of one session at this input size, at most: the cache (a measured
        constant times ``height * width``, as for the decoder) and up to 3 waiting input frames."""
        scale = self.spatial_downscale
        if height <= 0 or width <= 0 or height % scale or width % scale:
            raise ValueError(f"height and width must be positive multiples of {scale}; got {height}x{width}")
        if self._bytes_per_pixel is None:
            self._bytes_per_pixel = measure_encoder_bytes_per_pixel(self.vae)
        element = torch.empty((), dtype=dtype).element_size()
        pending = (FRAMES_PER_LATENT - 1) * 3 * height * width * element
        return round(self._bytes_per_pixel * height * width * element / 4) + pending

    def _check_owner(self, state: WanEncodeState) -> None:
        if not isinstance(state, WanEncodeState):
            raise ValueError(f"expected a WanEncodeState, got {type(state).__name__}")
        if state.owner is not self:
            raise ValueError(f"encode state of session {state.session_id!r} belongs to another encoder")


def measure_encoder_bytes_per_pixel(vae: AutoencoderKLWan, height: int = 32, width: int = 32) -> float:
    """Resident encoder-state bytes per input pixel in fp32 for this VAE's architecture, without pending frames:
    the largest cache over a stream's first four latent groups (each slot reaches its final shape by the third),
    through a throw-away state on the VAE's own device and dtype."""
    encoder = WanStreamingEncoder(vae, bytes_per_pixel=0.0)
    state = encoder.new_state("measure-encoder-bytes-per-pixel")
    generator = torch.Generator().manual_seed(0)
    largest = 0
    for frames in (1, 4, 4, 4):
        clip = torch.rand(1, 3, frames, height, width, generator=generator) * 2 - 1
        encoder.encode_chunk(clip, state)
        largest = max(largest, state.nbytes())
    return largest / (height * width) * 4 / torch.empty((), dtype=encoder.dtype).element_size()
