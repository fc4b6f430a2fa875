"""Audio latent frames as extra tokens of each video latent frame.

Each video latent frame carries ``tokens_per_frame`` audio latent frames as
tokens after its video tokens, with their own input and output projections,
so a KV block (one latent frame) holds the frame's audio too and audio shares
the block's AR context. Rotary positions: the frame's time index, and a
virtual image row just below the picture, one column per audio token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


class AudioTokenProjections(nn.Module):
    def __init__(self, audio_dim: int, inner_dim: int, tokens_per_frame: int) -> None:
        super().__init__()
        if tokens_per_frame <= 0:
            raise ValueError("audio tokens per latent frame must be positive")
        self.audio_dim = audio_dim
        self.tokens_per_frame = tokens_per_frame
        self.embed = nn.Linear(audio_dim, inner_dim)
        self.head = nn.Linear(inner_dim, audio_dim)

    def tokens(self, audio: torch.Tensor, frames: int) -> torch.Tensor:
        """``[B, D, F * A]`` audio latents → ``[B, F, A, dim]`` tokens."""
        batch, dim, length = audio.shape
        if dim != self.audio_dim or length != frames * self.tokens_per_frame:
            raise ValueError(
                f"audio latents {tuple(audio.shape)} do not match {frames} frames x {self.tokens_per_frame} tokens "
                f"of dim {self.audio_dim}"
            )
        return self.embed(audio.transpose(1, 2)).view(batch, frames, self.tokens_per_frame, -1)

    def latents(self, tokens: torch.Tensor) -> torch.Tensor:
        """``[B, F, A, dim]`` tokens → ``[B, D, F * A]`` audio flow."""
        batch = tokens.shape[0]
        return self.head(tokens.flatten(1, 2)).transpose(1, 2).reshape(batch, self.audio_dim, -1)


@dataclass(frozen=True)
class AudioTiming:
    """How audio latent frames line up with video frames.

    A video latent frame stands for ``temporal_compression`` (4) video frames,
    so it carries ``4 · sample_rate / fps`` samples = ``tokens_per_frame`` audio
    latent frames of ``hop`` samples. The session's opening latent frame decodes
    to a single video frame: the first ``3 · sample_rate / fps`` samples of the
    session's audio lie before t = 0 and are dropped, which keeps audio and
    video on one clock (a block of 9 then 12 frames carries 27000 then 36000 samples).
    """

    sample_rate: int
    fps: int
    hop: int
    temporal_compression: int = 4

    def __post_init__(self) -> None:
        if self.sample_rate % self.fps:
            raise ValueError(f"{self.sample_rate} Hz is not a whole number of samples per frame at {self.fps} fps")
        if self.samples_per_video_frame % self.hop:
            raise ValueError(f"the audio hop {self.hop} must divide {self.samples_per_video_frame} samples per frame")

    @property
    def samples_per_video_frame(self) -> int:
        return self.sample_rate // self.fps

    @property
    def tokens_per_frame(self) -> int:
        return self.temporal_compression * self.samples_per_video_frame // self.hop

    @property
    def samples_before_start(self) -> int:
        return (self.temporal_compression - 1) * self.samples_per_video_frame
