"""The FP8 attention's q (or k) from its projection, two ways, at Wan 1.3B's shape (4,680 tokens, 12 heads of 128),
on CUDA: the engine's path without the fused kernel ("apart": torch's RMS norm, the compiled rotation, the
per-head amax quantizer's two passes) and engine/models/qk_quantize.py's one pass with the norm-bound scale
(``num_warps`` 2, 4, 8). Then what the static scale costs in accuracy: FP8 attention over the block's own keys
(q, k, v from random projections through the norms and the rotation), against float32 attention, with q and k
scaled per head by their amax and by the bound.

Per variant: ms a call (Triton's ``do_bench``, median, L2 flushed before each), the saving a standard block would
see ((apart - fastest) x 2 (q and k) x 150 layer forwards), and the attention's relative error both ways. Prints
one JSON line.

    python3 bench/qk_quantize_gpu.py
    TRITON_INTERPRET=1 python3 bench/qk_quantize_gpu.py --device cpu --tokens 64    # no GPU: a smoke run
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, ".")

from bench.fp8_attention_gpu import time_ms  # noqa: E402 - Triton's do_bench, L2 flushed between calls
from engine.models import fp8_attention as fa  # noqa: E402
from engine.models import qk_quantize as qq  # noqa: E402
from engine.models.kernels import Kernels  # noqa: E402
from engine.models.rope import FrameRotaryEmbedding  # noqa: E402

LAYER_FORWARDS_PER_BLOCK = 150


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4680)
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = args.device
    if device == "cpu":
        from tests.triton_interpreted import patch_interpreter  # e4m3 / bf16 rounding as the GPU's

        patch_interpreter()
    heads, head_dim, tokens = 12, 128, args.tokens
    generator = torch.Generator().manual_seed(0)
    # A projection's rows: per-channel magnitudes that differ, as a trained model's do; weights around 1.
    x = (torch.randn(1, tokens, heads * head_dim, generator=generator)
         * (0.5 + torch.rand(heads * head_dim, generator=generator))).bfloat16().to(device)
    weight = (1 + 0.3 * torch.randn(heads * head_dim, generator=generator)).bfloat16().to(device)
    cos, sin = FrameRotaryEmbedding(head_dim, 30, 52, 21).for_frames(21, device)
    cos, sin = cos[-tokens:], sin[-tokens:]
    kernels = Kernels.make(True, exact=False)
    scale, inverse = qq.static_scales(weight, heads)
    record = {"bench": "qk_quantize", "device": torch.cuda.get_device_name() if device == "cuda" else device, "torch": torch.__version__,
              "tokens": tokens, "heads": heads, "head_dim": head_dim, "ms": {}}

    def apart():
        rotated = kernels.rms_norm_rotate(x, weight, 1e-6, heads, cos, sin)
        dst = torch.empty(rotated.shape, dtype=fa.FP8_DTYPE, device=device)
        dst_scale = torch.empty(1, heads, device=device)
        fa.quantize_per_head_into(rotated, dst, dst_scale)
        return dst

    record["ms"]["apart"] = time_ms(apart, x.device, rep=args.reps)
    dst = torch.empty(1, tokens, heads, head_dim, dtype=fa.FP8_DTYPE, device=device)
    for warps in (2, 4, 8):
        record["ms"][f"fused_warps{warps}"] = time_ms(
            lambda w=warps: qq.rms_rotate_quantize(x, weight, 1e-6, heads, cos, sin, inverse, dst, num_warps=w),
            x.device, rep=args.reps)
    fused = min(v for k, v in record["ms"].items() if k.startswith("fused"))
    record["predicted_saving_ms_per_standard_block"] = (record["ms"]["apart"] - fused) * 2 * LAYER_FORWARDS_PER_BLOCK
    expected, _ = qq.rms_rotate_quantize_reference(x, weight, 1e-6, heads, cos, sin, inverse)
    qq.rms_rotate_quantize(x, weight, 1e-6, heads, cos, sin, inverse, dst)
    record["values_equal_fraction"] = float((dst.float() == expected.float()).float().mean())

    # Attention over the block's own keys: q and k through the norm and rotation, v a projection's rows.
    k_rows = (torch.randn(1, tokens, heads * head_dim, generator=generator)
              * (0.5 + torch.rand(heads * head_dim, generator=generator))).bfloat16().to(device)
    k_weight = (1 + 0.3 * torch.randn(heads * head_dim, generator=generator)).bfloat16().to(device)
    v = torch.randn(1, tokens, heads, head_dim, generator=generator).bfloat16().to(device)
    q = kernels.rms_norm_rotate(x, weight, 1e-6, heads, cos, sin)
    k = kernels.rms_norm_rotate(k_rows, k_weight, 1e-6, heads, cos, sin)
    reference = torch.nn.functional.scaled_dot_product_attention(
        q.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2)).transpose(1, 2)
    v_fp8, v_scale = fa.quantize_per_head(v, transpose=True)

    def error(out):
        return float((out.float() - reference).norm() / reference.norm())

    q_fp8, q_scale = fa.quantize_per_head(q)
    k_fp8, k_scale = fa.quantize_per_head(k)
    record["attention_rel_err_amax_scales"] = error(fa.fp8_attention_quantized(q_fp8, q_scale, k_fp8, k_scale, v_fp8, v_scale))
    k_static, k_inverse = qq.static_scales(k_weight, heads)
    qs = torch.empty_like(q_fp8)
    ks = torch.empty_like(k_fp8)
    qq.rms_rotate_quantize(x, weight, 1e-6, heads, cos, sin, inverse, qs)
    qq.rms_rotate_quantize(k_rows, k_weight, 1e-6, heads, cos, sin, k_inverse, ks)
    record["attention_rel_err_static_scales"] = error(
        fa.fp8_attention_quantized(qs, scale.view(1, heads), ks, k_static.view(1, heads), v_fp8, v_scale))
    record["attention_rel_err_bf16"] = error(torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2))
    record["largest_static_e4m3"] = float(qs.float().abs().max())
    print(json.dumps(record))


if __name__ == "__main__":
    main()
