"""Stage 3: the DiT's training set: world clips encoded once by the trained codec, in model space.

Video latents are normalised per channel (mean and std measured here, stored
with the codec's weights so the engine's decoder denormalises them back). Audio latents are the clips' sound features (already in [-1, 1]).
Each latent frame also gets the object's footprint on the latent grid (the
coverage of the video frames it stands for, max-pooled to 8x8 cells and
dilated by one cell): the DiT's video loss is weighted up there.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from world.clips import random_clip


@dataclass
class LatentSet:
    video: torch.Tensor  # [n, 16, L, h, w] model space
    audio: torch.Tensor  # [n, 8, 20 L]
    token_ids: list[list[int]]  # the clips' captions, as text-encoder ids
    switch: torch.Tensor  # [n] latent frame of the prompt switch, -1 when none
    mean: torch.Tensor  # [16] the codec's latent channel means
    std: torch.Tensor  # [16]
    objects: torch.Tensor | None = None  # [n, L, h, w] in [0, 1]: the object's footprint per latent frame

    def __len__(self) -> int:
        return self.video.shape[0]


def latent_footprint(coverage: torch.Tensor, latent_frames: int, scale: int = 8) -> torch.Tensor:
    """``[T, H, W]`` object coverage -> ``[L, H/scale, W/scale]``: max over each latent frame's video frames and cell."""
    groups = [coverage[:1]] + [coverage[4 * j - 3 : 4 * j + 1] for j in range(1, latent_frames)]
    per_latent = torch.stack([g.amax(dim=0) for g in groups])  # [L, H, W]
    cells = F.max_pool2d(per_latent.unsqueeze(1), scale)
    return F.max_pool2d(cells, 3, stride=1, padding=1).squeeze(1)


@torch.no_grad()
def build_latent_set(codec, text_encoder, *, clips: int, latent_frames: int, device, batch: int = 16, seed: int = 3,
                     switch_probability: float = 0.25, stats: tuple[torch.Tensor, torch.Tensor] | None = None,
                     shades_probability: float = 0.0, orbit_spread: float = 0.0) -> LatentSet:
    """``stats``: the (mean, std) to normalise with, when a DiT was already trained on them; else measured here.
    ``shades_probability``: the share of clips drawn in everyday shades of their colours (world.render.Shades),
    so that a picture in colours off the palette is continued in its own. ``orbit_spread``: the share of orbits
    drawn about another centre at another radius (world.motion.Jitter.from_seed), so that an object pictured off
    the world's one orbit circle is continued on a circle of its own."""
    rng = np.random.default_rng(seed)
    videos, audios, ids, switches, objects = [], [], [], [], []
    for start in range(0, clips, batch):
        group = [
            random_clip(int(rng.integers(1 << 31)), latent_frames, switch_probability=switch_probability,
                        shades_probability=shades_probability, orbit_spread=orbit_spread, device=device)
            for _ in range(min(batch, clips - start))
        ]
        videos.append(codec.encode_video(torch.stack([c.video for c in group])))
        audios.append(torch.stack([c.features for c in group]))
        objects.append(torch.stack([latent_footprint(c.coverage, latent_frames) for c in group]).half())
        ids += [text_encoder.token_ids(c.caption) for c in group]
        switches += [-1 if c.switch_latent is None else c.switch_latent for c in group]
    video = torch.cat(videos)
    if stats is None:
        mean = video.mean(dim=(0, 2, 3, 4))
        std = video.std(dim=(0, 2, 3, 4)).clamp_min(1e-3)
    else:
        mean, std = (torch.as_tensor(x, dtype=video.dtype, device=video.device) for x in stats)
    video = (video - mean.view(1, -1, 1, 1, 1)) / std.view(1, -1, 1, 1, 1)
    return LatentSet(video, torch.cat(audios), ids, torch.tensor(switches, device=device), mean.cpu(), std.cpu(),
                     torch.cat(objects))
