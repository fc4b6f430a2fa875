"""Which float32 arithmetic torch's affine layer norm does on CUDA: norm2 finished from its statistics (GPU).

The engine finishes norm2 (``FP32LayerNorm`` with weights) from torch's row statistics of the bf16 rows. To be
bit-identical to the eager path, the last step must round as torch's kernel does: ``w * n + b`` with one
rounding (a fused multiply-add, nvcc's default) or two. This counts, on Wan 1.3B's norm2 shape, the bf16
outputs that differ from ``F.layer_norm(x.float(), w, b).to(bf16)`` for the engine's norm2
(``engine/models/affine_norm.py``: one rounding, ``fma``) and for the compiled ``normalize_affine`` (Inductor:
the product rounded before the sum). Prints one JSON line.

    python3 bench/affine_norm_gpu.py
"""

from __future__ import annotations

import json
import sys

import torch

sys.path.insert(0, ".")

from engine.models import kernels  # noqa: E402


def main() -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    record = {"bench": "affine_norm", "device": torch.cuda.get_device_name()}
    for rows in (4680, 1560):
        x = (3 * torch.randn(1, rows, 1536, device="cuda", generator=generator) + 0.5).bfloat16()
        weight = (1 + 0.2 * torch.randn(1536, device="cuda", generator=generator)).bfloat16()
        bias = (0.2 * torch.randn(1536, device="cuda", generator=generator)).bfloat16()
        expected = kernels.affine_layer_norm(x, weight, bias, 1e-6)
        mean, rstd = kernels.layer_norm_stats(x, 1e-6)
        variants = {
            "engine_fma": lambda: kernels.Kernels.make(True).affine_layer_norm(x, weight, bias, 1e-6),
            "inductor_two_roundings": lambda: kernels._FUSED_NORMALIZE_AFFINE(x, mean, rstd, weight, bias),
        }
        result = {"elements": x.numel()}
        for name, fn in variants.items():
            try:
                result[name] = int((fn() != expected).sum())
            except Exception as error:  # noqa: BLE001 - a variant's failure is a result
                result[name] = f"{type(error).__name__}: {error}"[:300]
        record[str(rows)] = result
    print(json.dumps(record))


if __name__ == "__main__":
    main()
