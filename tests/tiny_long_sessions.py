"""The shipped tiny model's long sessions, measured in a subprocess the test session starts early.

    python -m tests.tiny_long_sessions OUT.json

Each is a session of hundreds of blocks through the engine's model path (train.checks.stream) whose scores do
not depend on time, so tests/test_tiny_model.py runs them as a background job (tests/background.py): on the
core the one-thread tests leave idle, instead of ~45 s of the suite's own time. The test module asserts on what
this writes; the thresholds stay there.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

from train import checks
from world.grammar import Scene
from world.measure import colour_name

LONG_FRAMES = 2000
FAST_FRAMES = 285  # 18 s: far past the attention window
OPENING_FRAMES = 33


def long_session(bundle) -> dict:
    """The 2,000-frame session of an orbiting circle: what its last chunk shows."""
    prompt = Scene("circle", "yellow", "orbiting", "blue").caption
    chunks = checks.chunks_for(bundle, LONG_FRAMES)
    result = checks.stream(bundle, prompt, 0, chunks, decode_from=chunks - 2)  # the model runs every block
    return {"prompt": prompt, "chunks": chunks, **checks.colour_scores(result.frames[-1], prompt)}


def fast_object(bundle) -> dict:
    """The demo's example, a fast bouncing circle: its opening area and, 18 s in, its area and colour."""
    prompt = Scene("circle", "red", "bouncing", "blue").caption
    opening = checks.readings(np.concatenate(checks.stream(bundle, prompt, 0, checks.chunks_for(bundle, OPENING_FRAMES)).frames[1:]))
    chunks = checks.chunks_for(bundle, FAST_FRAMES)
    late = checks.readings(checks.stream(bundle, prompt, 0, chunks, decode_from=chunks - 2).frames[-1])
    return {
        "prompt": prompt,
        "opening_area": float(np.median([r.foreground_pixels for r in opening])),
        "late_area": float(np.median([r.foreground_pixels for r in late])),
        "late_colour": float(np.mean([colour_name(r) == "red" for r in late])),
    }


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # the idle core; the tests' own process has the other
    bundle = checks.build()
    results = {"long_session": long_session(bundle), "fast_object": fast_object(bundle)}
    with open(argv[0], "w") as out:
        json.dump(results, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
