"""Benchmark: streaming audio decode of one AR block (3A audio latent frames) per call.

Times ``AudioStreamingDecoder.decode_block`` at steady state (the session has
already decoded two blocks, so every window is the block plus its full
left/right halo) through each tier the device offers: eager everywhere; on
CUDA also plain graphs and compiled buckets (one bucket = the steady window,
so the compiled graph needs no padding). Prints one JSON line.

    python bench/bench_audio_decode.py [--device cuda] [--config tiny|stable-audio-sized] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from diffusers import AutoencoderOobleck

from decoders.audio import AudioStreamingDecoder, receptive_field, streaming_window_frames
from decoders.audio_graphs import AudioDecodeGraphs
from engine.models.presets import STABLE_AUDIO_SIZED_VAE_CONFIG, TINY_AUDIO_VAE_CONFIG

CONFIGS = {"tiny": TINY_AUDIO_VAE_CONFIG, "stable-audio-sized": STABLE_AUDIO_SIZED_VAE_CONFIG}
SAMPLES_PER_VIDEO_LATENT_FRAME = 12000  # 4 video frames x 3000 samples (48 kHz, 16 fps)
VIDEO_LATENT_FRAMES_PER_BLOCK = 3


def build_vae(name: str, device: str, dtype: torch.dtype, seed: int = 0) -> AutoencoderOobleck:
    torch.manual_seed(seed)
    vae = AutoencoderOobleck(**CONFIGS[name]).eval().to(device)
    return vae if dtype == torch.float32 else vae.to(dtype)


def block_frames(vae: AutoencoderOobleck) -> int:
    """3A: audio latent frames per AR block."""
    hop = int(vae.hop_length)
    return VIDEO_LATENT_FRAMES_PER_BLOCK * SAMPLES_PER_VIDEO_LATENT_FRAME // hop


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_streaming(decoder: AudioStreamingDecoder, blocks: int, seed: int = 1, warm_blocks: int = 2) -> list[float]:
    """Milliseconds per steady-state ``decode_block``; the first ``warm_blocks`` fill the halo and warm kernels."""
    device = str(decoder.device)
    frames = block_frames(decoder.vae)
    generator = torch.Generator().manual_seed(seed)
    latents = [
        torch.randn(1, decoder.latent_dim, frames, generator=generator).to(decoder.device, decoder.dtype)
        for _ in range(warm_blocks + blocks)
    ]
    state = decoder.new_state("bench")
    timings = []
    for index, block in enumerate(latents):
        _sync(device)
        start = time.perf_counter()
        decoder.decode_block(block, state)
        _sync(device)
        if index >= warm_blocks:
            timings.append((time.perf_counter() - start) * 1000.0)
    decoder.release(state)
    return timings


def summarize(timings: list[float]) -> dict:
    return {"ms_per_block": round(statistics.median(timings), 3), "ms_min": round(min(timings), 3)}


def bench_tiers(vae: AutoencoderOobleck, blocks: int, tiers: tuple[str, ...]) -> dict:
    """``{tier: {ms_per_block, ms_min} | {error}}`` for each tier asked; a failing tier is reported, not raised."""
    window = streaming_window_frames(vae, block_frames(vae))
    results = {}
    for tier in tiers:
        try:
            if tier == "eager":
                decoder = AudioStreamingDecoder(vae)
            else:
                graphs = AudioDecodeGraphs(vae, compile_shapes=(window,) if tier == "compiled" else (), tile_frames=0)
                if tier == "compiled":
                    started = time.perf_counter()
                    graphs.warmup(next(vae.parameters()).device)
                    if graphs.compile_errors:
                        raise RuntimeError(graphs.compile_errors[window])
                decoder = AudioStreamingDecoder(vae, graphs=graphs)
            results[tier] = summarize(time_streaming(decoder, blocks))
            if tier != "eager":
                results[tier]["served_by"] = graphs.last_mode
            if tier == "compiled":
                results[tier]["warmup_s"] = round(time.perf_counter() - started, 1)
        except Exception as error:  # noqa: BLE001 - report the tier, keep benchmarking the others
            results[tier] = {"error": repr(error)[:400]}
    return results


def describe(vae: AutoencoderOobleck) -> dict:
    left, right = receptive_field(vae)
    frames = block_frames(vae)
    hop = int(vae.hop_length)
    return {
        "hop": hop,
        "receptive_field": [left, right],
        "lookahead_ms": right * hop / 48.0,
        "block_frames": frames,
        "window_frames": streaming_window_frames(vae, frames),
        "block_audio_ms": frames * hop / 48.0,
        "state_bytes": AudioStreamingDecoder(vae).declared_state_bytes(),
        "parameters_m": round(sum(p.numel() for p in vae.decoder.parameters()) / 1e6, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--blocks", type=int, default=10, help="timed blocks per tier")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    if args.threads:
        torch.set_num_threads(args.threads)
    vae = build_vae(args.config, args.device, getattr(torch, args.dtype), args.seed)
    tiers = ("eager", "graph", "compiled") if args.device.startswith("cuda") else ("eager",)
    print(json.dumps({
        "bench": "audio_decode_block",
        "config": args.config,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else f"cpu x{torch.get_num_threads()}",
        "dtype": args.dtype,
        "torch": torch.__version__,
        "blocks_timed": args.blocks,
        **describe(vae),
        "tiers": bench_tiers(vae, args.blocks, tiers),
    }))


if __name__ == "__main__":
    main()
