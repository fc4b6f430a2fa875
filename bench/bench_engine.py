"""Engine benchmark: ms per DiT forward by history length and per VAE block decode, paged vs naive.

Prints ONE JSON line. The naive reference path runs in the same process on the
same weights: history K/V kept as concatenated tensors and attended with dense
SDPA (what Self-Forcing's cache does), against the paged sink + window pool.

    python bench/bench_engine.py --preset wan2.1-1.3b --device cuda --dtype bfloat16 --blocks 10
    python bench/bench_engine.py            # tiny on this CPU
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.bundle import build_models
from engine.models.pipeline import draw_noise


@dataclass
class ConcatenatedContext:
    """The naive path's attention context: every layer's history K/V as one concatenated tensor, read in each
    forward (``engine.models.attention.PerForwardContext``; the engine has no such path)."""

    cos: torch.Tensor
    sin: torch.Tensor
    history_kv: torch.Tensor | None  # [layers, 2, S_h, heads, head_dim], unrotated
    stage: torch.Tensor | None = None
    attn_mask = None

    def history(self, layer: int) -> torch.Tensor | None:
        return None if self.history_kv is None else self.history_kv[layer]


class Clock:
    """Wall time of a region, synchronising the device first (events would hide host gaps we want to see)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()


def paged_run(bundle, blocks: int, clock: Clock):
    """The engine's own path: pipeline.run_block over the paged pool, then streaming decode."""
    pipeline, decoder = bundle.pipeline, bundle.decoder
    manager = KVCacheManager(pipeline.kv_spec(), 1, pipeline.transformer.device)
    kv = manager.open_session("bench")
    progress = pipeline.new_progress(seed=0, prompt="a bench")
    state = decoder.new_state("bench")
    forward_ms = defaultdict(list)
    original = pipeline.forward_branch

    def timed_forward(kv_, progress_, branch, latents, timestep, *, stage):
        history = kv_.history(branch)[1]
        start = clock.now()
        out = original(kv_, progress_, branch, latents, timestep, stage=stage)
        forward_ms[history].append((clock.now() - start) * 1000)
        return out

    pipeline.forward_branch = timed_forward
    decode_ms, block_ms, frames, outputs = [], [], 0, []
    try:
        for _ in range(blocks):
            start = clock.now()
            clean = pipeline.run_block(kv, progress)
            mid = clock.now()
            pixels = decoder.decode_chunk(decoder.denormalize(clean.video), state)
            end = clock.now()
            decode_ms.append((end - mid) * 1000)
            block_ms.append((end - start) * 1000)
            frames += pixels.shape[2]
            outputs.append(clean)
    finally:
        pipeline.forward_branch = original
    state_bytes = state.nbytes()
    kv.close()
    decoder.release(state)
    return forward_ms, decode_ms, block_ms, frames, outputs, state_bytes


@torch.no_grad()
def naive_run(bundle, blocks: int, clock: Clock):
    """Same block loop, history K/V as one growing concatenated tensor per layer, window by slicing."""
    pipeline = bundle.pipeline
    transformer = pipeline.transformer
    device = transformer.device
    spec = pipeline.kv_spec()
    tokens = spec.tokens_per_frame
    generator = torch.Generator().manual_seed(0)
    text = transformer.project_text(pipeline.embed("a bench"))[0]
    history = None  # [layers, 2, frames * tokens, H, D]
    sink_tokens, window_tokens = spec.sink_frames * tokens, spec.window_frames * tokens
    forward_ms = defaultdict(list)
    stage = torch.empty(
        (spec.num_layers, 2, spec.frames_per_block * tokens, spec.num_kv_heads, spec.head_dim),
        dtype=spec.dtype, device=device,
    )
    outputs = []

    def forward(latents, timestep, write):
        history_frames = 0 if history is None else history.shape[2] // tokens
        cos, sin = transformer.rotary(history_frames + latents.frames)
        context = ConcatenatedContext(cos=cos, sin=sin, history_kv=history, stage=stage if write else None)
        timesteps = torch.full((1, latents.frames), timestep, device=device)
        start = clock.now()
        out = transformer(latents, timesteps, context, text)
        forward_ms[history_frames].append((clock.now() - start) * 1000)
        return out.float()

    def noise():
        return draw_noise(generator, pipeline.latent_shape, pipeline.audio_shape, device)

    for _ in range(blocks):
        x = noise()
        for index, sigma in enumerate(pipeline.sigmas):
            clean = x.combine(forward(x, 1000.0 * sigma, False), 1.0, -sigma)
            if index + 1 < pipeline.num_steps:
                nxt = pipeline.sigmas[index + 1]
                x = clean.combine(noise(), 1.0 - nxt, nxt)
        forward(clean, 0.0, True)
        history = stage.clone() if history is None else torch.cat([history, stage], dim=2)
        if history.shape[2] > sink_tokens + window_tokens:  # keep sink + the last window frames
            history = torch.cat([history[:, :, :sink_tokens], history[:, :, -window_tokens:]], dim=2)
        outputs.append(clean)
    return forward_ms, outputs


def summarize(forward_ms) -> dict:
    return {str(k): round(statistics.median(v), 2) for k, v in sorted(forward_ms.items())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--blocks", type=int, default=10)
    parser.add_argument("--sink-frames", type=int, default=3)
    parser.add_argument("--window-frames", type=int, default=15)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = EngineConfig(
        preset=args.preset, device=args.device, dtype=args.dtype,
        sink_frames=args.sink_frames, window_frames=args.window_frames,
        random_weights=True,  # benchmarks: speed does not depend on weight values
    )
    bundle = build_models(config)
    device = torch.device(args.device)
    clock = Clock(device)
    paged_run(bundle, 2, clock)  # warm-up: kernels, allocator, cuDNN algorithm choice
    forward_ms, decode_ms, block_ms, frames, paged_out, state_bytes = paged_run(bundle, args.blocks, clock)
    naive_ms, naive_out = naive_run(bundle, args.blocks, clock)
    agreement = max(a.float().max_abs_diff(b.float()) for a, b in zip(paged_out, naive_out))
    steady = block_ms[1:]
    result = {
        "bench": "engine",
        "date": time.strftime("%Y-%m-%d"),
        "preset": args.preset,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "dtype": args.dtype,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "size": [bundle.width, bundle.height],
        "sink_frames": args.sink_frames,
        "window_frames": args.window_frames,
        "blocks": args.blocks,
        "paged_forward_ms_by_history_frames": summarize(forward_ms),
        "naive_forward_ms_by_history_frames": summarize(naive_ms),
        "vae_decode_ms_per_block": round(statistics.median(decode_ms[1:]), 2),
        "vae_decode_ms_first_block": round(decode_ms[0], 2),
        "block_ms_median": round(statistics.median(steady), 2),
        "frames_per_s_end_to_end": round(frames / (sum(block_ms) / 1000), 2),
        "decoder_state_mib": round(state_bytes / 2**20, 1),
        "paged_vs_naive_max_abs_diff": agreement,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
