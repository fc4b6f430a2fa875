"""GPU correctness check: the paged streamed path against the whole-sequence reference on CUDA.

Prints ONE JSON line with the max abs (and relative) difference per dtype. Run on the GPU machine:
    python bench/gpu_check_engine.py
"""

from __future__ import annotations

import json

import torch

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.bundle import build_models
from engine.models.reference import reference_generate


def check(dtype: str, blocks: int = 5) -> dict:
    bundle = build_models(EngineConfig(preset="tiny", device="cuda", dtype=dtype))
    pipeline = bundle.pipeline
    manager = KVCacheManager(pipeline.kv_spec(), 1, "cuda")
    kv = manager.open_session("check")
    progress = pipeline.new_progress(seed=7, prompt="a check")
    streamed = [pipeline.run_block(kv, progress) for _ in range(blocks)]
    reference = reference_generate(
        pipeline.transformer, pipeline.embed("a check"), num_blocks=blocks, seed=7,
        sigmas=pipeline.sigmas, latent_shape=pipeline.latent_shape, audio_shape=pipeline.audio_shape,
    )
    diffs = [a.max_abs_diff(b) for a, b in zip(streamed, reference)]
    rel = [((a.video - b.video).norm() / b.video.norm()).item() for a, b in zip(streamed, reference)]
    state = bundle.decoder.new_state("check")
    pixels = bundle.decoder.decode_chunk(bundle.decoder.denormalize(streamed[0].video), state)
    return {"dtype": dtype, "max_abs_diff_per_block": diffs, "rel_diff_per_block": rel,
            "decoded_finite": bool(torch.isfinite(pixels).all()), "decoded_std": pixels.float().std().item()}


def main() -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    results = [check("float32"), check("bfloat16")]
    print(json.dumps({"check": "paged_vs_reference_cuda", "device": torch.cuda.get_device_name(), "results": results}))


if __name__ == "__main__":
    main()
