"""Seeded clips of the world: frames, sound features and the caption, optionally with a prompt switch.

A clip of ``N`` latent frames has ``1 + 4 (N - 1)`` video frames (the video
codec's 4x temporal compression, its first latent frame being a single video
frame) and ``20 N`` sound-feature frames (12000 samples of 48 kHz audio per
latent frame at 16 fps). With a switch at latent frame ``j``, the scene from
video frame ``4 j - 3`` on is another one (new colour, shape and background,
same trajectory), and the clip's caption is the new scene's: what a session
shows after its prompt changed.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from world import sound
from world.grammar import BACKGROUNDS, COLOURS, MOTIONS, SHAPES, TEXTURES, Scene
from world.motion import FPS, Jitter, centre
from world.render import Shades, frame_times, render_with_coverage

AUDIO_FRAMES_PER_LATENT = 20


def video_frames(latent_frames: int) -> int:
    return 1 + 4 * (latent_frames - 1)


def first_video_frame(latent_frame: int) -> int:
    return 0 if latent_frame == 0 else 4 * latent_frame - 3


@dataclass
class Clip:
    video: torch.Tensor  # [3, T, 144, 256] in [-1, 1]
    features: torch.Tensor  # [8, 20 N] sound features
    caption: str
    scenes: list[tuple[Scene, float]]  # (scene, from time s)
    coverage: torch.Tensor  # [T, 144, 256] the object's share of each pixel
    switch_latent: int | None = None


def random_scene(rng: np.random.Generator, motion: str | None = None) -> Scene:
    colour = str(rng.choice(list(COLOURS)))
    background = str(rng.choice([b for b in BACKGROUNDS if b != colour]))
    return Scene(
        shape=str(rng.choice(SHAPES)),
        colour=colour,
        motion=motion or str(rng.choice(MOTIONS)),
        background=background,
        texture=str(rng.choice(TEXTURES, p=[0.5, 0.25, 0.25])),
    )


def make_clip(
    scene: Scene,
    seed: int,
    latent_frames: int,
    *,
    switch_to: Scene | None = None,
    switch_latent: int | None = None,
    device="cpu",
    shades: Shades | None = None,
    orbit_spread: float = 0.0,
) -> Clip:
    """The clip of ``scene`` for ``seed``: deterministic in its arguments. ``shades``: drawn in those colours
    instead of the palette's (a clip without a switch); ``orbit_spread``: :meth:`Jitter.from_seed`'s."""
    if shades is not None and switch_to is not None:
        raise ValueError("shades are for a clip of one scene")
    if latent_frames < 1:
        raise ValueError("a clip needs at least one latent frame")
    jitter = Jitter.from_seed(seed, orbit_spread)
    times = frame_times(video_frames(latent_frames))
    cx, cy = centre(scene.motion, jitter, times)
    scenes = [(scene, 0.0)]
    video, coverage = render_with_coverage(scene, cx, cy, device, shades)
    if switch_to is not None:
        if switch_latent is None or not 0 < switch_latent < latent_frames:
            raise ValueError("switch_latent must fall inside the clip")
        if switch_to.motion != scene.motion:
            raise ValueError("a switch keeps the motion (the trajectory continues)")
        start = first_video_frame(switch_latent)
        video[:, start:], coverage[start:] = render_with_coverage(switch_to, cx[start:], cy[start:], device)
        scenes.append((switch_to, start / FPS))
    features = sound.features(scenes, jitter, AUDIO_FRAMES_PER_LATENT * latent_frames)
    caption = scenes[-1][0].caption
    return Clip(video * 2 - 1, features.to(device), caption, scenes, coverage, switch_latent if switch_to else None)


def random_clip(seed: int, latent_frames: int, *, switch_probability: float = 0.0, shades_probability: float = 0.0,
                orbit_spread: float = 0.0, device="cpu") -> Clip:
    """A random scene (and maybe a switch at a block boundary, multiple of 3) from one seed; a clip without a
    switch is drawn in shades near the palette's (:meth:`Shades.around`) with ``shades_probability``; an orbit
    turns about another centre at another radius with ``orbit_spread`` (:meth:`Jitter.from_seed`)."""
    rng = np.random.default_rng(seed)
    scene = random_scene(rng)
    if shades_probability > 0 and rng.random() < shades_probability:
        return make_clip(scene, seed, latent_frames, device=device, shades=Shades.around(scene, rng),
                         orbit_spread=orbit_spread)
    if latent_frames > 6 and rng.random() < switch_probability:
        switch_latent = 3 * int(rng.integers(1, (latent_frames - 1) // 3 + 1))
        if switch_latent < latent_frames:
            other = random_scene(rng, motion=scene.motion)
            return make_clip(scene, seed, latent_frames, switch_to=other, switch_latent=switch_latent, device=device,
                             orbit_spread=orbit_spread)
    return make_clip(scene, seed, latent_frames, device=device, orbit_spread=orbit_spread)
