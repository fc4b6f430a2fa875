"""Why do FP8 linears give so little? (issue 31) Where a block's GPU time goes, with and without ``--fp8 linear``.

Prints ONE JSON line. For each precision in ``--modes`` (the first is the reference), one session of the
configured model as the engine runs it: warm-up blocks that fill the window, timed blocks (median ms), then a
``torch.profiler`` trace of two blocks whose CUDA kernels are summed by kind — matrix products (cuBLAS /
CUTLASS, bf16 or FP8), attention, the compiled (Triton) kernels (the FP8 activation quantizers, fused
elementwise), the rest — and the largest kernels by name. CUDA graphs are off here so every kernel is seen, unless
``--cuda-graphs``: then the timed blocks are the engine's own (graphs replayed), and their median against the kernel
sum of a run without says what the launches between kernels cost.

    python bench/fp8_linear_probe.py --device cuda --dtype bfloat16 --preset wan2.1-1.3b --modes attention,all
    python bench/fp8_linear_probe.py --device cuda --dtype bfloat16 --preset wan2.1-1.3b --modes all \
        --window-frames 6 [--cuda-graphs]                                  # the fast window's DiT
    python bench/fp8_linear_probe.py --blocks 2 --warmup 2 --modes none    # a CPU smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from engine.bundle import build_models
from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.models import history_fp8, kernels
from kernel_sums import DIT_KINDS, cuda_kernel_sums, profiled

def run(args, mode: str) -> dict:
    """``mode``: an ``fp8`` setting (``none`` for off); ``/fast`` or ``/exact`` after it: ``fp8_fast_accum`` on or
    off (else the default: on with FP8 linears); ``/apart``: the path before the
    thirty-fifth session (the FP8 modes' norms and q / k writing bf16 rows for their quantizers,
    ``kernels.QUANTIZED_NORMS`` off; the FP8 mirror's history through the bf16 buffer, ``history_fp8.DIRECT_LOAD``
    off: read at every load, so off for the whole run)."""
    precision, _, variant = mode.partition("/")
    apart = variant == "apart"
    settings = dict(preset=args.preset, device=args.device, dtype=args.dtype, random_weights=True,
                    cuda_graphs=args.cuda_graphs)
    if variant in ("fast", "exact"):
        settings["fp8_fast_accum"] = variant == "fast"
    if args.window_frames is not None:
        settings["window_frames"] = args.window_frames
    if precision != "none":
        settings["fp8"] = precision
    saved = kernels.QUANTIZED_NORMS, history_fp8.DIRECT_LOAD
    if apart:
        kernels.QUANTIZED_NORMS = history_fp8.DIRECT_LOAD = False
    try:
        return _probe(args, mode, build_models(EngineConfig(**settings)))
    finally:
        kernels.QUANTIZED_NORMS, history_fp8.DIRECT_LOAD = saved


def _probe(args, mode: str, bundle) -> dict:
    pipeline = bundle.pipeline
    manager = KVCacheManager(pipeline.kv_spec(), 1, args.device)
    kv = manager.open_session("probe")
    progress = pipeline.new_progress(seed=0, prompt="a red circle bouncing on a blue background")
    cuda = args.device.startswith("cuda")

    def block() -> None:
        pipeline.run_block(kv, progress)

    for _ in range(args.warmup):
        block()
    times = []
    for _ in range(args.blocks):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        block()
        if cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    trace = profiled(block, 2, cuda)
    by_kind, named = cuda_kernel_sums(trace, DIT_KINDS, 90)
    result = {
        "mode": mode,
        "block_ms_median": round(statistics.median(times), 1),
        "kernel_ms_per_block_by_kind": {k: round(v / 2000, 1) for k, v in sorted(by_kind.items())},
        "kernel_ms_per_block_total": round(sum(by_kind.values()) / 2000, 1),
        # [name, ms a block, calls a block]
        "largest_kernels_ms_per_block": [(name, round(us / 2000, 2), calls / 2) for name, (us, calls) in
                                         sorted(named.items(), key=lambda item: -item[1][0])[:args.top]],
        # [operator, device ms a block of the kernels it launched itself, calls a block]: which operator launches
        # a kernel the names above do not place (a memset, a copy)
        "largest_operators_ms_per_block": _operators(trace, args.top),
    }
    return result  # the model goes with this frame: main() collects it before the next precision's


def _operators(trace, top: int) -> list:
    def device_us(a) -> float:  # torch renamed self_cuda_time_total to self_device_time_total
        return getattr(a, "self_device_time_total", None) or getattr(a, "self_cuda_time_total", 0.0)

    rows = [(a.key, round(device_us(a) / 2000, 2), a.count / 2) for a in trace.key_averages() if device_us(a) > 0]
    return sorted(rows, key=lambda row: -row[1])[:top]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--modes", default="attention,all",
                        help="comma-separated: none, linear, attention, all; linear/apart, all/apart, linear/fast, all/exact, ... "
                             "(see run)")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=8)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--window-frames", type=int, default=None, help="the engine's window (default its own)")
    parser.add_argument("--cuda-graphs", action="store_true", help="the engine's CUDA graphs on (see above)")
    args = parser.parse_args()
    runs = []
    for mode in args.modes.split(","):
        runs.append(run(args, mode))
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    print(json.dumps({
        "bench": "fp8_linear_probe",
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "preset": args.preset,
        "window_frames": args.window_frames,
        "cuda_graphs": args.cuda_graphs,
        "runs": runs,
    }))


if __name__ == "__main__":
    main()
