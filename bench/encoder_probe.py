"""What detecting the H.264 encoder costs in a fresh process, candidate by candidate; prints ONE JSON line.

The service detects its encoder by opening each preferred one in turn (`app/media.py`): PyAV lists `h264_nvenc`
on machines without NVENC hardware, and there it fails only when opened. Detection is cached, so its cost falls
once per process: on the first socket after `/readyz` before the service warmed its encoders at start-up
(issue 23: ~0.48 s on an H200 between `session created` and `session started`). This measures it directly:
each candidate's open (and one frame's encode) with its time and error, in a process where CUDA is already
initialised as it is in the server (`--cuda`), then the service's own warm-up at a given size.

    python bench/encoder_probe.py --cuda --width 832 --height 480
    python bench/encoder_probe.py                 # this machine's CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cuda", action="store_true", help="initialise CUDA first, as the server has")
    parser.add_argument("--width", type=int, default=832)
    parser.add_argument("--height", type=int, default=480)
    parser.add_argument("--frames", type=int, default=12)
    args = parser.parse_args()
    result: dict = {"bench": "encoder_probe", "cuda": args.cuda, "size": [args.width, args.height]}
    if args.cuda:
        import torch

        started = time.perf_counter()
        torch.zeros(1, device="cuda")
        torch.cuda.synchronize()
        result["cuda_init_ms"] = round((time.perf_counter() - started) * 1000.0, 1)
        result["device"] = torch.cuda.get_device_name()
    import numpy as np
    from av.video.reformatter import VideoReformatter

    from app import media

    candidates = {}
    for name in media.VIDEO_ENCODER_PREFERENCE:  # each as the detection tries it, uncached
        started = time.perf_counter()
        try:
            context = media._new_video_context(name, *media._PROBE_SIZE, fps=16, global_header=True)
            context.open()
            rgb = np.zeros((media._PROBE_SIZE[1], media._PROBE_SIZE[0], 3), np.uint8)
            packets = context.encode(media._rgb_to_encoder_frame(rgb, 0, VideoReformatter())) + context.encode(None)
            outcome = {"ok": bool(packets)}
        except Exception as error:  # noqa: BLE001 - the point is what each one answers
            outcome = {"ok": False, "error": str(error)[:200]}
        outcome["ms"] = round((time.perf_counter() - started) * 1000.0, 1)
        candidates[name] = outcome
    result["candidates"] = candidates
    started = time.perf_counter()
    result["detected"] = media.open_h264_encoder_name()  # the service's detection, cold in this process
    result["detection_ms"] = round((time.perf_counter() - started) * 1000.0, 1)
    warmup = media.warm_up_encoders(args.width, args.height, 16, args.frames)
    result["warm_up"] = {"video_encoder": warmup.video_encoder, "probe_ms": round(warmup.probe_s * 1000.0, 1),
                         "stream_ms": round(warmup.stream_s * 1000.0, 1)}
    result["cpu_count"] = os.cpu_count()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
