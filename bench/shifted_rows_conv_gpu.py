"""The Wan decoder's convolutions through the shifted-rows kernel (decoders/shifted_rows_conv.py) against cuDNN.

Prints ONE JSON line last (progress on stderr). Two parts, at 832x480 in bf16, one latent frame's calls:

1. Per convolution shape of the decoder's steady state (channels, frames, size; how many a latent frame runs):
   cuDNN's conv3d as diffusers calls it (the causal sequence padded in NCDHW, no padding in the call: the
   reference), the same on channels-last-3d, and the kernel under every configuration of the sweep: median
   ms, TFLOP/s, the largest difference from cuDNN's output (relative to its largest magnitude). The fastest
   configuration per shape is the one installed in part 2.
2. One session's streaming decode (``WanStreamingDecoder``, random weights, blocks of 3 latent frames after an
   opening chunk and warm-up blocks), compiled (the engine's steady state; ``--eager-decode``: eager too), with
   diffusers' convolutions (the reference path), with the kernel, and with the kernel in e4m3 for the residual
   blocks: ms a block, and the same latents' frames in uint8 against the reference (largest and mean
   difference, PSNR).

    python3 bench/shifted_rows_conv_gpu.py --out $OUT/conv.json          # the device (one H100/H200)
    python3 bench/shifted_rows_conv_gpu.py --compile-only                 # no GPU: cross-compile for sm_90
    TRITON_INTERPRET=1 python3 bench/shifted_rows_conv_gpu.py --smoke      # no GPU: this script's code paths
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import platform
import statistics
import sys
import time
from dataclasses import asdict

sys.path.insert(0, ".")

import torch
import torch.nn.functional as F

from decoders import shifted_rows_conv as src
from kernel_sums import cuda_kernel_sums  # bench/, the script's own folder

C = src.ConvKernelConfig
# The reduction runs over each (dt, dy)'s KW * C_in contiguous values (decoders/shifted_rows_conv.py), so a
# block_k need not divide C_in: at 96 channels (288 a pair) 64 and 128 leave a masked tail.
SWEEP = (
    C(128, 128, 32, 8, 4), C(128, 128, 64, 8, 3), C(128, 64, 32, 4, 4), C(256, 128, 32, 8, 3),
    C(128, 32, 32, 4, 4), C(128, 256, 64, 8, 3), C(256, 128, 64, 8, 3), C(128, 64, 64, 4, 3),
    C(128, 128, 128, 8, 3), C(256, 128, 128, 8, 2),
)
# e4m3 operands: the reduction step is 32 wide, so wider K blocks.
FP8_SWEEP = (
    C(128, 128, 64, 8, 4), C(128, 128, 128, 8, 3), C(128, 64, 128, 4, 3), C(256, 128, 64, 8, 3),
    C(128, 256, 64, 8, 3), C(128, 32, 64, 4, 4), C(256, 128, 32, 8, 3), C(128, 128, 32, 8, 4),
    C(128, 64, 32, 4, 4), C(256, 128, 128, 8, 3), C(128, 128, 256, 8, 2),
)
SMOKE_SWEEP = (C(16, 16, 16, 4, 2), C(32, 16, 16, 4, 2))
SMOKE_FP8_SWEEP = (C(16, 32, 32, 4, 2),)
# (C_in, C_out, kernel, frames, height, width, calls a latent frame): the decoder's steady state at 832x480.
SHAPES = (
    (96, 96, (3, 3, 3), 4, 480, 832, 6),      # up_blocks.3
    (192, 192, (3, 3, 3), 4, 240, 416, 6),    # up_blocks.2
    (192, 96, (1, 3, 3), 4, 480, 832, 1),     # up_blocks.2's upsampler (a 2-D conv per frame)
    (384, 384, (3, 3, 3), 2, 120, 208, 5),    # up_blocks.1
    (192, 384, (3, 3, 3), 2, 120, 208, 1),    # up_blocks.1.resnets.0.conv1
    (384, 192, (1, 3, 3), 4, 240, 416, 1),    # up_blocks.1's upsampler
    (384, 384, (3, 3, 3), 1, 60, 104, 10),    # mid_block, up_blocks.0
    (384, 192, (1, 3, 3), 2, 120, 208, 1),    # up_blocks.0's upsampler
)
SMOKE_SHAPES = ((32, 24, (3, 3, 3), 2, 6, 10, 1), (32, 16, (1, 3, 3), 2, 6, 10, 1))


def log(message: str) -> None:
    print(f"[srconv {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def describe(error: BaseException, limit: int = 1500) -> str:
    return f"{type(error).__name__}: {error}"[:limit]


def timed_ms(fn, device: torch.device, reps: int) -> float:
    """Median ms of ``fn()`` over ``reps`` calls after 2 warm-up calls (CUDA events on a GPU)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            started = time.perf_counter()
            fn()
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def shape_run(shape, sweep, fp8_sweep, device, dtype, reps: int) -> dict:
    c_in, c_out, kernel, frames, height, width, calls = shape
    kt, kh, kw = kernel
    generator = torch.Generator(device=device).manual_seed(0)
    padded = torch.randn(frames + kt - 1, height + kh - 1, width + kw - 1, c_in, device=device, dtype=dtype,
                         generator=generator)
    weight = (torch.randn(c_out, c_in, *kernel, device=device, dtype=dtype, generator=generator)
              / (c_in * kt * kh * kw) ** 0.5)
    bias = torch.randn(c_out, device=device, dtype=dtype, generator=generator)
    flops = 2 * frames * height * width * c_in * c_out * kt * kh * kw
    ncdhw = padded.permute(3, 0, 1, 2).unsqueeze(0).contiguous()  # as diffusers hands it to conv3d
    channels_last = ncdhw.contiguous(memory_format=torch.channels_last_3d)
    weight_cl = weight.contiguous(memory_format=torch.channels_last_3d)
    row = {"c_in": c_in, "c_out": c_out, "kernel": list(kernel), "frames": frames, "height": height,
           "width": width, "calls_per_latent_frame": calls, "gflop": round(flops / 1e9, 1)}
    reference = F.conv3d(ncdhw, weight, bias)[0].permute(1, 2, 3, 0)
    scale = reference.float().abs().max().item()
    for name, fn in (("cudnn_ncdhw", lambda: F.conv3d(ncdhw, weight, bias)),
                     ("cudnn_channels_last", lambda: F.conv3d(channels_last, weight_cl, bias))):
        try:
            ms = timed_ms(fn, device, reps)
            row[name] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1)}
        except Exception as error:  # noqa: BLE001 - the kernel's rows still run
            row[name] = {"error": describe(error)}
    variants = [("", sweep, src.pack_weight(weight), padded, 1.0, 0.02)]
    if kernel == (3, 3, 3) and c_in % 32 == 0:
        # e4m3 as the decoder's residual convolutions run it: the input's bound (here its largest magnitude)
        # mapped to 448; the error bound is e4m3's (3 mantissa bits: ~2^-4 relative per operand).
        input_scale = padded.float().abs().max().item() / src.FP8_MAX
        variants.append(("fp8_", fp8_sweep, src.pack_weight_fp8(weight), src.quantize_input(padded, input_scale),
                         input_scale, 0.15))
    base = row["cudnn_ncdhw"].get("ms")
    for prefix, configs_swept, packed, operand, input_scale, tolerance in variants:
        configs = []
        for config in configs_swept:
            entry = asdict(config)

            def call(config=config):
                return src.shifted_rows_conv(operand, packed, bias, config, input_scale=input_scale, out_dtype=dtype)
            try:
                started = time.monotonic()
                out = call()
                entry["first_call_s"] = round(time.monotonic() - started, 2)
                entry["max_abs_diff_rel"] = round((out.float() - reference.float()).abs().max().item() / scale, 5)
                entry["rel_fro"] = round(((out.float() - reference.float()).norm() / reference.float().norm()).item(), 5)
                ms = timed_ms(call, device, reps)
                entry.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
            except Exception as error:  # noqa: BLE001 - every configuration reports
                entry["error"] = describe(error)
            configs.append(entry)
        row[prefix + "configs"] = configs
        good = [c for c in configs if "ms" in c and c["max_abs_diff_rel"] < tolerance]
        if good:
            best = min(good, key=lambda c: c["ms"])
            row[prefix + "best"] = best
            if base:
                row[prefix + "best_speedup_vs_cudnn"] = round(base / best["ms"], 3)
        log(f"shape {shape}: cudnn {row['cudnn_ncdhw']} {prefix}best {row.get(prefix + 'best')}")
    return row


def make_vae(device, dtype, smoke: bool):
    from diffusers import AutoencoderKLWan

    from engine.models.presets import WAN_2_1_VAE_CONFIG

    torch.manual_seed(0)
    if smoke:
        vae = AutoencoderKLWan(base_dim=16, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                               temperal_downsample=[False, True, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    else:
        vae = AutoencoderKLWan(**WAN_2_1_VAE_CONFIG)
    return vae.to(device, dtype).eval()


DECODE_KINDS = (  # (kind, substrings of a kernel's name), first match wins: where a decode block's device time goes
    # Inductor's kernels first: their names list the ops they fused ("..._convolution_...", "..._cat_...").
    ("compiled_reduction", ("triton_red", "triton_per")),
    ("compiled_pointwise", ("triton_poi",)),
    ("convolution", ("conv", "fprop", "implicit", "xmma", "cudnn", "sm90", "nvjet", "gemm", "shifted_rows")),
    ("copy", ("memcpy", "memset", "copy", "cat", "pad")),
)


def profile_blocks(decode_block, device, blocks: int = 2, top: int = 40) -> dict:
    """The CUDA kernels of ``blocks`` steady decode blocks by kind and by name (ms a block, calls a block)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        for _ in range(blocks):
            decode_block()
        torch.cuda.synchronize(device)
    by_kind, by_name = cuda_kernel_sums(trace, DECODE_KINDS, 110)
    per_block = 1000.0 * blocks
    return {"ms_per_block_by_kind": {k: round(v / per_block, 2) for k, v in sorted(by_kind.items())},
            "ms_per_block_total": round(sum(by_kind.values()) / per_block, 2),
            "largest": [(name, round(us / per_block, 2), calls // blocks) for name, (us, calls) in
                        sorted(by_name.items(), key=lambda item: -item[1][0])[:top]]}


DECODE_PATHS = ("kernel", "kernel_fp8", "kernel_fp8_fused")


def decode_run(vae, configs, device, latent_hw, blocks: int, warmup: int, compiled: bool,  # noqa: C901
               profiled: tuple[str, ...] = (), paths: tuple[str, ...] = DECODE_PATHS) -> dict:
    """Steady ms a 3-latent-frame block, with diffusers' convolutions and with the kernel; the pixels' difference.

    ``paths``: besides the reference, ``kernel`` (bf16), ``kernel_fp8`` (the residual blocks' convolutions in
    e4m3), ``kernel_fp8_fused`` (the same, their inputs from decoders/conv_input_fp8.py). Each path named in
    ``profiled`` also gets a kernel profile of two more blocks (their frames are not compared)."""
    from decoders import conv_input_fp8
    from decoders.video import WanStreamingDecoder, _decode_one_frame

    generator = torch.Generator(device=device).manual_seed(1)
    z_dim = vae.config.z_dim
    latents = torch.randn(1, z_dim, 1 + 3 * (warmup + blocks), *latent_hw, device=device, generator=generator,
                          dtype=next(vae.parameters()).dtype)
    result = {"compiled": compiled}
    pixels = {}
    names = ("reference", *paths) + (("reference_eager",) if compiled else ())
    for name in names:
        model = copy.deepcopy(vae)
        if name.startswith("kernel"):
            result[name + "_convs_installed"] = src.install(model.decoder, configs, fp8=name != "kernel")
        if name == "kernel_fp8_fused":
            result[name + "_blocks_fused"] = conv_input_fp8.install(model.decoder)
        decoder = WanStreamingDecoder(model, fast_path=False,
                                      compile_steady_state=compiled and name != "reference_eager")
        state = decoder.new_state(name)
        frames = [decoder.decode_chunk(latents[:, :, :1], state)]
        times = []
        for index in range(warmup + blocks):
            chunk = latents[:, :, 1 + 3 * index : 4 + 3 * index]
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            frames.append(decoder.decode_chunk(chunk, state))
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - started) * 1e3)
        pixels[name] = torch.cat([decoder.to_uint8_tensor(f) for f in frames]).cpu()
        if name in profiled and device.type == "cuda":
            spare = latents[:, :, 1:4]
            result[name + "_profile"] = profile_blocks(lambda: decoder.decode_chunk(spare, state), device)
        if compiled and name.startswith("kernel"):
            # Where torch.compile breaks the graph (a break splits the decoder into many small graphs).
            with torch.inference_mode():
                frame = model.post_quant_conv(latents[:, :, -1:])
                explained = torch._dynamo.explain(functools.partial(_decode_one_frame, model.decoder))(
                    frame, list(state.feat_map))
            result[name + "_graph_breaks"] = {"count": explained.graph_break_count, "reasons": [
                str(reason.reason)[:400] for reason in explained.break_reasons[:4]]}
        steady = times[warmup:]
        result[name] = {"ms_per_block_median": round(statistics.median(steady), 2), "ms_per_block": [
            round(t, 1) for t in steady], "warmup_ms": [round(t, 1) for t in times[:warmup]]}
        if decoder.steady_state is not None:
            result[name]["compile_failed"] = decoder.steady_state.failed
            result[name]["compiled_calls"] = decoder.steady_state.calls
        del decoder, model
    for name in names[1:]:
        diff = (pixels["reference"].int() - pixels[name].int()).abs()
        mse = diff.float().pow(2).mean().item()
        result[name].update(
            uint8_max_diff=int(diff.max()), uint8_mean_diff=round(diff.float().mean().item(), 4),
            psnr_db=round(10 * math.log10(255**2 / mse), 2) if mse > 0 else None,
            speedup=round(result["reference"]["ms_per_block_median"] / result[name]["ms_per_block_median"], 3))
    if compiled:  # the rounding floor: diffusers' convolutions eager vs compiled
        eager = result.pop("reference_eager")
        result["reference_eager_vs_compiled"] = {k: eager[k] for k in ("uint8_max_diff", "uint8_mean_diff", "psnr_db")}
    if "kernel_fp8" in pixels and "kernel_fp8_fused" in pixels:  # the fused inputs against the compiled ones
        diff = (pixels["kernel_fp8"].int() - pixels["kernel_fp8_fused"].int()).abs()
        result["kernel_fp8_fused"]["vs_kernel_fp8"] = {"uint8_max_diff": int(diff.max()),
                                                       "uint8_mean_diff": round(diff.float().mean().item(), 4)}
    result["reference_pixel_std"] = round(pixels["reference"].float().std().item(), 2)
    log(f"decode compiled={compiled}: reference {result['reference']['ms_per_block_median']} ms, " + ", ".join(
        f"{name} {result[name]['ms_per_block_median']} ms (uint8 max diff {result[name]['uint8_max_diff']}, "
        f"PSNR {result[name]['psnr_db']} dB)" for name in paths))
    return result


# --- no GPU: what the compiled kernel is -------------------------------------------------------------------


def cross_compile(config: src.ConvKernelConfig, kernel: tuple[int, int, int], fp8: bool = False, arch: int = 90):
    """The kernel for sm_``arch`` without a GPU, specialised as a launch on the decoder's tensors would be."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = src._shifted_rows_conv_kernel
    operand = "*fp8e4nv" if fp8 else "*bf16"
    pointers = {"x_ptr": operand, "w_ptr": operand, "b_ptr": "*bf16", "w_scale_ptr": "*fp32", "out_ptr": "*bf16",
                "a_scale": "fp32"}
    constants = {"KT": kernel[0], "KH": kernel[1], "KW": kernel[2], "HAS_BIAS": True, "SCALED": fp8,
                 "BLOCK_M": config.block_m, "BLOCK_N": config.block_n, "BLOCK_K": config.block_k, "IEEE": False,
                 "K_TAIL": (kernel[2] * 96) % config.block_k != 0,  # as at 96 channels, the narrowest
                 ("w_stride_k" if fp8 else "w_stride_n"): 1}  # Triton makes an int equal to 1 a constant
    # 96, 192, 384 channels; the weight's other stride (256-padded columns or taps * C_in) divides by 16 too
    aligned = {"x_ptr", "w_ptr", "b_ptr", "w_scale_ptr", "out_ptr", "c_in", "c_out", "w_stride_k", "w_stride_n"}
    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            continue
        signature[name] = pointers.get(name, "i32")
        if name in aligned:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": config.num_warps, "num_stages": config.num_stages})


def compile_only() -> list[dict]:
    sys.path.insert(0, "bench")
    from fp8_attention_gpu import cubin_usage, kernel_facts

    rows = []
    variants = [((3, 3, 3), config, False) for config in SWEEP] + [((1, 3, 3), SWEEP[0], False)]
    variants += [((3, 3, 3), config, True) for config in FP8_SWEEP]
    for kernel, config, fp8 in variants:
        row = {"kernel": list(kernel), "fp8": fp8, **asdict(config)}
        try:
            started = time.monotonic()
            compiled = cross_compile(config, kernel, fp8)
            row.update(compile_s=round(time.monotonic() - started, 2), **kernel_facts(compiled),
                       **cubin_usage(compiled))
            row.pop("n_regs", None), row.pop("n_spills", None)
        except Exception as error:  # noqa: BLE001 - report every configuration
            row["error"] = describe(error)
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the JSON line to this file too")
    parser.add_argument("--compile-only", action="store_true", help="cross-compile the sweep for sm_90, no GPU")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--blocks", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-shapes", action="store_true", help="no per-shape sweep: the decode with MEASURED_CONFIGS")
    parser.add_argument("--shapes", default=None, help="sweep only these rows of SHAPES (comma-separated indices)")
    parser.add_argument("--eager-decode", action="store_true", help="time the eager decode too (compiled only else)")
    parser.add_argument("--profile", default="reference,kernel_fp8",
                        help="compiled decode paths to profile by kernel (comma-separated; '' for none)")
    parser.add_argument("--paths", default=",".join(DECODE_PATHS),
                        help=f"decode paths beside the reference (comma-separated, of {', '.join(DECODE_PATHS)})")
    args = parser.parse_args()
    if args.compile_only:
        compile_only()
        return
    if args.smoke:
        from tests.triton_interpreted import patch_interpreter

        patch_interpreter()  # NumPy 2.4 and the interpreter's range() (see tests/triton_interpreted.py)
        device, dtype, sweep, shapes, latent_hw = torch.device("cpu"), torch.float32, SMOKE_SWEEP, SMOKE_SHAPES, (2, 2)
        fp8_sweep = SMOKE_FP8_SWEEP
        args.reps, args.blocks, args.warmup = 2, 1, 1
    else:
        device, dtype, sweep, shapes, latent_hw = torch.device("cuda"), torch.bfloat16, SWEEP, SHAPES, (60, 104)
        fp8_sweep = FP8_SWEEP
        torch.backends.cudnn.benchmark = True
    import triton

    record = {"bench": "shifted_rows_conv_gpu", "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "triton": triton.__version__, "python": platform.python_version(),
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)",
              "dtype": str(dtype).removeprefix("torch."), "cudnn_benchmark": torch.backends.cudnn.benchmark}
    log(f"start {record}")
    record["shapes"] = []
    best_configs = {}
    if args.shapes:
        shapes = tuple(shapes[int(index)] for index in args.shapes.split(","))
    for shape in () if args.skip_shapes else shapes:
        try:
            row = shape_run(shape, sweep, fp8_sweep, device, dtype, args.reps)
        except Exception as error:  # noqa: BLE001 - the other shapes still run
            row = {"shape": list(map(str, shape)), "error": describe(error)}
        record["shapes"].append(row)
        for prefix, tag in (("", ()), ("fp8_", ("fp8",))):
            if prefix + "best" in row:
                key = (row["c_in"], row["c_out"], row["kernel"][0] * row["kernel"][1] * row["kernel"][2], *tag)
                if key not in best_configs or row["calls_per_latent_frame"] > 1:
                    best_configs[key] = C(*(row[prefix + "best"][k] for k in (
                        "block_m", "block_n", "block_k", "num_warps", "num_stages")))
    # A latent frame's convolution time, cuDNN vs the kernel's best (the shapes above, by their call counts).
    with_calls = [r for r in record["shapes"] if "best" in r and "ms" in r.get("cudnn_ncdhw", {})]
    record["latent_frame_conv_ms"] = {
        "cudnn": round(sum(r["cudnn_ncdhw"]["ms"] * r["calls_per_latent_frame"] for r in with_calls), 2),
        "kernel_best": round(sum(r["best"]["ms"] * r["calls_per_latent_frame"] for r in with_calls), 2)}
    fp8_rows = [r for r in with_calls if "fp8_best" in r]
    record["latent_frame_conv_ms"]["kernel_fp8_where_it_applies"] = round(sum(
        (r["fp8_best"] if "fp8_best" in r else r["best"])["ms"] * r["calls_per_latent_frame"] for r in with_calls), 2)
    record["fp8_shapes"] = len(fp8_rows)
    record["installed_configs"] = {"x".join(map(str, k)): asdict(v) for k, v in best_configs.items()}
    if not args.skip_decode:
        vae = make_vae(device, dtype, args.smoke)
        record["decode"] = []
        for compiled in ((False,) if args.smoke else (False, True) if args.eager_decode else (True,)):
            try:
                record["decode"].append(decode_run(
                    vae, best_configs, device, latent_hw, args.blocks, args.warmup, compiled,
                    profiled=tuple(filter(None, args.profile.split(","))) if compiled else (),
                    paths=tuple(filter(None, args.paths.split(",")))))
            except Exception as error:  # noqa: BLE001
                record["decode"].append({"compiled": compiled, "error": describe(error)})
    line = json.dumps(record)
    print(line, flush=True)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as file:
            file.write(line + "\n")


if __name__ == "__main__":
    main()
