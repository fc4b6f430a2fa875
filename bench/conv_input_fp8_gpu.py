"""The e4m3 decode's residual-block inputs (decoders/conv_input_fp8.py) at the Wan decoder's 832x480 shapes, on
CUDA: the kernel under each launch (rows and warps a program) against the compiled eager path it replaces
(``conv_input_reference`` under ``torch.compile``: what the decode ran before), the bytes against that path's
and the memory floor. Prints one JSON line.

Per stage (channels, frames and size of one latent frame's chunk, the cache of two frames in front): µs a call
(CUDA events, median of ``--reps`` after warm-up), the e4m3 bytes apart from the reference's, the bytes moved
(the chunk read once, the padded e4m3 input and the cache written) and the rate. ``calls_per_latent_frame``
weights them into ms a latent frame; ``best`` names the fastest launch within one e4m3 step of the reference.

    python3 bench/conv_input_fp8_gpu.py                  # every launch of LAUNCHES
    python3 bench/conv_input_fp8_gpu.py --default-only   # each stage's default launch (a before/after)
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

sys.path.insert(0, ".")

from bench.shifted_rows_conv_gpu import timed_ms  # noqa: E402
from decoders import conv_input_fp8 as cif  # noqa: E402
from decoders import shifted_rows_conv as src  # noqa: E402

# (channels, frames, height, width, residual-block convolutions at this shape per latent frame) of the Wan 2.1
# decoder at 832x480: the mid block and up_blocks.0 at the latent size, then the three upsampled stages.
STAGES = ((384, 1, 60, 104, 10), (192, 2, 120, 208, 1), (384, 2, 120, 208, 5), (192, 4, 240, 416, 6),
          (96, 4, 480, 832, 6))
LAUNCHES = tuple((rows, warps) for rows in (2, 4, 8, 16, 32, 64) for warps in (2, 4, 8))


def default_launch(channels: int) -> tuple[int, int]:
    """The module's launch for ``channels``; a tree from before ``default_launch`` (bench/device/
    run_access_widths.sh's baseline) had one launch for every stage."""
    return cif.default_launch(channels) if hasattr(cif, "default_launch") else cif.DEFAULT_LAUNCH


def timed_us(fn, reps: int) -> float:
    return 1000 * timed_ms(fn, torch.device("cuda"), reps)


def stage_run(channels: int, frames: int, height: int, width: int, reps: int, launches) -> dict:
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanResidualBlock

    torch.manual_seed(0)
    block = WanResidualBlock(channels, channels).eval().cuda().to(torch.bfloat16)
    with torch.no_grad():
        block.norm1.gamma.uniform_(0.5, 1.5)
    src.install(torch.nn.Sequential(block), fp8=True)
    generator = torch.Generator(device="cuda").manual_seed(1)
    # Channels-last, as the decoder's convolutions leave their outputs.
    x = (3 * torch.randn(1, frames, height, width, channels, device="cuda", generator=generator)).bfloat16()
    x = x.permute(0, 4, 1, 2, 3)
    cache = torch.randn(1, 2, height, width, channels, device="cuda", generator=generator).bfloat16()
    cache = cache.permute(0, 4, 1, 2, 3)
    compiled = torch.compile(cif.conv_input_reference, dynamic=False)
    want = compiled(block.norm1, block.conv1, x, cache)
    moved = x.numel() * 2 + want[0].numel() + want[1].numel() * 2
    row = {"channels": channels, "frames": frames, "height": height, "width": width, "bytes": moved,
           "compiled_us": round(timed_us(lambda: compiled(block.norm1, block.conv1, x, cache), reps), 1),
           "launches": {}}
    for launch in launches or (default_launch(channels),):
        name = f"rows{launch[0]}_warps{launch[1]}"
        try:
            got = cif.conv_input(block.norm1, block.conv1, x, cache, launch)
            apart = (got[0].view(torch.uint8).int() - want[0].view(torch.uint8).int()).abs()
            us = timed_us(lambda launch=launch: cif.conv_input(block.norm1, block.conv1, x, cache, launch), reps)
            row["launches"][name] = {"us": round(us, 1), "tb_s": round(moved / us / 1e6, 2),
                                     "max_steps": int(apart.max()), "unequal": round(float((apart > 0).float().mean()), 6),
                                     "cache_equal": bool(torch.equal(got[1].permute(0, 2, 3, 4, 1).contiguous(),
                                                                     want[1].permute(0, 2, 3, 4, 1).contiguous()))}
        except Exception as error:  # noqa: BLE001 - the other launches still run
            row["launches"][name] = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
    good = {k: v for k, v in row["launches"].items() if "us" in v and v["max_steps"] <= 1}
    row["best"] = min(good, key=lambda k: good[k]["us"]) if good else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--default-only", action="store_true", help="time each stage's default launch only")
    args = parser.parse_args()
    record = {"bench": "conv_input_fp8", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "values_per_thread": getattr(cif, "VALUES_PER_THREAD", None), "stages": []}
    for channels, frames, height, width, calls in STAGES:
        row = stage_run(channels, frames, height, width, args.reps, () if args.default_only else LAUNCHES)
        row["calls_per_latent_frame"] = calls
        record["stages"].append(row)
        print(f"stage {channels}x{frames}x{height}x{width}: compiled {row['compiled_us']} us, best {row['best']} "
              f"{row['launches'].get(row['best'] or '', {}).get('us')} us", file=sys.stderr, flush=True)
    per_frame = {"compiled": 0.0, "default": 0.0, "best": 0.0}
    for row in record["stages"]:
        calls = row["calls_per_latent_frame"] / 1000
        default = "rows{}_warps{}".format(*default_launch(row["channels"]))
        per_frame["compiled"] += row["compiled_us"] * calls
        per_frame["default"] += row["launches"].get(default, {}).get("us", float("nan")) * calls
        per_frame["best"] += row["launches"].get(row["best"] or "", {}).get("us", float("nan")) * calls
    record["ms_per_latent_frame"] = {k: round(v, 2) for k, v in per_frame.items()}
    print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
