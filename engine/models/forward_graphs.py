"""DiT forwards replayed as CUDA graphs, one graph per forward shape.

A 1.3B forward launches ~1,500 kernels. At the fast window the device needs
less time for them than the host needs to launch them (docs/BENCHMARKS.md),
so the host sets the pace. A graph replays the whole forward with one launch.

What a graph may depend on must not move between replays, so everything a
forward reads is either copied into the graph's own input buffers (latents,
timesteps, the session's text K/V) or lives at a fixed address for the
engine's life (the per-branch :class:`ContextKV` buffer, the KV manager's
staging buffer, the cached rotary tables). The key of a graph is exactly
that: shapes, history length, and the addresses of the fixed buffers. A graph
also holds the kernels the transformer ran when it was captured: if its kernel
set is swapped (benchmarks and equivalence checks do), every graph is dropped,
so a replay never runs another set's kernels.
Graphs are captured on first use of a shape — the engine's warm-up meets
every shape — into one memory pool (:class:`GraphCache`); outputs are copied
out at once, so replaying graphs in any order is safe. Anything that goes
wrong while capturing switches graphs off for good (eager forwards, the
reference path).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.models.attention import AttentionContext, GatheredContext
from engine.models.causal_wan import CausalWanTransformer
from decoders.graph_capture import GraphCache, capture
from engine.models.latents import BlockLatents

MAX_GRAPHS = 64  # shapes x fixed buffers of one engine: ~14 for the standard window, more with CFG branches


@dataclass
class _ForwardGraph:
    graph: torch.cuda.CUDAGraph
    latents: BlockLatents  # input buffers
    timesteps: torch.Tensor
    cross_kv: torch.Tensor
    output: BlockLatents  # written by every replay


def _buffer_like(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return None if tensor is None else torch.empty_like(tensor, memory_format=torch.contiguous_format)


class GraphedForwards:
    """Calls ``transformer(latents, frame_timesteps, context, cross_kv)``, through a CUDA graph where it can."""

    def __init__(self, transformer: CausalWanTransformer, *, enabled: bool = True) -> None:
        self.transformer = transformer
        self.graphs: GraphCache[_ForwardGraph] = GraphCache("DiT forwards", MAX_GRAPHS)
        self.enabled = enabled
        self.kernels = transformer.kernels  # the set every graph was captured with
        self.replays = 0
        # One text K/V input buffer per shape for every graph (a prompt's is ~90 MiB at 1.3B: one each for the
        # ~14 graphs of an engine held 1.23 GiB): graphs replay one at a time on one stream, each after its copy.
        self._cross_buffers: dict[tuple, torch.Tensor] = {}

    @property
    def enabled(self) -> bool:
        return self.graphs.enabled

    @enabled.setter
    def enabled(self, enabled: bool) -> None:
        """Graphs on (where the transformer runs on CUDA) or off (benchmarks compare both)."""
        self.graphs.enabled = enabled and self.transformer.device.type == "cuda"

    @property
    def num_graphs(self) -> int:
        return len(self.graphs)

    def __call__(
        self, latents: BlockLatents, frame_timesteps: torch.Tensor, context: AttentionContext,
        cross_kv: torch.Tensor | Sequence[torch.Tensor],
    ) -> BlockLatents:
        """``cross_kv``: one tensor, or a batch's text K/V one session at a time (copied into the graph's input
        buffer row by row, never stacked first)."""
        if self.transformer.kernels is not self.kernels:
            self.graphs.clear()
            self.kernels = self.transformer.kernels
        rows = tuple(cross_kv) if isinstance(cross_kv, (tuple, list)) else None
        like = rows[0] if rows is not None else cross_kv  # one session's text K/V
        cross_shape = (len(rows), *like.shape) if rows is not None else tuple(like.shape)
        key = self._key(latents, frame_timesteps, context, cross_shape)
        entry = None
        if key is not None:
            entry = self.graphs.get(key) or self.graphs.capture(
                key, lambda pool: self._capture(latents, frame_timesteps, context, cross_kv, cross_shape, like, pool)
            )
        if entry is None:
            return self.transformer(latents, frame_timesteps, context, torch.stack(rows) if rows else cross_kv)
        entry.latents.video.copy_(latents.video)
        if latents.audio is not None:
            entry.latents.audio.copy_(latents.audio)
        entry.timesteps.copy_(frame_timesteps)
        _fill(entry.cross_kv, cross_kv)
        entry.graph.replay()
        self.replays += 1
        return BlockLatents(
            entry.output.video.clone(), None if entry.output.audio is None else entry.output.audio.clone()
        )

    def _key(self, latents, frame_timesteps, context: AttentionContext, cross_shape: tuple) -> tuple | None:
        """The graph for this call, or ``None`` where a graph cannot serve it (eager then): only a forward over
        the gathered history has every input at a fixed address."""
        if not self.enabled or not isinstance(context, GatheredContext) or torch.cuda.is_current_stream_capturing():
            return None
        stage = context.stage
        return (
            tuple(latents.video.shape),
            None if latents.audio is None else tuple(latents.audio.shape),
            tuple(frame_timesteps.shape),
            cross_shape,
            context.history_tokens,
            context.context_kv.data_ptr(),
            context.context_kv.ndim,  # one session's context or a batch's (the same address for slot 0)
            None if context.fp8 is None else context.fp8.k.data_ptr(),  # the FP8 mirror, fixed like context_kv
            None if stage is None else stage.data_ptr(),
            context.cos.data_ptr(),
            context.sin.data_ptr(),
        )

    def _cross_buffer(self, shape: tuple, like: torch.Tensor) -> torch.Tensor:
        key = (shape, like.dtype, like.device)
        if key not in self._cross_buffers:
            self._cross_buffers[key] = torch.empty(shape, dtype=like.dtype, device=like.device)
        return self._cross_buffers[key]

    def _capture(self, latents, frame_timesteps, context, cross_kv, cross_shape, like, pool) -> _ForwardGraph:
        static_latents = BlockLatents(_buffer_like(latents.video), _buffer_like(latents.audio))
        static_latents.video.copy_(latents.video)
        if latents.audio is not None:
            static_latents.audio.copy_(latents.audio)
        static_timesteps = frame_timesteps.clone()
        static_cross = self._cross_buffer(cross_shape, like)
        _fill(static_cross, cross_kv)
        graph, output = capture(
            lambda: self.transformer(static_latents, static_timesteps, context, static_cross), pool=pool
        )
        return _ForwardGraph(graph, static_latents, static_timesteps, static_cross, output)


def _fill(buffer: torch.Tensor, cross_kv: torch.Tensor | Sequence[torch.Tensor]) -> None:
    """The graph's text K/V input from one tensor or from a batch's rows."""
    if isinstance(cross_kv, (tuple, list)):
        for row, part in enumerate(cross_kv):
            buffer[row].copy_(part)
    else:
        buffer.copy_(cross_kv)
