"""Score clip continuation (the seam after a world clip) on the installed tiny weights, on the CPU.

    python -m train.seam [--install CKPT] [--tests]

``--install CKPT``: first copy a checkpoint's module files (the ``.train-ckpt`` layout train.run writes) into
``engine/models/weights/tiny`` with ``python -m train.export`` (files it lacks keep the installed ones: a
``--only dit`` round brings transformer, audio_tokens and text_encoder). The tests and the engine load only
that directory, so do this in a worktree whose weights may change; ``git checkout -- engine/models/weights/tiny``
restores the committed ones.

Then, for 8 plain-background clips of 6 latent frames (21 frames; the first two are
tests/test_image_to_video.py's cases), each committed as a session's opening context through the runner and
continued for 3 blocks, as that test does: the jump from the clip's last frame to the first generated one (mean
absolute difference, levels) against the largest frame-to-frame jump inside the generated stream (the test's
bound: ratio <= 1.25), the background colour's shift at the seam (world.measure, levels, largest channel), and
the object's centroid at the seam against the stream's largest step and a fresh session's distance.
``--tests``: then ``pytest tests/test_image_to_video.py tests/test_tiny_model.py`` on the same weights
(a seam case that now passes shows as XPASS(strict), i.e. a failure: its xfail mark is then out of date).

Session 8's and 9's weights on these 8 clips (2026-12-02): docs/TINY_MODEL.md ("Pictures and video in").
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import numpy as np
import torch

from world import measure
from world.grammar import Scene

SEAM_FACTOR = 1.25  # tests/test_image_to_video.py
CLIPS = (
    (Scene("circle", "green", "bouncing", "blue"), 21),  # the test's first case (an xfail on session 8's weights)
    (Scene("square", "red", "orbiting", "purple"), 22),  # the test's second case
    (Scene("triangle", "yellow", "drifting", "black"), 23),
    (Scene("circle", "white", "orbiting", "grey"), 24),
    (Scene("square", "blue", "bouncing", "green"), 25),
    (Scene("triangle", "white", "drifting", "red"), 26),
    (Scene("circle", "red", "bouncing", "blue"), 27),
    (Scene("square", "yellow", "drifting", "purple"), 28),
)


def seam_rows(runner) -> list[dict]:
    from tests.input_helpers import centroid, mean_abs_step, run_session, scene_frames

    rows = []
    for scene, seed in CLIPS:
        clip = scene_frames(scene, seed, 6)
        chunks = run_session(runner, "clip", scene.caption, blocks=3, context=clip, seed=seed)
        last, generated = chunks[0][0], np.concatenate(chunks[1:])
        steps = [mean_abs_step(a, b) for a, b in zip(generated[:-1], generated[1:])]
        seam = mean_abs_step(last, generated[0])
        background = np.abs(np.subtract(measure.read_frame(generated[0]).background_rgb,
                                        measure.read_frame(last).background_rgb)).max() * 255
        positions = [centroid(frame) for frame in generated]
        moves = [np.linalg.norm(b - a) for a, b in zip(positions[:-1], positions[1:]) if a is not None and b is not None]
        at_seam = (np.linalg.norm(positions[0] - centroid(last))
                   if positions[0] is not None and centroid(last) is not None else float("nan"))
        fresh = run_session(runner, "fresh", scene.caption, blocks=1, seed=seed)[0]
        fresh_at = centroid(fresh[0])
        away = float(np.linalg.norm(fresh_at - centroid(last))) if fresh_at is not None else float("nan")
        rows.append({"clip": f"{scene.caption} (seed {seed})", "seam": seam, "inside": max(steps), "ratio": seam / max(steps),
                     "background": float(background), "centroid": float(at_seam), "move": max(moves) if moves else float("nan"),
                     "fresh": away})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--install", metavar="CKPT", help="copy this checkpoint into engine/models/weights/tiny first")
    parser.add_argument("--tests", action="store_true", help="then run tests/test_image_to_video.py and tests/test_tiny_model.py")
    args = parser.parse_args(argv)
    if args.install:
        from train import export

        export.main([args.install])
    torch.set_num_threads(1)
    from engine.kv_cache import KVCacheManager
    from engine.runner import runner_for
    from train import checks

    started = time.monotonic()
    bundle = checks.build()
    runner = runner_for(bundle, KVCacheManager(bundle.pipeline.kv_spec(), 2, "cpu"))
    rows = seam_rows(runner)
    print(f"\nClip continuation, 6 latent frames of context, 3 blocks ({time.monotonic() - started:.0f} s)\n"
          "| clip | seam levels | largest step inside | ratio (<= 1.25) | background shift at the seam, levels | "
          "centroid at the seam px | largest move px | fresh session px |\n| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['clip']} | {r['seam']:.1f} | {r['inside']:.1f} | {r['ratio']:.2f} | {r['background']:.0f} | "
              f"{r['centroid']:.0f} | {r['move']:.0f} | {r['fresh']:.0f} |")
    ratios = [r["ratio"] for r in rows]
    print(f"ratio {min(ratios):.2f}-{max(ratios):.2f} (median {np.median(ratios):.2f}); within {SEAM_FACTOR}: "
          f"{sum(x <= SEAM_FACTOR for x in ratios)} of {len(ratios)}", flush=True)
    if not args.tests:
        return 0
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-rxXf", "-p", "no:cacheprovider",
                            "tests/test_image_to_video.py", "tests/test_tiny_model.py"])


if __name__ == "__main__":
    sys.exit(main())
