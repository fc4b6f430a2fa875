"""GPU check of the engine API end to end: CUDA admission from measured memory, warm-up, chunks, release.

Prints ONE JSON line per preset. Run on the GPU machine:
    python bench/gpu_check_engine_api.py
"""

from __future__ import annotations

import asyncio
import json
import time

import torch

from engine.api import Engine
from engine.config import EngineConfig


async def check(preset: str, dtype: str, chunks: int = 4) -> dict:
    started = time.perf_counter()
    engine = Engine(EngineConfig(preset=preset, device="cuda", dtype=dtype, max_sessions=64, random_weights=True))
    await engine.start()
    start_s = time.perf_counter() - started
    session = engine.create_session(seed=1, prompt="a check", pace=False)
    received = []
    async for chunk in engine.chunks(session.session_id):
        received.append(chunk)
        if len(received) == chunks:
            break
    in_use = engine.counters().kv_blocks_in_use
    engine.close(session.session_id)
    await asyncio.sleep(0.5)
    free_after_close = engine.counters().kv_blocks_in_use
    result = {
        "preset": preset,
        "dtype": dtype,
        "start_s": round(start_s, 1),
        "capacity": engine.capacity,
        "per_session_mib": round(engine.per_session_bytes / 2**20, 1),
        "gpu_allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 1),
        "frames": [int(c.frames.shape[0]) for c in received],
        "audio_samples": [0 if c.audio is None else int(c.audio.shape[1]) for c in received],
        "denoise_ms": [round(c.timings.denoise_ms, 1) for c in received],
        "decode_ms": [round(c.timings.decode_ms, 1) for c in received],
        "kv_blocks_in_use": in_use,
        "kv_blocks_in_use_after_close": free_after_close,
        "frames_finite_std": float(received[-1].frames.std()),
    }
    await engine.shutdown()
    del engine
    torch.cuda.empty_cache()
    return result


def main() -> None:
    for preset, dtype in (("tiny", "float32"), ("wan2.1-1.3b", "bfloat16")):
        print(json.dumps({"check": "engine_api_cuda", "device": torch.cuda.get_device_name(), **asyncio.run(check(preset, dtype))}))


if __name__ == "__main__":
    main()
