"""Rotary position embedding with arbitrary frame positions.

diffusers' ``WanRotaryPosEmbed`` always numbers frames from 0 for the tensor it
is given. A streamed block needs its keys numbered after the history, so this
builds the same tables (same split of head_dim into t/h/w, same frequencies,
from diffusers' own ``get_1d_rotary_pos_embed``) and indexes the frame axis by
position.

The spatial axes may take their own ``spatial_theta``: with Wan's 10000, a head of 32 dims gives each spatial axis
five frequencies of which only the two fastest move across a small frame (the tiny model's is 16 tokens wide), so
a position 6 tokens away looks to attention nearly like the query's own. A smaller base spreads the five across
the frame (docs/TINY_MODEL.md, *Pictures in everyday colours*). Trained weights say which base they were trained
with (``engine.models.trained``); the frame axis always keeps ``theta``.
"""

from __future__ import annotations

import torch
from diffusers.models.embeddings import get_1d_rotary_pos_embed

ROPE_THETA = 10000.0  # Wan2.1's base, for every axis


class FrameRotaryEmbedding:
    """cos/sin tables for tokens laid out frame-major: each frame's image tokens ``[row, col]``, then its audio tokens.

    Audio tokens (if any) sit on a virtual row just below the image, one column each.
    """

    def __init__(
        self,
        head_dim: int,
        rows: int,
        cols: int,
        max_frames: int,
        theta: float = ROPE_THETA,
        audio_tokens: int = 0,
        spatial_theta: float = ROPE_THETA,
    ) -> None:
        if not spatial_theta > 1.0:
            raise ValueError(f"spatial rotary base {spatial_theta} must be above 1")
        self.head_dim = head_dim
        self.rows = rows
        self.cols = cols
        self.audio_tokens = audio_tokens
        self.max_frames = max_frames
        self.spatial_theta = float(spatial_theta)
        h_dim = w_dim = 2 * (head_dim // 6)
        t_dim = head_dim - h_dim - w_dim
        row_index = torch.arange(rows).repeat_interleave(cols)
        col_index = torch.arange(cols).repeat(rows)
        if audio_tokens:
            row_index = torch.cat([row_index, torch.full((audio_tokens,), rows)])
            col_index = torch.cat([col_index, torch.arange(audio_tokens)])
        # Half-width tables: one angle per rotated pair of channels.
        halves = []
        axes = ((t_dim, max_frames, theta), (h_dim, rows + 1, spatial_theta), (w_dim, max(cols, audio_tokens), spatial_theta))
        for dim, length, base in axes:
            cos, sin = get_1d_rotary_pos_embed(
                dim, length, base, use_real=True, repeat_interleave_real=True, freqs_dtype=torch.float64
            )
            halves.append((cos[:, 0::2].float(), sin[:, 0::2].float()))
        (self._t_cos, self._t_sin), (h_cos, h_sin), (w_cos, w_sin) = halves
        # Within a frame the (row, col) part never changes: [tokens_per_frame, (h_dim + w_dim) / 2].
        self._hw_cos = torch.cat([h_cos[row_index], w_cos[col_index]], dim=-1)
        self._hw_sin = torch.cat([h_sin[row_index], w_sin[col_index]], dim=-1)
        self._cache: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def tokens_per_frame(self) -> int:
        return self.rows * self.cols + self.audio_tokens

    def for_frames(self, num_frames: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape ``[num_frames * tokens_per_frame, 1, head_dim // 2]`` for frame positions 0..num_frames-1.

        Frames numbered from 0 cover every use: a block's context is
        ``sink | window | block`` numbered contiguously, and a suffix of the
        result serves the queries.
        """
        if not 0 < num_frames <= self.max_frames:
            raise ValueError(f"{num_frames} frames outside the rotary range 1..{self.max_frames}")
        key = (num_frames, str(device))
        cached = self._cache.get(key)
        if cached is None:
            tokens = self.tokens_per_frame

            def grid(t_table, hw_table):
                t_part = t_table[:num_frames].unsqueeze(1).expand(num_frames, tokens, -1)
                hw_part = hw_table.unsqueeze(0).expand(num_frames, tokens, -1)
                return torch.cat([t_part, hw_part], dim=-1).reshape(num_frames * tokens, 1, -1).to(device)

            cached = (grid(self._t_cos, self._hw_cos), grid(self._t_sin, self._hw_sin))
            self._cache[key] = cached
        return cached
