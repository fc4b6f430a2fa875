"""One session's KV handle: the only view of the cache a model call gets."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

import torch

from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.block_table import BranchBlockTable
from engine.kv_cache.cross_cache import CrossAttentionCache
from engine.kv_cache.spec import KVSpec


class SessionKVState:
    """Self-attention blocks per KV branch plus named cross-attention caches.

    Contracts:
    * lengths are frame-aligned: a forward covers whole latent frames;
    * a forward stages the current block's K/V; :meth:`commit` copies it into
      blocks only after the forward succeeded, so a failure leaves nothing half
      written;
    * :meth:`clear_cross_attention` drops text K/V but keeps self-KV (prompt change);
    * :meth:`reset` can keep named cross caches; :meth:`close` releases everything
      and is idempotent.

    The handle holds the storage it works on (pool, cross caches, staging),
    never the manager that made it: the manager hears of a close only through
    ``on_close``.
    """

    def __init__(
        self,
        session_id: str,
        tables: dict[str, BranchBlockTable],
        *,
        spec: KVSpec,
        block_pool: BlockPool,
        cross_cache: CrossAttentionCache,
        staging: torch.Tensor,
        on_close: Callable[[str], None],
    ) -> None:
        self.session_id = session_id
        self.tables = tables
        self.spec = spec
        self._block_pool = block_pool
        self._cross_cache = cross_cache
        self._staging = staging  # [slots, branches, layers, 2, frames_per_block * tokens_per_frame, heads, head_dim]
        self._on_close = on_close
        self.closed = False
        # While a journal is open, commits record what they did (and keep the frames they evict) so that
        # the block can be taken back (supersede, engine/undo.py).
        self._journal: list[tuple[str, int, int | None]] | None = None
        self._held: set[int] = set()  # evicted blocks kept for an undo; freed with the state at the latest

    @property
    def branch_names(self) -> tuple[str, ...]:
        return tuple(self.tables)

    @property
    def pool(self) -> torch.Tensor:
        """The block pool's storage ``[layers, 2, blocks, tokens_per_frame, heads, head_dim]`` that history ids index."""
        return self._block_pool.storage

    def table(self, branch: str) -> BranchBlockTable:
        if self.closed:
            raise RuntimeError(f"KV state of session {self.session_id!r} is closed")
        try:
            return self.tables[branch]
        except KeyError:
            raise KeyError(f"unknown KV branch {branch!r}; expected one of {self.branch_names}") from None

    # --- self-attention -------------------------------------------------
    def history(self, branch: str) -> tuple[torch.Tensor | None, int]:
        """(block ids on the device or None, number of history frames) for one branch."""
        table = self.table(branch)
        if table.num_resident == 0:
            return None, 0
        return table.history_ids_tensor(), table.num_resident

    def resident_block_ids(self, branch: str) -> list[int]:
        return self.table(branch).history_block_ids()

    def num_resident_blocks(self, branch: str) -> int:
        return self.table(branch).num_resident

    def committed_frames(self, branch: str) -> int:
        return self.table(branch).committed_frames

    def staging(self, branch: str, slot: int = 0) -> torch.Tensor:
        """``[layers, 2, frames_per_block * tokens_per_frame, heads, head_dim]`` written by a commit forward (in a
        batched one, the session's slot)."""
        self.table(branch)
        return self._staging_for(branch, slot)

    def staging_batch(self, branch: str, batch: int) -> torch.Tensor:
        """Slots ``[0, batch)`` of the branch's staging, ``[batch, layers, 2, tokens, heads, head_dim]``: a batched
        commit forward's, session ``b`` in slot ``b`` (the slots are shared by every session of the manager)."""
        self.table(branch)
        if not 0 < batch <= self._staging.shape[0]:
            raise ValueError(f"a batch of {batch} sessions; the staging has {self._staging.shape[0]} slots")
        return self._staging[:batch, self.spec.branch_names.index(branch)]

    def _staging_for(self, branch: str, slot: int = 0) -> torch.Tensor:
        return self._staging[slot, self.spec.branch_names.index(branch)]

    def commit(self, branch: str, num_frames: int, slot: int = 0) -> None:
        """Move ``num_frames`` staged frames (of staging slot ``slot``) into blocks (evicting old window frames)."""
        table = self.table(branch)
        if not 0 < num_frames <= self.spec.frames_per_block:
            raise ValueError(f"commit of {num_frames} frames; a block has {self.spec.frames_per_block}")
        block_ids = []
        for _ in range(num_frames):
            block, evicted = table.append_frame(hold_evicted=self._journal is not None)
            block_ids.append(block)
            if self._journal is not None:
                self._journal.append((branch, block, evicted))
                if evicted is not None:
                    self._held.add(evicted)
        self._write_blocks(branch, block_ids, slot)

    # --- taking commits back --------------------------------------------
    def begin_journal(self) -> None:
        """From now on commits are recorded (and what they evict is held) until :meth:`take_journal`."""
        self._journal = []

    def take_journal(self) -> list[tuple[str, int, int | None]]:
        """The commits since :meth:`begin_journal` as ``(branch, block, evicted)``; journaling stops."""
        journal, self._journal = self._journal or [], None
        return journal

    def undo(self, journal: list[tuple[str, int, int | None]]) -> None:
        """Take back the journal's commits (the newest first: they must be the last ones made)."""
        for branch, block, evicted in reversed(journal):
            self.table(branch).undo_frame(block, evicted)
            self._held.discard(evicted)

    def settle(self, journal: list[tuple[str, int, int | None]]) -> None:
        """The journal's commits are final: the frames they evicted go back to the pool."""
        evicted = [block for _, _, block in journal if block is not None and block in self._held]
        self._held.difference_update(evicted)
        self._block_pool.free(evicted)

    def _free_held(self) -> None:
        held, self._held = list(self._held), set()
        self._block_pool.free(held)
        self._journal = None

    def overwrite(self, branch: str, block_ids: list[int]) -> None:
        """Replace resident blocks' K/V in place from staging (prompt recache)."""
        resident = set(self.table(branch).history_block_ids())
        if not set(block_ids) <= resident:
            raise ValueError("overwrite targets blocks this branch does not hold")
        self._write_blocks(branch, block_ids)

    def _write_blocks(self, branch: str, block_ids: list[int], slot: int = 0) -> None:
        spec = self.spec
        staged = self._staging_for(branch, slot)[:, :, : len(block_ids) * spec.tokens_per_frame]
        staged = staged.unflatten(2, (len(block_ids), spec.tokens_per_frame))
        storage = self._block_pool.storage
        # One copy per block with host-side ids: an index tensor built on the host would make the
        # host wait for the device (a pageable copy) at every commit.
        for position, block in enumerate(block_ids):
            storage[:, :, block].copy_(staged[:, :, position])

    # --- cross-attention ------------------------------------------------
    def is_cross_populated(self, branch: str, name: str) -> bool:
        self.table(branch)
        return self._cross_cache.is_populated(self.session_id, branch, name)

    def populate_cross(self, branch: str, name: str, layer_kv: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.table(branch)
        self._cross_cache.populate(self.session_id, branch, name, layer_kv)

    def read_cross(self, branch: str, name: str) -> torch.Tensor:
        self.table(branch)
        return self._cross_cache.read(self.session_id, branch, name)

    def clear_cross_attention(self) -> None:
        """Invalidate text K/V, keeping every self-attention block (soft prompt switch)."""
        if self.closed:
            raise RuntimeError(f"KV state of session {self.session_id!r} is closed")
        self._cross_cache.release(self.session_id)

    # --- lifetime -------------------------------------------------------
    def reset(self, *, keep_cross_attention: Collection[str] = ()) -> None:
        """Release every block (and cross caches not kept); the session starts over."""
        if self.closed:
            raise RuntimeError(f"KV state of session {self.session_id!r} is closed")
        unknown = set(keep_cross_attention) - set(self.spec.cross_attention_lengths)
        if unknown:
            raise KeyError(f"unknown cross-attention caches to keep: {sorted(unknown)}")
        for table in self.tables.values():
            table.release()
        self._free_held()
        self._cross_cache.release(self.session_id, keep=keep_cross_attention)

    def close(self) -> None:
        if self.closed:
            return
        for table in self.tables.values():
            table.release()
        self._free_held()
        self._cross_cache.release(self.session_id)
        self.closed = True
        self._on_close(self.session_id)

    def nbytes(self) -> int:
        """Bytes this session holds now: its resident blocks and published cross caches."""
        spec = self.spec
        blocks = (sum(t.num_resident for t in self.tables.values()) + len(self._held)) * spec.block_bytes
        cross = sum(
            spec.cross_cache_bytes(name)
            for branch in self.tables
            for name in spec.cross_attention_lengths
            if self._cross_cache.is_populated(self.session_id, branch, name)
        )
        return blocks + cross
