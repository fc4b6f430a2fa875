"""Measure the shipped tiny weights on the checks of tests/test_tiny_model.py and print a markdown table.

    python -m train.score [--long]      (--long adds the 2,000-frame session, ~2 min on the 2-core CPU)
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch

from train import checks
from world.grammar import SHAPES, Scene


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--long", action="store_true")
    parser.add_argument("--random-weights", action="store_true", help="score the seeded random model instead")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    bundle = checks.build(random_weights=args.random_weights)
    rows = []

    for colour in ("red", "green"):
        prompt = Scene("circle", colour, "bouncing", "blue").caption
        s = checks.colour_scores(checks.stream(bundle, prompt, 0, checks.chunks_for(bundle, 57)).video[:48], prompt)
        rows.append((f"colour: {prompt} (first 3 s)", f"fg {s['foreground_colour']:.2f}, bg {s['background_colour']:.2f}", ">= 0.80 each"))

    shares = []
    for shape in SHAPES:
        per_shape = []
        for colour in ("red", "yellow", "white"):
            for seed in (0, 1):
                prompt = Scene(shape, colour, "drifting", "black").caption
                per_shape.append(checks.shape_score(checks.stream(bundle, prompt, seed, checks.chunks_for(bundle, 21)).video, shape))
        shares.append(min(per_shape))
        rows.append((f"shape: {shape} x 3 colours x 2 seeds", f"min {min(per_shape):.2f}, mean {np.mean(per_shape):.2f}", ">= 0.80 each"))

    for motion in ("bouncing", "drifting", "orbiting", "still"):
        s = checks.motion_scores(checks.stream(bundle, Scene("square", "white", motion, "black").caption, 0,
                                                   checks.chunks_for(bundle, 57)).frames)
        rows.append((
            f"motion: white square {motion}",
            f"{s['speed_px_s']:.1f} px/s, strays {s['max_offset_px']:.1f} px from its mean position; "
            f"jump at chunk edge {s['max_step_boundary_px']:.1f} vs in-chunk {s['max_step_inside_px']:.1f} px; tracked {s['tracked_frames']:.2f}",
            "strays <= 3 px" if motion == "still" else ">= 10 px/s, edge <= 2 x in-chunk",
        ))

    old, new = Scene("circle", "red", "drifting", "black").caption, Scene("circle", "green", "drifting", "black").caption
    switched = checks.stream(bundle, old, 0, 6, switch=(3, new))
    s = checks.colour_scores(switched.frames[4], new)
    rows.append(("prompt change red -> green: 2nd chunk after", f"green in {s['foreground_colour']:.2f} of frames", ">= 0.80"))

    for shape in SHAPES:
        s = checks.audio_score(checks.stream(bundle, Scene(shape, "white", "bouncing", "blue").caption, 0,
                                                 checks.chunks_for(bundle, 33)).mono, shape)
        rows.append((f"audio: {shape} ({s['tone_hz']:.0f} Hz)", f"median {s['median_hz']:.0f} Hz ({100 * s['relative_error']:.1f} %)", "within 5 %"))

    if args.long:
        prompt = Scene("circle", "yellow", "orbiting", "blue").caption
        started = time.perf_counter()
        blocks = checks.chunks_for(bundle, 2000)
        long = checks.stream(bundle, prompt, 0, blocks, decode_from=blocks - 2)
        seconds = time.perf_counter() - started
        s = checks.colour_scores(long.frames[-1], prompt)
        rows.append((
            f"long session: 2,000+ frames ({seconds:.0f} s here)",
            f"object in {s['object_present']:.2f}, yellow in {s['foreground_colour']:.2f} of the last chunk",
            ">= 0.80 each",
        ))

    print("| check | measured | needed |\n| --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
