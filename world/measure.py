"""Reading a scene back from frames and sound: what the world's tests and the model's checks measure.

Nothing here knows what a frame is supposed to show. The background is the
frame's most common colour (and its darker texture tone when there is one);
the foreground is every pixel far from both; the rest follows from that mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from world.grammar import BACKGROUNDS, COLOURS, SHAPES
from world.render import TEXTURE_SHADE
from world.sound import SAMPLE_RATE, TONES_HZ

FOREGROUND_DISTANCE = 0.25  # RGB distance (0..sqrt 3) from every background tone
MIN_FOREGROUND_PIXELS = 80
# One object, not noise: the world's objects cover ~750-1060 pixels inside a box of at most 40 x 36.
MAX_FOREGROUND_PIXELS = 4000
MAX_OBJECT_SIDE = 80
# Foreground pixels / bounding-box area: circle pi/4 ~ 0.79, square 1, triangle 0.5.
FILL_SQUARE, FILL_CIRCLE = 0.92, 0.72  # (anti-aliased edges: ~1.0, ~0.83, ~0.62)


@dataclass(frozen=True)
class FrameReading:
    background_rgb: tuple[float, float, float]
    foreground_pixels: int
    foreground_rgb: tuple[float, float, float] | None
    centroid: tuple[float, float] | None  # (x, y) pixels
    fill_ratio: float | None
    box_size: tuple[float, float] | None = None  # (width, height) of the foreground's bounding box

    @property
    def has_object(self) -> bool:
        """The foreground looks like one object: enough pixels, not too many, inside a compact box."""
        return (
            MIN_FOREGROUND_PIXELS <= self.foreground_pixels <= MAX_FOREGROUND_PIXELS
            and self.box_size is not None
            and max(self.box_size) <= MAX_OBJECT_SIDE
        )


def _as_float(frame: np.ndarray) -> np.ndarray:
    frame = np.asarray(frame)
    return frame.astype(np.float32) / 255.0 if frame.dtype == np.uint8 else frame.astype(np.float32)


def read_frame(frame: np.ndarray) -> FrameReading:
    """``frame``: ``[H, W, 3]`` uint8 (or float in [0, 1])."""
    pixels = _as_float(frame)
    height, width, _ = pixels.shape
    quantised = np.round(pixels.reshape(-1, 3) * 15).astype(np.int32)
    codes = quantised[:, 0] * 256 + quantised[:, 1] * 16 + quantised[:, 2]
    values, counts = np.unique(codes, return_counts=True)
    mode = values[np.argmax(counts)]
    flat = pixels.reshape(-1, 3)
    background = flat[codes == mode].mean(axis=0)
    # A textured background's second tone is the first one shaded (either way round).
    tones = [background, background * TEXTURE_SHADE, np.minimum(background / TEXTURE_SHADE, 1.0)]
    distances = [np.linalg.norm(flat - tone, axis=1) for tone in tones]
    # The mode may be a texture's dark tone: name the background by its bright tone when that covers a fifth.
    if (distances[2] < 0.08).mean() > 0.2:
        background = tones[2]
    distance = np.min(distances, axis=0)
    mask = (distance > FOREGROUND_DISTANCE).reshape(height, width)
    count = int(mask.sum())
    if count < MIN_FOREGROUND_PIXELS:
        return FrameReading(tuple(background), count, None, None, None)
    ys, xs = np.nonzero(mask)
    # The bounding box of the central 98 % of foreground pixels: a few stray pixels do not stretch it.
    x0, x1 = np.percentile(xs, [1, 99])
    y0, y1 = np.percentile(ys, [1, 99])
    box = max((x1 - x0 + 1) * (y1 - y0 + 1), 1.0)
    inside = ((xs >= x0) & (xs <= x1) & (ys >= y0) & (ys <= y1)).sum()
    rgb = pixels[mask].mean(axis=0)
    centroid = (float(xs.mean()), float(ys.mean()))
    size = (float(x1 - x0 + 1), float(y1 - y0 + 1))
    return FrameReading(tuple(background), count, tuple(rgb), centroid, float(inside / box), size)


def nearest(rgb, palette: dict[str, tuple[float, float, float]]) -> str:
    rgb = np.asarray(rgb, dtype=np.float32)
    return min(palette, key=lambda name: float(np.linalg.norm(rgb - np.asarray(palette[name]))))


def colour_name(reading: FrameReading) -> str | None:
    """The object's colour, or None when the frame shows no single object."""
    return nearest(reading.foreground_rgb, COLOURS) if reading.has_object else None


def background_name(reading: FrameReading) -> str:
    return nearest(reading.background_rgb, BACKGROUNDS)


def shape_name(reading: FrameReading) -> str | None:
    """The object's shape by how much of its bounding box it fills, or None when there is no single object."""
    if not reading.has_object:
        return None
    if reading.fill_ratio >= FILL_SQUARE:
        return "square"
    return "circle" if reading.fill_ratio >= FILL_CIRCLE else "triangle"


def dominant_frequencies(waveform: np.ndarray, window: int = 4800) -> np.ndarray:
    """The strongest frequency (Hz) of each ``window``-sample stretch of a mono waveform (Hann window)."""
    waveform = np.asarray(waveform, dtype=np.float64)
    count = len(waveform) // window
    if count == 0:
        return np.zeros(0)
    frames = waveform[: count * window].reshape(count, window) * np.hanning(window)
    spectrum = np.abs(np.fft.rfft(frames, axis=1))
    spectrum[:, :2] = 0.0  # ignore DC
    return np.argmax(spectrum, axis=1) * SAMPLE_RATE / window


def tone_of(shape: str) -> float:
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}")
    return TONES_HZ[shape]
