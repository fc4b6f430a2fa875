"""Where the object is at every moment: one trajectory per motion word, with a small seeded jitter.

Each motion starts from a canonical layout (the seed moves it by a few pixels
and changes speeds by a few percent), so a caption nearly fixes its video: a
few-step model trained on this world can then give sharp frames, and the
session seed still varies the details. Units: pixels and seconds, y downward.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

WIDTH, HEIGHT, FPS = 256, 144, 16
X_MIN, X_MAX = 40.0, 216.0  # the object's centre stays inside these (its half-size is <= 20 px)
BOUNCE_TOP, BOUNCE_FLOOR = 40.0, 122.0
BOUNCE_PERIOD_S = 1.25
BOUNCE_SPEED = 48.0
DRIFT_SPEED = 28.0
ORBIT_RADIUS = 36.0
ORBIT_PERIOD_S = 4.0
# An orbit drawn elsewhere (Jitter.from_seed's orbit_spread): its radius in this range, its centre anywhere that
# keeps the object's centre within X_MIN..X_MAX and ORBIT_Y_MIN..ORBIT_Y_MAX (half-size <= 20 px in a 144-px frame).
ORBIT_RADIUS_MIN = 20.0
ORBIT_Y_MIN, ORBIT_Y_MAX = 24.0, 120.0


@dataclass(frozen=True)
class Jitter:
    """The seed's share of a trajectory: offsets in pixels, speed factor, phase in radians."""

    dx: float = 0.0
    dy: float = 0.0
    speed: float = 1.0
    phase: float = 0.0
    # An orbit's centre (from the frame's middle) and radius; the world's own orbit unless drawn elsewhere.
    orbit_dx: float = 0.0
    orbit_dy: float = 0.0
    orbit_radius: float = ORBIT_RADIUS

    @staticmethod
    def from_seed(seed: int, orbit_spread: float = 0.0) -> "Jitter":
        """``orbit_spread``: the chance that the orbit turns about another centre at another radius (the path of
        every other motion is the same). The seed's other draws come first, so 0 gives the world as it always was."""
        if not 0.0 <= orbit_spread <= 1.0:
            raise ValueError(f"orbit_spread is a share in [0, 1], got {orbit_spread}")
        rng = np.random.default_rng(seed)
        jitter = Jitter(
            dx=float(rng.uniform(-6, 6)),
            dy=float(rng.uniform(-6, 6)),
            speed=float(rng.uniform(0.92, 1.08)),
            phase=float(rng.uniform(-0.3, 0.3)),
        )
        if orbit_spread == 0.0 or rng.random() >= orbit_spread:
            return jitter
        radius = float(rng.uniform(ORBIT_RADIUS_MIN, ORBIT_RADIUS))
        room_x, room_y = orbit_room(radius)
        return replace(jitter, orbit_dx=float(rng.uniform(-room_x, room_x)), orbit_dy=float(rng.uniform(-room_y, room_y)),
                       orbit_radius=radius)


def orbit_room(radius):
    """How far (x, y) an orbit of ``radius`` (a number or an array) may turn from the frame's middle with the object's
    centre staying within X_MIN..X_MAX and ORBIT_Y_MIN..ORBIT_Y_MAX: what Jitter.from_seed draws from, what a fit
    holds to."""
    return (X_MAX - X_MIN) / 2 - radius, (ORBIT_Y_MAX - ORBIT_Y_MIN) / 2 - radius


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
        r = jitter.orbit_radius
        return 128.0 + jitter.orbit_dx + r * np.cos(angle), 72.0 + jitter.orbit_dy + r * np.sin(angle)
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
