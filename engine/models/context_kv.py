"""A block's attention context, gathered from the pool once per block instead of once per forward.

The 4 denoising forwards and the commit pass of one block all attend to the
same history: the branch's resident frames, at the same positions. The
per-forward path gathers those frames from the pool and rotates their keys in
every layer of every forward (5x the work, and a concatenation on top). Here
one buffer per KV branch holds, for every layer::

    [layers, 2 (K, V), context tokens, heads, head_dim]
    | history: sink + window frames, keys rotated at 0..S_h-1 | current block |
      filled by load(), once per block                         written by each forward

One buffer per branch serves every session: the engine runs one session's
forward at a time, and :meth:`ContextKV.load` re-gathers whenever the owner
(session state, branch, committed frames, pool writes) differs from the last
load, so stepwise execution that interleaves sessions stays correct, it only
gathers more often. Its bytes are those of one session's full context per
branch, allocated when the pipeline is built (before the memory budget is
measured, so admission sees them as used).
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class ContextKV:
    def __init__(
        self,
        *,
        num_layers: int,
        max_tokens: int,
        num_heads: int,
        head_dim: int,
        tokens_per_frame: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.tokens_per_frame = tokens_per_frame
        self.buffer = torch.empty((num_layers, 2, max_tokens, num_heads, head_dim), dtype=dtype, device=device)
        self._owner: tuple | None = None  # (kv state, branch, committed frames, pool writes) of the last load
        self.loads = 0

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    @torch.no_grad()
    def load(
        self,
        owner: tuple,
        pool: torch.Tensor,
        block_ids: list[int],
        cos: torch.Tensor,
        sin: torch.Tensor,
        rotate: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> int:
        """Make the buffer's history the frames ``block_ids`` (oldest first), keys rotated; return its token count.

        ``owner`` identifies what the history belongs to; if it matches the last
        load, nothing is done. Block ids are host integers (the block table's),
        so the gather needs no index tensor and no host-device synchronisation.
        """
        tokens = len(block_ids) * self.tokens_per_frame
        if owner == self._owner:
            return tokens
        self._owner = None  # a failed load must not be taken for a complete one
        frame = self.tokens_per_frame
        for position, block in enumerate(block_ids):
            self.buffer[:, :, position * frame : (position + 1) * frame].copy_(pool[:, :, block])
        for layer in range(self.buffer.shape[0] if tokens else 0):  # an empty history: nothing to rotate
            keys = self.buffer[layer, 0, :tokens]
            keys.copy_(rotate(keys, cos[:tokens], sin[:tokens]))
        self._owner = owner
        self.loads += 1
        return tokens

    def invalidate(self) -> None:
        self._owner = None
