"""Train the tiny preset on the procedural world, stage by stage, each within its time budget.

    python -m train.run --checkpoint CKPT --log train/logs/tiny_train.log [--toy]

Resumable: each stage's weights go to the checkpoint directory when it ends,
and a stage marked done there is skipped on the next run (the DiT stages
then resume from its saved weights; optimiser state is not kept). ``--toy``
runs every stage for a few steps at small sizes (a CPU smoke test of the
whole pipeline). Export to the shipped weights with ``python -m train.export``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from engine.models.causal_wan import CausalWanTransformer
from train.audio import train_audio_decoder
from train.common import Checkpoint, LossLog, StageClock, build_modules, latent_stats_metadata
from train.data import build_latent_set
from train.dit import DiTTrainer, Sampler

# Session 1 ran --only audio beside --only video; session 2 ran --only vae-decoder beside --only dit-more
# (the decoder fine-tune keeps the encoder, so the DiT's latent space stays put).
FULL = {
    "vae_s": 85, "audio_s": 150, "data_clips": 768, "clip_latents": 39, "tf_s": 95, "fewstep_s": 75, "rollout_s": 55,
    "vae_batch": 8, "dit_batch": 16, "frames": 21, "max_steps": None,
    "vae_decoder_s": 85, "vae_decoder_latents": 7, "vae_decoder_batch": 6, "more_clips": 512, "fewstep2_s": 35,
    "rollout2_s": 30,
}
TOY = {
    "vae_s": 60, "audio_s": 60, "data_clips": 4, "clip_latents": 12, "tf_s": 60, "fewstep_s": 60, "rollout_s": 60,
    "vae_batch": 1, "dit_batch": 2, "frames": 9, "max_steps": 2,
    "vae_decoder_s": 60, "vae_decoder_latents": 3, "vae_decoder_batch": 1, "more_clips": 4, "fewstep2_s": 60,
    "rollout2_s": 60,
}
STATE_FILES = {"audio": "state.audio.json", "vae-decoder": "state.vae.json"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--log", type=Path, required=True)
    parser.add_argument("--toy", action="store_true")
    parser.add_argument(
        "--only", choices=["audio", "video", "vae-decoder", "dit-more"],
        help="audio: the audio stage alone; video: every stage but it; vae-decoder: fine-tune the VAE decoder; "
        "dit-more: a second round of the few-step and rollout stages",
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    cfg = TOY if args.toy else FULL
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.backends.cudnn.benchmark = True
    torch.manual_seed(0)
    if device.type == "cuda":
        from engine.models import rope

        rope._compile_failed = True  # rotate eagerly: compiling the fused kernel for autograd costs budget
    ckpt = Checkpoint(args.checkpoint, STATE_FILES.get(args.only, "state.json"))
    log = LossLog(args.log)
    modules = build_modules(device)
    for name, module in modules.items():
        if (name == "audio_vae") == (args.only == "audio") or args.only is None:
            if ckpt.load_into(name, module):
                print(f"resumed {name} from {ckpt.directory}", flush=True)
    steps = lambda: cfg["max_steps"]  # noqa: E731

    if args.only in (None, "audio") and not ckpt.done("audio"):
        n = train_audio_decoder(modules["audio_vae"], log, StageClock(cfg["audio_s"], steps()), device=device)
        ckpt.save("audio_vae", modules["audio_vae"])
        ckpt.mark("audio", steps=n)
    if args.only == "audio":
        return 0

    from train.vae import train_vae

    vae = modules["vae"]
    if args.only == "vae-decoder":
        if not ckpt.done("vae_decoder"):
            metadata = _vae_metadata(ckpt)
            n = train_vae(vae, log, StageClock(cfg["vae_decoder_s"], steps()), device=device, batch=cfg["vae_decoder_batch"],
                          latent_frames=cfg["vae_decoder_latents"], decoder_only=True, stage="vae_decoder", lr=1.5e-3)
            ckpt.save("vae", vae, metadata=metadata)
            ckpt.mark("vae_decoder", steps=n)
        _summary(log, ckpt)
        return 0
    if args.only != "dit-more" and not ckpt.done("vae"):
        n = train_vae(vae, log, StageClock(cfg["vae_s"], steps()), device=device, batch=cfg["vae_batch"])
        ckpt.save("vae", vae)
        ckpt.mark("vae", steps=n)

    t0 = time.monotonic()
    more = args.only == "dit-more"
    stats = None
    if more:
        metadata = _vae_metadata(ckpt)
        stats = (json.loads(metadata["latents_mean"]), json.loads(metadata["latents_std"]))
    data = build_latent_set(vae, modules["text_encoder"], clips=cfg["more_clips" if more else "data_clips"],
                            latent_frames=cfg["clip_latents"], device=device, stats=stats, seed=5 if more else 3)
    print(f"latent set: {len(data)} clips x {cfg['clip_latents']} latent frames in {time.monotonic() - t0:.1f}s; "
          f"VAE latent std by channel {[round(float(s), 3) for s in data.std]}", flush=True)
    if not more:
        ckpt.save("vae", vae, metadata=latent_stats_metadata(data.mean, data.std))

    latent_h, latent_w = data.video.shape[3], data.video.shape[4]
    causal = CausalWanTransformer(modules["transformer"], latent_height=latent_h, latent_width=latent_w, audio=modules["audio_tokens"])
    causal.train()
    modules["text_encoder"].train()
    rng = np.random.default_rng(4)
    sampler = Sampler(data, cfg["frames"], rng)
    trainer = DiTTrainer(causal, modules["text_encoder"], lr=1e-3 if not args.toy else 1e-4, device=device)

    def save_dit(stage: str, n: int) -> None:
        ckpt.save("transformer", modules["transformer"])
        ckpt.save("audio_tokens", modules["audio_tokens"])
        ckpt.save("text_encoder", modules["text_encoder"])
        ckpt.mark(stage, steps=n)

    batch = cfg["dit_batch"]
    if more:
        for group in trainer.optimizer.param_groups:
            group["lr"] = 5e-4 if not args.toy else 1e-4
        if not ckpt.done("fewstep2"):
            save_dit("fewstep2", trainer.few_step(sampler, log, StageClock(cfg["fewstep2_s"], steps()), batch, rng))
        if not ckpt.done("rollout2"):
            save_dit("rollout2", trainer.rollout(sampler, log, StageClock(cfg["rollout2_s"], steps()), batch, rng))
        _summary(log, ckpt)
        return 0
    if not ckpt.done("tf"):
        save_dit("tf", trainer.flow_matching(sampler, log, StageClock(cfg["tf_s"], steps()), batch))
    if not ckpt.done("fewstep"):
        for group in trainer.optimizer.param_groups:
            group["lr"] = 5e-4 if not args.toy else 1e-4
        save_dit("fewstep", trainer.few_step(sampler, log, StageClock(cfg["fewstep_s"], steps()), batch, rng))
    if not ckpt.done("rollout"):
        for group in trainer.optimizer.param_groups:
            group["lr"] = 2e-4 if not args.toy else 1e-4
        save_dit("rollout", trainer.rollout(sampler, log, StageClock(cfg["rollout_s"], steps()), batch, rng))

    _summary(log, ckpt)
    return 0


def _vae_metadata(ckpt: Checkpoint) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(ckpt.directory / "vae.safetensors"), framework="pt") as handle:
        return dict(handle.metadata() or {})


def _summary(log: LossLog, ckpt: Checkpoint) -> None:
    print("\nlast logged losses per stage:")
    for stage, values in log.last.items():
        print(f"  {stage:12s} " + " ".join(f"{k}={v:.4f}" for k, v in values.items()))
    print(json.dumps(ckpt.state), flush=True)


if __name__ == "__main__":
    sys.exit(main())
