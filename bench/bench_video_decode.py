"""CPU benchmark: streaming video decode of one 12-frame block (3 latent frames) at 256x144.

Times the tiny preset's codec decoder (TAEHV-class, decoders/taehv.py) against the toy Wan VAE it
replaced, the latter through the diffusers eager path (conv3d) and the CPU fast path (conv2d form),
all seeded, each through its own session that has already decoded its opening block, so every timed
block is a steady-state 12-frame block. Prints one JSON line.

    python bench/bench_video_decode.py [--threads 2] [--blocks 5] [--base-dim 16 --num-res-blocks 1]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
from diffusers import AutoencoderKLWan

from decoders.taehv import TAEHVDecoder, TAEHVStreamingDecoder
from decoders.video import WanStreamingDecoder
from engine.models.presets import TINY_CODEC_DECODER, TINY_VAE_CONFIG


def time_blocks(decoder, latent_blocks: list[torch.Tensor]) -> list[float]:
    """Milliseconds per block; the first block (the session's opening, 9 frames) is warm-up."""
    state = decoder.new_state("bench")
    decoder.decode_chunk(latent_blocks[0], state)
    timings = []
    for block in latent_blocks[1:]:
        start = time.perf_counter()
        frames = decoder.decode_chunk(block, state)
        timings.append((time.perf_counter() - start) * 1000.0)
        assert frames.shape[2] == 12
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=5, help="timed blocks per path")
    parser.add_argument("--height", type=int, default=144)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--base-dim", type=int, default=None, help="override TINY_VAE_CONFIG's base_dim")
    parser.add_argument("--num-res-blocks", type=int, default=None, help="override TINY_VAE_CONFIG's num_res_blocks")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    config = dict(TINY_VAE_CONFIG)
    if args.base_dim is not None:
        config["base_dim"] = args.base_dim
    if args.num_res_blocks is not None:
        config["num_res_blocks"] = args.num_res_blocks
    torch.manual_seed(args.seed)
    vae = AutoencoderKLWan(**config).eval()

    generator = torch.Generator().manual_seed(args.seed)
    latent_shape = (1, config.get("z_dim", 16), 3, args.height // 8, args.width // 8)
    latent_blocks = [torch.randn(latent_shape, generator=generator) for _ in range(args.blocks + 1)]

    load_before = os.getloadavg()[0]
    eager = time_blocks(WanStreamingDecoder(vae, fast_path=False), latent_blocks)
    fast = time_blocks(WanStreamingDecoder(vae, fast_path=True), latent_blocks)
    torch.manual_seed(args.seed)
    codec = time_blocks(TAEHVStreamingDecoder(TAEHVDecoder(TINY_CODEC_DECODER).eval()), latent_blocks)

    eager_ms = statistics.median(eager)
    fast_ms = statistics.median(fast)
    print(
        json.dumps(
            {
                "bench": "video_decode_block",
                "height": args.height,
                "width": args.width,
                "frames_per_block": 12,
                "vae_base_dim": config["base_dim"],
                "vae_num_res_blocks": config["num_res_blocks"],
                "blocks_timed": args.blocks,
                "eager_ms_per_block": round(eager_ms, 1),
                "fast_ms_per_block": round(fast_ms, 1),
                "eager_ms_min": round(min(eager), 1),
                "fast_ms_min": round(min(fast), 1),
                "speedup": round(eager_ms / fast_ms, 2),
                "tiny_codec_widths": list(TINY_CODEC_DECODER.widths),
                "tiny_codec_ms_per_block": round(statistics.median(codec), 1),
                "tiny_codec_ms_min": round(min(codec), 1),
                "fast_frames_per_s": round(12 / (fast_ms / 1000.0), 1),
                "threads": torch.get_num_threads(),
                # The 2-core CPU is shared with other jobs; a high load inflates both paths.
                "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
                "torch": torch.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
