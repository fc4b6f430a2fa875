"""Where one session's block spends device memory beyond what the engine holds: ONE JSON line.

Issue 23's 24 GiB mode was refused after its warm-up: the probe block measured a 5.72 GiB activation peak and
the build and the probe held 5.76 GiB more than the weights and workspaces explain (docs/BENCHMARKS.md). This
runs the engine's own probe (``engine.startup``'s: one session slot, blocks through every history length) twice
with torch's memory history recorded: the first pass captures the CUDA graphs, the second replays them. For each
pass it reports the peak above what was allocated before it, and the allocations live at that peak grouped by
the first frame of our code or diffusers' that made them; then what stays reserved after the probe, by pool
(the general pool, each CUDA graph pool).

    python bench/memory_peak.py --device cuda --dtype bfloat16            # 1.3B random weights, 832x480
    python bench/memory_peak.py --preset tiny --device cpu --dtype float32  # runs anywhere (no history on CPU)
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import torch

from engine.bundle import build_models
from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.runner import runner_for

GIB = 2**30
OURS = ("/engine/", "/decoders/", "/diffusers/", "/app/")


def site(frames: list[dict]) -> str:
    """The innermost frame of our code or diffusers' that led to an allocation (its file:line and function)."""
    for frame in frames:
        name = frame.get("filename", "")
        if any(part in name for part in OURS):
            return f"{name.split('/')[-2]}/{name.split('/')[-1]}:{frame.get('line')} {frame.get('name')}"
    return frames[0].get("name", "?") if frames else "?"


def peak_sites(events: list[dict], top: int = 12) -> dict:
    """Replays alloc/free events: the peak of live bytes among them and, at that peak, the top sites."""
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for event in events:
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = (event["size"], site(event.get("frames") or []))
            total += event["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif action == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    by_site: dict[str, int] = defaultdict(int)
    for size, where in at_peak.values():
        by_site[where] += size
    ranked = sorted(by_site.items(), key=lambda kv: -kv[1])[:top]
    return {"peak_gib": round(peak / GIB, 3), "sites_gib": {k: round(v / GIB, 3) for k, v in ranked}}


def pools(device: torch.device) -> dict[str, float]:
    """Reserved bytes by allocator pool: (0, 0) is the general pool, any other a CUDA graph's private pool."""
    out: dict[str, int] = defaultdict(int)
    for segment in torch.cuda.memory_snapshot():
        if segment.get("device") == device.index:
            out[str(tuple(segment.get("segment_pool_id", (0, 0))))] += segment["total_size"]
    return {k: round(v / GIB, 3) for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="wan2.1-1.3b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--decoder", default=None, choices=["wan", "taehv"])
    parser.add_argument("--video-input", action="store_true", help="keep the video encoder (its warm blocks too)")
    args = parser.parse_args()
    config = EngineConfig(preset=args.preset, device=args.device, dtype=args.dtype, random_weights=True,
                          video_decoder=args.decoder, video_input=args.video_input, text_encoder_device="cpu")
    cuda = torch.device(args.device).type == "cuda"
    device = torch.device(args.device)
    if cuda:
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000)
    gib = (lambda: round(torch.cuda.memory_allocated(device) / GIB, 3)) if cuda else (lambda: None)
    result: dict = {"bench": "memory_peak", "date": time.strftime("%Y-%m-%d"), "preset": args.preset,
                    "device": torch.cuda.get_device_name(device) if cuda else "cpu", "dtype": args.dtype}
    bundle = build_models(config)
    result["allocated_after_build_gib"] = gib()
    spec = bundle.pipeline.kv_spec()
    probe = runner_for(bundle, KVCacheManager(spec, 1, device))
    result["allocated_with_probe_kv_gib"] = gib()
    blocks = -(-spec.resident_frames // spec.frames_per_block) + 1
    marks = []
    for name in ("capture_pass", "replay_pass"):
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
            marks.append(len(torch.cuda.memory._snapshot()["device_traces"][device.index]))
        started = time.perf_counter()
        probe.warmup(blocks, transitions=False)
        entry = {"blocks": blocks, "s": round(time.perf_counter() - started, 2)}
        if cuda:
            torch.cuda.synchronize(device)
            entry["peak_above_before_gib"] = round((torch.cuda.max_memory_allocated(device) - before) / GIB, 3)
            entry["allocated_after_gib"] = gib()
            entry["reserved_after_gib"] = round(torch.cuda.memory_reserved(device) / GIB, 3)
        result[name] = entry
    if cuda:
        traces = torch.cuda.memory._snapshot()["device_traces"][device.index]
        marks.append(len(traces))
        result["capture_pass"].update(peak_sites(traces[marks[0]:marks[1]]))
        result["replay_pass"].update(peak_sites(traces[marks[1]:marks[2]]))
        del probe
        torch.cuda.empty_cache()
        result["after_probe"] = {"allocated_gib": gib(), "reserved_gib": round(torch.cuda.memory_reserved(device) / GIB, 3),
                                 "reserved_by_pool_gib": pools(device)}
        torch.cuda.memory._record_memory_history(enabled=None)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
