"""Stage 1: the tiny Wan VAE (diffusers AutoencoderKLWan, the preset's config) on world clips.

Loss: L1 on pixels, weighted up on the object (it covers ~3 % of a frame and
is what the checks read), plus a small KL so latents stay near unit scale.
"""

from __future__ import annotations

import numpy as np
import torch

from train.common import LossLog, StageClock
from world.clips import random_clip

OBJECT_WEIGHT = 8.0
KL_WEIGHT = 1e-6


def clip_batch(rng: np.random.Generator, batch: int, latent_frames: int, device):
    clips = [random_clip(int(rng.integers(1 << 31)), latent_frames, switch_probability=0.3, device=device) for _ in range(batch)]
    video = torch.stack([c.video for c in clips])  # [B, 3, T, H, W]
    weight = 1.0 + OBJECT_WEIGHT * torch.stack([c.coverage for c in clips]).unsqueeze(1)
    return video, weight


def train_vae(vae, log: LossLog, clock: StageClock, *, device, batch: int = 8, latent_frames: int = 3, lr: float = 1e-3,
              seed: int = 1, decoder_only: bool = False, stage: str = "vae"):
    """Train the whole VAE, or (``decoder_only``) its decoder on the frozen encoder's posterior means.

    Decoder-only keeps the latent space, so a DiT trained on it stays valid;
    longer clips there teach the decoder the steady state of its temporal cache.
    """
    rng = np.random.default_rng(seed)
    vae.train()
    params = list(vae.decoder.parameters()) + list(vae.post_quant_conv.parameters()) if decoder_only else list(vae.parameters())
    optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    step = 0
    while not clock.expired(step):
        video, weight = clip_batch(rng, batch, latent_frames, device)
        if decoder_only:
            with torch.no_grad():
                latents = vae.encode(video).latent_dist.mode()
            kl = torch.zeros((), device=video.device)
        else:
            posterior = vae.encode(video).latent_dist
            latents = posterior.sample()
            kl = posterior.kl().mean() / posterior.mean[0].numel()
        recon = vae.decode(latents).sample
        l1 = ((recon - video).abs() * weight).mean() / weight.mean()
        loss = l1 + KL_WEIGHT * kl
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        step += 1
        if step % 25 == 0 or step == 1:
            log.write(stage, step, l1=l1.item(), kl=kl.item())
    vae.eval()
    return step


@torch.no_grad()
def encode_mode(vae, video: torch.Tensor) -> torch.Tensor:
    """Posterior means of ``[B, 3, T, H, W]`` frames: ``[B, 16, N, h, w]`` in VAE space."""
    return vae.encode(video).latent_dist.mode()
