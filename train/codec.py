"""Stage 1: the tiny preset's video codec (a TAEHV-class encoder + decoder with a colour shortcut) on world clips.

The codec (:class:`TinyCodec`) maps ``1 + 4 (N - 1)`` frames to ``N`` latent frames of 16 channels at 1/8
of the size, the Wan2.1 geometry the DiT is built for. Latent channels 0-2 carry each 8x8 cell's mean colour
(written by the encoder, added back by the decoder), so a flat background's colour is right from the first
step and the convs learn the detail: edges, shapes, motion (docs/TINY_MODEL.md, "Session 6").

Loss: squared error on pixels, weighted up on the object (it covers ~3 % of a frame and is what the checks
read), on the decoder's *unclamped* output (a clamp passes no gradient to a pixel beyond it, and the world's
darkest and brightest channels sit at -0.9 and +1.0 of the [-1, 1] range: an overshoot would stick). The
decoder reads the encoder's latents plus a little noise (a tenth of each channel's spread in the batch), so
it also decodes latents that are a little off, as the DiT's are.

Speed: the clips are rendered once into a pool on the device (:class:`ClipPool`); on CUDA the whole step
(forward, backward, clipping, AdamW with a tensor learning rate) is captured once as a CUDA graph and
replayed, after one replay is checked against one eager step from the same state; any failure falls back
to eager steps. The learning rate follows the stage clock: warm-up, then a cosine to a tenth of the peak.
"""

from __future__ import annotations

import copy
import math
import time

import numpy as np
import torch
from torch import nn

from decoders.taehv import MemoryBlock, TAEHVConfig, TAEHVDecoder
from decoders.taehv_encoder import TAEHVEncoder, TAEHVEncoderConfig
from train.progress import LossLog, StageClock
from world.clips import first_video_frame, random_scene, video_frames
from world.motion import Jitter, centre
from world.render import frame_times, render_with_coverage

OBJECT_WEIGHT = 8.0
LATENT_NOISE = 0.1  # decoder input noise, relative to each latent channel's spread in the batch
# Adam's first steps move every weight by about the learning rate, all in step: through a final conv of
# 576 inputs that moves a latent by ~0.6 (measured: 2 steps at 1e-3 took the reconstruction's L1 from
# 0.02 to ~0.8). So the rate ramps up by steps, not by the clock.
WARMUP_STEPS = 200


class TinyCodec(nn.Module):
    """The encoder and decoder trained together; the shipped file holds both halves' tensors side by side.

    ``state_dict()`` keys are ``encoder.…`` and ``decoder.…`` as each half names them (the layout of the
    published TAEHV files), so the engine loads the decoder half alone (engine.models.trained).
    """

    def __init__(self, encoder: TAEHVEncoderConfig, decoder: TAEHVConfig) -> None:
        super().__init__()
        self.encoder_half = TAEHVEncoder(encoder)
        self.decoder_half = TAEHVDecoder(decoder)

    def encode_video(self, video: torch.Tensor) -> torch.Tensor:
        return self.encoder_half.encode_video(video)

    def decode_video(self, latents: torch.Tensor, *, clamp: bool = True) -> torch.Tensor:
        return self.decoder_half.decode_video(latents, clamp=clamp)

    def state_dict(self, *args, **kwargs):  # noqa: D102 - the file layout, see the class docstring
        return {**self.encoder_half.state_dict(), **self.decoder_half.state_dict()}

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):  # noqa: D102
        halves = (self.encoder_half, "encoder."), (self.decoder_half, "decoder.")
        unknown = [key for key in state_dict if not key.startswith(("encoder.", "decoder."))]
        if strict and unknown:
            raise RuntimeError(f"unknown codec keys: {unknown[:4]}")
        for half, prefix in halves:
            half.load_state_dict({k: v for k, v in state_dict.items() if k.startswith(prefix)}, strict=strict, assign=assign)


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


def init_for_training(codec: TinyCodec) -> None:
    """Initialise from scratch so the codec starts as its colour shortcut and every block as the identity.

    Convs: He-normal weights (the gain a ReLU stack keeps its scale with), zero biases; each memory block's
    last conv and both halves' final convs zero. The encoder's latents then hold the mean colours in
    channels 0-2 and zeros elsewhere, the decoder's output is those colours upsampled, and the gradients
    reach every conv from the first step (through the zeroed convs' weights first).
    """
    with torch.no_grad():
        for module in codec.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                if module.bias is not None:
                    module.bias.zero_()
        for module in codec.modules():
            if isinstance(module, MemoryBlock):
                module.conv[-1].weight.zero_()
        for half in (codec.encoder_half.encoder, codec.decoder_half.decoder):
            last = [m for m in half.modules() if isinstance(m, nn.Conv2d)][-1]
            last.weight.zero_()


def codec_lr(peak: float, step: int, fraction: float) -> float:
    """A linear ramp over the first ``WARMUP_STEPS`` steps, times a cosine from ``peak`` to ``peak / 10`` over
    the stage's clock (``fraction`` of its time spent)."""
    ramp = min((step + 1) / WARMUP_STEPS, 1.0)
    return ramp * peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(fraction, 1.0))))


def codec_loss(codec, video: torch.Tensor, weight: torch.Tensor, noise: torch.Tensor | float = LATENT_NOISE):
    """``(object-weighted squared error, its L1)``; ``noise`` scales the decoder's input noise.

    ``codec``: anything with ``encode_video`` and ``decode_video(latents, clamp=False)`` over ``[B, 3, T, H, W]``
    clips in ``[-1, 1]`` (the tests run the old tiny Wan VAE through the same step as a control).
    """
    latents = codec.encode_video(video)
    spread = latents.detach().std(dim=(0, 2, 3, 4), keepdim=True)
    recon = codec.decode_video(latents + noise * spread * torch.randn_like(latents), clamp=False)
    error = recon - video
    l1 = (error.abs() * weight).mean() / weight.mean()
    return (error.pow(2) * weight).mean() / weight.mean(), l1


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


def train_codec(codec: TinyCodec, log: LossLog, clock: StageClock, *, device, seconds: float, batch: int = 16,
                latent_frames: int = 9, lr: float = 2e-3, pool: ClipPool | None = None, graphs: bool = True, save=None,
                save_every_s: float = 45.0, stage: str = "codec") -> int:
    """Train both halves for ``seconds`` (``clock`` may stop it sooner); returns the steps taken.

    ``save(codec)`` is called every ``save_every_s`` seconds (a timed-out run still returns weights).
    """
    device = torch.device(device)
    if pool is None:
        pool = ClipPool(max(4 * batch, 8), latent_frames, device)
    codec.train()
    params = [p for p in codec.parameters() if p.requires_grad]
    cuda = device.type == "cuda"
    lr_tensor = torch.tensor(lr * 0.02, device=device)
    optimizer = torch.optim.AdamW(params, lr=lr_tensor if cuda else lr * 0.02, weight_decay=0.0, capturable=cuda)
    frames = video_frames(latent_frames)
    video = torch.zeros(batch, 3, frames, 144, 256, device=device)
    weight = torch.ones(batch, 1, frames, 144, 256, device=device)
    noise = torch.tensor(LATENT_NOISE, device=device)  # a tensor: the graph reads it at every replay
    t0 = time.monotonic()

    def set_lr(step: int) -> float:
        value = codec_lr(lr, step, (time.monotonic() - t0) / seconds)
        if cuda:
            lr_tensor.fill_(value)
        else:
            optimizer.param_groups[0]["lr"] = value
        return value

    def eager_step(set_to_none: bool = True):
        optimizer.zero_grad(set_to_none=set_to_none)
        loss, l1 = codec_loss(codec, video, weight, noise)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        return loss.detach(), l1.detach()

    run = eager_step
    step = 0
    last_save = time.monotonic()
    if cuda and graphs:
        try:
            backup = copy.deepcopy(codec.state_dict())
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):  # warm-up (cuDNN picks its algorithms here): real steps
                    pool.fill(video, weight)
                    set_lr(step)
                    mse, l1 = eager_step()
                    step += 1
            torch.cuda.current_stream().wait_stream(side)
            log.write(stage, step, mse=mse.item(), l1=l1.item(), lr=set_lr(step), graph=0.0)
            graph = torch.cuda.CUDAGraph()
            optimizer.zero_grad(set_to_none=True)
            with torch.cuda.graph(graph):
                g_loss, g_l1 = codec_loss(codec, video, weight, noise)
                g_loss.backward()
                torch.nn.utils.clip_grad_norm_(params, 1.0)
                optimizer.step()

            def graph_step():
                graph.replay()
                return g_loss, g_l1

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
            print(f"{stage}: CUDA graph capture failed ({type(exc).__name__}: {exc}); eager steps", flush=True)
            torch.cuda.synchronize()
            codec.load_state_dict(backup)
            optimizer = torch.optim.AdamW(params, lr=lr_tensor, weight_decay=0.0, capturable=True)
            run = eager_step
    current = lr
    while not clock.expired(step) and time.monotonic() - t0 < seconds:
        pool.fill(video, weight)
        current = set_lr(step)
        mse, l1 = run()
        step += 1
        if step % 100 == 0 or step == 1:
            value = mse.item()
            if not math.isfinite(value):
                raise FloatingPointError(f"{stage}: loss is {value} at step {step}")
            log.write(stage, step, mse=value, l1=l1.item(), lr=current)
        if save is not None and time.monotonic() - last_save > save_every_s:
            save(codec)
            last_save = time.monotonic()
    if step:
        log.write(stage, step, mse=mse.item(), l1=l1.item(), lr=current)
    optimizer.zero_grad(set_to_none=True)
    codec.eval()
    return step


# Scenes the reconstruction check encodes and decodes: the checks' prompts and a few harder backgrounds.
# Seeds from 10_000 on: clips the training pool (seeded rng draws) does not hold.
CHECK_SCENES = (
    ("circle", "red", "bouncing", "blue", "plain"),
    ("circle", "green", "bouncing", "blue", "plain"),
    ("square", "white", "drifting", "black", "plain"),
    ("triangle", "yellow", "drifting", "black", "plain"),
    ("circle", "yellow", "orbiting", "blue", "plain"),
    ("square", "yellow", "still", "purple", "plain"),
    ("triangle", "green", "orbiting", "grey", "striped"),
    ("square", "blue", "bouncing", "black", "checkered"),
    ("triangle", "white", "bouncing", "red", "plain"),
    ("circle", "blue", "drifting", "green", "checkered"),
    ("square", "red", "orbiting", "grey", "plain"),
    ("triangle", "blue", "still", "purple", "striped"),
)
CHECK_SEED = 10_000
# The gate before the DiT gets device time: shares of frames read back right, every scene pooled.
GATE = {"colour": 0.9, "background": 0.9, "shape": 0.8}


@torch.no_grad()
def reconstruction_report(codec, device, latent_frames: int = 12) -> tuple[list[dict], np.ndarray]:
    """Encode and decode held-out world clips; read truth and reconstruction with ``world.measure``.

    Returns one row per scene (shares of frames whose colour / background / shape reading matches the
    truth's, the mean centroid error in pixels) and an image: each scene's frames 4, 20, 40, truth above
    reconstruction.
    """
    from world import measure
    from world.clips import make_clip
    from world.grammar import Scene

    codec.eval()
    rows, tiles = [], []
    for index, fields in enumerate(CHECK_SCENES):
        scene = Scene(*fields)
        clip = make_clip(scene, CHECK_SEED + index, latent_frames, device=device)
        recon = codec.decode_video(codec.encode_video(clip.video.unsqueeze(0)))[0]
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


def gate_scores(rows: list[dict]) -> dict[str, float]:
    """The report's shares pooled over its scenes (every scene has as many frames)."""
    return {key: float(np.mean([row[key] for row in rows])) for key in GATE}


def passes_gate(rows: list[dict]) -> bool:
    scores = gate_scores(rows)
    return all(scores[key] >= GATE[key] for key in GATE)


def print_report(title: str, rows: list[dict]) -> None:
    print(f"\n{title}\n| scene | colour | background | shape | centroid error px | L1 |\n| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['caption']} | {r['colour']:.2f} | {r['background']:.2f} | {r['shape']:.2f} | "
              f"{r['centroid_error_px']:.1f} | {r['l1']:.3f} |", flush=True)
    scores = gate_scores(rows)
    print(f"pooled: colour {scores['colour']:.2f}, background {scores['background']:.2f}, shape {scores['shape']:.2f} "
          f"(gate {GATE}): {'pass' if passes_gate(rows) else 'FAIL'}", flush=True)
