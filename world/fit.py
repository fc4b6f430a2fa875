"""The world trajectory nearest to where an object was seen: what a model's own frames would continue as.

A model rolled out on its own drifts from any clip it was trained on: its fast
object is a little ahead of, behind or beside where the clip has it. Learning
the next block against the clip then asks for an object somewhere the model's
history does not put it, and the error-minimising answer is a smear between
the two (a fading object). Fitting the world's own trajectory family (the
motion word's path, with a seed's jitter and a start time) to the centroids
the model drew gives a continuation that agrees with its history, so a long
rollout can be learned against the world itself.

Brute force over a grid, separately for x and y where the motion allows:
a bouncing fit costs ~10 ms for 24 frames. Units: pixels, seconds, as world.motion.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from world import motion as m

# The grids cover the seed's jitter (world.motion.Jitter.from_seed) at 1 px / 1 % / 1/64 s.
_SPEEDS = np.linspace(0.92, 1.08, 9)
_OFFSETS = np.arange(-6.0, 6.01, 1.0)
_STEP_S = 1.0 / 64
_PHASES = np.linspace(-np.pi, np.pi, 720, endpoint=False)  # an orbit's phase, 0.5 degree apart


@dataclass(frozen=True)
class Fit:
    """The path ``centre(motion, jitter, ...)`` with its own start time per axis (a session runs for hours, so
    the horizontal and vertical phases of a bounce are free of each other); ``error_px``: RMS distance over the
    seen frames."""

    motion: str
    jitter: m.Jitter
    start_x_s: float
    start_y_s: float
    error_px: float

    def centre(self, times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        t = np.asarray(times, dtype=np.float64)
        x, _ = m.centre(self.motion, self.jitter, self.start_x_s + t)
        _, y = m.centre(self.motion, self.jitter, self.start_y_s + t)
        return x, y

    def bounces(self, until_s: float) -> np.ndarray:
        """The moments in ``[0, until_s)`` (this path's clock) the object lands (only a bounce lands)."""
        landed = m.bounce_times(self.motion, self.jitter, self.start_y_s + until_s + m.BOUNCE_PERIOD_S * 2) - self.start_y_s
        return landed[(landed >= 0) & (landed < until_s)]


def _fitted(motion: str, jitter: m.Jitter, start_x: float, start_y: float, t, x, y) -> Fit:
    fit = Fit(motion, jitter, start_x, start_y, 0.0)
    cx, cy = fit.centre(t)
    return Fit(motion, jitter, start_x, start_y, float(np.sqrt(np.mean((cx - x) ** 2 + (cy - y) ** 2))))


def _axis_x(velocity: float, speeds, starts, offsets, t, x):
    """Squared error of the horizontal reflection for every (speed, start, dx): ``[S, K, D]``."""
    when = starts[None, :, None, None] + t[None, None, None, :]
    return ((m._reflect(64.0 + offsets[None, None, :, None], velocity * speeds[:, None, None, None], when) - x) ** 2).sum(-1)


def _axis_bounce(speeds, starts, offsets, t, y):
    """Squared error of the bounce's height for every (speed, start, dy): ``[S, K, D]``."""
    when = starts[None, :, None, None] + t[None, None, None, :]
    top = m.BOUNCE_TOP + offsets[None, None, :, None]
    u = np.mod(when / (m.BOUNCE_PERIOD_S * speeds[:, None, None, None]) + 0.5, 1.0)
    return ((top + (m.BOUNCE_FLOOR - top) * (2 * u - 1) ** 2 - y) ** 2).sum(-1)


def _best_per_speed(err: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each speed: the least error and the (start, offset) indices that give it."""
    flat = err.reshape(err.shape[0], -1)
    index = flat.argmin(axis=1)
    return flat[np.arange(err.shape[0]), index], index // err.shape[2], index % err.shape[2]


def nearest_trajectory(motion: str, times: np.ndarray, xs: np.ndarray, ys: np.ndarray, free_orbit: bool = False) -> Fit:
    """The path of ``motion`` whose centre passes nearest ``(xs, ys)`` at ``times`` (seconds, any origin).
    ``free_orbit``: an orbit's centre and radius are fitted too, within the range ``Jitter.from_seed``'s
    ``orbit_spread`` draws from (else every orbit is the world's one circle)."""
    t = np.asarray(times, dtype=np.float64)
    x, y = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    if t.ndim != 1 or not (t.shape == x.shape == y.shape) or t.size == 0:
        raise ValueError("times, xs and ys must be 1-D and of one length, at least one point")
    if motion == "still":
        jitter = m.Jitter(dx=float(np.clip(x.mean() - 128.0, -6, 6)), dy=float(np.clip(y.mean() - 72.0, -6, 6)))
        return _fitted(motion, jitter, 0.0, 0.0, t, x, y)
    if motion == "orbiting" and free_orbit:
        return _free_orbit(t, x, y)
    if motion == "orbiting":
        angle = _orbit_angles(t)
        err = ((128.0 + m.ORBIT_RADIUS * np.cos(angle) - x) ** 2 + (72.0 + m.ORBIT_RADIUS * np.sin(angle) - y) ** 2).sum(-1)
        s, p = np.unravel_index(err.argmin(), err.shape)
        jitter = m.Jitter(speed=float(_SPEEDS[s]), phase=float(_PHASES[p]))
        return _fitted(motion, jitter, 0.0, 0.0, t, x, y)
    if motion not in ("drifting", "bouncing"):
        raise ValueError(f"unknown motion {motion!r}")
    velocity = m.DRIFT_SPEED if motion == "drifting" else m.BOUNCE_SPEED
    # Every start within one period of the horizontal reflection at the slowest speed.
    starts_x = np.arange(0.0, 2 * (m.X_MAX - m.X_MIN) / (velocity * _SPEEDS.min()), _STEP_S)
    best_x, kx, dx = _best_per_speed(_axis_x(velocity, _SPEEDS, starts_x, _OFFSETS, t, x))
    if motion == "drifting":
        s = int(best_x.argmin())
        jitter = m.Jitter(dx=float(_OFFSETS[dx[s]]), dy=float(np.clip(y.mean() - 72.0, -6, 6)), speed=float(_SPEEDS[s]))
        return _fitted(motion, jitter, float(starts_x[kx[s]]), 0.0, t, x, y)
    starts_y = np.arange(0.0, m.BOUNCE_PERIOD_S * _SPEEDS.max(), _STEP_S)
    best_y, ky, dy = _best_per_speed(_axis_bounce(_SPEEDS, starts_y, _OFFSETS, t, y))
    s = int((best_x + best_y).argmin())
    coarse = _fitted(motion, m.Jitter(dx=float(_OFFSETS[dx[s]]), dy=float(_OFFSETS[dy[s]]), speed=float(_SPEEDS[s])),
                     float(starts_x[kx[s]]), float(starts_y[ky[s]]), t, x, y)
    return _refined_bounce(coarse, t, x, y)


def _orbit_angles(t: np.ndarray) -> np.ndarray:
    """The orbit's angle at ``t`` for every (speed, phase) of the grid: ``[S, P, T]``. angle = phase + 2 pi (start +
    t) speed / period: the start folds into the phase."""
    return _PHASES[None, :, None] + 2 * np.pi * t[None, None, :] / m.ORBIT_PERIOD_S * _SPEEDS[:, None, None]


def _free_orbit(t, x, y) -> Fit:
    """Every (speed, phase) on the grid, and for each the centre and radius of least squares (closed form: the
    path is linear in them), held to the drawable range; the best of those."""
    angle = _orbit_angles(t)
    cos, sin = np.cos(angle), np.sin(angle)
    dc, ds = cos - cos.mean(-1, keepdims=True), sin - sin.mean(-1, keepdims=True)
    spread = (dc ** 2 + ds ** 2).sum(-1)
    radius = ((x - x.mean()) * dc + (y - y.mean()) * ds).sum(-1) / np.maximum(spread, 1e-9)
    radius = np.clip(radius, m.ORBIT_RADIUS_MIN, m.ORBIT_RADIUS)
    room_x, room_y = m.orbit_room(radius)
    centre_dx = np.clip(x.mean() - radius * cos.mean(-1) - 128.0, -room_x, room_x)
    centre_dy = np.clip(y.mean() - radius * sin.mean(-1) - 72.0, -room_y, room_y)
    err = ((128.0 + centre_dx[..., None] + radius[..., None] * cos - x) ** 2
           + (72.0 + centre_dy[..., None] + radius[..., None] * sin - y) ** 2).sum(-1)
    s, p = np.unravel_index(err.argmin(), err.shape)
    jitter = m.Jitter(speed=float(_SPEEDS[s]), phase=float(_PHASES[p]), orbit_dx=float(centre_dx[s, p]),
                      orbit_dy=float(centre_dy[s, p]), orbit_radius=float(radius[s, p]))
    return _fitted("orbiting", jitter, 0.0, 0.0, t, x, y)


def _refined_bounce(coarse: Fit, t, x, y) -> Fit:
    """A finer grid around the coarse fit: near the floor the bounce moves ~4 px per 1/64 s."""
    j = coarse.jitter
    speeds = np.clip(j.speed + np.arange(-0.01, 0.0101, 0.0025), 0.92, 1.08)
    fine = np.arange(-_STEP_S, _STEP_S + 1e-9, _STEP_S / 8)
    offsets = np.arange(-1.0, 1.01, 0.125)
    dxs, dys = np.clip(j.dx + offsets, -6, 6), np.clip(j.dy + offsets, -6, 6)
    best_x, kx, dx = _best_per_speed(_axis_x(m.BOUNCE_SPEED, speeds, coarse.start_x_s + fine, dxs, t, x))
    best_y, ky, dy = _best_per_speed(_axis_bounce(speeds, coarse.start_y_s + fine, dys, t, y))
    s = int((best_x + best_y).argmin())
    refined = _fitted("bouncing", m.Jitter(dx=float(dxs[dx[s]]), dy=float(dys[dy[s]]), speed=float(speeds[s])),
                      float(coarse.start_x_s + fine[kx[s]]), float(coarse.start_y_s + fine[ky[s]]), t, x, y)
    return refined if refined.error_px <= coarse.error_px else coarse
