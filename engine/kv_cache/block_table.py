"""Per-branch block table: the sink frames kept forever plus a ring of recent frames."""

from __future__ import annotations

from collections import deque

import torch

from engine.kv_cache.block_pool import BlockPool


class BranchBlockTable:
    """Which pool blocks hold one KV branch's committed frames, oldest first.

    ::

        committed frames:  0 1 2 | 3 ... n-W-1 | n-W ... n-1
                           sink    (evicted)     window ring
        history order:     sink blocks, then window blocks, oldest first

    Frame positions seen by the model are indices into this history, so they
    stay below ``sink + window + frames_per_block`` however long the session runs.
    """

    def __init__(self, pool: BlockPool, sink_frames: int, window_frames: int) -> None:
        self.pool = pool
        self.sink_frames = sink_frames
        self.window_frames = window_frames
        self.sink_ids: list[int] = []
        self.window_ids: deque[int] = deque()
        self.committed_frames = 0
        self._ids_tensor: torch.Tensor | None = None

    @property
    def num_resident(self) -> int:
        return len(self.sink_ids) + len(self.window_ids)

    def history_block_ids(self) -> list[int]:
        return self.sink_ids + list(self.window_ids)

    def history_ids_tensor(self) -> torch.Tensor:
        """History block ids on the pool's device, rebuilt only when the table changes."""
        if self._ids_tensor is None:
            self._ids_tensor = torch.tensor(
                self.history_block_ids(), dtype=torch.long, device=self.pool.storage.device
            )
        return self._ids_tensor

    def append_frame(self, *, hold_evicted: bool = False) -> tuple[int, int | None]:
        """Give the next committed frame a block, evicting the oldest window frame when full; returns
        ``(new block, evicted block or None)``.

        The evicted block goes back to the pool before the new one is taken, so a
        session at steady state needs no free block beyond its own — unless
        ``hold_evicted``: then the caller keeps it (to put it back, :meth:`undo_frame`, or free it later).
        """
        evicted = None
        if len(self.sink_ids) < self.sink_frames:
            target = self.sink_ids
        else:
            if len(self.window_ids) == self.window_frames:
                evicted = self.window_ids.popleft()
                if not hold_evicted:
                    self.pool.free([evicted])
            target = self.window_ids
        ids = self.pool.allocate(1)
        if ids is None:
            raise RuntimeError("KV pool exhausted while committing a reserved session; admission is broken")
        target.append(ids[0])
        self.committed_frames += 1
        self._ids_tensor = None
        return ids[0], None if evicted is None or not hold_evicted else evicted

    def undo_frame(self, block: int, evicted: int | None) -> None:
        """Take back the last committed frame (``block``, freed) and restore the window frame its commit
        evicted (``evicted``, held since)."""
        target = self.window_ids if self.window_ids and self.window_ids[-1] == block else self.sink_ids
        if not target or target[-1] != block:
            raise RuntimeError("undo of a frame that is not the last committed one")
        target.pop()
        self.pool.free([block])
        if evicted is not None:
            self.window_ids.appendleft(evicted)
        self.committed_frames -= 1
        self._ids_tensor = None

    def release(self) -> None:
        self.pool.free(self.history_block_ids())
        self.sink_ids = []
        self.window_ids = deque()
        self.committed_frames = 0
        self._ids_tensor = None
