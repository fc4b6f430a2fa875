"""A codec's per-channel latent statistics: model space <-> the codec's own latents.

The tiny preset's codec was trained on raw latents and its DiT on latents normalised per channel with the
mean and std measured over the training set (stored in the codec file's metadata); its encoder normalises
with them and its decoder denormalises, exactly inverse to each other. Without statistics both are the
identity (the published TAEHV weights work in the model's space already).
"""

from __future__ import annotations

import torch


class LatentStats:
    """Mean and std per latent channel, copied to each (device, dtype) once: a host-to-device copy per block
    would make the host wait for the device mid-block."""

    def __init__(self, mean: list[float], std: list[float], channels: int) -> None:
        if len(mean) != channels or len(std) != channels:
            raise ValueError(f"latent statistics need {channels} values each")
        self._host = (torch.tensor(mean), torch.tensor(std))
        self._placed: dict[tuple[str, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def optional(cls, mean: list[float] | None, std: list[float] | None, channels: int) -> LatentStats | None:
        """The statistics when both are given, None when neither is; one without the other is an error."""
        if (mean is None) != (std is None):
            raise ValueError("latents_mean and latents_std come together")
        return None if mean is None else cls(mean, std, channels)

    def _on(self, latents: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        key = (str(latents.device), latents.dtype)
        if key not in self._placed:
            self._placed[key] = tuple(t.to(latents.device, latents.dtype).view(1, -1, 1, 1, 1) for t in self._host)
        return self._placed[key]

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        """The codec's latents ``[B, C, T, h, w]`` -> model space: ``(z - mean) / std``."""
        mean, std = self._on(latents)
        return (latents - mean) / std

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """Model space -> the codec's latents: ``z * std + mean``."""
        mean, std = self._on(latents)
        return latents * std + mean
