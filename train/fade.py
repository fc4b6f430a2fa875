"""How long a fast object lasts: its area in each stretch of a session, as a share of its opening area.

    python -m train.fade [--weights DIR] [--seconds 30] [--seeds 0,1,2,3] [--prompts "a red circle bouncing ..."]
                         [--sheet PNG] [--device cuda] [--window-s 30]

A session of each prompt and seed through the engine's own model path (train.checks.stream, the served block
length), every frame read back with world.measure. Per window: the median of the frames' object area over the
median area of frames 1-32 (%), and the share of frames whose object reads in the prompted colour. ``--weights``
lays a checkpoint's DiT files (transformer, audio_tokens, text_encoder) over the shipped weights, so a training
round is judged before it is installed. One JSON line per session, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from train import checks
from world import measure
from world.grammar import parse_caption

PROMPTS = (
    "a red circle bouncing on a blue background",  # the demo's example (issue 30's evidence)
    "a green triangle bouncing on a black background",
    "a white square bouncing on a red background",
)
WINDOWS_S = (0, 2, 4, 6, 8, 10, 15, 20, 30, 45, 60, 120, 300, 600, 3600)
DIT_FILES = {"transformer": lambda p: p.transformer.transformer, "audio_tokens": lambda p: p.transformer.audio,
             "text_encoder": lambda p: p.text_encoder}


def overlay(bundle, directory: Path) -> list[str]:
    """Load the DiT's module files found in ``directory`` into ``bundle``'s modules; the names loaded."""
    from engine.models.prompt_embeddings import PromptEmbeddings
    from engine.models.trained import rope_spatial_theta
    from train.common import load_module_file

    loaded = []
    transformer_file = directory / "transformer.safetensors"
    if transformer_file.exists():  # trained with another spatial rotary base than the shipped file's
        bundle.pipeline.transformer.use_rope_spatial_theta(rope_spatial_theta(transformer_file))
    for name, module_of in DIT_FILES.items():
        module = module_of(bundle.pipeline)
        if module is not None and load_module_file(directory / f"{name}.safetensors", module):
            loaded.append(name)
    bundle.pipeline.embeddings = PromptEmbeddings(bundle.pipeline.text_encoder)  # none made by the old encoder
    return loaded


def windows_of(seconds: float, window_s: float | None) -> tuple[float, ...]:
    """The stretches' edges: ``WINDOWS_S`` (short ones first, where a fade begins), or every ``window_s`` seconds."""
    if window_s is None:
        return WINDOWS_S
    return tuple(window_s * k for k in range(int(np.ceil(seconds / window_s)) + 1))


def session_report(bundle, prompt: str, seed: int, seconds: float, sheet: Path | None = None,
                   window_s: float | None = None) -> dict:
    scene = parse_caption(prompt)
    frames = checks.stream(bundle, prompt, seed, checks.chunks_for(bundle, int(seconds * 16) + 1)).video
    if sheet is not None:
        save_sheet(frames, seconds, sheet)
    readings = checks.readings(frames)
    areas = np.array([r.foreground_pixels if r.has_object else 0 for r in readings], dtype=np.float64)
    coloured = np.array([measure.colour_name(r) == scene.colour for r in readings])
    opening = float(np.median(areas[1:33])) or 1.0
    windows = {}
    edges = windows_of(seconds, window_s)
    for start, end in zip(edges, edges[1:]):
        if start >= seconds:
            break
        part = slice(int(start * 16), min(int(end * 16), int(seconds * 16), len(frames)))
        windows[f"{start:g}-{min(end, seconds):g}s"] = {"area_pct": round(100 * float(np.median(areas[part])) / opening),
                                      "colour": round(float(coloured[part].mean()), 2)}
    return {"prompt": prompt, "seed": seed, "opening_px": opening, "windows": windows}


def save_sheet(frames: np.ndarray, seconds: float, path: Path, columns: int = 4) -> None:
    """Frames at 1 s and every 10 s after, ``columns`` to a row (left to right, top to bottom)."""
    from PIL import Image

    picks = [16] + [16 * t for t in range(10, int(seconds) + 1, 10) if 16 * t < len(frames)]
    tiles = [frames[k] for k in picks]
    tiles += [np.zeros_like(tiles[0])] * (-len(tiles) % columns)
    rows = [np.concatenate(tiles[i : i + columns], axis=1) for i in range(0, len(tiles), columns)]
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.concatenate(rows, axis=0)).save(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--weights", type=Path, help="a checkpoint directory whose DiT files replace the shipped ones")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--seeds", default="0,1,2,3")
    parser.add_argument("--prompts", default="|".join(PROMPTS), help="prompts separated by |")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--window-s", type=float, help="stretches of this many seconds (the issue's 30) instead of the "
                        "short-then-long default")
    parser.add_argument("--device", default="cpu", help="where the model runs (cuda: the issue's device-length checks)")
    parser.add_argument("--sheet", type=Path, help="save the first session's frames at 1 s and every 10 s here (PNG)")
    args = parser.parse_args(argv)
    if args.seconds <= 2 or args.seconds > 3600:
        parser.error("--seconds must be in (2, 3600]")
    torch.set_num_threads(args.threads)
    bundle = checks.build(device=args.device)
    if args.weights is not None:
        loaded = overlay(bundle, args.weights)
        if not loaded:
            parser.error(f"no DiT module files in {args.weights}")
        print(f"# weights: {args.weights} ({', '.join(loaded)}) over the shipped ones", flush=True)
    reports = []
    for prompt in filter(None, args.prompts.split("|")):
        for seed in (int(s) for s in args.seeds.split(",")):
            report = session_report(bundle, prompt, seed, args.seconds, args.sheet if not reports else None,
                                    args.window_s)
            print(json.dumps(report), flush=True)
            reports.append(report)
    names = list(reports[0]["windows"])
    print("\n| prompt | seed | " + " | ".join(names) + " |\n| --- | --- | " + " | ".join("---" for _ in names) + " |")
    for r in reports:
        cells = [f"{r['windows'][n]['area_pct']} % ({r['windows'][n]['colour']:.2f})" for n in names]
        print(f"| {r['prompt']} | {r['seed']} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
