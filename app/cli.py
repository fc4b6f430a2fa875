"""The ``arstream`` command line: ``generate`` (offline clip through the engine) and ``serve``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys
from pathlib import Path

from tqdm import tqdm

from app.media import Mp4FileWriter
from engine.api import Engine
from engine.config import EngineConfig
from engine.errors import CapacityFull

MAX_GENERATE_SECONDS = 24 * 3600


def _engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny", choices=["tiny", "wan2.1-1.3b"])
    parser.add_argument("--model", type=Path, default=None, help="local model directory (nothing is downloaded)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--sink-frames", type=int, default=3)
    parser.add_argument("--window-frames", type=int, default=15)
    parser.add_argument("--guidance", type=float, default=1.0)
    parser.add_argument("--cpu-threads", type=int, default=None)


def _engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    return EngineConfig(
        preset=args.preset,
        model_dir=args.model,
        device=args.device,
        dtype=args.dtype,
        height=args.height,
        width=args.width,
        sink_frames=args.sink_frames,
        window_frames=args.window_frames,
        guidance_scale=args.guidance,
        cpu_threads=args.cpu_threads,
        **overrides,
    )


async def generate(args: argparse.Namespace) -> int:
    """One session through the same engine the service runs, written as a plain MP4."""
    config = _engine_config(args, max_sessions=1, warmup_blocks=0)
    engine = Engine(config)
    await engine.start()
    try:
        geometry = engine.geometry
        total_frames = max(1, math.ceil(args.seconds * geometry.fps))
        session = engine.create_session(seed=args.seed, pace=False)
        if isinstance(session, CapacityFull):  # cannot happen with a fresh engine; keep the type honest
            raise RuntimeError(session.message)
        engine.start_session(session.session_id, args.prompt, negative_prompt=args.negative_prompt)
        written = 0
        with Mp4FileWriter(args.out, geometry.width, geometry.height, fps=geometry.fps) as writer, tqdm(
            total=total_frames, unit="frame", disable=args.quiet
        ) as progress:
            async for chunk in engine.chunks(session.session_id):
                frames = chunk.frames[: total_frames - written]
                writer.write(frames)
                written += len(frames)
                progress.update(len(frames))
                if written >= total_frames:
                    break
        status = engine.status(session.session_id)
        if status.close_reason == "failed":
            print(f"generation failed: {engine.get(session.session_id).error}", file=sys.stderr)
            return 1
        print(f"wrote {written} frames ({written / geometry.fps:.2f} s) to {args.out}")
        return 0
    finally:
        await engine.shutdown("client")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arstream", description="realtime autoregressive video diffusion")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate one clip offline through the engine")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--negative-prompt", default="")
    gen.add_argument("--seconds", type=float, default=5.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--out", type=Path, default=Path("clip.mp4"))
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    _engine_arguments(gen)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if args.command == "generate":
        if not 0 < args.seconds <= MAX_GENERATE_SECONDS:
            parser.error(f"--seconds must be in (0, {MAX_GENERATE_SECONDS}]")
        if args.seed < 0:
            parser.error("--seed must be >= 0")
        return asyncio.run(generate(args))
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
