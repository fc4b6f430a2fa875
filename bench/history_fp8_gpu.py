"""The FP8 mirror's history load two ways, at Wan 1.3B's standard window (30 layers, 12 heads of 128, 1,560 tokens
a frame, 18 history frames) and the fast one's (9), on CUDA: the gather path (every frame copied from the pool
into the bf16 buffer, the keys rotated in place, the per-head quantizer over the buffer) and
engine/models/history_fp8.py's two passes straight from the pool. Each through ``ContextKV.load`` on the same
pool, block ids and rotary tables, CUDA graphs off (both are one graph in the engine; the gather's copies are
not).

Per window: ms a load (CUDA events, median of ``--reps`` after two warm-ups; the owner changes every call so
every call loads), the mirrors byte for byte equal, and the saving a block would see (one load a block a
branch). Prints one JSON line.

    python3 bench/history_fp8_gpu.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

sys.path.insert(0, ".")

from engine.models import history_fp8  # noqa: E402
from engine.models.context_kv import HISTORY, ContextKV  # noqa: E402
from engine.models.kernels import Kernels  # noqa: E402
from engine.models.rope import FrameRotaryEmbedding  # noqa: E402

LAYERS, HEADS, HEAD_DIM, ROWS, COLS = 30, 12, 128, 30, 52


def time_loads(workspace: ContextKV, pool, ids, cos, sin, rotate, reps: int) -> float:
    times = []
    for rep in range(reps + 2):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        workspace.load(("bench", rep), pool, ids, cos, sin, rotate)
        end.record()
        torch.cuda.synchronize()
        if rep >= 2:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    device = torch.device("cuda")
    frame = ROWS * COLS
    rotate = Kernels.make(True, exact=False).rotate_pairs  # the engine's rotation on CUDA
    default = history_fp8.DIRECT_LOAD
    record = {"bench": "history_fp8", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "windows": {}}
    for name, history_frames in (("standard", 18), ("fast", 9)):
        blocks = history_frames + 6
        generator = torch.Generator(device=device).manual_seed(0)
        pool = torch.randn(LAYERS, 2, blocks, frame, HEADS, HEAD_DIM, device=device, generator=generator,
                           dtype=torch.bfloat16)
        ids = list(torch.randperm(blocks, generator=torch.Generator().manual_seed(1))[:history_frames].tolist())
        cos, sin = FrameRotaryEmbedding(HEAD_DIM, ROWS, COLS, history_frames + 3).for_frames(history_frames + 3,
                                                                                             device)
        entry = {}
        mirrors = {}
        for path, direct in (("gather", False), ("direct", True)):
            history_fp8.DIRECT_LOAD = direct
            workspace = ContextKV(num_layers=LAYERS, max_tokens=(history_frames + 3) * frame, num_heads=HEADS,
                                  head_dim=HEAD_DIM, tokens_per_frame=frame, dtype=torch.bfloat16, device=device,
                                  fp8_attention=True)
            entry[f"{path}_ms"] = time_loads(workspace, pool, ids, cos, sin, rotate, args.reps)
            tokens = history_frames * frame
            mirrors[path] = (workspace.fp8.k[:, :tokens].view(torch.uint8).clone(),
                             workspace.fp8.v[..., :tokens].view(torch.uint8).clone(),
                             workspace.fp8.scales[:, :, HISTORY].clone())
            del workspace
            torch.cuda.empty_cache()
        history_fp8.DIRECT_LOAD = default
        entry["mirror_equal"] = all(torch.equal(a, b) for a, b in zip(mirrors["gather"], mirrors["direct"]))
        entry["saving_ms_per_block"] = entry["gather_ms"] - entry["direct_ms"]
        record["windows"][name] = entry
        del pool, mirrors
        torch.cuda.empty_cache()
    print(json.dumps(record))


if __name__ == "__main__":
    main()
