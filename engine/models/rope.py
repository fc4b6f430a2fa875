"""Rotary position embedding with arbitrary frame positions.

diffusers' ``WanRotaryPosEmbed`` always numbers frames from 0 for the tensor it
is given. A streamed block needs its keys numbered after the history, so this
builds the same tables (same split of head_dim into t/h/w, same frequencies,
from diffusers' own ``get_1d_rotary_pos_embed``) and indexes the frame axis by
position.
"""

from __future__ import annotations

import torch
from diffusers.models.embeddings import get_1d_rotary_pos_embed


class FrameRotaryEmbedding:
    """cos/sin tables for tokens laid out frame-major: ``[frame, row, col]``."""

    def __init__(self, head_dim: int, rows: int, cols: int, max_frames: int, theta: float = 10000.0) -> None:
        self.head_dim = head_dim
        self.rows = rows
        self.cols = cols
        self.max_frames = max_frames
        h_dim = w_dim = 2 * (head_dim // 6)
        t_dim = head_dim - h_dim - w_dim
        # Half-width tables: one angle per rotated pair of channels.
        self._tables = []
        for dim, length in ((t_dim, max_frames), (h_dim, rows), (w_dim, cols)):
            cos, sin = get_1d_rotary_pos_embed(
                dim, length, theta, use_real=True, repeat_interleave_real=True, freqs_dtype=torch.float64
            )
            self._tables.append((cos[:, 0::2].float(), sin[:, 0::2].float()))
        self._cache: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def tokens_per_frame(self) -> int:
        return self.rows * self.cols

    def for_frames(self, num_frames: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape ``[num_frames * rows * cols, 1, head_dim // 2]`` for frame positions 0..num_frames-1.

        Frames numbered from 0 cover every use: a block's context is
        ``sink | window | block`` numbered contiguously, and a suffix of the
        result serves the queries.
        """
        if not 0 < num_frames <= self.max_frames:
            raise ValueError(f"{num_frames} frames outside the rotary range 1..{self.max_frames}")
        key = (num_frames, str(device))
        cached = self._cache.get(key)
        if cached is None:
            (tc, ts), (hc, hs), (wc, ws) = self._tables
            f, r, c = num_frames, self.rows, self.cols

            def grid(t, h, w):
                return torch.cat(
                    [
                        t[:f].view(f, 1, 1, -1).expand(f, r, c, -1),
                        h[:r].view(1, r, 1, -1).expand(f, r, c, -1),
                        w[:c].view(1, 1, c, -1).expand(f, r, c, -1),
                    ],
                    dim=-1,
                ).reshape(f * r * c, 1, -1)

            cached = (grid(tc, hc, wc).to(device), grid(ts, hs, ws).to(device))
            self._cache[key] = cached
        return cached


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved channel pairs of ``x [..., S, H, D]`` (Wan's convention), in float32."""
    pairs = x.float().unflatten(-1, (-1, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)
    return out.to(x.dtype)
