"""The sound of a scene: codec-frame features, and the 48 kHz waveform they stand for.

A tone per shape, an octave partial whose level rises with the object's
height, a short click each time it hits the floor. Every tone is a multiple
of 80 Hz = 48000 / 600, so each 600-sample codec frame holds whole periods:
a waveform that depends only on per-frame features can then be a pure tone
(a decoder fed a constant feature repeats one frame's samples, so any other
pitch would need phase in the features). For that reason height changes the
timbre, not the pitch.

Features, one column per codec frame (12.5 ms), values in [-1, 1]::

    0..2  tone on (+1) / off (-1) for circle, square, triangle
    3     height: -1 at the bottom edge, +1 at the top
    4     click: +1 in the frame where a bounce lands, else -1
    5..7  0 (unused)

Codec frame ``a`` of a session covers samples ``[600 a - 9000, 600 (a + 1) - 9000)``
of the video clock: the session's first latent frame stands for one video
frame but carries four frames' worth of audio, and the engine drops the first
three (9000 samples).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from world.grammar import SHAPES, Scene
from world.motion import HEIGHT, Jitter, bounce_times, centre

SAMPLE_RATE = 48000
HOP = 600
FEATURES = 8
SAMPLES_BEFORE_START = 9000
TONES_HZ: dict[str, float] = {"circle": 480.0, "square": 320.0, "triangle": 640.0}
TONE_LEVEL, OCTAVE_LEVEL, CLICK_LEVEL = 0.25, 0.10, 0.5
CLICK_HZ, CLICK_DECAY_SAMPLES = 2400.0, 120.0


def frame_start_times(num_frames: int, start_frame: int = 0) -> np.ndarray:
    """Video-clock time (s) at the start of each codec frame (negative before the session's t = 0)."""
    return ((start_frame + np.arange(num_frames)) * HOP - SAMPLES_BEFORE_START) / SAMPLE_RATE


def features(
    scenes: list[tuple[Scene, float]], jitter: Jitter, num_frames: int, start_frame: int = 0
) -> torch.Tensor:
    """``[8, num_frames]`` features; ``scenes`` lists ``(scene, from_time_s)`` in order (a prompt switch adds one)."""
    motion = scenes[0][0].motion
    starts = frame_start_times(num_frames, start_frame)
    duration = max(starts[-1] + HOP / SAMPLE_RATE, 0.0) + 1.0
    return features_along(scenes, lambda t: centre(motion, jitter, t)[1], bounce_times(motion, jitter, duration),
                          num_frames, start_frame)


def features_along(scenes: list[tuple[Scene, float]], height_at, bounces: np.ndarray, num_frames: int,
                   start_frame: int = 0) -> torch.Tensor:
    """:func:`features` of any path: ``height_at(times)`` gives the object's y (px), ``bounces`` the moments (s)
    it lands, both on the session's clock (a model's own path fitted with world.fit, say)."""
    starts = frame_start_times(num_frames, start_frame)
    middle = np.maximum(starts + HOP / SAMPLE_RATE / 2, 0.0)
    out = np.zeros((FEATURES, num_frames), dtype=np.float32)
    out[:5] = -1.0
    y = np.asarray(height_at(middle), dtype=np.float64)
    out[3] = 1.0 - 2.0 * np.clip(y / HEIGHT, 0.0, 1.0)
    for index, (scene, since) in enumerate(scenes):
        until = scenes[index + 1][1] if index + 1 < len(scenes) else math.inf
        active = (middle >= since) & (middle < until)
        out[SHAPES.index(scene.shape), active] = 1.0
    for t in bounces:
        hit = np.nonzero((starts <= t) & (t < starts + HOP / SAMPLE_RATE))[0]
        out[4, hit] = 1.0
    return torch.from_numpy(out)


def synthesize(feature_frames: torch.Tensor) -> torch.Tensor:
    """The waveform ``[..., samples]`` (``HOP`` per frame) that ``[..., 8, frames]`` features stand for."""
    device = feature_frames.device
    n = torch.arange(HOP, device=device, dtype=torch.float32)
    t = n / SAMPLE_RATE
    on = (feature_frames[..., :3, :] > 0).float()  # [..., 3, F]
    height = (feature_frames[..., 3, :] + 1.0) / 2.0  # [..., F]
    click = (feature_frames[..., 4, :] > 0).float()
    tones = torch.tensor([TONES_HZ[s] for s in SHAPES], device=device).view(3, 1)
    fundamental = torch.sin(2 * math.pi * tones * t)  # [3, HOP]
    octave = torch.sin(4 * math.pi * tones * t)
    wave = TONE_LEVEL * torch.einsum("...kf,kn->...fn", on, fundamental)
    wave = wave + OCTAVE_LEVEL * height.unsqueeze(-1) * torch.einsum("...kf,kn->...fn", on, octave)
    burst = CLICK_LEVEL * torch.exp(-n / CLICK_DECAY_SAMPLES) * torch.sin(2 * math.pi * CLICK_HZ * t)
    wave = wave + click.unsqueeze(-1) * burst
    return wave.flatten(-2)
