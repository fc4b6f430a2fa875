"""FP8 products with and without fast accumulation, at Wan 1.3B's shapes (issue 31): ms a call and error.

A Wan 1.3B block runs eight FP8 products a forward (``engine.models.fp8_linear.BLOCK_LINEARS``): six of 1,536 ->
1,536 (self-attention q, k, v, out; cross-attention q, out), the FFN's 1,536 -> 8,960 and 8,960 -> 1,536, each
on a block's 4,680 tokens (``--rows``). For each shape, :class:`FP8Linear` (``torch._scaled_mm``, rowwise scales,
bias in the epilogue) with ``fast_accum`` off (partial sums promoted to float32) and on (the tensor cores'
accumulator only): ms a call (CUDA events, median of ``--reps`` after two warm-ups), and the error of each against the float32
product of the same dequantized operands (relative Frobenius, largest difference over the output's largest
value). Then the sum over a forward and over a fast block (5 forwards x 30 layers). Prints ONE JSON line.

    python3 bench/fp8_fast_accum_gpu.py
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, ".")

from engine.models.fp8_linear import FP8Linear  # noqa: E402
from shifted_rows_conv_gpu import timed_ms  # noqa: E402 - bench/, the script's own folder

SHAPES = {"1536x1536": (1536, 1536, 6), "1536x8960": (1536, 8960, 1), "8960x1536": (8960, 1536, 1)}  # K, N, per layer
LAYER_FORWARDS_PER_FAST_BLOCK = 30 * 5


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4680)
    parser.add_argument("--reps", type=int, default=50)
    args = parser.parse_args()
    torch.manual_seed(0)
    record = {"bench": "fp8_fast_accum", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "rows": args.rows, "shapes": {}}
    per_forward = {False: 0.0, True: 0.0}
    for name, (k, n, per_layer) in SHAPES.items():
        linear = torch.nn.Linear(k, n).to("cuda", torch.bfloat16)
        torch.nn.init.normal_(linear.weight, std=k ** -0.5)
        x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
        layers = {fast: FP8Linear.from_linear(linear, fast_accum=fast) for fast in (False, True)}
        quantized, scale = layers[False].quantize_input(x)
        reference = (quantized.float() * scale) @ layers[False].dequantized_weight().t() + linear.bias.float()
        peak = reference.abs().max().item()
        entry = {}
        for fast, layer in layers.items():
            out = layer.forward_quantized(x, quantized, scale).float()
            ms = timed_ms(lambda: layer.forward_quantized(x, quantized, scale), x.device, args.reps)
            per_forward[fast] += per_layer * ms
            entry["fast" if fast else "exact"] = {
                "ms": round(ms, 4),
                "rel_fro_err": (out - reference).norm().item() / reference.norm().item(),
                "max_err_over_peak": (out - reference).abs().max().item() / peak,
            }
        entry["speedup"] = round(entry["exact"]["ms"] / entry["fast"]["ms"], 3)
        record["shapes"][name] = entry
    record["ms_per_layer_forward"] = {("fast" if f else "exact"): round(v, 4) for f, v in per_forward.items()}
    record["ms_per_fast_block"] = {("fast" if f else "exact"): round(v * LAYER_FORWARDS_PER_FAST_BLOCK, 2)
                                   for f, v in per_forward.items()}
    print(json.dumps(record))


if __name__ == "__main__":
    main()
