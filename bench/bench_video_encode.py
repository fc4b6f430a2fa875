"""Benchmark: the streaming video encoders (live input) per block, and their per-session state; ONE JSON line.

Each encoder, with seeded random weights at its real geometry (speed does not depend on weight values), encodes
a session's input as the engine does: its opening block of 9 frames, then steady blocks of 12 frames (3 latent
frames each), through one session state. Steady blocks after ``--warmup`` are timed, the clock read after a
device synchronise. State bytes: the largest measured after any block, and what admission reserves (declared).

    # the GPU figure (bf16, 832x480): the Wan2.1 VAE's encoder and the tiny codec's
    python bench/bench_video_encode.py
    # the CPU figure of the tiny preset (fp32, 256x144, one thread):
    python bench/bench_video_encode.py --device cpu --dtype float32 --height 144 --width 256 --threads 1
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

from decoders.taehv_encoder import TAEHVStreamingEncoder, random_taehv_encoder  # noqa: E402
from decoders.video_encode import WanStreamingEncoder  # noqa: E402
from engine.models.presets import TINY_CODEC_ENCODER, TINY_VAE_CONFIG  # noqa: E402

MIB = 1024 * 1024
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_encoder(encoder, height: int, width: int, blocks: int, warmup: int, device: torch.device, dtype) -> dict:
    generator = torch.Generator().manual_seed(0)
    frames = [torch.rand(1, 3, 9 if i == 0 else 12, height, width, generator=generator).mul(2).sub(1)
              for i in range(1 + warmup + blocks)]
    frames = [f.to(device, dtype) for f in frames]
    state = encoder.new_state("bench")
    largest, timings = 0, []
    for index, block in enumerate(frames):
        _synchronize(device)
        started = time.perf_counter()
        latents = encoder.encode_chunk(block, state)
        _synchronize(device)
        if index > warmup:
            timings.append((time.perf_counter() - started) * 1000.0)
        assert latents.shape[2] == 3, latents.shape
        largest = max(largest, state.nbytes())
    declared = encoder.declared_state_bytes(height, width, dtype)
    return {
        "ms_per_block_median": round(statistics.median(timings), 2),
        "ms_per_block_all": [round(t, 2) for t in timings],
        "state_bytes_measured": largest,
        "state_mib_measured": round(largest / MIB, 2),
        "state_bytes_declared": declared,
        "state_mib_declared": round(declared / MIB, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPES), help="default: bfloat16 on CUDA, float32 else")
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--blocks", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--encoders", default="wan2.1,tiny-codec", help="comma list of wan2.1, tiny-codec, toy-wan")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    load_before = os.getloadavg()[0]
    result = {"bench": "video_encode", "device": str(device), "dtype": str(dtype).removeprefix("torch."),
              "height": args.height, "width": args.width, "frames_per_block": 12, "torch": torch.__version__,
              "threads": torch.get_num_threads()}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)
    for name in args.encoders.split(","):
        torch.manual_seed(0)
        if name == "tiny-codec":
            encoder = TAEHVStreamingEncoder(random_taehv_encoder(0, TINY_CODEC_ENCODER, device, dtype))
        elif name in ("wan2.1", "toy-wan"):
            vae = AutoencoderKLWan(**({} if name == "wan2.1" else TINY_VAE_CONFIG)).to(device, dtype).eval()
            encoder = WanStreamingEncoder(vae)
        else:
            raise SystemExit(f"unknown encoder {name!r}")
        result[name] = time_encoder(encoder, args.height, args.width, args.blocks, args.warmup, device, dtype)
        del encoder
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result["loadavg_1m_before"] = round(load_before, 2)
    result["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
