"""A contact sheet of what the shipped tiny model streams: prompts through the engine's own model path.

    python -m train.sheet docs/img/tiny_sheet.png [--seed 0] [--chunks 12]

One row per prompt (the demo page's examples, then captions the tests do not use), one tile per
chosen frame (the first chunk's last frame, then every few chunks), each tile labelled with its
frame index and what ``world.measure`` reads in it. Prints the same readings as a markdown table.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageDraw

from train import checks
from world import measure
from world.grammar import EXAMPLE_PROMPTS

OTHER_PROMPTS = (  # grammar captions no test streams
    "a green square bouncing on a red background",
    "a white triangle orbiting on a purple background",
    "a blue circle drifting on a grey background",
    "a yellow circle still on a green checkered background",
)


def reading(frame: np.ndarray) -> str:
    r = measure.read_frame(frame)
    background = measure.background_name(r)
    if not r.has_object:
        return f"{background} / no object"
    return f"{background} / {measure.colour_name(r)} {measure.shape_name(r)}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunks", type=int, default=12)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    bundle = checks.build()
    picks = sorted({0, 2, args.chunks // 2, args.chunks - 1})
    rows, table = [], []
    for prompt in EXAMPLE_PROMPTS + OTHER_PROMPTS:
        chunks = checks.stream(bundle, prompt, args.seed, args.chunks).frames
        tiles, cells = [], []
        for index in picks:
            frame = chunks[index][-1]
            number = sum(len(c) for c in chunks[: index + 1]) - 1
            text = reading(frame)
            tile = Image.fromarray(frame)
            ImageDraw.Draw(tile).text((3, 2), f"f{number}: {text}", fill=(255, 255, 255))
            tiles.append(np.asarray(tile))
            cells.append(f"f{number}: {text}")
        rows.append(np.concatenate(tiles, axis=1))
        table.append(f"| {prompt} | " + " | ".join(cells) + " |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.concatenate(rows, axis=0)).save(args.out)
    print("| prompt | " + " | ".join(f"chunk {i + 1}" for i in picks) + " |")
    print("| --- |" + " --- |" * len(picks))
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
