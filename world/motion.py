"""Where the object is at every moment: one trajectory per motion word, with a small seeded jitter.

Each motion starts from a canonical layout (the seed moves it by a few pixels
and changes speeds by a few percent), so a caption nearly fixes its video: a
few-step model trained on this world can then give sharp frames, and the
session seed still varies the details. Units: pixels and seconds, y downward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WIDTH, HEIGHT, FPS = 256, 144, 16
X_MIN, X_MAX = 40.0, 216.0  # the object's centre stays inside these (its half-size is <= 20 px)
BOUNCE_TOP, BOUNCE_FLOOR = 40.0, 122.0
BOUNCE_PERIOD_S = 1.25
BOUNCE_SPEED = 48.0
DRIFT_SPEED = 28.0
ORBIT_RADIUS = 36.0
ORBIT_PERIOD_S = 4.0


@dataclass(frozen=True)
class Jitter:
    """The seed's share of a trajectory: offsets in pixels, speed factor, phase in radians."""

    dx: float = 0.0
    dy: float = 0.0
    speed: float = 1.0
    phase: float = 0.0

    @staticmethod
    def from_seed(seed: int) -> "Jitter":
        rng = np.random.default_rng(seed)
        return Jitter(
            dx=float(rng.uniform(-6, 6)),
            dy=float(rng.uniform(-6, 6)),
            speed=float(rng.uniform(0.92, 1.08)),
            phase=float(rng.uniform(-0.3, 0.3)),
        )


def _reflect(start: float, velocity: float, times: np.ndarray) -> np.ndarray:
    """Position of a point moving at ``velocity`` between X_MIN and X_MAX, reflecting at both (a triangle wave)."""
    span = X_MAX - X_MIN
    travelled = (start - X_MIN) + velocity * times
    phase = np.mod(travelled, 2 * span)
    return X_MIN + np.where(phase <= span, phase, 2 * span - phase)


def centre(motion: str, jitter: Jitter, times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` of the object's centre at ``times`` (seconds)."""
    times = np.asarray(times, dtype=np.float64)
    if motion == "still":
        return np.full_like(times, 128.0 + jitter.dx), np.full_like(times, 72.0 + jitter.dy)
    if motion == "drifting":
        return _reflect(64.0 + jitter.dx, DRIFT_SPEED * jitter.speed, times), np.full_like(times, 72.0 + jitter.dy)
    if motion == "orbiting":
        angle = jitter.phase + 2 * np.pi * times / ORBIT_PERIOD_S * jitter.speed
        return 128.0 + ORBIT_RADIUS * np.cos(angle), 72.0 + ORBIT_RADIUS * np.sin(angle)
    if motion == "bouncing":
        x = _reflect(64.0 + jitter.dx, BOUNCE_SPEED * jitter.speed, times)
        top = BOUNCE_TOP + jitter.dy
        u = np.mod(times / (BOUNCE_PERIOD_S * jitter.speed) + 0.5, 1.0)  # 0.5 at the apex, 0 on the floor
        return x, top + (BOUNCE_FLOOR - top) * (2 * u - 1) ** 2
    raise ValueError(f"unknown motion {motion!r}")


def bounce_times(motion: str, jitter: Jitter, duration_s: float) -> np.ndarray:
    """Moments the object hits the floor (seconds, within ``[0, duration_s)``); only ``bouncing`` bounces."""
    if motion != "bouncing":
        return np.zeros(0)
    period = BOUNCE_PERIOD_S * jitter.speed
    return np.arange(period / 2, duration_s, period)
