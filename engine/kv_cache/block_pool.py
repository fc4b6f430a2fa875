"""One preallocated tensor of KV blocks and its free list."""

from __future__ import annotations

from collections import deque

import torch

from engine.kv_cache.spec import KVSpec


class BlockPool:
    """All self-attention KV blocks, allocated once at start-up.

    Storage is ``[num_layers, 2, num_blocks, tokens_per_frame, heads, head_dim]``
    so each layer reads its history with one ``index_select`` on a contiguous
    view. Nothing is allocated inside a step; running out is a ``None``.
    """

    def __init__(self, spec: KVSpec, num_blocks: int, device: torch.device | str) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.spec = spec
        self.num_blocks = num_blocks
        # Zeroed, not empty: a never-written block holds no NaN bit patterns that could leak into a comparison.
        self.storage = torch.zeros(
            (spec.num_layers, 2, num_blocks, spec.tokens_per_frame, spec.num_kv_heads, spec.head_dim),
            dtype=spec.dtype,
            device=device,
        )
        self._free: deque[int] = deque(range(num_blocks))
        self._free_set: set[int] = set(self._free)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def allocate(self, count: int) -> list[int] | None:
        """Take ``count`` blocks, or ``None`` (taking nothing) if fewer are free."""
        if count > len(self._free):
            return None
        ids = [self._free.popleft() for _ in range(count)]
        self._free_set.difference_update(ids)
        return ids

    def free(self, block_ids: list[int]) -> None:
        for block_id in block_ids:
            if block_id in self._free_set or not 0 <= block_id < self.num_blocks:
                raise RuntimeError(f"block {block_id} freed twice or out of range")
            self._free.append(block_id)
            self._free_set.add(block_id)
