"""Stage 1: the tiny Wan VAE (diffusers AutoencoderKLWan, the preset's config) on world clips.

Loss: squared error on pixels (``LOSS``), weighted up on the object (it
covers ~3 % of a frame and is what the checks read). Sessions 1-3 used L1:
overfitting a single world frame on the CPU, L1 learned the background in ~20
steps and then held a flat field with no object for 150+ steps (its first-order
cost on every already-right background pixel outweighs a blurry object), where
the squared error brings the object, its colour and its shape back in ~100.

Initialisation (``init_for_training``, applied by ``train.run`` to a VAE trained
from scratch): with PyTorch's default conv init the tiny VAE's posterior means
hardly depend on the image and stay so in training, so the decoder learns the
data's mean colour; see the function.

The decoder reads the posterior *mean* plus a small noise (a tenth of the
batch's per-channel spread), not a posterior sample. Sessions 1-3 decoded
``posterior.sample()`` with a KL weight of 1e-6: the encoder's log-variance
stayed near 0 (sigma ~0.7-1.7 per channel) while the means spread only
0.1-0.7, so the decoder was trained on latents that were mostly noise and
learned blurred means (no object, washed-out colours; docs/TINY_MODEL.md).
The engine never samples either: the DiT makes latents and the decoder reads
them, and the latent set is built from the means. A tiny L2 on the means
keeps their scale from running away.

Speed: diffusers' Wan VAE runs its encoder once per 4 frames and its decoder
once per latent frame (a Python loop over a causal cache), so at toy width a
small-batch step is hundreds of tiny kernels (session 1: 4 steps/s at batch
8 x 9 frames, launch-bound). Here the clips are rendered once into a pool on
the device (``ClipPool``), and on CUDA the whole step (forward, backward,
clipping, AdamW with a tensor learning rate) is captured once as a CUDA graph
and replayed; one replay is checked against one eager step from the same
state (the parameter updates must agree) before training on, and any failure
falls back to eager steps. Session 3 measured 0.38 s a step at batch 12 x 33
frames with the graph: at that size the step is bound by the convolutions,
not the launches, so smaller batches buy steps. The learning rate follows the
stage clock: warm-up, then a cosine to a tenth of the peak.
"""

from __future__ import annotations

import copy
import math
import time

import numpy as np
import torch

from train.common import LossLog, StageClock
from world.clips import first_video_frame, random_scene, video_frames
from world.motion import Jitter, centre
from world.render import frame_times, render_with_coverage

OBJECT_WEIGHT = 8.0
LATENT_NOISE = 0.1  # decoder input noise, relative to each latent channel's spread in the batch
MEAN_L2 = 1e-4
LOSS = "mse"  # "l1": sessions 1-3 (the object never appears, even overfitting one frame; docs/TINY_MODEL.md)


class ClipPool:
    """``count`` clips of ``latent_frames`` latent frames, rendered once, kept as uint8 on ``device``.

    Each clip starts at a random moment of its trajectory (0-12 s), so objects are seen all over the
    frame and moving both ways; 30 % switch scene at a latent boundary (what a prompt change shows).
    """

    def __init__(self, count: int, latent_frames: int, device, seed: int = 1, switch_probability: float = 0.3) -> None:
        rng = np.random.default_rng(seed)
        frames = video_frames(latent_frames)
        self.video = torch.empty(count, 3, frames, 144, 256, dtype=torch.uint8, device=device)
        self.coverage = torch.empty(count, frames, 144, 256, dtype=torch.uint8, device=device)
        for i in range(count):
            scene = random_scene(rng)
            jitter = Jitter.from_seed(int(rng.integers(1 << 31)))
            start = int(rng.integers(0, 192))
            cx, cy = centre(scene.motion, jitter, frame_times(frames, start))
            video, cover = render_with_coverage(scene, cx, cy, device)
            if latent_frames > 2 and rng.random() < switch_probability:
                cut = first_video_frame(int(rng.integers(1, latent_frames)))
                video[:, cut:], cover[cut:] = render_with_coverage(random_scene(rng, scene.motion), cx[cut:], cy[cut:], device)
            self.video[i] = (video * 255).round().to(torch.uint8)
            self.coverage[i] = (cover * 255).round().to(torch.uint8)
        self.rng = rng

    def __len__(self) -> int:
        return self.video.shape[0]

    def fill(self, video: torch.Tensor, weight: torch.Tensor) -> None:
        """Write a random batch (with random horizontal flips) into ``video [B,3,T,H,W]`` and ``weight [B,1,T,H,W]``.

        ``T`` may be shorter than the pool's clips: their first ``T`` frames are used.
        """
        batch, frames = video.shape[0], video.shape[2]
        index = torch.as_tensor(self.rng.integers(0, len(self), batch), device=video.device)
        clips = self.video[:, :, :frames].index_select(0, index).float().mul_(2 / 255).sub_(1)
        cover = self.coverage[:, :frames].index_select(0, index).float().mul_(OBJECT_WEIGHT / 255).add_(1).unsqueeze(1)
        flip = torch.as_tensor(self.rng.random(batch) < 0.5, device=video.device).view(-1, 1, 1, 1, 1)
        video.copy_(torch.where(flip, clips.flip(-1), clips))
        weight.copy_(torch.where(flip, cover.flip(-1), cover))


def init_for_training(vae, zero_branches: bool = True) -> None:
    """Re-initialise every convolution for training from scratch: normal(0, 1/fan_in) weights, zero biases.

    PyTorch's default (kaiming-uniform with a = sqrt 5: a gain of 1/sqrt 3 per conv) plus its uniform
    biases lets the input fade against the biases along the Wan VAE's stream of plain convs (resamples,
    shortcuts, quant convs, every one followed by an RMS norm that rescales signal and bias alike). At
    the preset's size the encoder's posterior means then hardly depend on the image (at init: std across
    4 world frames 0.012 against 0.040 across positions; here 0.077 against 0.109) and the decoder
    hardly depends on the latent (a unit latent moves its output by 0.06; here 0.23). Trained from the
    default init on 8 world frames, the means' std across frames stayed at 0.002-0.005 for 140 steps
    (0.4-0.7 from this init): the latent carried a position pattern, not the picture, and the decoder
    learned one flat field of the data's mean colour (docs/TINY_MODEL.md).
    ``zero_branches`` also zeroes each residual block's second conv (every block starts as identity).
    """
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanResidualBlock

    with torch.no_grad():
        for module in vae.modules():
            if isinstance(module, (torch.nn.Conv2d, torch.nn.Conv3d)):
                fan_in = module.weight[0].numel()
                module.weight.normal_(0.0, fan_in ** -0.5)
                if module.bias is not None:
                    module.bias.zero_()
        if zero_branches:
            for module in vae.modules():
                if isinstance(module, WanResidualBlock):
                    module.conv2.weight.zero_()


def cosine_lr(peak: float, fraction: float, warm: float) -> float:
    """Linear warm-up over the first ``warm`` of the stage, then a cosine from ``peak`` to ``peak / 10``."""
    if fraction < warm:
        return peak * max(fraction / warm, 0.02)
    progress = min((fraction - warm) / max(1 - warm, 1e-6), 1.0)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _vae_loss(vae, video: torch.Tensor, weight: torch.Tensor, noise: torch.Tensor | float = LATENT_NOISE):
    """``(loss, l1, mean square of the latent means)``; ``noise`` scales the decoder's input noise."""
    mean = vae.encode(video).latent_dist.mode()
    spread = mean.detach().std(dim=(0, 2, 3, 4), keepdim=True)
    recon = vae.decode(mean + noise * spread * torch.randn_like(mean)).sample
    error = recon - video
    l1 = (error.abs() * weight).mean() / weight.mean()
    square = mean.pow(2).mean()
    if LOSS == "l1":
        return l1 + MEAN_L2 * square, l1, square
    mse = (error.pow(2) * weight).mean() / weight.mean()
    return mse + MEAN_L2 * square, l1, square


def _snapshot(params, optimizer) -> list[torch.Tensor]:
    tensors = list(params) + [v for p in params for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v)]
    return [t.detach().clone() for t in tensors]


def _restore(params, optimizer, saved: list[torch.Tensor]) -> None:
    tensors = list(params) + [v for p in params for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v)]
    with torch.no_grad():
        for t, value in zip(tensors, saved, strict=True):
            t.copy_(value)


def update_mismatch(params, optimizer, first, second) -> float:
    """Relative difference of the parameter updates that ``first()`` and ``second()`` make from the same state.

    Both run from the current parameters and optimiser state, which are restored afterwards.
    """
    saved = _snapshot(params, optimizer)
    first()
    delta_first = [p.detach() - s for p, s in zip(params, saved)]
    _restore(params, optimizer, saved)
    second()
    delta_second = [p.detach() - s for p, s in zip(params, saved)]
    _restore(params, optimizer, saved)
    diff = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(delta_first, delta_second)))
    norm = torch.sqrt(sum((b**2).sum() for b in delta_second))
    return float(diff / norm.clamp_min(1e-20))


def train_vae(vae, log: LossLog, clock: StageClock, *, device, seconds: float, batch: int = 16, latent_frames: int = 9,
              lr: float = 2e-3, pool: ClipPool | None = None, graphs: bool = True, save=None, save_every_s: float = 45.0,
              stage: str = "vae") -> int:
    """Train the whole VAE (encoder and decoder) for ``seconds`` (``clock`` may stop it sooner); returns steps.

    ``save(vae)`` is called every ``save_every_s`` seconds (a timed-out run still returns weights).
    """
    device = torch.device(device)
    if pool is None:
        pool = ClipPool(max(4 * batch, 8), latent_frames, device)
    vae.train()
    params = [p for p in vae.parameters() if p.requires_grad]
    cuda = device.type == "cuda"
    lr_tensor = torch.tensor(lr * 0.02, device=device)
    optimizer = torch.optim.AdamW(params, lr=lr_tensor if cuda else lr * 0.02, weight_decay=0.0, capturable=cuda)
    frames = video_frames(latent_frames)
    video = torch.zeros(batch, 3, frames, 144, 256, device=device)
    weight = torch.ones(batch, 1, frames, 144, 256, device=device)
    noise = torch.tensor(LATENT_NOISE, device=device)  # a tensor: the graph reads it at every replay
    t0 = time.monotonic()

    def set_lr(step: int) -> float:
        value = cosine_lr(lr, (time.monotonic() - t0) / seconds, 0.05)
        if cuda:
            lr_tensor.fill_(value)
        else:
            optimizer.param_groups[0]["lr"] = value
        return value

    def eager_step(set_to_none: bool = True):
        optimizer.zero_grad(set_to_none=set_to_none)
        loss, l1, kl = _vae_loss(vae, video, weight, noise)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        return l1, kl

    run = eager_step
    step = 0
    last_save = time.monotonic()
    if cuda and graphs:
        try:
            backup = copy.deepcopy(vae.state_dict())
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):  # warm-up (cuDNN picks its algorithms here): real steps
                    pool.fill(video, weight)
                    set_lr(step)
                    l1, kl = eager_step()
                    step += 1
            torch.cuda.current_stream().wait_stream(side)
            log.write(stage, step, l1=l1.item(), mean_sq=kl.item(), lr=set_lr(step), graph=0.0)
            graph = torch.cuda.CUDAGraph()
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.graph(graph):
                g_loss, g_l1, g_kl = _vae_loss(vae, video, weight, noise)
                g_loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()

            def graph_step():
                graph.replay()
                return g_l1, g_kl

            # The graph must make the update an eager step makes (noise off: the same inputs for both;
            # the eager step keeps the graph's gradient buffers, set_to_none=False).
            pool.fill(video, weight)
            noise.fill_(0.0)
            mismatch = update_mismatch(params, optimizer, graph_step, lambda: eager_step(set_to_none=False))
            noise.fill_(LATENT_NOISE)
            print(f"{stage}: captured the training step as a CUDA graph after {time.monotonic() - t0:.1f}s; "
                  f"graph vs eager update mismatch {mismatch:.2e}", flush=True)
            if not mismatch < 0.05:
                raise RuntimeError(f"the graph's update differs from the eager one by {mismatch:.2e}")
            run = graph_step
        except Exception as exc:  # noqa: BLE001 - any capture failure: eager from here on
            # Eager steps are launch-bound (one decoder call per latent frame): shorter clips, more steps.
            short = min(latent_frames, 5)
            print(f"{stage}: CUDA graph capture failed ({type(exc).__name__}: {exc}); eager steps on {short}-latent clips",
                  flush=True)
            torch.cuda.synchronize()
            vae.load_state_dict(backup)
            optimizer = torch.optim.AdamW(params, lr=lr_tensor, weight_decay=0.0, capturable=True)
            video = torch.zeros(batch, 3, video_frames(short), 144, 256, device=device)
            weight = torch.ones(batch, 1, video_frames(short), 144, 256, device=device)
            run = eager_step
    while not clock.expired(step) and time.monotonic() - t0 < seconds:
        pool.fill(video, weight)
        current = set_lr(step)
        l1, kl = run()
        step += 1
        if step % 50 == 0 or step == 1:
            value = l1.item()
            if not math.isfinite(value):
                raise FloatingPointError(f"{stage}: loss is {value} at step {step}")
            log.write(stage, step, l1=value, mean_sq=kl.item(), lr=current)
        if save is not None and time.monotonic() - last_save > save_every_s:
            save(vae)
            last_save = time.monotonic()
    log.write(stage, step, l1=l1.item(), mean_sq=kl.item(), lr=current)
    optimizer.zero_grad(set_to_none=True)
    vae.eval()
    return step


@torch.no_grad()
def encode_mode(vae, video: torch.Tensor) -> torch.Tensor:
    """Posterior means of ``[B, 3, T, H, W]`` frames: ``[B, 16, N, h, w]`` in VAE space."""
    return vae.encode(video).latent_dist.mode()


# Scenes the reconstruction check encodes and decodes: the checks' prompts and a few harder backgrounds.
CHECK_SCENES = (
    ("circle", "red", "bouncing", "blue", "plain"),
    ("circle", "green", "bouncing", "blue", "plain"),
    ("square", "white", "drifting", "black", "plain"),
    ("triangle", "yellow", "drifting", "black", "plain"),
    ("circle", "yellow", "orbiting", "blue", "plain"),
    ("square", "yellow", "still", "purple", "plain"),
    ("triangle", "green", "orbiting", "grey", "striped"),
    ("square", "blue", "bouncing", "black", "checkered"),
)


@torch.no_grad()
def reconstruction_report(vae, device, latent_frames: int = 12) -> tuple[list[dict], np.ndarray]:
    """Encode and decode true world clips; read truth and reconstruction with ``world.measure``.

    Returns one row per scene (shares of frames whose colour / background / shape reading matches the
    truth's, the mean centroid error in pixels) and an image: each scene's frames 4, 20, 40, truth above
    reconstruction.
    """
    from world import measure
    from world.clips import make_clip
    from world.grammar import Scene

    vae.eval()
    rows, tiles = [], []
    for seed, fields in enumerate(CHECK_SCENES):
        scene = Scene(*fields)
        clip = make_clip(scene, seed, latent_frames, device=device)
        recon = vae.decode(encode_mode(vae, clip.video.unsqueeze(0))).sample[0]
        truth = ((clip.video + 1) * 127.5).round().clamp(0, 255).byte().permute(1, 2, 3, 0).cpu().numpy()
        made = ((recon.float() + 1) * 127.5).round().clamp(0, 255).byte().permute(1, 2, 3, 0).cpu().numpy()
        colour = background = shape = 0
        errors = []
        for t in range(truth.shape[0]):
            r = measure.read_frame(made[t])
            colour += measure.colour_name(r) == scene.colour
            background += measure.background_name(r) == scene.background
            shape += measure.shape_name(r) == scene.shape
            if r.has_object:
                true_centroid = measure.read_frame(truth[t]).centroid
                errors.append(float(np.hypot(r.centroid[0] - true_centroid[0], r.centroid[1] - true_centroid[1])))
        n = truth.shape[0]
        rows.append({
            "caption": scene.caption, "colour": colour / n, "background": background / n, "shape": shape / n,
            "centroid_error_px": float(np.mean(errors)) if errors else float("nan"),
            "l1": float((recon - clip.video).abs().mean()),
        })
        picks = [t for t in (4, 20, 40) if t < n] or [n - 1]
        tiles.append(np.concatenate([np.concatenate([truth[t] for t in picks], axis=1),
                                     np.concatenate([made[t] for t in picks], axis=1)], axis=0))
    return rows, np.concatenate(tiles, axis=0)


def print_report(title: str, rows: list[dict]) -> None:
    print(f"\n{title}\n| scene | colour | background | shape | centroid error px | L1 |\n| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['caption']} | {r['colour']:.2f} | {r['background']:.2f} | {r['shape']:.2f} | "
              f"{r['centroid_error_px']:.1f} | {r['l1']:.3f} |", flush=True)
