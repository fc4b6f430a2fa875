"""The latents of an AR block: video frames and, when the model has audio, its audio latent frames.

The block loop's arithmetic (x0 = x − σ·v, re-noising) applies to both alike,
so it is written once against this type.

::

    video  [1, C, F, h, w]        F latent frames
    audio  [1, D, F * A]          A audio latent frames per video latent frame
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockLatents:
    video: torch.Tensor
    audio: torch.Tensor | None = None

    @property
    def frames(self) -> int:
        return self.video.shape[2]

    def to(self, device: torch.device | str, dtype: torch.dtype | None = None) -> "BlockLatents":
        return BlockLatents(
            self.video.to(device, dtype),
            None if self.audio is None else self.audio.to(device, dtype),
        )

    def float(self) -> "BlockLatents":
        return BlockLatents(self.video.float(), None if self.audio is None else self.audio.float())

    def combine(self, other: "BlockLatents", a: float, b: float) -> "BlockLatents":
        """``a * self + b * other`` for both modalities."""
        audio = None if self.audio is None else a * self.audio + b * other.audio
        return BlockLatents(a * self.video + b * other.video, audio)

    def split_frames(self) -> list["BlockLatents"]:
        """One ``BlockLatents`` per latent frame (audio split evenly with its frame)."""
        videos = self.video.split(1, dim=2)
        if self.audio is None:
            return [BlockLatents(v) for v in videos]
        per_frame = self.audio.shape[2] // self.frames
        return [BlockLatents(v, a) for v, a in zip(videos, self.audio.split(per_frame, dim=2))]

    @staticmethod
    def cat(parts: list["BlockLatents"]) -> "BlockLatents":
        video = torch.cat([p.video for p in parts], dim=2)
        audio = None if parts[0].audio is None else torch.cat([p.audio for p in parts], dim=2)
        return BlockLatents(video, audio)

    @staticmethod
    def stack(parts: list["BlockLatents"]) -> "BlockLatents":
        """Sessions' latents (each of batch 1) as one batch, in order (a batched forward's input)."""
        video = torch.cat([p.video for p in parts], dim=0)
        audio = None if parts[0].audio is None else torch.cat([p.audio for p in parts], dim=0)
        return BlockLatents(video, audio)

    def row(self, index: int) -> "BlockLatents":
        """One session's latents of a batch (batch 1, a view)."""
        return BlockLatents(self.video[index : index + 1],
                            None if self.audio is None else self.audio[index : index + 1])

    @staticmethod
    def cat_groups(latents: "BlockLatents", size: int) -> list["BlockLatents"]:
        """``latents`` in consecutive groups of ``size`` latent frames (the last one may be shorter)."""
        frames = latents.split_frames()
        return [BlockLatents.cat(frames[start : start + size]) for start in range(0, len(frames), size)]

    @property
    def nbytes(self) -> int:
        return self.video.nbytes + (0 if self.audio is None else self.audio.nbytes)

    def max_abs_diff(self, other: "BlockLatents") -> float:
        diff = (self.video - other.video).abs().max().item()
        if self.audio is not None:
            diff = max(diff, (self.audio - other.audio).abs().max().item())
        return diff
