"""FP8 against bf16 on the same weights and noise: latent error, decoded PSNR and forward time (GPU).

Builds the model bundle once per variant from one config that differs only in
``fp8`` ("off" first, then each of ``--variants``). The weights are seeded
random ones (``--random-weights``; identical in every build because the seed
is), the preset's shipped ones, or a model directory's (``--model DIR``). Each variant runs ``--blocks`` blocks of one
session (same seed, same prompt: the same noise), past the window's first
eviction with the default sink 3 + window 6; every forward is timed with a
device synchronisation around it. The latents of every variant are then decoded
by one decoder (the "off" build's Wan VAE), so the PSNR sees only what the DiT
changed. CUDA graphs stay on (the engine's default); ``graphs`` says whether
each variant's forwards were captured.

Per block: max |Δ| and ‖Δ‖/‖ref‖ of the clean video latents, PSNR (dB) of the
decoded frames (in [-1, 1]: peak-to-peak 2; null where identical). Per variant:
median ms per forward at the largest history, the DiT's weight bytes. Prints one
JSON line and appends it to ``--out``.

    python bench/fp8_quality.py --preset wan2.1-1.3b --device cuda --dtype bfloat16 --random-weights --out /tmp/fp8.jsonl
    python bench/fp8_quality.py --preset wan2.1-1.3b --device cuda --dtype bfloat16 --random-weights \
        --variants linear,attention,all --out /tmp/fp8.jsonl     # FP8 attention needs Hopper (9.0+)
    python bench/fp8_quality.py --preset tiny --device cpu      # smoke test: a few seconds on a CPU
    TRITON_INTERPRET=1 python bench/fp8_quality.py --preset tiny --device cpu --variants linear,attention,all \
        --blocks 3 --height 48 --width 64                       # the attention variants through the interpreter
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys
import time
import typing

import torch
from pydantic import ValidationError

sys.path.insert(0, ".")  # run from the repository root without installing

from bench.bench_fast_paths import relative_errors, timed_blocks  # noqa: E402
from engine.bundle import ModelBundle, build_models  # noqa: E402
from engine.config import EngineConfig  # noqa: E402

FP8_VARIANTS = tuple(v for v in typing.get_args(EngineConfig.model_fields["fp8"].annotation) if v != "off")
FAST_ACCUM = {"": None, "fast": True, "exact": False}  # a variant's suffix -> fp8_fast_accum (None: the default)
PEAK_TO_PEAK = 2.0  # decoded frames lie in [-1, 1]


def dit_weight_bytes(bundle: ModelBundle) -> int:
    """Bytes of the DiT's parameters and buffers (FP8 weights and their scales are buffers)."""
    model = bundle.pipeline.transformer.transformer
    return sum(t.nbytes for t in itertools.chain(model.parameters(), model.buffers()))


def psnr(frames: torch.Tensor, reference: torch.Tensor) -> float | None:
    mse = float((frames.float() - reference.float()).pow(2).mean())
    return None if mse == 0 else round(10 * math.log10(PEAK_TO_PEAK**2 / mse), 2)


def decode_blocks(bundle: ModelBundle, blocks, name: str) -> list[torch.Tensor]:
    """One stream's blocks through ``bundle``'s video decoder, in order, as one session; frames on the CPU."""
    decoder = bundle.decoder
    state = decoder.new_state(name)
    try:
        return [decoder.decode_chunk(decoder.denormalize(block.video), state).cpu() for block in blocks]
    finally:
        decoder.release(state)


def run_variant(config: EngineConfig, blocks: int, seed: int) -> tuple[ModelBundle, dict, list]:
    started = time.perf_counter()
    bundle = build_models(config)
    build_s = time.perf_counter() - started
    pipeline = bundle.pipeline
    forward_ms, block_ms, _, outputs = timed_blocks(pipeline, blocks, per_forward=True, seed=seed)
    largest = max(forward_ms)
    record = {
        "build_s": round(build_s, 1),
        "forward_ms_median_at_largest_history": round(statistics.median(forward_ms[largest]), 2),
        "largest_history_frames": largest,
        "forwards_timed_at_largest_history": len(forward_ms[largest]),
        "block_ms_median": round(statistics.median(block_ms[1:] or block_ms), 2),
        "dit_weight_bytes": dit_weight_bytes(bundle),
        "graphs": pipeline.forwards.num_graphs,
        "graph_replays": pipeline.forwards.replays,
        "graphs_enabled": pipeline.forwards.enabled,
    }
    if bundle.fp8 is not None:
        record.update(layers_converted=bundle.fp8.converted, weight_bytes_saved=bundle.fp8.bytes_saved,
                      layers_kept_bf16=bundle.fp8.kept)
    record["fp8_attention"] = pipeline.transformer.fp8_attention
    if pipeline.transformer.fp8_attention:  # the e4m3 context mirror, on top of the bf16 gathered context
        record["fp8_mirror_bytes"] = sum(workspace.fp8.nbytes for workspace in pipeline.context_kv.values())
    return bundle, record, outputs


def parse_variants(value: str) -> list[str]:
    """fp8 values, each optionally with ``/fast`` or ``/exact`` after it (``fp8_fast_accum`` on or off; else its
    default): ``all/exact,all/fast``."""
    variants = [v.strip() for v in value.split(",") if v.strip()]
    unknown = [v for v in variants if v.partition("/")[0] not in FP8_VARIANTS or v.partition("/")[2] not in
               ("", "fast", "exact")]
    if not variants or unknown:
        raise argparse.ArgumentTypeError(f"{value!r}: give a comma-separated list of {', '.join(FP8_VARIANTS)} "
                                         "(each may end in /fast or /exact: fast accumulation on or off)")
    return list(dict.fromkeys(variants))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="wan2.1-1.3b", choices=["tiny", "wan2.1-1.3b"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16"], help="FP8 is a bf16-model option")
    parser.add_argument("--random-weights", action="store_true",
                        help="seeded random weights (wan2.1-1.3b needs it or --model)")
    parser.add_argument("--model", default=None, metavar="DIR", help="a model directory (docs/MODELS.md): real weights")
    parser.add_argument("--causal-weights", default=None, metavar="FILE", help="causal DiT weights for --model")
    parser.add_argument("--variants", type=parse_variants, default=["linear"],
                        help=f"fp8 values to compare with off, comma-separated ({', '.join(FP8_VARIANTS)})")
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--sink-frames", type=int, default=3)
    parser.add_argument("--window-frames", type=int, default=6)
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0, help="weight seed and session noise seed")
    parser.add_argument("--out", default=None, help="append the JSON line to this file")
    args = parser.parse_args()
    if args.blocks < 2:
        parser.error("--blocks must be at least 2")
    if os.environ.get("TRITON_INTERPRET") == "1":  # FP8 attention on the CPU: the interpreter's casts (see there)
        from tests.triton_interpreted import patch_interpreter

        patch_interpreter()
    started = time.perf_counter()
    try:
        configs = {
            variant: EngineConfig(
                preset=args.preset, model_dir=args.model, causal_weights=args.causal_weights,
                device=args.device, dtype=args.dtype, random_weights=args.random_weights,
                fp8=variant.partition("/")[0], fp8_fast_accum=FAST_ACCUM[variant.partition("/")[2]], sink_frames=args.sink_frames, window_frames=args.window_frames, height=args.height,
                width=args.width, seed=args.seed, audio=False, compile_decoder=False, warmup_blocks=0,
            )
            for variant in ["off", *args.variants]
        }
    except ValidationError as error:
        problems = "; ".join(p["msg"].removeprefix("Value error, ") for p in error.errors(include_url=False))
        parser.exit(2, f"fp8_quality: {problems}\n")

    reference_bundle, reference_record, reference = run_variant(configs["off"], args.blocks, args.seed)
    # One decoder for every stream: the "off" build's. The others' pipelines go as soon as they have run.
    reference_frames = decode_blocks(reference_bundle, reference, "off")
    variants = {"off": reference_record}
    for variant in args.variants:
        bundle, record, outputs = run_variant(configs[variant], args.blocks, args.seed)
        del bundle
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        frames = decode_blocks(reference_bundle, outputs, variant)
        errors = relative_errors(outputs, reference)
        psnrs = [psnr(a, b) for a, b in zip(frames, reference_frames)]
        finite = [p for p in psnrs if p is not None]
        record.update(
            finite=all(bool(torch.isfinite(o.video).all()) for o in outputs),
            max_abs_latent_diff_per_block=[round((a.video.float() - b.video.float()).abs().max().item(), 5)
                                           for a, b in zip(outputs, reference)],
            rel_latent_err_per_block=[round(e, 6) for e in errors],
            psnr_db_per_block=psnrs,
            max_rel_latent_err=round(max(errors), 6),
            min_psnr_db=min(finite) if finite else None,
            mean_psnr_db=round(statistics.mean(finite), 2) if finite else None,
            forward_time_vs_off=round(record["forward_ms_median_at_largest_history"]
                                      / reference_record["forward_ms_median_at_largest_history"], 3),
        )
        variants[variant] = record
    config = configs["off"]
    line = {
        "bench": "fp8_quality",
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(config.device) if config.device.startswith("cuda") else "cpu",
        "preset": config.preset,
        "random_weights": config.random_weights,
        "model_dir": None if config.model_dir is None else str(config.model_dir),
        "frame": f"{config.resolved_width}x{config.resolved_height}",
        "sink_frames": config.sink_frames,
        "window_frames": config.window_frames,
        "blocks": args.blocks,
        "seed": args.seed,
        "variants": variants,
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    text = json.dumps(line)
    print(text, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
