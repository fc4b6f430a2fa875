"""The shipped tiny model's content checks that only stream and read back, run in a subprocess the test session
starts early.

    python -m tests.tiny_sessions OUT.json

Each is a session (or a few) through the engine's model path (train.checks.stream) whose scores do not depend on
time: the first seconds of the checks' prompts, the 2,000-frame session, the fast object at 40 s. So
tests/test_tiny_model.py runs them as a background job (tests/background.py), on the core the one-thread tests
leave idle, instead of ~80 s of the suite's own time; it asserts on what this writes, and the thresholds stay
there.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

from train import checks
from world.grammar import SHAPES, Scene
from world.measure import colour_name

FRAMES_3S = 48
FRAMES_CHECKED = 57  # what the content checks read: 3 s and more (9 + 4 * 12 with blocks of 3 latent frames)
SHAPE_FRAMES = 21
LONG_FRAMES = 2000
FAST_FRAMES = 645  # 40 s: far past the attention window (the shipped weights until session 20 lost the object at 8-10 s)
OPENING_FRAMES = 33
# None of the other checks' prompts: every object colour, every background, every texture at least once.
OTHER_CAPTIONS = (
    "a yellow triangle drifting on a red checkered background",
    "a blue circle orbiting on a green striped background",
    "a white triangle still on a purple background",
    "a red square bouncing on a grey striped background",
    "a green circle drifting on a black checkered background",
)


def _stream(bundle, prompt: str, seed: int = 0, frames: int = FRAMES_CHECKED, **kw):
    return checks.stream(bundle, prompt, seed, checks.chunks_for(bundle, frames), **kw)


def colours(bundle) -> dict:
    """The first 3 s of a bouncing circle, red and green, on blue."""
    out = {}
    for colour in ("red", "green"):
        prompt = Scene("circle", colour, "bouncing", "blue").caption
        out[prompt] = checks.colour_scores(_stream(bundle, prompt).video[:FRAMES_3S], prompt)
    return out


def shapes(bundle) -> list[dict]:
    """Every shape in three colours and two seeds, drifting on black: the share of frames read as the shape."""
    out = []
    for shape in SHAPES:
        for colour in ("red", "yellow", "white"):
            for seed in (0, 1):
                prompt = Scene(shape, colour, "drifting", "black").caption
                share = checks.shape_score(_stream(bundle, prompt, seed, SHAPE_FRAMES).video, shape)
                out.append({"prompt": prompt, "seed": seed, "shape": shape, "share": share})
    return out


def motions(bundle) -> dict:
    """A white square on black under every motion word: speed, how far it strays, chunk-edge jumps."""
    return {motion: checks.motion_scores(_stream(bundle, Scene("square", "white", motion, "black").caption).frames)
            for motion in ("bouncing", "drifting", "orbiting", "still")}


def other_captions(bundle) -> dict:
    return {prompt: checks.colour_scores(_stream(bundle, prompt, seed=5).video[:FRAMES_3S], prompt)
            for prompt in OTHER_CAPTIONS}


def long_session(bundle) -> dict:
    """The 2,000-frame session of an orbiting circle: what its last chunk shows."""
    prompt = Scene("circle", "yellow", "orbiting", "blue").caption
    chunks = checks.chunks_for(bundle, LONG_FRAMES)
    result = checks.stream(bundle, prompt, 0, chunks, decode_from=chunks - 2)  # the model runs every block
    return {"prompt": prompt, "chunks": chunks, **checks.colour_scores(result.frames[-1], prompt)}


def fast_object(bundle) -> dict:
    """The demo's example, a fast bouncing circle: its opening area and, 40 s in, its area and colour."""
    prompt = Scene("circle", "red", "bouncing", "blue").caption
    opening = checks.readings(np.concatenate(_stream(bundle, prompt, frames=OPENING_FRAMES).frames[1:]))
    chunks = checks.chunks_for(bundle, FAST_FRAMES)
    late = checks.readings(checks.stream(bundle, prompt, 0, chunks, decode_from=chunks - 2).frames[-1])
    return {
        "prompt": prompt,
        "opening_area": float(np.median([r.foreground_pixels for r in opening])),
        "late_area": float(np.median([r.foreground_pixels for r in late])),
        "late_colour": float(np.mean([colour_name(r) == "red" for r in late])),
    }


CHECKS = {"colours": colours, "shapes": shapes, "motions": motions, "other_captions": other_captions,
          "long_session": long_session, "fast_object": fast_object}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    torch.set_num_threads(1)  # the idle core; the tests' own process has the other
    bundle = checks.build()
    results = {name: check(bundle) for name, check in CHECKS.items()}
    with open(argv[0], "w") as out:
        json.dump(results, out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
