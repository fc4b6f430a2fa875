"""A Wan block's three layer norms with their FP8 products' quantization, two ways, at Wan 1.3B's shape (4,680
tokens x 1,536, three frames), on CUDA: the engine's path without the fused kernel ("apart": the residual,
torch's row statistics, the compiled normalize/modulate, the compiled row quantizer) and
engine/models/norm_quantize.py's one-pass kernel under each launch configuration of ``CONFIGS`` (rows a program,
warps, divided or multiplied by the row's inverse scale).

Per norm (norm1: modulated; norm2: the gated residual, then affine; norm3: the residual, then modulated) and
variant: ms a call of the whole chain (Triton's ``do_bench``, median, L2 flushed before each chain), and against
the eager reference (:func:`norm_quantize_reference`): the hidden states bit for bit, the largest relative scale
difference, the fraction of equal e4m3 values, every value within one e4m3 step. Then the saving a standard
block would see: (apart - kernel) summed over the three norms, times 150 (30 layers x 5 forwards), for the
configuration fastest over the three (``best_config``, what the device script installs). Prints one JSON line.

    python3 bench/norm_quantize_gpu.py [--rows 4680] [--reps 100]
    TRITON_INTERPRET=1 python3 bench/norm_quantize_gpu.py --device cpu --rows 30 --width 96   # no GPU: a smoke run
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, ".")

from bench.fp8_attention_gpu import time_ms  # noqa: E402 - Triton's do_bench, L2 flushed between calls
from engine.models import norm_quantize as nq  # noqa: E402
from engine.models.fp8_linear import QuantizedRows, _quantizer  # noqa: E402
from engine.models.kernels import Kernels  # noqa: E402

CONFIGS = [nq.NormQuantizeConfig(rows, warps, divide) for rows in (1, 2, 4) for warps in (2, 4, 8)
           for divide in (True, False)]

LAYER_FORWARDS_PER_BLOCK = 150  # 30 layers x (4 denoising steps + the commit pass), the standard window


def compare(result: tuple[torch.Tensor, QuantizedRows], reference: tuple[torch.Tensor, QuantizedRows]) -> dict:
    """Hidden states and quantized rows against the reference's (tests/test_norm_quantize.py's bounds)."""
    (hidden, rows), (expected_hidden, expected) = result, reference
    ours, theirs = rows.values.float() * rows.scale, expected.values.float() * expected.scale
    step = torch.maximum(theirs.abs() / 8, expected.scale * 2.0**-9)
    scale_rel = (rows.scale - expected.scale).abs() / expected.scale
    return {
        "hidden_equal": bool(torch.equal(hidden, expected_hidden)),
        "shape": list(rows.shape), "dtype": str(rows.values.dtype), "scale_shape": list(rows.scale.shape),
        "scales_rel_max": float(scale_rel.max()), "scales_equal_fraction": float((scale_rel == 0).float().mean()),
        "values_equal_fraction": float((rows.values.float() == expected.values.float()).float().mean()),
        "within_one_step": bool(((ours - theirs).abs() <= step * 1.0001).all()),
    }


def operands(kind: str, x: torch.Tensor, frames: int, generator: torch.Generator) -> dict:
    width = x.shape[-1]
    mod = torch.randn(1, frames, 6, width, device=x.device, generator=generator) * 0.5
    shift, scale, gate = (mod[:, :, i].unsqueeze(2) for i in range(3))  # views of one table, as the block's
    update = torch.randn(x.shape, device=x.device, generator=generator).bfloat16()
    if kind == "norm1":
        return dict(scale=scale, shift=shift)
    if kind == "norm2":
        return dict(update=update, gate=gate, weight=1 + 0.2 * torch.randn(width, device=x.device, generator=generator),
                    bias=0.1 * torch.randn(width, device=x.device, generator=generator))
    return dict(update=update, scale=scale, shift=shift)


def apart(kernels: Kernels, kind: str, x: torch.Tensor, eps: float, ops: dict):
    """What causal_wan._run_block computes for the norm on CUDA without the kernel, and the products' quantizer."""
    if kind == "norm1":
        hidden, normed = x, kernels.modulated_layer_norm(x, ops["scale"], ops["shift"], eps)
    elif kind == "norm2":
        hidden = kernels.gated_residual(x, ops["update"], ops["gate"])
        normed = kernels.affine_layer_norm(hidden, ops["weight"], ops["bias"], eps)
    else:
        hidden, normed = kernels.residual_modulated_layer_norm(x, ops["update"], ops["scale"], ops["shift"], eps)
    values, scale = _quantizer(x.shape[-1])(normed.reshape(-1, x.shape[-1]))
    return hidden, QuantizedRows(values, scale, x.shape, x.dtype)


def _name(config: nq.NormQuantizeConfig) -> str:
    """``rows2_warps4_divide``: also what the device script writes back as the engine's DEFAULT_CONFIG."""
    return f"rows{config.rows_per_program}_warps{config.num_warps}_{'divide' if config.divide else 'multiply'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4680)
    parser.add_argument("--frames", type=int, default=3)
    parser.add_argument("--width", type=int, default=1536)
    parser.add_argument("--reps", type=int, default=100, help="do_bench's rep: milliseconds of timed calls")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.device == "cpu":
        from tests.triton_interpreted import patch_interpreter  # e4m3 / bf16 rounding as the GPU's

        patch_interpreter()
    generator = torch.Generator(device=args.device).manual_seed(0)
    kernels = Kernels.make(True, exact=False)  # the FP8 modes' set, as the engine builds it on CUDA
    eps = 1e-6
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    record = {"bench": "norm_quantize", "device": device, "torch": torch.__version__,
              "rows": args.rows, "width": args.width, "per_norm": {}}
    for kind in ("norm1", "norm2", "norm3"):
        x = (3 * torch.randn(1, args.rows, args.width, device=args.device, generator=generator)).bfloat16()
        ops = operands(kind, x, args.frames, generator)
        reference = nq.norm_quantize_reference(x, eps, **ops)
        variants = {"apart": lambda: apart(kernels, kind, x, eps, ops)}
        for config in CONFIGS:
            variants[_name(config)] = lambda c=config: nq.norm_quantize(x, eps, **ops, config=c)
        entry = {}
        for name, fn in variants.items():
            try:
                entry[name] = {**compare(fn(), reference), "ms": time_ms(fn, x.device, rep=args.reps)}
            except Exception as error:  # noqa: BLE001 - a variant's failure is a result
                entry[name] = {"error": f"{type(error).__name__}: {error}"[:500]}
        record["per_norm"][kind] = entry
    # One configuration for all three norms: the fastest in sum among those that ran within the tests' bounds.
    sums = {}
    for config in CONFIGS:
        entries = [record["per_norm"][kind].get(_name(config), {}) for kind in record["per_norm"]]
        if all("ms" in e and e["hidden_equal"] and e["within_one_step"] for e in entries):
            sums[_name(config)] = sum(e["ms"] for e in entries)
    apart_ms = [record["per_norm"][kind]["apart"].get("ms") for kind in record["per_norm"]]
    if sums and None not in apart_ms:
        best = min(sums, key=sums.get)
        record["best_config"] = best
        record["best_config_ms"] = sums[best]
        record["apart_ms"] = sum(apart_ms)
        record["predicted_saving_ms_per_standard_block"] = (sum(apart_ms) - sums[best]) * LAYER_FORWARDS_PER_BLOCK
    print(json.dumps(record))


if __name__ == "__main__":
    main()
