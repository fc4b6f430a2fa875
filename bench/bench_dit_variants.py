"""Where does a DiT forward's time go? Variants of the engine's forward at full history, in one run.

Prints ONE JSON line: ms per forward (median of N, synchronised) at ``sink + window`` history frames for
the engine's path as it is (the reference) and for variants patched in for this process only, with each
variant's max abs difference to the reference output. Meant for the GPU machine:

    python bench/bench_dit_variants.py --preset wan2.1-1.3b --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import engine.models.attention as attention
import engine.models.rope as rope
from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.models.attention import SelfAttentionContext
from engine.bundle import build_models


def rotate_in_model_dtype(x, cos, sin):
    """Rotation without the float32 round trip (cos/sin cast to x's dtype)."""
    pairs = x.unflatten(-1, (-1, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def timed(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="wan2.1-1.3b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--profile", default=None, help="write the profiler's top CUDA kernels of one forward here")
    args = parser.parse_args()
    bundle = build_models(EngineConfig(preset=args.preset, device=args.device, dtype=args.dtype, audio=False,
                                       random_weights=True))
    pipeline = bundle.pipeline
    transformer = pipeline.transformer
    spec = pipeline.kv_spec()
    manager = KVCacheManager(spec, 1, args.device)
    kv = manager.open_session("bench")
    progress = pipeline.new_progress(seed=0, prompt="variants")
    while kv.num_resident_blocks("cond") < spec.resident_frames:
        pipeline.run_block(kv, progress)
    ids, history = kv.history("cond")
    cos, sin = transformer.rotary(history + spec.frames_per_block)
    context = SelfAttentionContext(cos=cos, sin=sin, pool=manager.block_pool.storage, history_ids=ids)
    cross = kv.read_cross("cond", "text")
    latents = pipeline._noise(progress)
    timesteps = torch.full((1, spec.frames_per_block), 937.5, device=args.device)

    def forward():
        return transformer(latents, timesteps, context, cross).video

    results = {}
    reference = forward().float()
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            forward()
            torch.cuda.synchronize()
        with open(args.profile, "w") as handle:
            handle.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))
    results["engine"] = {"ms": round(timed(forward, args.repeats), 2), "max_abs_diff": 0.0}

    def variant(name, patch, unpatch):
        patch()
        try:
            out = forward().float()
            results[name] = {"ms": round(timed(forward, args.repeats), 2),
                             "max_abs_diff": (out - reference).abs().max().item()}
        except Exception as error:  # report, do not crash the run
            results[name] = {"error": repr(error)[:300]}
        finally:
            unpatch()

    original_rotary = attention.apply_rotary
    variant("eager_rotary (before: six passes over every key)",
            lambda: setattr(attention, "apply_rotary", rope.rotate_pairs),
            lambda: setattr(attention, "apply_rotary", original_rotary))
    variant("rotary_in_model_dtype",
            lambda: setattr(attention, "apply_rotary", rotate_in_model_dtype),
            lambda: setattr(attention, "apply_rotary", original_rotary))
    no_history = SelfAttentionContext(cos=cos[-spec.frames_per_block * spec.tokens_per_frame:],
                                      sin=sin[-spec.frames_per_block * spec.tokens_per_frame:])
    results["no_history_floor"] = {"ms": round(timed(lambda: transformer(latents, timesteps, no_history, cross), args.repeats), 2)}
    print(json.dumps({"bench": "dit_variants", "date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(),
                      "torch": torch.__version__, "preset": args.preset, "dtype": args.dtype,
                      "history_frames": history, "results": results}))


if __name__ == "__main__":
    main()
