"""The checks of the trained tiny model: stream a prompt through the engine's own model path and read it back.

A session here is what the runner does for one session (pipeline blocks with
paged sink + window KV, streaming video decode, streaming audio decode with
the pre-t=0 trim), without the service around it. Every score is a number in
a dict, so the tests assert thresholds and docs/TINY_MODEL.md records the
measured values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.bundle import ModelBundle, build_models
from world import measure
from world.grammar import parse_caption

FPS = 16


@dataclass
class Stream:
    frames: list[np.ndarray] = field(default_factory=list)  # one [T, H, W, 3] uint8 array per chunk
    audio: list[np.ndarray] = field(default_factory=list)  # one [channels, samples] array per chunk

    @property
    def video(self) -> np.ndarray:
        return np.concatenate(self.frames)

    @property
    def mono(self) -> np.ndarray:
        return np.concatenate(self.audio, axis=1).mean(axis=0)


def build(**overrides) -> ModelBundle:
    return build_models(EngineConfig(warmup_blocks=0, **overrides))


@torch.no_grad()
def stream(bundle: ModelBundle, prompt: str, seed: int, chunks: int, *, switch: tuple[int, str] | None = None,
           keep_every: int = 1, decode_from: int = 0, policy: str = "soft") -> Stream:
    """``chunks`` blocks of a session; ``switch=(k, prompt)`` changes the prompt (``policy``: soft or recache)
    before chunk ``k``.

    ``keep_every``: keep only every n-th chunk's frames (long sessions). ``decode_from``: decode only
    the chunks from this one on (long sessions: the model runs every block, the decoders start there
    as on a fresh stream, so the first decoded chunk is an opening chunk; read the ones after it).
    """
    pipeline = bundle.pipeline
    manager = KVCacheManager(pipeline.kv_spec(), 1, pipeline.transformer.device)
    kv = manager.open_session("check")
    progress = pipeline.new_progress(seed, prompt, "")
    decode_state = bundle.decoder.new_state("check")
    audio_state = bundle.audio_decoder.new_state("check") if bundle.audio_decoder else None
    trim = bundle.audio_timing.samples_before_start if bundle.audio_timing else 0
    out = Stream()
    try:
        for index in range(chunks):
            if switch is not None and index == switch[0]:
                pipeline.set_prompt(kv, progress, switch[1], "", policy)
            clean = pipeline.run_block(kv, progress)
            if index < decode_from:
                continue
            pixels = bundle.decoder.decode_chunk(bundle.decoder.denormalize(clean.video), decode_state)
            frames = bundle.decoder.to_uint8(pixels)
            if audio_state is not None:
                pcm = bundle.audio_decoder.decode_block(clean.audio, audio_state)
                cut = min(trim, pcm.shape[1])
                trim -= cut
                out.audio.append(pcm[:, cut:].float().cpu().numpy())
            if index % keep_every == 0 or index == chunks - 1:
                out.frames.append(frames)
    finally:
        kv.close()
    return out


def chunks_for(bundle: ModelBundle, frames: int) -> int:
    """Blocks (a stream's chunks) for at least ``frames`` frames in the bundle's block length (a session's first
    latent frame decodes to one frame: 9 frames, then 12, with blocks of 3 latent frames; 5, then 8, with 2)."""
    block = 4 * bundle.pipeline.frames_per_block
    return 1 + max(0, -(-(frames - (block - 3)) // block))


def readings(frames: np.ndarray) -> list[measure.FrameReading]:
    return [measure.read_frame(f) for f in frames]


def colour_scores(frames: np.ndarray, prompt: str) -> dict[str, float]:
    scene = parse_caption(prompt)
    rs = readings(frames)
    return {
        "foreground_colour": float(np.mean([measure.colour_name(r) == scene.colour for r in rs])),
        "background_colour": float(np.mean([measure.background_name(r) == scene.background for r in rs])),
        "object_present": float(np.mean([r.has_object for r in rs])),
    }


def shape_score(frames: np.ndarray, shape: str) -> float:
    return float(np.mean([measure.shape_name(r) == shape for r in readings(frames)]))


def motion_scores(chunks: list[np.ndarray]) -> dict[str, float]:
    """Centroid speed (px/s, median over frames), how far the centroid strays from its mean position (px), and
    the largest jump at a chunk boundary vs inside chunks."""
    centroids, boundary = [], []
    for chunk in chunks:
        for i, frame in enumerate(chunk):
            r = measure.read_frame(frame)
            centroids.append(r.centroid if r.has_object else (np.nan, np.nan))
            boundary.append(i == 0 and len(centroids) > 1)
    xy = np.array(centroids, dtype=np.float64)
    steps = np.linalg.norm(np.diff(xy, axis=0), axis=1)
    at_boundary = np.array(boundary[1:])
    valid = ~np.isnan(steps)
    inside, across = steps[valid & ~at_boundary], steps[valid & at_boundary]
    return {
        "speed_px_s": float(np.median(steps[valid]) * FPS) if valid.any() else float("nan"),
        "max_step_inside_px": float(inside.max()) if inside.size else float("nan"),
        "max_step_boundary_px": float(across.max()) if across.size else float("nan"),
        "tracked_frames": float(valid.mean()),
        "max_offset_px": float(np.nanmax(np.linalg.norm(xy - np.nanmean(xy, axis=0), axis=1))) if valid.any() else float("nan"),
    }


def audio_score(mono: np.ndarray, shape: str) -> dict[str, float]:
    frequencies = measure.dominant_frequencies(mono)
    median = float(np.median(frequencies)) if frequencies.size else float("nan")
    tone = measure.tone_of(shape)
    return {"median_hz": median, "tone_hz": tone, "relative_error": abs(median - tone) / tone}
