"""Frames of a scene, rendered with torch (CPU or GPU) at 256x144.

Shapes are drawn with 2x2 supersampling, so edges are anti-aliased and a
moving object's outline changes smoothly from frame to frame.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from world.grammar import BACKGROUNDS, COLOURS, Scene
from world.motion import FPS, HEIGHT, WIDTH

CIRCLE_RADIUS = 18.0
SQUARE_HALF = 16.0
TRIANGLE_HALF_WIDTH, TRIANGLE_HALF_HEIGHT = 20.0, 18.0
STRIPE_PERIOD, CHECKER_SIZE = 32, 24
TEXTURE_SHADE = 0.6  # the darker tone of a textured background, relative to its colour


def frame_times(num_frames: int, start_frame: int = 0) -> np.ndarray:
    return (start_frame + np.arange(num_frames)) / FPS


def shape_mask(shape: str, cx: torch.Tensor, cy: torch.Tensor, height: int = HEIGHT, width: int = WIDTH) -> torch.Tensor:
    """``[T, H, W]`` coverage in [0, 1] of ``shape`` centred at ``(cx[t], cy[t])``."""
    device = cx.device
    offsets = torch.tensor([0.25, 0.75], device=device)
    ys = (torch.arange(height, device=device).unsqueeze(1) + offsets).reshape(-1)  # [2H] sub-pixel rows
    xs = (torch.arange(width, device=device).unsqueeze(1) + offsets).reshape(-1)
    dx = xs.view(1, 1, -1) - cx.view(-1, 1, 1)
    dy = ys.view(1, -1, 1) - cy.view(-1, 1, 1)
    if shape == "circle":
        inside = dx * dx + dy * dy <= CIRCLE_RADIUS**2
    elif shape == "square":
        inside = (dx.abs() <= SQUARE_HALF) & (dy.abs() <= SQUARE_HALF)
    elif shape == "triangle":
        # Apex at the top centre, base along the bottom: it fills half its bounding box.
        depth = (dy + TRIANGLE_HALF_HEIGHT) / (2 * TRIANGLE_HALF_HEIGHT)
        inside = (depth >= 0) & (depth <= 1) & (dx.abs() <= TRIANGLE_HALF_WIDTH * depth)
    else:
        raise ValueError(f"unknown shape {shape!r}")
    return inside.float().view(-1, height, 2, width, 2).mean(dim=(2, 4))


def background(name: str, texture: str, device, height: int = HEIGHT, width: int = WIDTH,
               rgb: tuple[float, float, float] | None = None) -> torch.Tensor:
    """``[3, H, W]`` in [0, 1]; textures are fixed patterns (no seed), so a caption fixes its background.
    ``rgb``: another shade of it than the palette's (a picture in everyday colours)."""
    colour = torch.tensor(rgb or BACKGROUNDS[name], device=device).view(3, 1, 1)
    ys = torch.arange(height, device=device).view(-1, 1)
    xs = torch.arange(width, device=device).view(1, -1)
    if texture == "plain":
        shade = torch.ones(height, width, device=device)
    elif texture == "striped":
        shade = torch.where((xs // (STRIPE_PERIOD // 2)) % 2 == 0, 1.0, TEXTURE_SHADE).expand(height, width)
    elif texture == "checkered":
        shade = torch.where((xs // CHECKER_SIZE + ys // CHECKER_SIZE) % 2 == 0, 1.0, TEXTURE_SHADE)
    else:
        raise ValueError(f"unknown texture {texture!r}")
    return colour * shade


@dataclass(frozen=True)
class Shades:
    """The colours a scene is drawn in where they are not the palette's: a picture's everyday shade of its
    caption's colours (RGB in [0, 1])."""

    object: tuple[float, float, float]
    background: tuple[float, float, float]

    @staticmethod
    def around(scene: Scene, rng: np.random.Generator) -> "Shades":
        """Random shades near the palette's: the background brighter or darker (0.7-1.9 x) and tinted (+-0.12 per
        channel), the object a little (0.85-1.1 x, +-0.06): an ordinary blue (35, 60, 190) or a pure one
        (0, 0, 255) for the palette's (20, 36, 133). A background that comes near the object's colour (0.3 or
        less on every channel) is drawn again."""
        base_object, base_ground = np.array(COLOURS[scene.colour]), np.array(BACKGROUNDS[scene.background])
        while True:
            ground = np.clip(base_ground * rng.uniform(0.7, 1.9) + rng.uniform(-0.12, 0.12, 3), 0, 1)
            thing = np.clip(base_object * rng.uniform(0.85, 1.1) + rng.uniform(-0.06, 0.06, 3), 0, 1)
            if np.abs(ground - thing).max() > 0.3:
                return Shades(tuple(float(v) for v in thing), tuple(float(v) for v in ground))


def render(scene: Scene, cx: np.ndarray, cy: np.ndarray, device="cpu") -> torch.Tensor:
    """``[3, T, H, W]`` in [0, 1]: the scene with its object at ``(cx[t], cy[t])``."""
    return render_with_coverage(scene, cx, cy, device)[0]


def render_with_coverage(scene: Scene, cx, cy, device="cpu", shades: Shades | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`render` and the object's ``[T, H, W]`` coverage (training weighs the object's pixels up).
    ``shades``: the object's and the background's colours as drawn, where not the palette's."""
    cx_t = torch.as_tensor(cx, dtype=torch.float32, device=device)
    cy_t = torch.as_tensor(cy, dtype=torch.float32, device=device)
    mask = shape_mask(scene.shape, cx_t, cy_t).unsqueeze(0)  # [1, T, H, W]
    colour = torch.tensor(shades.object if shades else COLOURS[scene.colour], device=device).view(3, 1, 1, 1)
    ground = background(scene.background, scene.texture, device, rgb=shades.background if shades else None)
    frames = ground.unsqueeze(1) * (1 - mask) + colour * mask
    return frames, mask[0]
