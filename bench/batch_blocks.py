"""Several sessions' blocks in one forward a step (``CausalWanPipeline.run_blocks``) against one session at a
time (``run_block``, the engine's path until now and the reference): ms of device time per session and block, and
how far each session's latents moved (issue 31: three paced viewers of the fast window need <= 227 ms a block).

Prints ONE JSON line. Two sets of ``--sessions`` sessions with the same seeds and prompts: one set runs its blocks
one session after another, the other in one batch; every round's clean latents are compared session by session
(relative error), after ``--warmup`` rounds that fill the window and capture every graph.

    python bench/batch_blocks.py --device cuda --dtype bfloat16 --preset wan2.1-1.3b --fp8 all \
        --window-frames 6 --cuda-graphs                                   # the fast window
    python bench/batch_blocks.py --rounds 2 --warmup 1                    # a CPU smoke run (tiny preset)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.bundle import build_models
from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager

PROMPTS = ("a red circle bouncing on a blue background", "a kite over dunes", "a boat on a lake at dawn",
           "a city street at night")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--fp8", default="off")
    parser.add_argument("--window-frames", type=int, default=None)
    parser.add_argument("--cuda-graphs", action="store_true")
    parser.add_argument("--sessions", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args()

    settings = dict(preset=args.preset, device=args.device, dtype=args.dtype, random_weights=True,
                    cuda_graphs=args.cuda_graphs, fp8=args.fp8)
    if args.window_frames is not None:
        settings["window_frames"] = args.window_frames
    bundle = build_models(EngineConfig(**settings))
    serial = bundle.pipeline
    batched = serial.variant(gather_history_once=True, cuda_graphs=args.cuda_graphs, batch_slots=args.sessions)
    cuda = args.device.startswith("cuda")

    def sessions(pipeline):
        manager = KVCacheManager(pipeline.kv_spec(), args.sessions, args.device)
        return [(manager.open_session(f"s{i}"), pipeline.new_progress(seed=i, prompt=PROMPTS[i % len(PROMPTS)]))
                for i in range(args.sessions)]

    alone, together = sessions(serial), sessions(batched)

    def timed(run):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = run()
        if cuda:
            torch.cuda.synchronize()
        return out, (time.perf_counter() - start) * 1000

    serial_ms, batched_ms, errors = [], [], []
    for index in range(args.warmup + args.rounds):
        expected, one_ms = timed(lambda: [serial.run_block(*member) for member in alone])
        made, all_ms = timed(lambda: batched.run_blocks(together))
        errors.append(max(float((a.video.float() - b.video.float()).norm() / b.video.float().norm())
                          for a, b in zip(made, expected)))
        if index >= args.warmup:
            serial_ms.append(one_ms / args.sessions)
            batched_ms.append(all_ms / args.sessions)
    serial_block = statistics.median(serial_ms)
    batched_block = statistics.median(batched_ms)
    print(json.dumps({
        "bench": "batch_blocks", "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__, "preset": args.preset, "dtype": args.dtype, "fp8": args.fp8,
        "window_frames": serial.window_frames, "cuda_graphs": args.cuda_graphs, "sessions": args.sessions,
        "rounds": args.rounds,
        "serial_ms_per_session_block": round(serial_block, 2),
        "batched_ms_per_session_block": round(batched_block, 2),
        "saving_ms_per_session_block": round(serial_block - batched_block, 2),
        "serial_ms_all": [round(ms, 2) for ms in serial_ms], "batched_ms_all": [round(ms, 2) for ms in batched_ms],
        "max_rel_latent_err": max(errors), "rel_latent_err_by_round": [round(e, 6) for e in errors],
        "graphs": batched.forwards.num_graphs, "replays": batched.forwards.replays,
    }))


if __name__ == "__main__":
    main()
