"""The KV cache manager: pools, per-session reservations and staging for commits."""

from __future__ import annotations

import torch

from engine.kv_cache.block_pool import BlockPool
from engine.kv_cache.block_table import BranchBlockTable
from engine.kv_cache.cross_cache import CrossAttentionCache
from engine.kv_cache.spec import KVSpec
from engine.kv_cache.state import SessionKVState


class KVCacheManager:
    """Owns every KV tensor; hands sessions a small :class:`SessionKVState` handle.

    Capacity is counted in whole sessions: opening a session reserves its
    maximum residency (``sink + window`` blocks per branch, one cross cache per
    name and branch), so a running session can never hit an empty pool mid
    stream. A full manager answers ``None``, never an exception.

    Two sides, two threads:
    * admission (the event loop) *reserves* a slot when a session is admitted
      and gives it back when the session ends (:meth:`reserve`, :meth:`unreserve`);
    * the device thread opens and closes the session's state
      (:meth:`open_session`, ``SessionKVState.close``). A step plan releases
      ended sessions before it opens new ones, so a reservation handed from an
      ended session to a newcomer never finds its blocks still taken.
    """

    def __init__(self, spec: KVSpec, max_sessions: int, device: torch.device | str) -> None:
        if max_sessions <= 0:
            raise ValueError("max_sessions must be positive")
        self.spec = spec
        self.max_sessions = max_sessions
        self.device = torch.device(device)
        self.block_pool = BlockPool(spec, max_sessions * spec.blocks_per_session, device)
        # One spare slot per name makes atomic publishing possible (see CrossAttentionCache).
        self.cross_cache = CrossAttentionCache(spec, max_sessions * len(spec.branch_names) + 1, device)
        # The current block's K/V per branch, written by a commit forward and copied
        # into blocks only once that forward has succeeded; a slot for each session of a batched forward.
        self.staging_slots = torch.empty(
            (
                spec.staging_slots,
                len(spec.branch_names),
                spec.num_layers,
                2,
                spec.frames_per_block * spec.tokens_per_frame,
                spec.num_kv_heads,
                spec.head_dim,
            ),
            dtype=spec.dtype,
            device=device,
        )
        self.staging = self.staging_slots[0]  # [branches, layers, 2, tokens, heads, head_dim]: one session's
        self._sessions: dict[str, SessionKVState] = {}
        self._reserved: set[str] = set()

    @property
    def num_sessions(self) -> int:
        return len(self._sessions)

    def reserve(self, session_id: str) -> int | None:
        """Reserve a session's residency: the slots still free afterwards, or ``None`` (nothing reserved) when full.

        Event loop only. This is the one capacity number admission asks for.
        """
        if session_id in self._reserved:
            raise ValueError(f"session {session_id!r} already holds a reservation")
        if len(self._reserved) >= self.max_sessions:
            return None
        self._reserved.add(session_id)
        return self.max_sessions - len(self._reserved)

    def unreserve(self, session_id: str) -> None:
        """Give an ended session's reservation back (event loop only; idempotent)."""
        self._reserved.discard(session_id)

    @property
    def num_reserved(self) -> int:
        return len(self._reserved)

    @property
    def blocks_in_use(self) -> int:
        return self.block_pool.num_blocks - self.block_pool.num_free_blocks

    @property
    def nbytes(self) -> int:
        return self.block_pool.nbytes + self.cross_cache.nbytes + self.staging_slots.numel() * self.staging_slots.element_size()

    def open_session(self, session_id: str) -> SessionKVState | None:
        """A fresh state for ``session_id``, or ``None`` when every reservation is taken."""
        if session_id in self._sessions:
            raise ValueError(f"session {session_id!r} already has KV state")
        if len(self._sessions) >= self.max_sessions:
            return None
        state = SessionKVState(
            session_id,
            self._new_tables(),
            spec=self.spec,
            block_pool=self.block_pool,
            cross_cache=self.cross_cache,
            staging=self.staging_slots,
            on_close=self._forget,
        )
        self._sessions[session_id] = state
        return state

    def _new_tables(self) -> dict[str, BranchBlockTable]:
        return {
            name: BranchBlockTable(self.block_pool, self.spec.sink_frames, self.spec.window_frames)
            for name in self.spec.branch_names
        }

    def _forget(self, session_id: str) -> None:
        self._sessions.pop(session_id, None)
