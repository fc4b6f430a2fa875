"""The FFN's GELU quantizer three ways, at Wan 1.3B's shape (4,680 tokens x 8,960), on CUDA: eager (the
reference: ``F.gelu`` then ``quantize_rows``), compiled (what ``--fp8 linear`` runs: Inductor's two-pass row
reduction, ``_quantizer(8960, "gelu_rows")``) and the one-pass Triton kernel (engine/models/gelu_quantize.py).

Per variant: ms a call (Triton's ``do_bench``, median, L2 flushed between calls),
the GB/s of one bf16 read and one e4m3 write, and, against eager, the largest relative scale difference, the
fraction of equal e4m3 values and whether every value is within one e4m3 step. Also the same at the 1,536-wide
inputs (compiled ``quantize_rows``, the other quantizers of a block) for scale. Prints one JSON line.

    python3 bench/gelu_quantize_gpu.py [--rows 4680] [--reps 100]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, ".")

from bench.fp8_attention_gpu import time_ms  # noqa: E402 - Triton's do_bench, L2 flushed between calls
from engine.models import gelu_quantize as gq  # noqa: E402
from engine.models.fp8_linear import _quantizer, gelu_quantize_rows, quantize_rows  # noqa: E402


def against(result, reference) -> dict:
    (quantized, scale), (expected, expected_scale) = result, reference
    ours, theirs = quantized.float() * scale, expected.float() * expected_scale
    step = torch.maximum(theirs.abs() / 8, expected_scale * 2.0**-9)
    return {
        "scales_rel_max": float(((scale - expected_scale).abs() / expected_scale).max()),
        "values_equal_fraction": float((quantized.float() == expected.float()).float().mean()),
        "within_one_step": bool(((ours - theirs).abs() <= step * 1.0001).all()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4680)
    parser.add_argument("--reps", type=int, default=100, help="do_bench's rep: milliseconds of timed calls")
    args = parser.parse_args()
    generator = torch.Generator(device="cuda").manual_seed(0)
    record = {"bench": "gelu_quantize", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "rows": args.rows}
    # The FFN's first product's output: roughly normal, a few larger channels.
    rows = (torch.randn(args.rows, 8960, device="cuda", generator=generator)
            * (1 + 3 * torch.rand(8960, device="cuda", generator=generator))).bfloat16()
    moved = rows.numel() * 3  # bytes: one bf16 read, one e4m3 write
    reference = gelu_quantize_rows(rows)  # eager: F.gelu, then quantize_rows
    variants = {
        "eager": lambda: gelu_quantize_rows(rows),
        "compiled": lambda: _quantizer(8960, "gelu_rows")(rows),
        "triton_one_pass": lambda: gq.gelu_quantize_rows(rows),
    }
    for name, fn in variants.items():
        try:
            entry = against(fn(), reference)
            entry["ms"] = time_ms(fn, rows.device, rep=args.reps)
            entry["gb_per_s"] = moved / (entry["ms"] * 1e-3) / 1e9
        except Exception as error:  # noqa: BLE001 - a variant's failure is a result
            entry = {"error": f"{type(error).__name__}: {error}"[:500]}
        record[name] = entry
    narrow = torch.randn(args.rows, 1536, device="cuda", generator=generator).bfloat16()
    record["compiled_rows_1536"] = {**against(_quantizer(1536)(narrow), quantize_rows(narrow)),
                                    "ms": time_ms(lambda: _quantizer(1536)(narrow), narrow.device, rep=args.reps)}
    if "ms" in record["compiled"] and "ms" in record["triton_one_pass"]:
        record["one_pass_speedup"] = record["compiled"]["ms"] / record["triton_one_pass"]["ms"]
    print(json.dumps(record))


if __name__ == "__main__":
    main()
