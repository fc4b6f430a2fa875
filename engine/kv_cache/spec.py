"""What a pipeline declares so the runner can build KV pools without knowing the model."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class KVSpec:
    """Shape of one session's attention state, derived from the model config.

    One *block* is one latent frame of self-attention K/V for every layer:
    ``[num_layers, 2 (K, V), tokens_per_frame, num_kv_heads, head_dim]``.
    A branch of a session keeps at most ``sink_frames + window_frames`` of them::

        attention context of a block
        | sink (first frames, kept) | window (last frames, a ring) | current block |
          sink_frames                 window_frames                  frames_per_block
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    tokens_per_frame: int
    frames_per_block: int
    sink_frames: int
    window_frames: int
    branch_names: tuple[str, ...]
    cross_attention_lengths: dict[str, int] = field(default_factory=dict)
    model_state_bytes: int = 0
    dtype: torch.dtype = torch.float32
    # Window frames a branch may hold after evicting them, for blocks that can still be taken back (supersede:
    # ``undo_blocks`` blocks' worth); 0 when nothing is ever taken back.
    held_frames: int = 0
    # Sessions one forward may batch: each stages its commit in a slot of its own (engine/models/pipeline.py).
    staging_slots: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "tokens_per_frame", "frames_per_block", "window_frames"):
            if getattr(self, name) <= 0:
                raise ValueError(f"KVSpec.{name} must be positive, got {getattr(self, name)}")
        if self.staging_slots < 1:
            raise ValueError("KVSpec.staging_slots must be >= 1")
        if self.sink_frames < 0:
            raise ValueError("KVSpec.sink_frames must be >= 0")
        if not self.branch_names or len(set(self.branch_names)) != len(self.branch_names):
            raise ValueError(f"KVSpec.branch_names must be unique and non-empty, got {self.branch_names}")

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def resident_frames(self) -> int:
        """Committed frames a branch keeps, whatever the session length."""
        return self.sink_frames + self.window_frames

    @property
    def context_frames(self) -> int:
        """Frames a block attends to: resident history plus itself."""
        return self.resident_frames + self.frames_per_block

    @property
    def block_bytes(self) -> int:
        """Bytes of one block (one latent frame, all layers, K and V)."""
        return self.num_layers * 2 * self.tokens_per_frame * self.num_kv_heads * self.head_dim * self.element_size

    def cross_cache_bytes(self, name: str) -> int:
        length = self.cross_attention_lengths[name]
        return self.num_layers * 2 * length * self.num_kv_heads * self.head_dim * self.element_size

    @property
    def blocks_per_session(self) -> int:
        return len(self.branch_names) * (self.resident_frames + self.held_frames)

    @property
    def session_bytes(self) -> int:
        """Most KV bytes one session can hold: resident blocks and one cross cache per name, per branch."""
        cross = sum(self.cross_cache_bytes(name) for name in self.cross_attention_lengths)
        frames = self.resident_frames + self.held_frames
        return len(self.branch_names) * (frames * self.block_bytes + cross) + self.model_state_bytes
