"""Benchmark: streaming TAEHV decode of one 12-frame block (3 latent frames) against the Wan2.1 VAE, same run.

Both decoders have seeded random weights at their real geometry (TAEHV at the published taew2_1 widths,
the VAE at diffusers' AutoencoderKLWan defaults, which are Wan2.1's). Each variant decodes through its
own session that has already decoded its opening block and ``--warmup`` more, so every timed block is
a steady-state 12-frame block; the clock is read after a device synchronise. Prints one JSON line.

Needs only torch, diffusers and this repository.

    # the GPU figure (bf16 on CUDA, 832x480):
    python bench/bench_taehv.py
    python bench/bench_taehv.py --compile --wan-compile      # also the torch.compile'd variants
    # a CPU smoke run at a small size (fp32):
    python bench/bench_taehv.py --device cpu --height 96 --width 160 --blocks 2 --warmup 0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from anywhere, no install needed

from diffusers import AutoencoderKLWan  # noqa: E402

from decoders.taehv import TAEHVStreamingDecoder, random_taehv  # noqa: E402
from decoders.video import WanStreamingDecoder  # noqa: E402

FRAMES_PER_BLOCK = 12
LATENT_FRAMES_PER_BLOCK = 3
MIB = 1024 * 1024


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_blocks(decoder, latent_blocks: list[torch.Tensor], warmup: int, device: torch.device) -> dict:
    """Milliseconds per steady-state block; the opening block (9 frames) and ``warmup`` more are not timed."""
    state = decoder.new_state("bench")
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    allocated_before = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    decoder.decode_chunk(latent_blocks[0], state)
    for block in latent_blocks[1 : 1 + warmup]:
        decoder.decode_chunk(block, state)
    timings, frames = [], None
    for block in latent_blocks[1 + warmup :]:
        _synchronize(device)
        start = time.perf_counter()
        frames = decoder.decode_chunk(block, state)
        _synchronize(device)
        timings.append((time.perf_counter() - start) * 1000.0)
        if frames.shape[2] != FRAMES_PER_BLOCK:
            raise RuntimeError(f"a steady block gave {frames.shape[2]} frames, not {FRAMES_PER_BLOCK}")
    result = {
        "ms_per_block": round(statistics.median(timings), 2),
        "ms_min": round(min(timings), 2),
        "ms_max": round(max(timings), 2),
        "frames_per_s": round(FRAMES_PER_BLOCK / (statistics.median(timings) / 1000.0), 1),
        "state_bytes_measured": state.nbytes(),
    }
    if device.type == "cuda":
        result["peak_mib_above_weights"] = round((torch.cuda.max_memory_allocated(device) - allocated_before) / MIB, 1)
    decoder.release(state)
    return result, frames


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default=None,
                        help="default bfloat16 on CUDA, float32 on the CPU")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--blocks", type=int, default=10, help="timed blocks per variant")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steady blocks per variant after the opening one")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compile", action="store_true", help="also time TAEHV with torch.compile per frame")
    parser.add_argument("--wan-compile", action="store_true", help="also time the Wan VAE's compiled steady state")
    parser.add_argument("--skip-wan", action="store_true", help="TAEHV only (no reference)")
    args = parser.parse_args()

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.height % 8 or args.width % 8:
        parser.error("height and width must be multiples of 8")
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # one shape per variant: let cuDNN pick its kernels once

    generator = torch.Generator().manual_seed(args.seed)
    latent_shape = (1, 16, LATENT_FRAMES_PER_BLOCK, args.height // 8, args.width // 8)
    block_count = 1 + args.warmup + args.blocks
    latent_blocks = [torch.randn(latent_shape, generator=generator).to(device, dtype) for _ in range(block_count)]

    load_before = os.getloadavg()[0]
    taehv = random_taehv(args.seed, device=device, dtype=dtype)
    variants: dict[str, dict] = {}
    outputs: dict[str, torch.Tensor] = {}
    taehv_variants = {"taehv": {"channels_last": False}, "taehv_channels_last": {"channels_last": True}}
    if args.compile:
        taehv_variants["taehv_compiled"] = {"channels_last": device.type == "cuda", "compile_frames": True}
    for name, options in taehv_variants.items():
        decoder = TAEHVStreamingDecoder(taehv, **options)
        variants[name], outputs[name] = time_blocks(decoder, latent_blocks, args.warmup, device)
        if options.get("compile_frames"):
            variants[name]["compile_failed"] = decoder.compile_failed
    taehv_decoder = TAEHVStreamingDecoder(taehv)
    taehv_declared = taehv_decoder.declared_state_bytes(args.height, args.width, dtype)
    # Same latents, same weights: the layouts (and compile) must be the same function.
    for name in outputs:
        if name != "taehv":
            difference = (outputs[name].float() - outputs["taehv"].float()).abs().max()
            variants[name]["max_abs_diff_vs_taehv"] = float(difference)
    start = time.perf_counter()
    taehv_decoder.to_uint8(outputs["taehv"])
    to_uint8_ms = (time.perf_counter() - start) * 1000.0
    del outputs

    wan_declared = None
    if not args.skip_wan:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)
            vae = AutoencoderKLWan().to(device, dtype).eval()
        wan_decoder = WanStreamingDecoder(vae)
        variants["wan_vae"], _ = time_blocks(wan_decoder, latent_blocks, args.warmup, device)
        wan_declared = wan_decoder.declared_state_bytes(args.height, args.width, dtype)
        if args.wan_compile:
            compiled = WanStreamingDecoder(vae, compile_steady_state=True)
            variants["wan_vae_compiled"], _ = time_blocks(compiled, latent_blocks, args.warmup, device)
            variants["wan_vae_compiled"]["compile_failed"] = compiled.steady_state.failed
        for name in list(variants):
            if name.startswith("taehv"):
                variants[name]["speedup_vs_wan_vae"] = round(
                    variants["wan_vae"]["ms_per_block"] / variants[name]["ms_per_block"], 1
                )

    print(
        json.dumps(
            {
                "bench": "taehv_decode_block",
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "dtype": str(dtype).removeprefix("torch."),
                "height": args.height,
                "width": args.width,
                "frames_per_block": FRAMES_PER_BLOCK,
                "blocks_timed": args.blocks,
                "warmup_blocks": args.warmup,
                "weights": "random (seeded)",
                "taehv_parameters": sum(p.numel() for p in taehv.parameters()),
                "taehv_state_mib_declared": round(taehv_declared / MIB, 2),
                "wan_vae_state_mib_declared": None if wan_declared is None else round(wan_declared / MIB, 1),
                "to_uint8_ms": round(to_uint8_ms, 2),
                "variants": variants,
                "threads": torch.get_num_threads(),
                "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                "torch": torch.__version__,
                "cudnn": torch.backends.cudnn.version() if device.type == "cuda" else None,
                "cudnn_benchmark": device.type == "cuda",
            }
        )
    )


if __name__ == "__main__":
    main()
