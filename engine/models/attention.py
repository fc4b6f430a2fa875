"""Attention processors for diffusers' WanAttention modules.

Self-attention reads the session's history K/V from paged blocks and attends
over ``history | current block``; the keys are stored *unrotated* and rotated at
attention time with their position in that context, which is what keeps every
position inside the trained rotary range for sessions of any length. Cross
attention reads text K/V projected once per prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from engine.models import qk_quantize
from engine.models.context_kv import CURRENT, FP8ContextKV
from engine.models.fp8_attention import FP8_DTYPE, quantize_per_head_into
from engine.models.fp8_linear import project_shared
from engine.models.kernels import EAGER_KERNELS, Kernels


@dataclass
class DenseContext:
    """No cache: a forward's keys are its own tokens, under an optional mask (the whole-sequence reference,
    training, unit tests). ``stage``: the forward's K/V are written there too, unrotated."""

    cos: torch.Tensor  # [S_k, 1, head_dim // 2] for key positions 0..S_k-1
    sin: torch.Tensor
    attn_mask: torch.Tensor | None = None  # [S_q, S_k] bool
    stage: torch.Tensor | None = None  # [layers, 2, S_q, heads, head_dim]

    def history(self, layer: int) -> None:
        return None


@dataclass
class PagedContext:
    """History read from the session's pool blocks and rotated in every forward: the per-forward reference
    for :class:`GatheredContext` (``CausalWanPipeline(gather_history_once=False)``)."""

    cos: torch.Tensor
    sin: torch.Tensor
    pool: torch.Tensor  # [layers, 2, blocks, tokens_per_frame, heads, head_dim]
    history_ids: torch.Tensor | None  # [history frames] block ids, oldest first (None: no history yet)
    stage: torch.Tensor | None = None
    attn_mask = None  # every key is visible: the history precedes the block

    def history(self, layer: int) -> torch.Tensor | None:
        """``[2, S_h, heads, head_dim]``: the layer's history K/V, unrotated."""
        if self.history_ids is None:
            return None
        return self.pool[layer].index_select(1, self.history_ids).flatten(1, 2)


@dataclass
class GatheredContext:
    """History gathered from the pool and rotated once per block (:class:`~engine.models.context_kv.ContextKV`):
    each layer writes its current K/V after it in ``context_kv`` and attends over the prefix. The engine's
    path, and the only one CUDA graphs and FP8 attention run on.

    One session's forward (``context_kv [layers, 2, S_max, heads, head_dim]``, ``stage [layers, 2, S_q, heads,
    head_dim]``) or a batch's (``[B, layers, ...]`` for both: row ``b`` of the forward's batch attends to slot
    ``b``'s history and stages into slot ``b``; every slot holds ``history_tokens`` rows of history).

    ``fp8``: with FP8 attention, the branch's e4m3 mirror of ``context_kv``
    (:class:`~engine.models.context_kv.FP8ContextKV`, its history quantized by the same load; batch row ``b`` in
    its slot ``b``).
    """

    cos: torch.Tensor
    sin: torch.Tensor
    context_kv: torch.Tensor  # [layers, 2, S_max, heads, head_dim] or [B, layers, 2, S_max, heads, head_dim]
    history_tokens: int  # rows of context_kv that hold the (rotated) history
    stage: torch.Tensor | None = None
    fp8: FP8ContextKV | None = None

    @property
    def batch(self) -> int:
        return self.context_kv.shape[0] if self.context_kv.ndim == 6 else 1

    def batched_kv(self) -> torch.Tensor:
        """``context_kv`` as ``[B, layers, 2, S_max, heads, head_dim]``."""
        return self.context_kv if self.context_kv.ndim == 6 else self.context_kv.unsqueeze(0)

    def batched_stage(self) -> torch.Tensor | None:
        """``stage`` as ``[B, layers, 2, S_q, heads, head_dim]`` (None without one)."""
        if self.stage is None:
            return None
        return self.stage if self.stage.ndim == 6 else self.stage.unsqueeze(0)


class PerForwardContext(Protocol):
    """A context whose history (if any) is read in each forward and rotated with the block's keys."""

    cos: torch.Tensor
    sin: torch.Tensor
    attn_mask: torch.Tensor | None
    stage: torch.Tensor | None

    def history(self, layer: int) -> torch.Tensor | None:
        """``[2, S_h, heads, head_dim]`` unrotated history K/V of ``layer``, or None."""


# What every self-attention layer of one forward reads and writes::
#
#     keys:    | history frames                     | current frames |
#     rotary:  0 ........................................... S_k - 1
#     queries:                                    | current frames |
#
# (a benchmark's own per-forward context, e.g. bench/bench_engine.py's concatenated history, fits PerForwardContext)
AttentionContext = GatheredContext | DenseContext | PagedContext | PerForwardContext


def _heads(attn, x: torch.Tensor) -> torch.Tensor:
    return x.unflatten(2, (attn.heads, -1))


def _attend(attn, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask=None) -> torch.Tensor:
    out = F.scaled_dot_product_attention(
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask=mask
    )
    out = out.transpose(1, 2).flatten(2, 3).type_as(query)
    return attn.to_out[1](attn.to_out[0](out))


class PagedSelfAttentionProcessor:
    """Self-attention over paged history plus the current block.

    ``fp8_attention``: attend through the FP8 kernel, which needs the gathered-history path and its e4m3
    mirror (``context.context_kv`` and ``context.fp8``); any other context is refused, never run in bf16.
    """

    def __init__(self, layer_index: int, *, fp8_attention: bool = False) -> None:
        self.layer_index = layer_index
        self.fp8_attention = fp8_attention
        self._static: dict[str, tuple] = {}  # "q" / "k": (the norm weight's identity, its static scales)

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states=None,
        attention_mask=None,
        rotary_emb=None,
        *,
        context: AttentionContext,
        kernels: Kernels = EAGER_KERNELS,
    ) -> torch.Tensor:
        layer = self.layer_index
        num_queries = hidden_states.shape[1]
        if isinstance(context, GatheredContext):
            return self._attend_gathered(attn, hidden_states, context, kernels)
        if self.fp8_attention:
            raise ValueError(
                "FP8 attention runs on the gathered-history path only (context_kv with its FP8 mirror); "
                "this forward gathers its history per forward"
            )
        query, key, value = project_shared(hidden_states, attn.to_q, attn.to_k, attn.to_v)
        query = _heads(attn, kernels.rms_norm(query, attn.norm_q.weight, attn.norm_q.eps))
        key = _heads(attn, kernels.rms_norm(key, attn.norm_k.weight, attn.norm_k.eps))
        value = _heads(attn, value)
        if context.stage is not None:
            # Unrotated, as stored: positions are assigned when the block is read back.
            context.stage[layer, 0, :num_queries].copy_(key[0])
            context.stage[layer, 1, :num_queries].copy_(value[0])
        history = context.history(layer)  # [2, S_h, H, D]
        if history is not None:
            key = torch.cat([history[0].unsqueeze(0).expand(key.shape[0], -1, -1, -1), key], dim=1)
            value = torch.cat([history[1].unsqueeze(0).expand(value.shape[0], -1, -1, -1), value], dim=1)
        num_keys = key.shape[1]
        if context.cos.shape[0] != num_keys:
            raise ValueError(f"rotary table covers {context.cos.shape[0]} keys, attention has {num_keys}")
        offset = num_keys - num_queries
        query = kernels.rotate_pairs(query, context.cos[offset:], context.sin[offset:])
        key = kernels.rotate_pairs(key, context.cos, context.sin)
        return _attend(attn, query, key, value, context.attn_mask)

    def _attend_gathered(self, attn, hidden_states, context: GatheredContext, kernels: Kernels) -> torch.Tensor:
        """The history is already in ``context_kv``, rotated: write this block's K/V after it and attend. A batch's
        rows each attend to their own slot's history (one kernel over the batch)."""
        batch = hidden_states.shape[0]
        if batch != context.batch:
            raise ValueError(f"a forward of {batch} sessions over a gathered context of {context.batch}")
        layer = self.layer_index
        start = context.history_tokens
        end = start + hidden_states.shape[1]
        if context.cos.shape[0] != end:
            raise ValueError(f"rotary table covers {context.cos.shape[0]} keys, attention has {end}")
        cos, sin = context.cos[start:], context.sin[start:]
        query, key, value = project_shared(hidden_states, attn.to_q, attn.to_k, attn.to_v)
        if self.fp8_attention and kernels.quantized_norms and qk_quantize.available(query):
            return self._attend_fp8_fused(attn, query, key, value, context, cos, sin)
        query = kernels.rms_norm_rotate(query, attn.norm_q.weight, attn.norm_q.eps, attn.heads, cos, sin)
        key = _heads(attn, kernels.rms_norm(key, attn.norm_k.weight, attn.norm_k.eps))
        value = _heads(attn, value)
        stage = context.batched_stage()
        if stage is not None:
            stage[:, layer, 0, : end - start].copy_(key)  # unrotated, as stored
            stage[:, layer, 1, : end - start].copy_(value)
        if self.fp8_attention:
            return self._attend_fp8(attn, query, kernels.rotate_pairs(key, cos, sin), value, context)
        buffer = context.batched_kv()[:, layer]  # [B, 2, S_max, H, D]
        buffer[:, 0, start:end].copy_(kernels.rotate_pairs(key, cos, sin))
        buffer[:, 1, start:end].copy_(value)
        return _attend(attn, query, buffer[:, 0, :end], buffer[:, 1, :end])

    def _attend_fp8(self, attn, query, key, value, context: GatheredContext) -> torch.Tensor:
        """FP8: this block's rotated K and its V ``[B, S, H, D]`` into the mirror after the history (current-segment
        scales), q quantized per head, the kernel over both segments. The bf16 buffer's current rows are not
        needed."""
        mirror = context.fp8
        if mirror is None:
            raise ValueError("FP8 attention needs the context's FP8 mirror (a ContextKV built with fp8_attention)")
        layer, start = self.layer_index, context.history_tokens
        end = start + key.shape[1]
        mirror.quantize(layer, CURRENT, start, key, value)
        q_fp8 = torch.empty(query.shape, dtype=FP8_DTYPE, device=query.device)
        q_scale = torch.empty(query.shape[0], query.shape[2], dtype=torch.float32, device=query.device)
        quantize_per_head_into(query, q_fp8, q_scale)
        out = mirror.attend(layer, q_fp8, q_scale, start, end)  # bf16 [B, S_q, H, D]
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(query)))

    def _attend_fp8_fused(self, attn, query, key, value, context: GatheredContext, cos, sin) -> torch.Tensor:
        """:meth:`_attend_fp8` with q and k normalized, rotated and cast in one pass each
        (:mod:`engine.models.qk_quantize`: their scales bound by the norms' weights, no amax pass), k straight
        into the mirror's current rows (and, in a commit pass, its normalized rows into the stage); v as before.
        The q / k pass runs per session of a batch (one launch each); v's quantizer and the attention run once."""
        mirror = context.fp8
        if mirror is None:
            raise ValueError("FP8 attention needs the context's FP8 mirror (a ContextKV built with fp8_attention)")
        layer, start, heads = self.layer_index, context.history_tokens, attn.heads
        batch, tokens = query.shape[0], query.shape[1]
        end = start + tokens
        q_scale, q_inverse = self._static_scales(attn.norm_q.weight, heads, "q")
        k_scale, k_inverse = self._static_scales(attn.norm_k.weight, heads, "k")
        q_fp8 = torch.empty((batch, tokens, heads, query.shape[2] // heads), dtype=FP8_DTYPE, device=query.device)
        stage = context.batched_stage()
        keys = mirror.keys(layer, start, end, batch)
        for row in range(batch):
            qk_quantize.rms_rotate_quantize(query[row : row + 1], attn.norm_q.weight, attn.norm_q.eps, heads, cos, sin,
                                            q_inverse, q_fp8[row : row + 1])
            qk_quantize.rms_rotate_quantize(key[row : row + 1], attn.norm_k.weight, attn.norm_k.eps, heads, cos, sin,
                                            k_inverse, keys[row : row + 1],
                                            None if stage is None else stage[row, layer, 0, :tokens])
        mirror.set_key_scale(layer, CURRENT, k_scale, batch)
        value = _heads(attn, value)
        if stage is not None:
            stage[:, layer, 1, :tokens].copy_(value)
        mirror.quantize_values(layer, CURRENT, start, value)
        q_scales = q_scale.view(1, heads) if batch == 1 else q_scale.view(1, heads).expand(batch, heads)
        out = mirror.attend(layer, q_fp8, q_scales, start, end)  # bf16 [B, S_q, H, D]
        return attn.to_out[1](attn.to_out[0](out.flatten(2, 3).type_as(query)))

    def _static_scales(self, weight: torch.Tensor, heads: int, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`qk_quantize.static_scales` of a norm's weight, kept while the weight is unchanged (its address and
        version: weights loaded in place after the first forward get new scales)."""
        key = (weight.data_ptr(), weight._version, weight.device)
        entry = self._static.get(name)
        if entry is None or entry[0] != key:
            entry = (key, qk_quantize.static_scales(weight, heads))
            self._static[name] = entry
        return entry[1]


class CachedCrossAttentionProcessor:
    """Cross-attention to text K/V that were projected once per prompt."""

    def __init__(self, layer_index: int) -> None:
        self.layer_index = layer_index

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states=None,
        attention_mask=None,
        rotary_emb=None,
        *,
        cross_kv: torch.Tensor,
        kernels: Kernels = EAGER_KERNELS,
    ) -> torch.Tensor:
        """``cross_kv``: ``[layers, 2, text_len, heads, head_dim]`` (batch 1) or ``[B, layers, 2, ...]``."""
        query = _heads(attn, kernels.rms_norm(attn.to_q(hidden_states), attn.norm_q.weight, attn.norm_q.eps))
        layer_kv = cross_kv[self.layer_index] if cross_kv.ndim == 5 else cross_kv[:, self.layer_index]
        if layer_kv.ndim == 4:
            layer_kv = layer_kv.unsqueeze(0)
        key, value = layer_kv[:, 0], layer_kv[:, 1]
        return _attend(attn, query, key.expand(query.shape[0], -1, -1, -1), value.expand(query.shape[0], -1, -1, -1))


def project_cross_kv(attn, context_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Text K/V of one layer as diffusers' Wan processor computes them: ``[B, text_len, heads, head_dim]``."""
    key = _heads(attn, attn.norm_k(attn.to_k(context_states)))
    value = _heads(attn, attn.to_v(context_states))
    return key, value
