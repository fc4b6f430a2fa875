"""CUDA graphs: recording one (the side-stream warm-up capture needs), and the cache every graph user keeps.

Four places replay graphs: the DiT forwards (``engine/models/forward_graphs.py``), the history load
(``engine/models/context_kv.py``), the text encoder (``engine/models/text_graphs.py``) and the audio decoder
(``decoders/audio_graphs.py``: its compiled buckets and its plain graphs, one cache each). They share
:func:`capture` and :class:`GraphCache`: one memory pool per cache, a bound on its graphs, and one rule for a
failed capture (that cache runs eagerly from then on: the eager path is the reference anyway). It lives in
``decoders/``, the lowest of the packages, so that the engine and the decoders both import it downward.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable
from typing import Generic, Literal, TypeVar

import torch

log = logging.getLogger("arstream.graphs")

T = TypeVar("T")
E = TypeVar("E")


def capture(fn: Callable[[], T], *, warm_runs: int = 1, pool=None, device=None) -> tuple[torch.cuda.CUDAGraph, T]:
    """``fn()`` recorded as a CUDA graph in ``pool``; returns the graph and the outputs its replays overwrite.

    ``warm_runs`` eager runs come first, on a side stream as capture requires: kernels pick their
    algorithms, cuBLAS/cuDNN their workspaces and lazy modules initialise there, not in the recording.
    They write what the replays will write again.
    """
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warm_runs):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = fn()
    return graph, output


class GraphCache(Generic[E]):
    """Captured entries (a graph and its buffers) by key, all in one memory pool, at most ``max_graphs``.

    When full, ``on_full`` decides: ``"eager"`` — a new key is not captured (its calls run eagerly; an
    engine meets its few shapes at warm-up), or ``"retire"`` — every entry and the pool are dropped
    together and capturing starts afresh (graphs of one pool reuse each other's freed blocks, so one
    cannot be dropped alone: a later capture could be handed memory an older graph still writes).
    A capture that raises turns the cache off for good, logged once.
    """

    def __init__(self, name: str, max_graphs: int, *, enabled: bool = True,
                 on_full: Literal["eager", "retire"] = "eager",
                 new_pool: Callable[[], object] = torch.cuda.graph_pool_handle,
                 capturing: Callable[[], bool] = torch.cuda.is_current_stream_capturing) -> None:
        """``new_pool`` / ``capturing``: CUDA's, given otherwise only where there is no CUDA (the CPU tests of
        this bookkeeping)."""
        if max_graphs < 1:
            raise ValueError(f"max_graphs must be >= 1, got {max_graphs}")
        self.name = name
        self._new_pool = new_pool
        self._capturing = capturing
        self.max_graphs = max_graphs
        self.enabled = enabled
        self.on_full = on_full
        self.retired_generations = 0
        self._entries: dict[Hashable, E] = {}
        self._pool = None

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> tuple:
        return tuple(self._entries)

    def entries(self) -> tuple[E, ...]:
        return tuple(self._entries.values())

    @property
    def pool(self):
        """The pool handle the entries share (None before the first capture, and after :meth:`clear`)."""
        return self._pool

    def get(self, key: Hashable) -> E | None:
        return self._entries.get(key)

    def capture(self, key: Hashable, record: Callable[[object], E]) -> E | None:
        """The entry ``record(pool)`` captures into this cache's pool, or None where the cache is off, full
        (``"eager"``) or the capture failed."""
        if not self.enabled or self._capturing():  # nested capture is not allowed: the caller runs eagerly
            return None
        if len(self._entries) >= self.max_graphs:
            if self.on_full == "eager":
                return None
            self.retire()
        if self._pool is None:
            self._pool = self._new_pool()
        try:
            entry = record(self._pool)
        except Exception:
            self.enabled = False
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()  # let a fault of the failed capture surface here, not in a later call
            log.warning("CUDA graph capture failed; running eagerly from now on", extra={"graphs": self.name},
                        exc_info=True)
            return None
        self._entries[key] = entry
        return entry

    def clear(self) -> None:
        """Drop every entry and the pool with them (capturing into a dropped graph's pool again is an error)."""
        self._entries.clear()
        self._pool = None

    def retire(self) -> None:
        """:meth:`clear`, counted as a retired generation."""
        if self._entries:
            log.info("retiring CUDA graphs", extra={"graphs": self.name, "count": len(self._entries)})
        self.clear()
        self.retired_generations += 1
