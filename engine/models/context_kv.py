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
from dataclasses import dataclass

import torch

from engine.models import fp8_attention as fa
from engine.models import history_fp8
from decoders.graph_capture import GraphCache, capture

HISTORY, CURRENT = 0, 1  # the segments of the FP8 mirror's scales


class FP8ContextKV:
    """The e4m3 mirror of one branch's context, laid out for the FP8 attention kernel, one slot per session of a
    batched forward (``slots``; one unless the engine batches sessions)::

        k       [slots, layers, S_max, heads, head_dim]     e4m3, head_dim contiguous (QKᵀ's K-major operand)
        v       [slots, layers, heads, head_dim, S_pad]     e4m3, keys contiguous (PV's K-major operand on Hopper),
                                                            S_pad = S_max rounded up to 16 (16-byte aligned rows)
        scales  [layers, 2 (k, v), 2 (history, current), slots, heads]   float32

    Rows ``[0, history_tokens)`` hold the history (quantized by :meth:`quantize` with ``HISTORY`` once per
    block), the rows after it the current block (``CURRENT``, every forward). Fixed buffers, allocated once:
    every forward's kernels read the same addresses (CUDA graphs), and the bytes are in use before the
    engine measures its memory budget. Bytes: ``slots * (layers * heads * head_dim * (S_max + S_pad) + 16 *
    layers * heads)``.

    ``k``, ``v`` and ``scales`` are slot 0's (``[layers, S_max, heads, head_dim]``, ...); :meth:`slot` gives
    another's. The methods that take ``batch`` work on slots ``[0, batch)`` at once, a batched forward's sessions
    in order: the kernel's batch axis is the slot axis.
    """

    def __init__(self, *, num_layers: int, max_tokens: int, num_heads: int, head_dim: int, device: torch.device,
                 slots: int = 1):
        if slots < 1:
            raise ValueError("an FP8 mirror needs at least one slot")
        padded = -(-max_tokens // fa.V_ROW_ALIGN) * fa.V_ROW_ALIGN
        self.slots = slots
        self.k_slots = torch.zeros((slots, num_layers, max_tokens, num_heads, head_dim), dtype=fa.FP8_DTYPE,
                                   device=device)
        self.v_slots = torch.zeros((slots, num_layers, num_heads, head_dim, padded), dtype=fa.FP8_DTYPE, device=device)
        self.scales_all = torch.ones((num_layers, 2, 2, slots, num_heads), dtype=torch.float32, device=device)

    def slot(self, index: int) -> "MirrorSlot":
        """One slot's buffers, shaped as a one-session mirror's (what :mod:`engine.models.history_fp8` fills)."""
        if not 0 <= index < self.slots:
            raise ValueError(f"slot {index} of a mirror with {self.slots}")
        return MirrorSlot(self.k_slots[index], self.v_slots[index], self.scales_all[:, :, :, index : index + 1])

    @property
    def k(self) -> torch.Tensor:
        return self.k_slots[0]

    @property
    def v(self) -> torch.Tensor:
        return self.v_slots[0]

    @property
    def scales(self) -> torch.Tensor:
        """Slot 0's ``[layers, 2, 2, 1, heads]``."""
        return self.scales_all[:, :, :, :1]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_slots, self.v_slots, self.scales_all))

    # The batch axis is the slot axis, so its stride is a whole slot's (a multiple of 16), never a slice's
    # length: Triton specialises every integer argument on divisibility by 16, and a batch stride of e.g.
    # 32,760 (a slice's key count) cost it the proof that the V rows are 16-byte aligned: V read byte by byte
    # instead of by 16-byte asynchronous copies (sm_90 PTX): the standard window's FP8 block ran several times
    # slower, at key counts that are not multiples of 16 only (docs/FP8.md).

    def keys(self, layer: int, start: int, end: int, batch: int = 1) -> torch.Tensor:
        """Rows ``start:end`` of one layer's K in slots ``[0, batch)``, as the kernel's ``[batch, S, H, D]``."""
        return self.k_slots[:batch, layer, start:end]

    def values(self, layer: int, start: int, end: int, batch: int = 1) -> torch.Tensor:
        """Keys ``start:end`` of one layer's transposed V in slots ``[0, batch)`` as a ``[batch, S, H, D]`` view
        (``stride(1) == 1``)."""
        return self.v_slots[:batch, layer, ..., start:end].permute(0, 3, 1, 2)

    def _scales(self, layer: int, kv: int, segment: int, batch: int) -> torch.Tensor:
        return self.scales_all[layer, kv, segment, :batch]  # [batch, heads], contiguous

    def quantize(self, layer: int, segment: int, start: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """``keys`` (rotated) and ``values`` ``[S, H, D]`` (slot 0) or ``[batch, S, H, D]`` (slots ``[0, batch)``)
        into rows ``start:start+S``, with the segment's scales."""
        keys = keys if keys.ndim == 4 else keys.unsqueeze(0)
        batch, end = keys.shape[0], start + keys.shape[1]
        fa.quantize_per_head_into(keys, self.keys(layer, start, end, batch), self._scales(layer, 0, segment, batch))
        self.quantize_values(layer, segment, start, values)

    def quantize_values(self, layer: int, segment: int, start: int, values: torch.Tensor) -> None:
        """:meth:`quantize`'s values alone (the keys written by :mod:`engine.models.qk_quantize`, whose scale
        :meth:`set_key_scale` records)."""
        values = values if values.ndim == 4 else values.unsqueeze(0)
        batch, end = values.shape[0], start + values.shape[1]
        fa.quantize_per_head_into(values, self.values(layer, start, end, batch), self._scales(layer, 1, segment, batch))

    def set_key_scale(self, layer: int, segment: int, scale: torch.Tensor, batch: int = 1) -> None:
        """The per-head scale ``[heads]`` of keys written into the segment's rows of slots ``[0, batch)`` by
        another quantizer."""
        self._scales(layer, 0, segment, batch).copy_(scale.expand(batch, -1))

    def quantize_layers(self, segment: int, start: int, keys: torch.Tensor, values: torch.Tensor,
                        slot: int = 0) -> None:
        """:meth:`quantize` for every layer of one slot at once: ``keys``/``values`` ``[layers, S, H, D]``.

        Bit for bit the per-layer calls (a scale per layer and head either way), in four launches instead of
        four per layer: the per-layer launches' host time left the GPU idle in each load (docs/BENCHMARKS.md).
        """
        end = start + keys.shape[1]
        target = self.slot(slot)
        fa.quantize_per_head_into(keys, target.k[:, start:end], target.scales[:, 0, segment, 0])
        fa.quantize_per_head_into(values, target.v[..., start:end].permute(0, 3, 1, 2), target.scales[:, 1, segment, 0])

    def segments(self, layer: int, end: int, batch: int = 1) -> tuple:
        """One layer's keys ``[0, end)`` in slots ``[0, batch)`` as the two-segment kernel takes them: K, its
        (history, current) scales, V, its (history, current) scales."""
        return (self.keys(layer, 0, end, batch), (self._scales(layer, 0, HISTORY, batch), self._scales(layer, 0, CURRENT, batch)),
                self.values(layer, 0, end, batch), (self._scales(layer, 1, HISTORY, batch), self._scales(layer, 1, CURRENT, batch)))

    def attend(self, layer: int, q_fp8: torch.Tensor, q_scale: torch.Tensor, history_tokens: int, end: int) -> torch.Tensor:
        """The FP8 kernel over keys ``[0, end)`` of one layer: history then current -> bf16 ``[B, S_q, H, D]``,
        query ``b`` against slot ``b``."""
        return fa.fp8_attention_segments(q_fp8, q_scale, *self.segments(layer, end, q_fp8.shape[0]), history_tokens)


@dataclass(frozen=True)
class MirrorSlot:
    """One slot of an :class:`FP8ContextKV`: ``k [layers, S_max, H, D]``, ``v [layers, H, D, S_pad]``,
    ``scales [layers, 2, 2, 1, H]`` (views)."""

    k: torch.Tensor
    v: torch.Tensor
    scales: torch.Tensor


class ContextKV:
    """One branch's gathered context: ``buffers [slots, layers, 2, S_max, heads, head_dim]`` (``buffer``: slot 0's)
    and, with FP8 attention, its e4m3 mirror. A batched forward's session ``b`` uses slot ``b``; each slot is
    loaded, and remembers its owner, on its own."""

    MAX_GRAPHS = 32  # history lengths x rotary tables x rotations (x slots): ~6 for one engine of one slot

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
        slots: int = 1,
    ) -> None:
        """``fp8_attention``: also hold the e4m3 mirror (:class:`FP8ContextKV`) the FP8 kernel reads.
        ``cuda_graphs``: on CUDA, prepare each history length's keys through a CUDA graph. ``slots``: sessions
        one forward may batch (each its own history)."""
        if slots < 1:
            raise ValueError("a context needs at least one slot")
        self.tokens_per_frame = tokens_per_frame
        self.slots = slots
        self.buffers = torch.empty((slots, num_layers, 2, max_tokens, num_heads, head_dim), dtype=dtype, device=device)
        self.fp8: FP8ContextKV | None = None
        if fp8_attention:
            self.fp8 = FP8ContextKV(num_layers=num_layers, max_tokens=max_tokens, num_heads=num_heads,
                                    head_dim=head_dim, device=device, slots=slots)
        self._graphs: GraphCache[torch.cuda.CUDAGraph] = GraphCache(
            "history load", self.MAX_GRAPHS * slots, enabled=cuda_graphs and torch.device(device).type == "cuda"
        )
        # With the mirror: each slot's history block ids on the device (history_fp8 reads the pool through them),
        # at a fixed address for the load's CUDA graphs.
        self._ids = None if self.fp8 is None else torch.zeros(
            (slots, max_tokens // tokens_per_frame + 1), dtype=torch.int32, device=device)
        # Per slot: (kv state's weak reference, branch, frames, pool writes) of its last load.
        self._owners: list[tuple | None] = [None] * slots
        self.loads = 0
        self.history_tokens = 0  # of the last load
        self.history_block_ids: tuple[int, ...] = ()  # of the last load, oldest first

    @property
    def buffer(self) -> torch.Tensor:
        """Slot 0's ``[layers, 2, S_max, heads, head_dim]``."""
        return self.buffers[0]

    @property
    def nbytes(self) -> int:
        """The bf16 buffers' bytes, plus the FP8 mirror's where there is one."""
        return self.buffers.numel() * self.buffers.element_size() + (0 if self.fp8 is None else self.fp8.nbytes)

    @torch.no_grad()
    def load(
        self,
        owner: tuple,
        pool: torch.Tensor,
        block_ids: list[int],
        cos: torch.Tensor,
        sin: torch.Tensor,
        rotate: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
        slot: int = 0,
    ) -> int:
        """Make the slot's history the frames ``block_ids`` (oldest first), keys rotated; return its token count.

        ``owner`` identifies what the history belongs to; if it matches the slot's
        last load, nothing is done. Block ids are host integers (the block table's),
        so the gather needs no index tensor and no host-device synchronisation.
        """
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} of a context with {self.slots}")
        tokens = len(block_ids) * self.tokens_per_frame
        if owner == self._owners[slot]:
            return tokens
        self._owners[slot] = None  # a failed load must not be taken for a complete one
        if self.fp8 is not None and history_fp8.available(pool):
            # FP8 attention reads the mirror only: its history straight from the pool (the buffer's stays unused).
            if tokens:
                self._load_mirror(pool, block_ids, tokens, cos, sin, slot)
        else:
            frame = self.tokens_per_frame
            buffer = self.buffers[slot]
            for position, block in enumerate(block_ids):
                buffer[:, :, position * frame : (position + 1) * frame].copy_(pool[:, :, block])
            if tokens:  # an empty history: nothing to rotate
                self._prepare_history(tokens, cos, sin, rotate, slot)
        self._owners[slot] = owner
        self.loads += 1
        self.history_tokens = tokens
        self.history_block_ids = tuple(block_ids)
        return tokens

    def _prepare_history(self, tokens: int, cos: torch.Tensor, sin: torch.Tensor, rotate: Callable, slot: int) -> None:
        """Rotate the slot's gathered history keys of every layer in place and quantize its FP8 mirror's history.

        On CUDA (``cuda_graphs``) this runs as one CUDA graph per (token count, tables, rotation, slot): its ~100
        launches are otherwise enqueued one by one at every block's start, and the GPU waits for them (the
        profile is in docs/BENCHMARKS.md). Everything it reads and writes is at a fixed address: this buffer,
        its mirror, the rotary module's tables.
        """
        buffer = self.buffers[slot]

        def run() -> None:
            for layer in range(buffer.shape[0]):
                keys = buffer[layer, 0, :tokens]
                keys.copy_(rotate(keys, cos[:tokens], sin[:tokens]))
            if self.fp8 is not None:  # once per block, for all its forwards: the history's own scales
                self.fp8.quantize_layers(HISTORY, 0, buffer[:, 0, :tokens], buffer[:, 1, :tokens], slot)

        self._graphed((tokens, cos.data_ptr(), sin.data_ptr(), rotate, slot), run)

    def _load_mirror(self, pool: torch.Tensor, block_ids: list[int], tokens: int, cos, sin, slot: int) -> None:
        """:func:`history_fp8.load_history` of ``block_ids`` into the slot, through one CUDA graph per (token count,
        pool, tables, slot) as :meth:`_prepare_history`; the ids reach the device by a stream-ordered copy from
        pinned memory (no host synchronisation; the caching host allocator keeps the pinned block until the copy
        is done)."""
        frames = len(block_ids)
        ids = torch.tensor(block_ids, dtype=torch.int32)
        slot_ids = self._ids[slot]
        slot_ids[:frames].copy_(ids.pin_memory() if slot_ids.is_cuda else ids, non_blocking=True)
        target = self.fp8.slot(slot)

        def run() -> None:
            history_fp8.load_history(pool, slot_ids[:frames], tokens, cos[:tokens], sin[:tokens], target, HISTORY)

        self._graphed(("mirror", tokens, pool.data_ptr(), cos.data_ptr(), sin.data_ptr(), slot), run)

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
        self._owners = [None] * self.slots
