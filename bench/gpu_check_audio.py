"""GPU check of the audio decode tiers against eager, plus decode ms per AR block. Prints ONE JSON line.

Checks (tiny Oobleck, seeded): plain graphs bit-identical to eager; compiled
buckets within 1e-4 (float32) / 2e-2 relative (bfloat16) of eager; the plain
graph pool retired whole at ``max_graphs`` with no old graph surviving and
outputs still exact; streaming through graphs == whole-clip decode; a long
clip tiled over compiled buckets == whole-clip decode; a decode during an
outer capture runs eager. Then steady-state ``decode_block`` ms per block
(3A latent frames) for eager, plain graph and compiled at tiny and at Stable
Audio size (float32 and bfloat16). Every check and tier is caught and
reported on its own, so one failure never hides the rest.

    python bench/gpu_check_audio.py [--blocks 20] [--skip-timings]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
import weakref
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_audio_decode import bench_tiers, block_frames, build_vae, describe  # noqa: E402

from decoders.audio import AudioStreamingDecoder, streaming_window_frames  # noqa: E402
from decoders.audio_graphs import AudioDecodeGraphs  # noqa: E402


def latents_for(vae, frames: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    parameter = next(vae.parameters())
    latents = torch.randn(1, vae.config.decoder_input_channels, frames, generator=generator)
    return latents.to(parameter.device, parameter.dtype)


def eager(vae, latents: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return vae.decoder(latents)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def check_plain_graphs_bit_identical() -> dict:
    vae = build_vae("tiny", "cuda", torch.float32)
    graphs = AudioDecodeGraphs(vae, compile_shapes=(), tile_frames=0)
    identical, modes = [], []
    for frames in (1, 17, 84, 150, 17):
        latents = latents_for(vae, frames, seed=frames)
        out = graphs.decode(latents)
        modes.append(graphs.last_mode)
        identical.append(bool(torch.equal(out, eager(vae, latents))))
    return {"ok": all(identical) and set(modes) == {"graph"}, "identical": identical, "modes": modes}


def check_compiled_close(dtype: torch.dtype) -> dict:
    vae = build_vae("tiny", "cuda", dtype)
    window = streaming_window_frames(vae, block_frames(vae))
    graphs = AudioDecodeGraphs(vae, compile_shapes=(window,), tile_frames=0)
    started = time.perf_counter()
    graphs.warmup("cuda")
    warmup_s = round(time.perf_counter() - started, 1)
    latents = latents_for(vae, window, seed=11)
    out = graphs.decode(latents)
    mode = graphs.last_mode
    reference = eager(vae, latents)
    result = {"warmup_s": warmup_s, "mode": mode, "compile_errors": graphs.compile_errors,
              "max_abs": max_abs(out, reference), "rel": rel(out, reference)}
    # Padded into a bucket only where the tail is dropped; exact-length plain graph otherwise.
    graphs.decode(latents[:, :, :50], tail_is_clip_end=False)
    result["short_window_dropped_tail_mode"] = graphs.last_mode
    graphs.decode(latents[:, :, :50])
    result["short_window_kept_tail_mode"] = graphs.last_mode
    close = result["max_abs"] <= 1e-4 if dtype == torch.float32 else result["rel"] <= 2e-2
    result["ok"] = (close and mode == "compiled" and result["short_window_dropped_tail_mode"] == "compiled"
                    and result["short_window_kept_tail_mode"] == "graph")
    return result


def check_pool_retirement() -> dict:
    vae = build_vae("tiny", "cuda", torch.float32)
    graphs = AudioDecodeGraphs(vae, compile_shapes=(), tile_frames=0, max_graphs=2)
    for frames in (10, 11):
        graphs.decode(latents_for(vae, frames, seed=frames))
    old_pool = graphs.plain_pool
    old_buffers = [weakref.ref(entry.static_samples) for entry in graphs.plain_graphs]
    latents = latents_for(vae, 12, seed=12)
    out = graphs.decode(latents)
    result = {
        "lengths_after": list(graphs.plain_graph_lengths),
        "new_pool": graphs.plain_pool is not None and graphs.plain_pool != old_pool,
        "old_graphs_gone": all(buffer() is None for buffer in old_buffers),
        "exact_after": bool(torch.equal(out, eager(vae, latents))),
    }
    again = latents_for(vae, 10, seed=3)
    result["exact_recaptured"] = bool(torch.equal(graphs.decode(again), eager(vae, again)))
    result["ok"] = (result["lengths_after"] == [12] and result["new_pool"] and result["old_graphs_gone"]
                    and result["exact_after"] and result["exact_recaptured"])
    return result


def stream(decoder: AudioStreamingDecoder, latents: torch.Tensor, split: list[int]) -> torch.Tensor:
    state = decoder.new_state("check")
    pieces = [decoder.decode_block(block, state) for block in latents.split(split, dim=2)]
    pieces.append(decoder.flush(state))
    return torch.cat(pieces, dim=1)


def check_streaming(compiled: bool) -> dict:
    vae = build_vae("tiny", "cuda", torch.float32)
    frames = block_frames(vae)
    window = streaming_window_frames(vae, frames)
    graphs = AudioDecodeGraphs(vae, compile_shapes=(window,) if compiled else (), tile_frames=0)
    graphs.warmup("cuda")
    latents = latents_for(vae, 4 * frames + 7, seed=21)
    with torch.inference_mode():
        reference = vae.decode(latents).sample[0]
    results = {}
    for name, split in {"blocks_3A": [frames] * 4 + [7], "mixed": [1, 5, 13, frames, frames, 2 * frames - 12]}.items():
        results[name] = max_abs(stream(AudioStreamingDecoder(vae, graphs=graphs), latents, split), reference)
    tolerance = 1e-4 if compiled else 1e-5
    return {"ok": all(value <= tolerance for value in results.values()), "max_abs": results,
            "last_mode": graphs.last_mode, "tolerance": tolerance}


def check_tiled_long_clip() -> dict:
    vae = build_vae("tiny", "cuda", torch.float32)
    # One bucket (the streaming window, as everywhere here) keeps Inductor to one compilation per dtype.
    window = streaming_window_frames(vae, block_frames(vae))
    graphs = AudioDecodeGraphs(vae, compile_shapes=(window,), tile_frames=window)
    graphs.warmup("cuda")
    latents = latents_for(vae, 1000, seed=31)
    out = graphs.decode(latents)
    with torch.inference_mode():
        reference = vae.decode(latents).sample
    modes = sorted(set(graphs.last_window_modes))
    error = max_abs(out, reference)
    return {"ok": error <= 1e-4 and graphs.last_mode == "tiled", "max_abs": error, "window_modes": modes,
            "windows": len(graphs.last_window_modes)}


def check_outer_capture_runs_eager() -> dict:
    vae = build_vae("tiny", "cuda", torch.float32)
    graphs = AudioDecodeGraphs(vae, compile_shapes=(), tile_frames=0)
    latents = latents_for(vae, 20, seed=41)
    eager(vae, latents)
    outer = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(outer):
        graphs.decode(latents)
    return {"ok": graphs.last_mode == "eager" and graphs.plain_graph_lengths == (), "mode": graphs.last_mode}


def guarded(check, *args) -> dict:
    try:
        return check(*args)
    except Exception as error:  # noqa: BLE001 - report and carry on with the other checks
        return {"ok": False, "error": repr(error)[:400], "where": traceback.format_exc(limit=-3)[-600:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=20, help="timed blocks per tier")
    parser.add_argument("--skip-timings", action="store_true")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"check": "audio_decode_cuda", "error": "no CUDA device"}))
        return
    # Exactness is judged against eager in true float32.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False

    checks = {
        "plain_graph_bit_identical": guarded(check_plain_graphs_bit_identical),
        "compiled_float32": guarded(check_compiled_close, torch.float32),
        "compiled_bfloat16": guarded(check_compiled_close, torch.bfloat16),
        "pool_retired_at_max_graphs": guarded(check_pool_retirement),
        "streaming_plain_graphs": guarded(check_streaming, False),
        "streaming_compiled": guarded(check_streaming, True),
        "tiled_long_clip": guarded(check_tiled_long_clip),
        "outer_capture_eager": guarded(check_outer_capture_runs_eager),
    }
    timings = {}
    if not args.skip_timings:
        for config, dtype in (("tiny", torch.float32), ("stable-audio-sized", torch.float32),
                              ("stable-audio-sized", torch.bfloat16)):
            key = f"{config}/{str(dtype).removeprefix('torch.')}"
            try:
                vae = build_vae(config, "cuda", dtype)
                timings[key] = {**describe(vae), "tiers": bench_tiers(vae, args.blocks, ("eager", "graph", "compiled"))}
                del vae
                torch.cuda.empty_cache()
            except Exception as error:  # noqa: BLE001
                timings[key] = {"error": repr(error)[:400]}
    print(json.dumps({
        "check": "audio_decode_cuda",
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "all_ok": all(result.get("ok") for result in checks.values()),
        "checks": checks,
        "timings": timings,
    }))


if __name__ == "__main__":
    main()
