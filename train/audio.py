"""Stage 2: the audio codec's decoder (diffusers AutoencoderOobleck, the preset's config) on sound features.

The DiT's audio latents are the world's sound features themselves (see
world.sound): 8 channels per 12.5 ms codec frame, already in [-1, 1]. So only
the decoder is trained, features -> the waveform they stand for, with L1 on
samples plus multi-resolution spectral L1 (the checks read pitch, which lives
in the spectrum). The encoder is left as built.
"""

from __future__ import annotations

import numpy as np
import torch

from train.progress import LossLog, StageClock
from world import sound
from world.clips import AUDIO_FRAMES_PER_LATENT

FFT_SIZES = (256, 1024, 4096)


def spectral_l1(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    loss = 0.0
    for n_fft in FFT_SIZES:
        window = torch.hann_window(n_fft, device=output.device)
        a = torch.stft(output, n_fft, n_fft // 4, window=window, return_complex=True).abs()
        b = torch.stft(target, n_fft, n_fft // 4, window=window, return_complex=True).abs()
        loss = loss + (a - b).abs().mean() + (torch.log(a + 1e-4) - torch.log(b + 1e-4)).abs().mean() * 0.1
    return loss / len(FFT_SIZES)


def feature_batch(rng: np.random.Generator, batch: int, frames: int, device) -> torch.Tensor:
    """``[B, 8, frames]`` windows of random clips' features (with prompt switches: the tone changes too)."""
    latent_frames = frames // AUDIO_FRAMES_PER_LATENT + 2
    out = []
    for _ in range(batch):
        clip_features = _features_only(int(rng.integers(1 << 31)), latent_frames)
        start = int(rng.integers(0, clip_features.shape[1] - frames + 1))
        out.append(clip_features[:, start : start + frames])
    return torch.stack(out).to(device)


def _features_only(seed: int, latent_frames: int) -> torch.Tensor:
    # Rendering frames just for their sound would cost ~100x the features: rebuild the clip's scene list alone.
    from world.clips import first_video_frame, random_scene
    from world.motion import FPS, Jitter

    rng = np.random.default_rng(seed)
    scene = random_scene(rng)
    scenes = [(scene, 0.0)]
    if rng.random() < 0.5:
        switch = 3 * int(rng.integers(1, max(2, (latent_frames - 1) // 3 + 1)))
        scenes.append((random_scene(rng, motion=scene.motion), first_video_frame(switch) / FPS))
    return sound.features(scenes, Jitter.from_seed(seed), AUDIO_FRAMES_PER_LATENT * latent_frames)


def train_audio_decoder(audio_vae, log: LossLog, clock: StageClock, *, device, batch: int = 16, frames: int = 48, lr: float = 2e-3, seed: int = 2):
    rng = np.random.default_rng(seed)
    decoder = audio_vae.decoder
    decoder.train()
    optimizer = torch.optim.AdamW(decoder.parameters(), lr=lr, weight_decay=0.0)
    step = 0
    while not clock.expired(step):
        features = feature_batch(rng, batch, frames, device)
        target = sound.synthesize(features)  # [B, frames * HOP]
        output = decoder(features)  # [B, 2, frames * HOP - crop]
        length = output.shape[-1]
        target = target[:, :length]
        wave_l1 = (output - target.unsqueeze(1)).abs().mean()
        spectral = spectral_l1(output.mean(dim=1), target)
        loss = wave_l1 + spectral
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(decoder.parameters(), 1.0)
        optimizer.step()
        step += 1
        if step % 25 == 0 or step == 1:
            log.write("audio", step, wave_l1=wave_l1.item(), spectral=spectral.item())
    decoder.eval()
    return step
