"""The DiT's fused elementwise kernels at the engine's shapes, alone (GPU): time per call, and exactness.

The clean profile of a standard block showed the rotation kernel at ~84 us per call where memory bandwidth
allows ~10: this times the eager rotation, the compiled one the engine runs, and two other formulations of
the same arithmetic (bit-identical by construction: the same products and sums, negation and order of
addends aside), plus the compiled modulation. One JSON line.

    python3 bench/elementwise_gpu.py
"""

from __future__ import annotations

import json
import sys

import torch

sys.path.insert(0, ".")

from engine.models import kernels  # noqa: E402


def rotate_swapped(x, cos, sin):
    """``x * [cos, cos] + swap_pairs(x) * [-sin, sin]``: the rotation without a stack of two results."""
    xf = x.float()
    swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    cos2 = torch.stack((cos, cos), -1).flatten(-2)
    sin2 = torch.stack((-sin, sin), -1).flatten(-2)
    return (xf * cos2 + swapped * sin2).to(x.dtype)


def rotate_tables(x, cos2, sin2):
    """As :func:`rotate_swapped` with the interleaved tables built beforehand."""
    xf = x.float()
    swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)
    return (xf * cos2 + swapped * sin2).to(x.dtype)


def time_us(fn, *args, repeats: int = 50) -> float:
    for _ in range(3):
        fn(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(repeats):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / repeats * 1000, 1)


def main() -> None:
    device, heads, dim, tokens = "cuda", 12, 128, 1560
    generator = torch.Generator(device=device).manual_seed(0)
    variants = {
        "compiled (engine)": kernels.compile_kernel(kernels.rotate_pairs),
        "compiled swapped": kernels.compile_kernel(rotate_swapped),
        "compiled tables": kernels.compile_kernel(rotate_tables),
    }
    record = {"bench": "elementwise_gpu", "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    shapes = {"q [1, 4680, H, D]": (1, 3 * tokens), "k [4680, H, D]": (None, 3 * tokens),
              "history k [28080, H, D]": (None, 18 * tokens), "k [9360, H, D]": (None, 6 * tokens)}
    for label, (batch, seq) in shapes.items():
        shape = (seq, heads, dim) if batch is None else (batch, seq, heads, dim)
        x = torch.randn(shape, device=device, generator=generator).bfloat16()
        angles = torch.randn(seq, 1, dim // 2, device=device, generator=generator)
        cos, sin = angles.cos(), angles.sin()
        cos2, sin2 = torch.stack((cos, cos), -1).flatten(-2), torch.stack((-sin, sin), -1).flatten(-2)
        reference = kernels.rotate_pairs(x, cos, sin)
        row = {"bytes_moved_mb": round(2 * x.nbytes / 1e6, 1), "eager_us": time_us(kernels.rotate_pairs, x, cos, sin)}
        for name, fn in variants.items():
            args = (x, cos2, sin2) if name.endswith("tables") else (x, cos, sin)
            try:
                out = fn(*args)
                row[name] = {"us": time_us(fn, *args), "bit_identical": bool(torch.equal(out, reference))}
            except Exception as error:
                row[name] = {"error": repr(error)[:200]}
        record[label] = row
        print(json.dumps({label: row}), file=sys.stderr, flush=True)
    normed = torch.randn(1, 3, tokens, heads * dim, device=device, generator=generator)
    scale, shift = (0.1 * torch.randn(2, 1, 3, 1, heads * dim, device=device, generator=generator)).unbind(0)
    fused = kernels.compile_kernel(kernels.modulate_frames)
    record["modulate_frames [1, 3, 1560, 1536] f32 -> bf16"] = {
        "eager_us": time_us(kernels.modulate_frames, normed, scale, shift, torch.bfloat16),
        "compiled_us": time_us(fused, normed, scale, shift, torch.bfloat16),
        "bytes_moved_mb": round((normed.nbytes + normed.nbytes // 2) / 1e6, 1),
        "copy_us_same_bytes": time_us(lambda a: a.to(torch.bfloat16), normed),
    }
    print(json.dumps(record))


if __name__ == "__main__":
    main()
