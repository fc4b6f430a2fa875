"""The DiT and VAE fast paths against the paths they replace, timed and checked in one run (GPU).

Prints one JSON line per section as it finishes (so a run cut short still
reports), then one summary line. Sections:

* ``forward``: ms per DiT forward by history length, and per block, for the
  history gathered per forward (the landed path) or once per block, with the
  elementwise work eager or fused; the naive concatenated-KV path (Self-Forcing
  style) in the same run; host enqueue time vs device time of a block (a host
  that waits inside a block shows as enqueue ~ device time).
* ``equivalence``: the engine's path (gathered once, fused) against the all-eager
  per-forward path on the same weights and noise, relative error per block over
  12 blocks past the window's first eviction (bf16), and the same in float32.
* ``attention``: SDPA backends at the largest context, in the engine's layout.
* ``vae``: ms per 12-frame decode: eager, cuDNN autotuned, channels-last,
  compiled steady state; max pixel difference of each to eager.
* ``profile``: where one block's DiT device time goes on the final path (the decode is not in it).

    python bench/bench_fast_paths.py --out /tmp/fast.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
import typing
from collections import defaultdict

import torch

sys.path.insert(0, ".")  # run from the repository root without installing

from bench.bench_engine import naive_run  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.kv_cache import KVCacheManager  # noqa: E402
from engine.bundle import build_models  # noqa: E402
from engine.models.kernels import EAGER_KERNELS, DeviceKernel, Kernels  # noqa: E402
from engine.models.pipeline import CausalWanPipeline  # noqa: E402
from decoders.video import WanStreamingDecoder  # noqa: E402

OUT = None


def emit(record: dict) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if OUT:
        with open(OUT, "a") as f:
            f.write(line + "\n")


def kernel_sets(transformer) -> dict[str, Kernels]:
    """``fused``: the set the engine built the transformer with (exact for bf16, not for the FP8 modes)."""
    rotation_only = Kernels.make(True, only=("rotate_pairs",), fuse_norms=True)
    return {"eager": EAGER_KERNELS, "rotation_fused": rotation_only, "fused": transformer.engine_kernels,
            "fused_norms": Kernels.make(True, fuse_norms=True, exact=transformer.engine_kernels.exact)}


def sync() -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


_MANAGERS: dict[int, tuple] = {}


def manager_for(pipeline: CausalWanPipeline) -> KVCacheManager:
    """One KV manager per pipeline for the run, as the engine has: its staging buffers (part of a commit graph's
    key) keep their addresses, so a timed run after the warm-up replays graphs instead of capturing new ones."""
    entry = _MANAGERS.get(id(pipeline))
    if entry is None or entry[0] is not pipeline:
        entry = (pipeline, KVCacheManager(pipeline.kv_spec(), 1, pipeline.transformer.device))
        _MANAGERS[id(pipeline)] = entry
    return entry[1]


def timed_blocks(pipeline: CausalWanPipeline, blocks: int, per_forward: bool, seed: int = 0):
    """Run ``blocks`` blocks of one session; per-forward ms by history (synchronised) or per-block times."""
    kv = manager_for(pipeline).open_session("bench")
    progress = pipeline.new_progress(seed=seed, prompt="a bench")
    forward_ms = defaultdict(list)
    block_ms, enqueue_ms, outputs = [], [], []
    original = pipeline.forward_branch
    if per_forward:
        def timed(kv_, progress_, branch, latents, timestep, *, stage):
            history = kv_.num_resident_blocks(branch)
            start = sync()
            out = original(kv_, progress_, branch, latents, timestep, stage=stage)
            forward_ms[history].append((sync() - start) * 1000)
            return out
        pipeline.forward_branch = timed
    try:
        for _ in range(blocks):
            start = sync()
            clean = pipeline.run_block(kv, progress)
            enqueued = time.perf_counter()
            end = sync()
            block_ms.append((end - start) * 1000)
            enqueue_ms.append((enqueued - start) * 1000)
            outputs.append(clean)
    finally:
        pipeline.forward_branch = original
        kv.close()
    return forward_ms, block_ms, enqueue_ms, outputs


def median_by_history(forward_ms) -> dict:
    return {str(k): round(statistics.median(v), 2) for k, v in sorted(forward_ms.items())}


def relative_errors(fast, reference) -> list[float]:
    errors = []
    for a, b in zip(fast, reference):
        a, b = a.video.float(), b.video.float()
        errors.append(((a - b).norm() / b.norm()).item())
    return errors


def forward_section(bundle, blocks: int, only: set[str] | None = None) -> dict:
    base = bundle.pipeline
    transformer = base.transformer
    kernels = kernel_sets(transformer)
    variants = {
        "landed (per-forward gather, fused rotation)": (False, "rotation_fused", False),
        "gather once, fused rotation": (True, "rotation_fused", False),
        "per-forward gather, fused kernels": (False, "fused", False),
        "nographs (gather once, fused kernels, no CUDA graphs)": (True, "fused", False),
        "engine (gather once, fused kernels, CUDA graphs)": (True, "fused", True),
        "normsfused (the engine with the norms fused too)": (True, "fused_norms", True),
    }
    if only is not None:
        variants = {name: v for name, v in variants.items() if name.split(" ")[0] in only}
    results = {}
    for name, (gather_once, kernel_set, graphs) in variants.items():
        pipeline = base if gather_once else base.variant(gather_history_once=False)
        transformer.kernels = kernels[kernel_set]
        pipeline.forwards.enabled = graphs and torch.cuda.is_available()
        timed_blocks(pipeline, 2, per_forward=False)  # warm-up: compiles, cuDNN plans, allocator
        forward_ms, _, _, _ = timed_blocks(pipeline, blocks, per_forward=True)
        _, block_ms, enqueue_ms, _ = timed_blocks(pipeline, blocks, per_forward=False)
        results[name] = {
            "forward_ms_by_history_frames": median_by_history(forward_ms),
            "block_ms_median_full_window": round(statistics.median(block_ms[-3:]), 2),
            "host_enqueue_ms_median_full_window": round(statistics.median(enqueue_ms[-3:]), 2),
            "graphs": pipeline.forwards.num_graphs, "graph_replays": pipeline.forwards.replays,
        }
        emit({"section": "forward_variant", "variant": name, **results[name]})
    transformer.kernels = kernels["fused"]
    base.forwards.enabled = torch.cuda.is_available()
    if transformer.fp8_attention:  # the naive path concatenates bf16 K/V per forward: no FP8 form of it
        results["naive (concatenated KV, Self-Forcing style)"] = {"skipped": "fp8 attention runs gathered only"}
        return results
    clock = type("Clock", (), {"now": staticmethod(sync)})()
    naive_ms, _ = naive_run(bundle, blocks, clock)
    results["naive (concatenated KV, Self-Forcing style)"] = {"forward_ms_by_history_frames": median_by_history(naive_ms)}
    return results


def equivalence_section(bundle, blocks: int, label: str) -> dict:
    base = bundle.pipeline
    transformer = base.transformer
    reference = base.variant(gather_history_once=False)
    transformer.kernels = EAGER_KERNELS
    _, _, _, eager = timed_blocks(reference, blocks, per_forward=False, seed=7)
    transformer.kernels = Kernels.make(True)  # the bf16 engine's: exact
    _, _, _, fast = timed_blocks(base, blocks, per_forward=False, seed=7)
    errors = relative_errors(fast, eager)
    graphs = base.forwards.num_graphs
    max_abs = max(a.float().max_abs_diff(b.float()) for a, b in zip(fast, eager))
    transformer.kernels = Kernels.make(True, fuse_norms=True)
    _, _, _, norms_fused = timed_blocks(base, blocks, per_forward=False, seed=7)
    transformer.kernels = Kernels.make(True, exact=False)  # the FP8 modes' set, on the bf16 model
    _, _, _, inexact = timed_blocks(base, blocks, per_forward=False, seed=7)
    transformer.kernels = transformer.engine_kernels
    return {"label": label, "blocks": blocks, "graphs": graphs, "graph_replays": base.forwards.replays,
            "rel_err_per_block": [round(e, 6) for e in errors],
            "max_rel_err": max(errors), "max_abs_diff": max_abs,
            "norms_fused_max_rel_err": max(relative_errors(norms_fused, eager)),
            "inexact_set_max_rel_err": max(relative_errors(inexact, eager))}


def equivalence_ablation(bundle, blocks: int) -> dict:
    """Where a bf16 difference comes from: each fast path alone against the eager path, and every path
    against the same weights run in float32 (how far bf16 itself is from the function). Leaves the
    bundle's transformer in float32: run it last on a bundle of its own."""
    base = bundle.pipeline
    transformer = base.transformer
    per_forward = base.variant(gather_history_once=False)
    paths = {
        "eager": (per_forward, EAGER_KERNELS),
        "gather_once": (base.variant(gather_history_once=True), EAGER_KERNELS),
        "fused": (per_forward, Kernels.make(True)),
        "engine": (base, Kernels.make(True)),
        "norms_fused": (base, Kernels.make(True, fuse_norms=True)),
    }
    for name in EAGER_KERNELS.__dataclass_fields__:  # each step fused alone, norms fused: which one differs
        if name not in ("fused", "fuse_norms"):
            paths[f"only_{name}"] = (base, Kernels.make(True, only=(name,), fuse_norms=True))
    outputs = {}
    for name, (pipeline, kernels) in paths.items():
        transformer.kernels = kernels
        outputs[name] = timed_blocks(pipeline, blocks, per_forward=False, seed=7)[3]
    transformer.float()
    transformer.kernels = EAGER_KERNELS
    outputs["float32"] = timed_blocks(base.variant(gather_history_once=False), blocks, per_forward=False, seed=7)[3]
    record = {"blocks": blocks}
    for name in [name for name in outputs if name not in ("eager", "float32")]:
        record[f"{name}_vs_eager_max_rel"] = max(relative_errors(outputs[name], outputs["eager"]))
    for name in ("eager", "engine", "norms_fused"):
        record[f"{name}_vs_float32_max_rel"] = max(relative_errors(outputs[name], outputs["float32"]))
    return record


def attention_section(bundle) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    spec = bundle.pipeline.kv_spec()
    tokens = spec.tokens_per_frame
    heads, dim = spec.num_kv_heads, spec.head_dim
    device, dtype = bundle.pipeline.transformer.device, bundle.pipeline.transformer.dtype
    q = torch.randn(1, spec.frames_per_block * tokens, heads, dim, device=device, dtype=dtype)
    kv = torch.randn(2, spec.context_frames * tokens, heads, dim, device=device, dtype=dtype)
    k, v = kv[0].unsqueeze(0), kv[1].unsqueeze(0)
    out = {}
    for name, backend in (("default", None), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                          ("flash", SDPBackend.FLASH_ATTENTION), ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        def call():
            return torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        try:
            with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
                for _ in range(3):
                    call()
                start = sync()
                for _ in range(20):
                    call()
                out[name] = round((sync() - start) / 20 * 1000, 3)
        except Exception as error:  # a backend that refuses this shape/layout
            out[name] = f"unavailable: {type(error).__name__}"
    flops = 4 * q.shape[1] * k.shape[1] * heads * dim
    out["tflops_default"] = round(flops / (out["default"] / 1000) / 1e12, 1) if isinstance(out["default"], float) else None
    out["queries"], out["keys"] = q.shape[1], k.shape[1]
    return out


def set_conv_layout(module: torch.nn.Module, memory_format: torch.memory_format) -> None:
    """Every 5-D conv weight in ``memory_format`` (cuDNN then runs the convs channels-last)."""
    for parameter in module.parameters():
        if parameter.ndim == 5:
            parameter.data = parameter.data.contiguous(memory_format=memory_format)


def vae_section(bundle, blocks: int) -> dict:
    vae = bundle.decoder.vae
    pipeline = bundle.pipeline
    _, channels, frames, height, width = pipeline.latent_shape
    generator = torch.Generator().manual_seed(3)
    latents = [torch.randn(1, channels, frames, height, width, generator=generator).to(vae.device, vae.dtype)
               for _ in range(blocks + 1)]

    def run(decoder):
        state = decoder.new_state("vae")
        times, pixels = [], []
        for block in latents:
            start = sync()
            pixels.append(decoder.decode_chunk(decoder.denormalize(block), state))
            times.append((sync() - start) * 1000)
        return statistics.median(times[1:]), times[0], torch.cat(pixels, dim=2)

    results = {}
    torch.backends.cudnn.benchmark = False
    eager_ms, first_ms, reference = run(WanStreamingDecoder(vae))
    results["eager"] = {"ms_per_block": round(eager_ms, 2), "first_block_ms": round(first_ms, 2)}
    emit({"section": "vae_variant", "variant": "eager", **results["eager"]})
    torch.backends.cudnn.benchmark = True
    run(WanStreamingDecoder(vae))  # autotune
    ms, _, pixels = run(WanStreamingDecoder(vae))
    results["cudnn_benchmark"] = {"ms_per_block": round(ms, 2), "max_abs_diff": (pixels - reference).abs().max().item()}
    emit({"section": "vae_variant", "variant": "cudnn_benchmark", **results["cudnn_benchmark"]})
    set_conv_layout(vae, torch.channels_last_3d)
    run(WanStreamingDecoder(vae))
    ms, _, pixels = run(WanStreamingDecoder(vae))
    results["channels_last_3d"] = {"ms_per_block": round(ms, 2), "max_abs_diff": (pixels - reference).abs().max().item()}
    emit({"section": "vae_variant", "variant": "channels_last_3d", **results["channels_last_3d"]})
    set_conv_layout(vae, torch.contiguous_format)
    compiled = WanStreamingDecoder(vae, compile_steady_state=True)
    start = time.perf_counter()
    run(compiled)  # compiles at the first steady frame
    compile_s = time.perf_counter() - start
    ms, _, pixels = run(compiled)
    results["compiled_steady_state"] = {
        "ms_per_block": round(ms, 2), "compile_s": round(compile_s, 1), "failed": compiled.steady_state.failed,
        "max_abs_diff": (pixels - reference).abs().max().item(),
    }
    emit({"section": "vae_variant", "variant": "compiled_steady_state", **results["compiled_steady_state"]})
    return results


def profile_section(bundle) -> dict:
    from torch.profiler import ProfilerActivity, profile

    pipeline = bundle.pipeline
    pipeline.transformer.kernels = pipeline.transformer.engine_kernels
    pipeline.forwards.enabled = torch.cuda.is_available()
    kv = manager_for(pipeline).open_session("profile")
    progress = pipeline.new_progress(seed=1, prompt="a profile")
    decoder = bundle.decoder
    state = decoder.new_state("profile")
    resident = pipeline.sink_frames + pipeline.window_frames
    for _ in range(resident // pipeline.frames_per_block + 2):  # fill the window, then a full-window block:
        decoder.decode_chunk(decoder.denormalize(pipeline.run_block(kv, progress).video), state)  # all captured
    sync()
    # Device activity only: tracing the host's operators too slows its launches enough to idle the GPU.
    activities = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
    graphs_before = pipeline.forwards.num_graphs
    with profile(activities=activities) as prof:  # the DiT's block alone: the trace's span is its own
        clean = pipeline.run_block(kv, progress)
        sync()
    decoder.decode_chunk(decoder.denormalize(clean.video), state)
    kv.close()
    categories = defaultdict(float)
    top = []
    for event in prof.key_averages():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue  # operators carry their kernels' time too: count the kernels alone
        device_us = getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0)
        if device_us <= 0:
            continue
        name = event.key.lower()
        if "sdpa" in name or "fmha" in name or "flash" in name or "attention" in name or "attn" in name:
            category = "attention"
        elif "conv" in name or "fprop_implicit" in name or "winograd" in name or "nchwtonhwc" in name or "nhwctonchw" in name:
            category = "conv (vae)"
        elif "gemm" in name or "matmul" in name or "cutlass" in name or "nvjet" in name:
            category = "gemm"
        elif "triton" in name:
            category = "fused elementwise (triton)"
        elif "copy" in name or "memcpy" in name or "cat" in name:
            category = "copy/cat"
        else:
            category = "other elementwise"
        categories[category] += device_us / 1000
        top.append((device_us / 1000, event.key[:90], event.count))
    top.sort(reverse=True)
    busy = {}
    if OUT:
        with open(OUT.replace(".jsonl", "_profile.txt"), "w") as f:
            f.write(prof.key_averages().table(sort_by="self_device_time_total", row_limit=40))
        busy = kernel_timeline(prof, OUT.replace(".jsonl", "_trace.json.gz"))
    return {"device_ms_by_category": {k: round(v, 1) for k, v in sorted(categories.items(), key=lambda kv: -kv[1])},
            "device_ms_total": round(sum(categories.values()), 1), **busy,
            "graphs_captured_while_profiling": pipeline.forwards.num_graphs - graphs_before,
            "top_kernels": [{"ms": round(ms, 2), "name": name, "count": count} for ms, name, count in top[:25]]}


def kernel_timeline(prof, path: str) -> dict:
    """Save the trace (gzip, chrome://tracing / Perfetto) and say how much of its span the GPU was busy."""
    import gzip
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as f:
            data = f.read()
    with gzip.open(path, "wb") as f:
        f.write(data)
    kernels = sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in json.loads(data).get("traceEvents", [])
                     if e.get("cat") == "kernel")
    if not kernels:
        return {"trace": os.path.basename(path), "kernels_in_trace": 0}
    busy, end = 0.0, kernels[0][0]
    for start, stop in kernels:  # union of the kernels' intervals: overlapping kernels count once
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    span = max(stop for _, stop in kernels) - kernels[0][0]
    return {"trace": os.path.basename(path), "kernels_in_trace": len(kernels), "gpu_span_ms": round(span / 1000, 1),
            "gpu_busy_ms": round(busy / 1000, 1), "gpu_idle_ms": round((span - busy) / 1000, 1)}


def overlap_section(bundle, blocks: int = 4) -> dict:
    """Would decoding block N on a second stream while block N+1 denoises pay? Serial vs concurrent, full window."""
    pipeline, decoder = bundle.pipeline, bundle.decoder
    kv = manager_for(pipeline).open_session("overlap")
    progress = pipeline.new_progress(seed=1, prompt="an overlap")
    state = decoder.new_state("overlap")
    resident = pipeline.sink_frames + pipeline.window_frames
    while kv.num_resident_blocks("cond") < resident:
        decoder.decode_chunk(decoder.denormalize(pipeline.run_block(kv, progress).video), state)
    sync()
    serial = []
    for _ in range(blocks):
        start = sync()
        decoder.decode_chunk(decoder.denormalize(pipeline.run_block(kv, progress).video), state)
        serial.append((sync() - start) * 1000)
    side = torch.cuda.Stream()
    main_stream = torch.cuda.current_stream()
    previous = pipeline.run_block(kv, progress)
    concurrent = []
    for _ in range(blocks):
        start = sync()
        side.wait_stream(main_stream)
        with torch.cuda.stream(side):
            decoder.decode_chunk(decoder.denormalize(previous.video), state)
        previous = pipeline.run_block(kv, progress)
        concurrent.append((sync() - start) * 1000)
    kv.close()
    serial_ms, concurrent_ms = statistics.median(serial), statistics.median(concurrent)
    return {"serial_block_plus_decode_ms": round(serial_ms, 1), "concurrent_ms": round(concurrent_ms, 1),
            "gain": round(1 - concurrent_ms / serial_ms, 3)}


def main() -> None:
    global OUT
    parser = argparse.ArgumentParser()
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--out", default=None)
    parser.add_argument("--sections", default="equivalence,forward,attention,vae,profile")
    parser.add_argument("--smoke", action="store_true", help="tiny models on this machine's device: checks the script runs")
    parser.add_argument("--variants", default=None, help="first words of the forward variants to run, e.g. landed,engine")
    parser.add_argument("--no-compile-decoder", action="store_true", help="eager VAE (skips its compile)")
    parser.add_argument("--window-frames", type=int, default=None, help="the sliding window (default: the preset's)")
    parser.add_argument("--fp8", default="off", choices=typing.get_args(EngineConfig.model_fields["fp8"].annotation))
    args = parser.parse_args()
    OUT = args.out
    sections = args.sections.split(",")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    summary = {"bench": "fast_paths", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
               "window_frames": args.window_frames, "fp8": args.fp8,
               "device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    started = time.perf_counter()
    if "equivalence" in sections:
        tiny = build_models(EngineConfig(preset="tiny", device=device, dtype="float32", sink_frames=3,
                                         window_frames=6, audio=False, random_weights=True))
        record = equivalence_section(tiny, 12, f"tiny fp32 {device}, sink 3 + window 6")
        emit({"section": "equivalence", **record})
        summary["equivalence_fp32"] = record
        del tiny
    window = {} if args.window_frames is None else {"window_frames": args.window_frames}
    if args.smoke:
        config = EngineConfig(preset="tiny", device=device, height=48, width=64, audio=False, random_weights=True,
                              compile_decoder=not args.no_compile_decoder, **window)
    else:
        config = EngineConfig(preset="wan2.1-1.3b", device=device, dtype="bfloat16", random_weights=True,
                              compile_decoder=not args.no_compile_decoder, fp8=args.fp8, **window)
    bundle = build_models(config)
    emit({"section": "built", "s": round(time.perf_counter() - started, 1),
          "allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 1) if device == "cuda" else None})
    if "equivalence" in sections:
        small_window = build_models(config.model_copy(update={"window_frames": 6}))
        record = equivalence_section(small_window, 12, f"{config.preset} {config.dtype}, sink 3 + window 6")
        emit({"section": "equivalence", **record})
        summary["equivalence_bf16"] = record
        if "ablation" in sections:
            record = equivalence_ablation(small_window, 12)
            emit({"section": "equivalence_ablation", **record})
            summary["equivalence_ablation"] = record
        del small_window
        if device == "cuda":
            torch.cuda.empty_cache()
    if "equivalence" in sections:  # the timed sections get kernels compiled for their own model's sizes
        DeviceKernel.forget_compiled()
    only = set(args.variants.split(",")) if args.variants else None
    for name, fn in (("forward", lambda: forward_section(bundle, args.blocks, only)),
                     ("attention", lambda: attention_section(bundle)),
                     ("vae", lambda: vae_section(bundle, 4)),
                     ("profile", lambda: profile_section(bundle)),
                     ("overlap", lambda: overlap_section(bundle))):
        if name not in sections:
            continue
        try:
            record = fn()
        except Exception as error:
            record = {"error": repr(error)}
        emit({"section": name, **record} if name != "forward" else {"section": name, "variants": record})
        summary[name] = record
        summary["elapsed_s"] = round(time.perf_counter() - started, 1)
    emit(summary)


if __name__ == "__main__":
    main()
