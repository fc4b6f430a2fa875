"""A TAEHV-class causal video encoder: frames -> Wan2.1-geometry latents (16 channels, 8x spatial, 4x temporal).

The tiny preset's codec is this encoder with :class:`decoders.taehv.TAEHVDecoder` (docs/TINY_MODEL.md):
plain 3x3 convs and ReLUs, no normalisation layer, so a colour is a linear function of the input all the
way down and back (the tiny Wan VAE's RMS norms over 4-16 channels made colour slow to learn). The
published TAEHV checkpoints ship an encoder of this shape too; this module builds its own, with its own
widths, and loads none of theirs.

Layer list (``w`` = ``config.widths``)::

    conv 3->w0, ReLU                                              full resolution, every frame
    stage s = 0, 1, 2:  temporal pool (x2, x2, x1) 1x1 conv over the pooled frames' channels
                        conv 3x3 stride 2 (w_s -> w_{s+1}), blocks_per_stage memory blocks (w_{s+1})
    conv w3->latent_channels                                      1/8 resolution, one frame per latent

Frame arithmetic (the Wan VAE's, so the DiT and the decoders see the same latents)::

    video frames   v0          | v1 v2 v3 v4 | v5 ...
    padded         v0 v0 v0 v0 | v1 v2 v3 v4 | ...      the first frame repeated 3 times in front
    latents        z0          | z1          | ...      1 + 4 (N - 1) frames -> N latents

Causal: latent ``k`` depends on video frames ``0 .. 4k`` only (a memory block sees its input one frame
earlier at its depth; a temporal pool joins consecutive frames). :meth:`TAEHVEncoder.encode_video` runs
every layer on all frames at once, which is the same function.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from decoders.taehv import MemoryBlock, _conv3x3

FRAMES_PER_LATENT = 4


@dataclass(frozen=True)
class TAEHVEncoderConfig:
    latent_channels: int = 16
    widths: tuple[int, int, int, int] = (16, 32, 48, 64)  # full-resolution conv, then stages at 1/2, 1/4, 1/8
    blocks_per_stage: int = 1
    time_downscale: tuple[bool, bool, bool] = (True, True, False)  # a 2x temporal pool before stage s
    image_channels: int = 3
    # Add each latent cell's mean colour (over its 4 frames and 8x8 pixels) to latent channels 0-2,
    # the half of decoders.taehv.colour_shortcut that the decoder adds back.
    colour_shortcut: bool = True

    def __post_init__(self) -> None:
        if len(self.widths) != 4 or min(self.widths) <= 0:
            raise ValueError(f"widths must be 4 positive channel counts, got {self.widths}")
        if len(self.time_downscale) != 3 or 2 ** sum(self.time_downscale) != FRAMES_PER_LATENT:
            raise ValueError(f"time_downscale must pool {FRAMES_PER_LATENT}x over 3 stages, got {self.time_downscale}")


class TemporalPool(nn.Module):
    """Joins ``stride`` consecutive frames: their channels stacked, then a 1x1 conv back to ``channels``."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(channels * stride, channels, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, C, H, W]`` -> ``[B, T / stride, C, H, W]``."""
        batch, frames, channels, height, width = x.shape
        if frames % self.stride:
            raise ValueError(f"{frames} frames do not pool by {self.stride}")
        stacked = x.reshape(batch * frames // self.stride, self.stride * channels, height, width)
        return self.conv(stacked).view(batch, frames // self.stride, channels, height, width)


class TAEHVEncoder(nn.Module):
    """The encoder as a plain module; ``state_dict()`` keys are ``encoder.{i}.…``."""

    def __init__(self, config: TAEHVEncoderConfig = TAEHVEncoderConfig()) -> None:
        super().__init__()
        self.config = config
        w = config.widths
        layers: list[nn.Module] = [_conv3x3(config.image_channels, w[0]), nn.ReLU()]
        for stage in range(3):
            layers += [
                TemporalPool(w[stage], 2 if config.time_downscale[stage] else 1),
                nn.Conv2d(w[stage], w[stage + 1], 3, stride=2, padding=1, bias=False),
            ]
            layers += [MemoryBlock(w[stage + 1]) for _ in range(config.blocks_per_stage)]
        layers.append(_conv3x3(w[3], config.latent_channels))
        self.encoder = nn.Sequential(*layers)

    def encode_video(self, video: torch.Tensor) -> torch.Tensor:
        """``[B, 3, 1 + 4 (N - 1), H, W]`` in ``[-1, 1]`` -> ``[B, latent_channels, N, H / 8, W / 8]`` (raw latents)."""
        if video.ndim != 5 or video.shape[1] != self.config.image_channels:
            raise ValueError(f"video must be [B, {self.config.image_channels}, T, H, W]; got {tuple(video.shape)}")
        frames = video.shape[2]
        if (frames - 1) % FRAMES_PER_LATENT:
            raise ValueError(f"{frames} frames: a clip has 1 + {FRAMES_PER_LATENT} (N - 1) frames")
        if video.shape[3] % 8 or video.shape[4] % 8:
            raise ValueError(f"height and width must be multiples of 8; got {video.shape[3]}x{video.shape[4]}")
        x = (video.transpose(1, 2) + 1) / 2  # [B, T, 3, H, W] in [0, 1], TAEHV's pixel range
        x = torch.cat([x[:, :1].expand(-1, FRAMES_PER_LATENT - 1, -1, -1, -1), x], dim=1)
        pixels = x
        for layer in self.encoder:
            if isinstance(layer, MemoryBlock):
                past = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
                x = layer(x.flatten(0, 1), past.flatten(0, 1)).view_as(x)
            elif isinstance(layer, TemporalPool):
                x = layer(x)
            else:
                batch, count = x.shape[:2]
                x = layer(x.flatten(0, 1))
                x = x.view(batch, count, *x.shape[1:])
        if self.config.colour_shortcut:
            x = x + F.pad(mean_colours(pixels), (0, 0, 0, 0, 0, x.shape[2] - 3))
        return x.transpose(1, 2)


def mean_colours(pixels: torch.Tensor) -> torch.Tensor:
    """``[B, 4N, 3, H, W]`` (padded frames) -> ``[B, N, 3, H / 8, W / 8]``: each latent cell's mean colour."""
    batch, frames, channels, height, width = pixels.shape
    cells = F.avg_pool2d(pixels.flatten(0, 1), 8).view(batch, frames // FRAMES_PER_LATENT, FRAMES_PER_LATENT, channels, height // 8, width // 8)
    return cells.mean(dim=2)
