"""The few-step flow-matching schedule of Self-Forcing / CausVid."""

from __future__ import annotations


def shifted_sigmas(timesteps: list[float], shift: float) -> list[float]:
    """σ for each timestep after the flow-matching shift warp: σ' = shift·s / (1 + (shift − 1)·s), s = t/1000.

    With shift 5, [1000, 750, 500, 250] becomes σ = 1, 0.9375, 0.8333…, 0.625.
    """
    sigmas = []
    for t in timesteps:
        s = t / 1000.0
        sigmas.append(shift * s / (1.0 + (shift - 1.0) * s))
    return sigmas


def model_timesteps(sigmas: list[float]) -> list[float]:
    """The timestep the model is conditioned on for each σ: t = 1000·σ."""
    return [1000.0 * s for s in sigmas]
