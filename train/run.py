"""Train the tiny preset on the procedural world, stage by stage, each within its time budget.

    python -m train.run --checkpoint CKPT --log LOG [--init DIR] [--only audio|codec|video|dit] [--budget k=s,...] [--toy]

``--only codec``: the video codec from scratch and its reconstruction check
(held-out world clips read back with world.measure), nothing else.
``--only video`` (the default): the codec (unless the checkpoint has it done)
and its check, which is a gate: the DiT gets no time unless colour,
background and shape read back in enough frames (train.codec.GATE;
``--no-gate`` overrides). Then the latent set, the DiT (teacher forcing,
few-step, rollout; and continuation when ``cont_s`` > 0, long rollouts learned against the world when ``long_s``
> 0: train.long_rollout) from scratch, then a sampled check of the DiT (sessions
generated as the engine does, decoded and read back).
``--only dit``: keep the codec (and its latent statistics) and continue the
DiT (stages tf2, fewstep2, rollout2, cont2, from the loaded weights; ``--round 3``
names a further continuation's stages tf3, ... and draws other clips). The
continuation stage (``cont_s``, train.dit.DiTTrainer.continuation) teaches the
model to go on from an image's or clip's encoded frames; a round of it alone:
``--only dit --round 3 --init engine/models/weights/tiny --budget
tf_s=0,fewstep_s=0,rollout_s=0,cont_s=180,dit_lr=2e-4``. ``--only
audio``: the audio decoder alone. The plan's latent set is sized for a GPU (1,024 clips of 39 latent frames,
encoded 64 at a time); on a CPU name a smaller one (``data_clips=48,clip_latents=12,data_batch=8,frames=12``
fits in 24 GB; the defaults there are ended by the OOM killer while the set is encoded).

``--init DIR`` loads module files from DIR first (e.g. the shipped weights, to
reuse the audio decoder); files in the checkpoint directory win. Resumable:
each stage's weights go to the checkpoint directory when it ends (and every
~45 s while it runs), and a stage marked done there is skipped on the next run
(optimiser state is not kept). ``--toy`` runs every stage for 2 steps at small
sizes (a CPU smoke test of the whole pipeline). Export with ``python -m train.export``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

from engine.models.causal_wan import CausalWanTransformer
from engine.models.rope import ROPE_THETA
from engine.models.trained import ROPE_SPATIAL_THETA_KEY, TrainedWeights, rope_spatial_theta
from train.audio import train_audio_decoder
from train.common import Checkpoint, build_modules, latent_stats_metadata, load_module_file
from train.progress import LossLog, StageClock
from train.data import build_latent_set
from train.dit import DiTTrainer, Sampler, sample_session

FULL = {
    "audio_s": 150, "codec_s": 180, "codec_batch": 8, "codec_latents": 5, "codec_lr": 2e-3, "codec_pool": 1024,
    "data_clips": 1024, "clip_latents": 39, "data_batch": 64,
    "tf_s": 120, "fewstep_s": 80, "rollout_s": 60, "cont_s": 0, "cont_context": 6, "cont_mix": 0.25, "cont_picture": 0.0, "data_shades": 0.0,
    "data_orbits": 0.0,  # the share of orbits drawn about another centre at another radius (world.motion)
    "long_s": 0, "long_blocks": 24, "long_block": 2, "long_from": 3, "long_share": 0.5, "long_hold": 0.0, "long_hold_kind": "fewstep", "dit_batch": 16, "frames": 21, "dit_lr": 2e-3, "max_steps": None,
    "rope_spatial_theta": 0.0,  # 0: the base of the transformer file loaded (Wan's 10000 for a new one)
}
TOY = {
    "audio_s": 60, "codec_s": 60, "codec_batch": 1, "codec_latents": 3, "codec_lr": 1e-3, "codec_pool": 2,
    "data_clips": 4, "clip_latents": 12, "data_batch": 4,
    "tf_s": 60, "fewstep_s": 60, "rollout_s": 60, "cont_s": 60, "cont_context": 6, "cont_mix": 0.25, "cont_picture": 0.5, "data_shades": 0.5, "data_orbits": 0.5,
    "long_s": 60, "long_blocks": 4, "long_block": 2, "long_from": 1, "long_share": 1.0, "long_hold": 0.5, "long_hold_kind": "fewstep", "dit_batch": 2, "frames": 9, "dit_lr": 1e-4, "max_steps": 2,
    "rope_spatial_theta": 0.0,
}
STATE_FILES = {"audio": "state.audio.json"}
SAVE_EVERY_S = 45.0
# The DiT check: prompts of tests/test_tiny_model.py, sampled as sessions of 6 blocks (69 frames).
SAMPLE_PROMPTS = (
    "a red circle bouncing on a blue background",
    "a green circle bouncing on a blue background",
    "a white square drifting on a black background",
    "a yellow triangle drifting on a black background",
    "a yellow circle orbiting on a blue background",
    "a white square orbiting on a black background",  # doubled after long-rollout rounds (TINY_MODEL.md)
    "a white square still on a black background",
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--init", type=Path, help="a directory of module files to start from (e.g. the shipped weights)")
    parser.add_argument("--init-modules", default="", help="comma-separated modules to take from --init (default: all there)")
    parser.add_argument("--toy", action="store_true")
    parser.add_argument("--only", choices=["audio", "codec", "video", "dit"], default="video")
    parser.add_argument("--no-gate", action="store_true", help="train the DiT even when the codec's check fails")
    parser.add_argument("--round", type=int, default=2,
                        help="with --only dit: the continuation's number, which names its stages (tf2, fewstep2, ...)")
    parser.add_argument("--budget", default="", help="stage seconds (and other plan values), e.g. codec_s=150,tf_s=90")
    parser.add_argument("--images", type=Path, help="directory for the check images (codec_check.png, dit_check.png)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    cfg = dict(TOY if args.toy else FULL)
    for item in filter(None, args.budget.split(",")):
        key, value = item.split("=")
        if key not in cfg:
            parser.error(f"unknown plan value {key!r}; known: {sorted(cfg)}")
        if isinstance(cfg[key], str):
            cfg[key] = value
        else:
            cfg[key] = type(cfg[key] if cfg[key] is not None else 0)(float(value)) if key != "max_steps" else int(value)
    if cfg["long_hold_kind"] not in ("fewstep", "cont"):
        parser.error("long_hold_kind is fewstep or cont")
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    ckpt = Checkpoint(args.checkpoint, STATE_FILES.get(args.only, "state.json"))
    log = LossLog(args.log)
    print(f"plan ({args.only}): {json.dumps(cfg)}", flush=True)
    modules = build_modules(device)
    from_init = set(filter(None, args.init_modules.split(","))) or set(modules)
    loaded = {}
    for name, module in modules.items():
        for source in (args.init if name in from_init else None, ckpt.directory):
            if source is not None and load_module_file(source / f"{name}.safetensors", module):
                loaded[name] = source / f"{name}.safetensors"
                print(f"loaded {name} from {source}", flush=True)
    # The DiT's spatial rotary base: asked for, else the loaded file's (a run resumed from its checkpoint keeps it).
    theta = cfg["rope_spatial_theta"] or (rope_spatial_theta(loaded["transformer"]) if "transformer" in loaded else ROPE_THETA)
    transformer_metadata = {ROPE_SPATIAL_THETA_KEY: repr(float(theta))} if theta != ROPE_THETA else None
    steps = lambda: cfg["max_steps"]  # noqa: E731

    if args.only == "audio":
        if not ckpt.done("audio"):
            n = train_audio_decoder(modules["audio_vae"], log, StageClock(cfg["audio_s"], steps()), device=device)
            ckpt.save("audio_vae", modules["audio_vae"])
            ckpt.mark("audio", steps=n)
        return 0

    from train.codec import ClipPool, init_for_training, passes_gate, print_report, reconstruction_report, train_codec

    codec = modules["codec"]
    continuing = args.only == "dit"
    if not continuing and not ckpt.done("codec"):
        if "codec" not in loaded:  # from scratch: the codec starts as its colour shortcut
            init_for_training(codec)
        started = time.monotonic()
        pool = ClipPool(cfg["codec_pool"], cfg["codec_latents"], device)
        print(f"codec clip pool: {len(pool)} clips x {cfg['codec_latents']} latent frames in {time.monotonic() - started:.1f}s", flush=True)
        n = train_codec(codec, log, StageClock(cfg["codec_s"], steps()), device=device, seconds=cfg["codec_s"],
                        batch=cfg["codec_batch"], latent_frames=cfg["codec_latents"], lr=cfg["codec_lr"],
                        save=lambda m: ckpt.save("codec", m), pool=pool)
        del pool
        ckpt.save("codec", codec)
        ckpt.mark("codec", steps=n)
    codec.eval()
    started = time.monotonic()
    rows = None
    try:  # a failing check must not cost the DiT its budget
        rows, image = reconstruction_report(codec, device, latent_frames=12 if not args.toy else 4)
        print_report(f"Codec reconstruction of held-out world clips ({time.monotonic() - started:.1f}s)", rows)
        _save_image(args.images, "codec_check.png", image)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    if args.only == "codec":
        _summary(log, ckpt)
        return 0
    if not continuing and not args.toy and not args.no_gate and not (rows and passes_gate(rows)):
        print("the codec's check did not pass its gate: no DiT training (--no-gate overrides)", flush=True)
        _summary(log, ckpt)
        return 3

    t0 = time.monotonic()
    stats = None
    if continuing:
        shipped = TrainedWeights(ckpt.directory if (ckpt.directory / "codec.safetensors").exists() else args.init)
        latent = shipped.latent_stats()  # as the engine's decoder reads them
        stats = (latent["latents_mean"], latent["latents_std"])
    data = build_latent_set(codec, modules["text_encoder"], clips=cfg["data_clips"], latent_frames=cfg["clip_latents"],
                            device=device, stats=stats, seed=3 + 2 * (args.round - 1) if continuing else 3,
                            batch=cfg["data_batch"], shades_probability=cfg["data_shades"],
                            orbit_spread=cfg["data_orbits"])
    print(f"latent set: {len(data)} clips x {cfg['clip_latents']} latent frames in {time.monotonic() - t0:.1f}s; "
          f"latent std by channel {[round(float(s), 3) for s in data.std]}", flush=True)
    codec_metadata = latent_stats_metadata(data.mean, data.std)
    if not continuing:
        ckpt.save("codec", codec, metadata=codec_metadata)

    latent_h, latent_w = data.video.shape[3], data.video.shape[4]
    causal = CausalWanTransformer(modules["transformer"], latent_height=latent_h, latent_width=latent_w,
                                  audio=modules["audio_tokens"], fused_kernels=False,  # no compile time in the budget
                                  rope_spatial_theta=theta)
    print(f"spatial rotary base {theta:g}", flush=True)
    causal.train()
    modules["text_encoder"].train()
    rng = np.random.default_rng(4 if not continuing else 4 + 2 * (args.round - 1))
    sampler = Sampler(data, cfg["frames"], rng)
    stages = ("tf", "fewstep", "rollout", "cont", "long")
    names = tuple(f"{stage}{args.round}" for stage in stages) if continuing else stages
    seconds = {name: cfg[key] for name, key in zip(names, ("tf_s", "fewstep_s", "rollout_s", "cont_s", "long_s"))
               if not ckpt.done(name)}
    total = max(sum(seconds.values()), 1e-6)
    clock_start = time.monotonic()
    last_save = [time.monotonic()]

    def schedule() -> float:  # one warm-up + cosine over all DiT stages of this run, by the clock
        fraction = (time.monotonic() - clock_start) / total
        warm = 0.03
        if fraction < warm:
            return cfg["dit_lr"] * max(fraction / warm, 0.02)
        progress = min((fraction - warm) / (1 - warm), 1.0)
        return cfg["dit_lr"] * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    def save_dit() -> None:
        ckpt.save("transformer", modules["transformer"], metadata=transformer_metadata)
        ckpt.save("audio_tokens", modules["audio_tokens"])
        ckpt.save("text_encoder", modules["text_encoder"])

    def on_step() -> None:
        if time.monotonic() - last_save[0] > SAVE_EVERY_S:
            save_dit()
            last_save[0] = time.monotonic()

    trainer = DiTTrainer(causal, modules["text_encoder"], lr=cfg["dit_lr"], device=device, schedule=schedule, on_step=on_step)
    batch = cfg["dit_batch"]
    tf, fewstep, rollout, cont, long = names
    if tf in seconds:
        n = trainer.flow_matching(sampler, log, StageClock(seconds[tf], steps()), batch, name=tf)
        save_dit()
        ckpt.mark(tf, steps=n)
    if fewstep in seconds:
        n = trainer.few_step(sampler, log, StageClock(seconds[fewstep], steps()), batch, rng, name=fewstep)
        save_dit()
        ckpt.mark(fewstep, steps=n)
    if rollout in seconds:
        n = trainer.rollout(sampler, log, StageClock(seconds[rollout], steps()), batch, rng, name=rollout)
        save_dit()
        ckpt.mark(rollout, steps=n)
    if cont in seconds and seconds[cont] > 0:  # none by default: a from-scratch run keeps its three stages
        n = trainer.continuation(sampler, log, StageClock(seconds[cont], steps()), batch, rng, name=cont,
                                 max_context=cfg["cont_context"], rollout_share=cfg["cont_mix"],
                                 picture_share=cfg["cont_picture"])
        save_dit()
        ckpt.mark(cont, steps=n)
    if long in seconds and seconds[long] > 0:  # none by default: rollouts past the window, learned against the world
        from train.long_rollout import LongRollout, WorldTargets

        if cfg["long_hold_kind"] == "cont":  # whole-clip continuation steps (D): hold the seam at a continued clip
            def hold():  # (cont_picture: that share of them start from one latent frame, a picture)
                return trainer.continuation_step_losses(sampler, batch, rng, cfg["cont_context"],
                                                        picture_share=cfg["cont_picture"])
        else:  # few-step steps (B): hold the first block's shapes
            def hold():
                return trainer.few_step_losses(sampler, batch, rng)
        stage = LongRollout(trainer, modules["text_encoder"], WorldTargets(codec, data.mean, data.std, device,
                                                                              free_orbit=cfg["data_orbits"] > 0),
                            latent_size=(latent_h, latent_w), block=cfg["long_block"], rng=rng)
        n = stage.run(log, StageClock(seconds[long], steps()), batch, blocks=cfg["long_blocks"],
                      learn_from=cfg["long_from"], learn_share=cfg["long_share"], name=long,
                      hold=hold, hold_share=cfg["long_hold"])
        save_dit()
        ckpt.mark(long, steps=n)

    causal.eval()
    modules["text_encoder"].eval()
    try:
        _sample_check(trainer, codec, data, args.images, blocks=6 if not args.toy else 2)
    except Exception:  # noqa: BLE001
        traceback.print_exc()
    _summary(log, ckpt)
    return 0


def _save_image(directory: Path | None, name: str, image: np.ndarray) -> None:
    if directory is None:
        return
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    Image.fromarray(image).save(directory / name)


@torch.no_grad()
def _sample_check(trainer: DiTTrainer, codec, data, images: Path | None, blocks: int) -> None:
    """Sessions of the checks' prompts generated as the engine does, decoded, read back with world.measure."""
    from engine.models.latents import BlockLatents
    from world import measure
    from world.grammar import parse_caption

    started = time.monotonic()
    ids = [trainer.text_encoder.token_ids(p) for p in SAMPLE_PROMPTS]
    count = len(ids)
    like = BlockLatents(torch.zeros(count, *data.video.shape[1:2], 3, *data.video.shape[3:], device=data.video.device),
                        torch.zeros(count, data.audio.shape[1], 3 * data.audio.shape[2] // data.video.shape[2], device=data.video.device))
    latents = sample_session(trainer, ids, blocks, like)
    mean = data.mean.to(latents.video.device).view(1, -1, 1, 1, 1)
    std = data.std.to(latents.video.device).view(1, -1, 1, 1, 1)
    pixels = codec.decode_video(latents.video.float() * std + mean)
    frames = ((pixels.float() + 1) * 127.5).round().clamp(0, 255).byte().permute(0, 2, 3, 4, 1).cpu().numpy()
    print("\nDiT sessions (engine sampler, dense context), read back:\n"
          "| prompt | object | colour | background | shape | speed px/s |\n| --- | --- | --- | --- | --- | --- |")
    tiles = []
    for prompt, clip in zip(SAMPLE_PROMPTS, frames):
        scene = parse_caption(prompt)
        rs = [measure.read_frame(f) for f in clip]
        xy = np.array([r.centroid if r.has_object else (np.nan, np.nan) for r in rs])
        steps = np.linalg.norm(np.diff(xy, axis=0), axis=1)
        speed = float(np.nanmedian(steps) * 16) if np.isfinite(steps).any() else float("nan")
        print(f"| {prompt} | {np.mean([r.has_object for r in rs]):.2f} | "
              f"{np.mean([measure.colour_name(r) == scene.colour for r in rs]):.2f} | "
              f"{np.mean([measure.background_name(r) == scene.background for r in rs]):.2f} | "
              f"{np.mean([measure.shape_name(r) == scene.shape for r in rs]):.2f} | {speed:.1f} |", flush=True)
        picks = [t for t in (4, 30, 60) if t < clip.shape[0]]
        tiles.append(np.concatenate([clip[t] for t in picks], axis=1))
    print(f"({time.monotonic() - started:.1f}s)", flush=True)
    _save_image(images, "dit_check.png", np.concatenate(tiles, axis=0))


def _summary(log: LossLog, ckpt: Checkpoint) -> None:
    print("\nlast logged losses per stage:")
    for stage, values in log.last.items():
        print(f"  {stage:12s} " + " ".join(f"{k}={v:.4f}" for k, v in values.items()))
    print(json.dumps(ckpt.state), flush=True)


if __name__ == "__main__":
    sys.exit(main())
