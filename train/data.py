"""Stage 3: the DiT's training set: world clips encoded once by the trained VAE, in model space.

Video latents are normalised per channel (mean and std measured here, stored
with the VAE weights so the engine's decoder denormalises exactly as it would
for Wan). Audio latents are the clips' sound features (already in [-1, 1]).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from train.vae import encode_mode
from world.clips import random_clip


@dataclass
class LatentSet:
    video: torch.Tensor  # [n, 16, L, h, w] model space
    audio: torch.Tensor  # [n, 8, 20 L]
    token_ids: list[list[int]]  # the clips' captions, as text-encoder ids
    switch: torch.Tensor  # [n] latent frame of the prompt switch, -1 when none
    mean: torch.Tensor  # [16] VAE-space channel means
    std: torch.Tensor  # [16]

    def __len__(self) -> int:
        return self.video.shape[0]


@torch.no_grad()
def build_latent_set(vae, text_encoder, *, clips: int, latent_frames: int, device, batch: int = 16, seed: int = 3,
                     switch_probability: float = 0.25, stats: tuple[torch.Tensor, torch.Tensor] | None = None) -> LatentSet:
    """``stats``: the (mean, std) to normalise with, when a DiT was already trained on them; else measured here."""
    rng = np.random.default_rng(seed)
    videos, audios, ids, switches = [], [], [], []
    for start in range(0, clips, batch):
        group = [
            random_clip(int(rng.integers(1 << 31)), latent_frames, switch_probability=switch_probability, device=device)
            for _ in range(min(batch, clips - start))
        ]
        videos.append(encode_mode(vae, torch.stack([c.video for c in group])))
        audios.append(torch.stack([c.features for c in group]))
        ids += [text_encoder.token_ids(c.caption) for c in group]
        switches += [-1 if c.switch_latent is None else c.switch_latent for c in group]
    video = torch.cat(videos)
    if stats is None:
        mean = video.mean(dim=(0, 2, 3, 4))
        std = video.std(dim=(0, 2, 3, 4)).clamp_min(1e-3)
    else:
        mean, std = (torch.as_tensor(x, dtype=video.dtype, device=video.device) for x in stats)
    video = (video - mean.view(1, -1, 1, 1, 1)) / std.view(1, -1, 1, 1, 1)
    return LatentSet(video, torch.cat(audios), ids, torch.tensor(switches, device=device), mean.cpu(), std.cpu())
