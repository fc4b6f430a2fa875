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

With FP8 attention (``fp8 = attention | all``) each branch also holds an e4m3
mirror of that context (:class:`FP8ContextKV`): :meth:`ContextKV.load`
quantizes every layer's rotated history K and its V into it once per block,
with per-head *history* scales; each forward quantizes its current block's K/V
after the history with per-head *current* scales, and the FP8 kernel reads
both segments (:func:`engine.models.fp8_attention.fp8_attention_segments`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.models import fp8_attention as fa
from engine.models import history_fp8
from decoders.graph_capture import GraphCache, capture

HISTORY, CURRENT = 0, 1  # the segments of the FP8 mirror's scales


class FP8ContextKV:
    """The e4m3 mirror of one branch's context, laid out for the FP8 attention kernel::

        k       [layers, S_max, heads, head_dim]          e4m3, head_dim contiguous (QKᵀ's K-major operand)
        v       [layers, heads, head_dim, S_pad]          e4m3, keys contiguous (PV's K-major operand on Hopper),
                                                          S_pad = S_max rounded up to 16 (16-byte aligned rows)
        scales  [layers, 2 (k, v), 2 (history, current), 1, heads]   float32

    Rows ``[0, history_tokens)`` hold the history (quantized by :meth:`quantize` with ``HISTORY`` once per
    block), the rows after it the current block (``CURRENT``, every forward). Fixed buffers, allocated once:
    every forward's kernels read the same addresses (CUDA graphs), and the bytes are in use before the
    engine measures its memory budget. Bytes: ``layers * heads * head_dim * (S_max + S_pad) + 16 * layers * heads``.
    """

    def __init__(self, *, num_layers: int, max_tokens: int, num_heads: int, head_dim: int, device: torch.device):
        padded = -(-max_tokens // fa.V_ROW_ALIGN) * fa.V_ROW_ALIGN
        self.k = torch.zeros((num_layers, max_tokens, num_heads, head_dim), dtype=fa.FP8_DTYPE, device=device)
        self.v = torch.zeros((num_layers, num_heads, head_dim, padded), dtype=fa.FP8_DTYPE, device=device)
        self.scales = torch.ones((num_layers, 2, 2, 1, num_heads), dtype=torch.float32, device=device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v, self.scales))

    # The batch axis is added before slicing, so its stride is the whole layer's (a multiple of 16), never
    # the slice's length: Triton specialises every integer argument on divisibility by 16, and a batch
    # stride of e.g. 32,760 (a slice's key count) cost it the proof that the V rows are 16-byte aligned:
    # V read byte by byte instead of by 16-byte asynchronous copies (sm_90 PTX): the standard window's FP8
    # block ran several times slower, at key counts that are not multiples of 16 only (docs/FP8.md).

    def keys(self, layer: int, start: int, end: int) -> torch.Tensor:
        """Rows ``start:end`` of one layer's K as the kernel's ``[1, S, H, D]``."""
        return self.k[layer].unsqueeze(0)[:, start:end]

    def values(self, layer: int, start: int, end: int) -> torch.Tensor:
        """Keys ``start:end`` of one layer's transposed V as a ``[1, S, H, D]`` view (``stride(1) == 1``)."""
        return self.v[layer].unsqueeze(0)[..., start:end].permute(0, 3, 1, 2)

    def quantize(self, layer: int, segment: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """``keys`` (rotated) and ``values`` ``[S, H, D]`` into rows ``start:start+S``, with the segment's scales."""
        end = start + keys.shape[0]
        fa.quantize_per_head_into(keys.unsqueeze(0), self.keys(layer, start, end), self.scales[layer, 0, segment])
        self.quantize_values(layer, segment, start, values)

    def quantize_values(self, layer: int, segment: int, start: int, values: torch.Tensor) -> None:
        """:meth:`quantize`'s values alone (the keys written by :mod:`engine.models.qk_quantize`, whose scale
        :meth:`set_key_scale` records)."""
        end = start + values.shape[0]
        fa.quantize_per_head_into(values.unsqueeze(0), self.values(layer, start, end), self.scales[layer, 1, segment])

    def set_key_scale(self, layer: int, segment: int, scale: torch.Tensor) -> None:
        """The per-head scale ``[heads]`` of keys written into the segment's rows by another quantizer."""
        self.scales[layer, 0, segment, 0].copy_(scale)

    def quantize_layers(self, segment: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """:meth:`quantize` for every layer at once: ``keys``/``values`` ``[layers, S, H, D]``.

        Bit for bit the per-layer calls (a scale per layer and head either way), in four launches instead of
        four per layer: the per-layer launches' host time left the GPU idle in each load (docs/BENCHMARKS.md).
        """
        end = start + keys.shape[1]
        fa.quantize_per_head_into(keys, self.k[:, start:end], self.scales[:, 0, segment, 0])
        fa.quantize_per_head_into(values, self.v[..., start:end].permute(0, 3, 1, 2), self.scales[:, 1, segment, 0])

    def segments(self, layer: int, end: int) -> tuple:
        """One layer's keys ``[0, end)`` as the two-segment kernel takes them: K, its (history, current) scales,
        V, its (history, current) scales."""
        scales = self.scales[layer]
        return (self.keys(layer, 0, end), (scales[0, HISTORY], scales[0, CURRENT]),
                self.values(layer, 0, end), (scales[1, HISTORY], scales[1, CURRENT]))

    def attend(self, layer: int, q_fp8: torch.Tensor, q_scale: torch.Tensor, history_tokens: int, end: int) -> torch.Tensor:
        """The FP8 kernel over keys ``[0, end)`` of one layer: history then current -> bf16 ``[1, S_q, H, D]``."""
        return fa.fp8_attention_segments(q_fp8, q_scale, *self.segments(layer, end), history_tokens)


class ContextKV:
    MAX_GRAPHS = 32  # history lengths x rotary tables x rotations: ~6 for one engine

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
        fp8_attention: bool = False,
        cuda_graphs: bool = False,
    ) -> None:
        """``fp8_attention``: also hold the e4m3 mirror (:class:`FP8ContextKV`) the FP8 kernel reads.
        ``cuda_graphs``: on CUDA, prepare each history length's keys through a CUDA graph."""
        self.tokens_per_frame = tokens_per_frame
        self.buffer = torch.empty((num_layers, 2, max_tokens, num_heads, head_dim), dtype=dtype, device=device)
        self.fp8: FP8ContextKV | None = None
        if fp8_attention:
            self.fp8 = FP8ContextKV(
                num_layers=num_layers, max_tokens=max_tokens, num_heads=num_heads, head_dim=head_dim, device=device
            )
        self._graphs: GraphCache[torch.cuda.CUDAGraph] = GraphCache(
            "history load", self.MAX_GRAPHS, enabled=cuda_graphs and torch.device(device).type == "cuda"
        )
        # With the mirror: the history's block ids on the device (history_fp8 reads the pool through them), at a
        # fixed address for the load's CUDA graphs.
        self._ids = None if self.fp8 is None else torch.zeros(
            max_tokens // tokens_per_frame + 1, dtype=torch.int32, device=device)
        self._owner: tuple | None = None  # (kv state's weak reference, branch, frames, pool writes) of the last load
        self.loads = 0
        self.history_tokens = 0  # of the last load
        self.history_block_ids: tuple[int, ...] = ()  # of the last load, oldest first

    @property
    def nbytes(self) -> int:
        """The bf16 buffer's bytes, plus the FP8 mirror's where there is one."""
        return self.buffer.numel() * self.buffer.element_size() + (0 if self.fp8 is None else self.fp8.nbytes)

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
        if self.fp8 is not None and history_fp8.available(pool):
            # FP8 attention reads the mirror only: its history straight from the pool (the buffer's stays unused).
            if tokens:
                self._load_mirror(pool, block_ids, tokens, cos, sin)
        else:
            frame = self.tokens_per_frame
            for position, block in enumerate(block_ids):
                self.buffer[:, :, position * frame : (position + 1) * frame].copy_(pool[:, :, block])
            if tokens:  # an empty history: nothing to rotate
                self._prepare_history(tokens, cos, sin, rotate)
        self._owner = owner
        self.loads += 1
        self.history_tokens = tokens
        self.history_block_ids = tuple(block_ids)
        return tokens

    def _prepare_history(self, tokens: int, cos: torch.Tensor, sin: torch.Tensor, rotate: Callable) -> None:
        """Rotate the gathered history keys of every layer in place and quantize the FP8 mirror's history.

        On CUDA (``cuda_graphs``) this runs as one CUDA graph per (token count, tables, rotation): its ~100
        launches are otherwise enqueued one by one at every block's start, and the GPU waits for them (the
        profile is in docs/BENCHMARKS.md). Everything it reads and writes is at a fixed address: this buffer,
        its mirror, the rotary module's tables.
        """

        def run() -> None:
            for layer in range(self.buffer.shape[0]):
                keys = self.buffer[layer, 0, :tokens]
                keys.copy_(rotate(keys, cos[:tokens], sin[:tokens]))
            if self.fp8 is not None:  # once per block, for all its forwards: the history's own scales
                self.fp8.quantize_layers(HISTORY, 0, self.buffer[:, 0, :tokens], self.buffer[:, 1, :tokens])

        self._graphed((tokens, cos.data_ptr(), sin.data_ptr(), rotate), run)

    def _load_mirror(self, pool: torch.Tensor, block_ids: list[int], tokens: int, cos, sin) -> None:
        """:func:`history_fp8.load_history` of ``block_ids``, through one CUDA graph per (token count, pool,
        tables) as :meth:`_prepare_history`; the ids reach the device by a stream-ordered copy from pinned memory
        (no host synchronisation; the caching host allocator keeps the pinned block until the copy is done)."""
        frames = len(block_ids)
        ids = torch.tensor(block_ids, dtype=torch.int32)
        self._ids[:frames].copy_(ids.pin_memory() if self._ids.is_cuda else ids, non_blocking=True)

        def run() -> None:
            history_fp8.load_history(pool, self._ids[:frames], tokens, cos[:tokens], sin[:tokens], self.fp8, HISTORY)

        self._graphed(("mirror", tokens, pool.data_ptr(), cos.data_ptr(), sin.data_ptr()), run)

    def _graphed(self, key: tuple, run: Callable[[], None]) -> None:
        """``run``'s work: its CUDA graph's replay where ``key`` has one, else ``run`` eagerly, then (graphs on)
        recorded for the next load of that key. Everything ``run`` touches is at a fixed address for the key."""
        graph = self._graphs.get(key) if self._graphs.enabled else None
        if graph is not None:
            graph.replay()
            return
        run()  # this load's work, eagerly; a capture only records it (in place: nothing replays now)
        if self._graphs.enabled:
            self._graphs.capture(key, lambda pool: capture(run, warm_runs=0, pool=pool)[0])

    def invalidate(self) -> None:
        self._owner = None
