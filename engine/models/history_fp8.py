"""The FP8 mirror's history straight from the paged pool: gather, rotate and quantize in two Triton passes.

Once per block the FP8 attention's mirror (:class:`~engine.models.context_kv.FP8ContextKV`) gets the session's
history: every layer's K and V of the sink and window frames, the keys rotated to their positions, quantized per
(layer, head) with the history's own scales. The bf16 path did that in three steps over the whole history: a
gather of every frame from the pool into the gathered-context buffer (a generic strided copy of all layers' K
and V), the keys rotated in place, then the per-head quantizer's two passes over the buffer: ~29 GB of traffic a
standard block (1.3B, 18 history frames), and the buffer's bf16 history is read by nothing else under FP8
attention. Here the two quantizer passes read the pool themselves (each row's frame through the block table,
the keys rotated as they are read): ~13 GB.

The numbers are the bf16 path's, bit for bit: the rotation in float32 (``kernels.rotate_pairs``' products and
sums, unfused), rounded to bf16 as the buffer held it; the head's amax over those values; ``scale = amax * (1 /
448)`` and ``x * ((1 / amax) * 448)`` cast to e4m3, as :func:`engine.models.fp8_attention.quantize_per_head_into`
computes them (tests/test_history_fp8.py compares the mirrors byte for byte).
"""

from __future__ import annotations

import torch

from engine.models import fp8_attention as fa

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the engine then takes the gather path
    triton = None

# On by default since its passes move 16-byte vectors: measured on an H100 (docs/BENCHMARKS.md, thirty-eighth
# session), one load takes 5.7 ms this way against 14.8 through the gather path at the standard window (7.3 against
# 7.5 at the fast one), the mirrors byte for byte equal (in the thirty-sixth session, with one pair of channels an
# instruction, it took 21.4). Off, ContextKV gathers into the bf16 buffer and quantizes that
# (bench/history_fp8_gpu.py times both).
DIRECT_LOAD = True

_BLOCK_S = 32  # history rows a tile
_MAX_PARTS = 128  # programs per (layer, head) in a pass: a head's partial maxima fit one load of the cast pass


if triton is not None:

    @triton.jit
    def _load_rows(Pool, Ids, Cos, Sin, layer_kv, head, rows, S, T, NB, H: tl.constexpr, HALF: tl.constexpr,
                   ROTATE: tl.constexpr):
        """History rows ``rows`` of one (layer, K or V, head) from the pool, ``[BLOCK_S, 2 * HALF]`` float32 (0 past
        ``S``): row r is token ``r % T`` of the frame in block ``Ids[r // T]``; keys rotated by row r's angles."""
        valid = rows < S
        block = tl.load(Ids + rows // T, mask=valid, other=0).to(tl.int64)
        base = ((layer_kv * NB + block) * T + rows % T) * (H * 2 * HALF) + head * (2 * HALF)
        # A row's channels as one contiguous run: 16-byte loads (a [rows, pairs, 2] tile loaded one pair each).
        x = tl.load(Pool + base[:, None] + tl.arange(0, 2 * HALF)[None, :], mask=valid[:, None], other=0.0)
        if ROTATE:  # kernels.rotate_pairs: (x1 cos - x2 sin, x1 sin + x2 cos) in float32, rounded to bf16
            even, odd = tl.split(tl.reshape(x.to(tl.float32), [x.shape[0], HALF, 2]))
            pairs = tl.arange(0, HALF)
            cos = tl.load(Cos + rows[:, None] * HALF + pairs[None, :], mask=valid[:, None], other=0.0)
            sin = tl.load(Sin + rows[:, None] * HALF + pairs[None, :], mask=valid[:, None], other=0.0)
            rotated = tl.join((even * cos - odd * sin).to(x.dtype), (even * sin + odd * cos).to(x.dtype))
            x = tl.reshape(rotated, [x.shape[0], 2 * HALF])
        return x.to(tl.float32)

    @triton.jit
    def _history_amax(
        Pool, Ids, Cos, Sin, Partial, KV, S, T, NB, NUM_PARTS, ROWS_PER_PART,
        H: tl.constexpr, HALF: tl.constexpr, ROTATE: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        """Pass 1: ``Partial[layer * H + head, part]`` = max |x| over the part's history rows."""
        part = tl.program_id(0)
        lh = tl.program_id(1)
        layer_kv = (lh // H) * 2 + KV
        head = lh % H
        amax = tl.zeros([BLOCK_S, 2 * HALF], dtype=tl.float32)
        first = part * ROWS_PER_PART
        for row in range(first, tl.minimum(first + ROWS_PER_PART, S), BLOCK_S):
            x = _load_rows(Pool, Ids, Cos, Sin, layer_kv, head, row + tl.arange(0, BLOCK_S), S, T, NB, H, HALF,
                           ROTATE)
            amax = tl.maximum(amax, tl.abs(x))
        tl.store(Partial + lh * NUM_PARTS + part, tl.max(tl.max(amax, 1), 0))

    @triton.jit
    def _history_cast(
        Pool, Ids, Cos, Sin, Partial, Dst, Scale, KV, S, T, NB, NUM_PARTS, ROWS_PER_PART,
        stride_dl, stride_dh, stride_ds, stride_dc, stride_sl,
        H: tl.constexpr, HALF: tl.constexpr, ROTATE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_P: tl.constexpr,
        INVERSE_MAX: tl.constexpr,
    ):
        """Pass 2: the head's amax from pass 1's partials, its scale (written by part 0), the e4m3 cast into the
        mirror at ``Dst + layer * stride_dl + head * stride_dh + row * stride_ds + channel * stride_dc`` (K: the
        channels contiguous; the transposed V: the rows)."""
        part = tl.program_id(0)
        lh = tl.program_id(1)
        layer = lh // H
        head = lh % H
        offs_p = tl.arange(0, BLOCK_P)
        amax = tl.max(tl.load(Partial + lh * NUM_PARTS + offs_p, mask=offs_p < NUM_PARTS, other=0.0), 0)
        nonzero = amax > 0
        scale = tl.where(nonzero, amax * INVERSE_MAX, 1.0)
        inverse = tl.where(nonzero, tl.math.div_rn(1.0, tl.maximum(amax, 1e-30)) * 448.0, 1.0)
        tl.store(Scale + layer * stride_sl + head, scale, mask=part == 0)
        channel = tl.arange(0, 2 * HALF)[None, :]
        base = Dst + layer.to(tl.int64) * stride_dl + head * stride_dh
        first = part * ROWS_PER_PART
        for row in range(first, tl.minimum(first + ROWS_PER_PART, S), BLOCK_S):
            rows = row + tl.arange(0, BLOCK_S)
            x = _load_rows(Pool, Ids, Cos, Sin, layer * 2 + KV, head, rows, S, T, NB, H, HALF, ROTATE)
            tl.store(base + rows[:, None].to(tl.int64) * stride_ds + channel * stride_dc,
                     (x * inverse).to(tl.float8e4nv), mask=(rows < S)[:, None])


def available(pool: torch.Tensor) -> bool:
    """Whether the direct load runs for ``pool`` (CUDA, or the Triton interpreter in tests; Triton installed;
    :data:`DIRECT_LOAD` on)."""
    if triton is None or not DIRECT_LOAD:
        return False
    return pool.is_cuda or (pool.device.type == "cpu" and type(_history_amax).__name__ == "InterpretedFunction")


def load_history(pool: torch.Tensor, ids: torch.Tensor, tokens: int, cos: torch.Tensor, sin: torch.Tensor,
                 mirror, segment: int) -> None:
    """The mirror's rows ``[0, tokens)`` and the segment's scales from the pool: ``pool`` ``[layers, 2, blocks,
    T, heads, head_dim]`` bf16, ``ids`` int32 ``[tokens // T]`` on its device (the history's blocks, oldest
    first), ``cos``/``sin`` ``[>= tokens, 1, head_dim // 2]`` float32 (row r's angles). Four launches, no host
    synchronisation: capturable in a CUDA graph (``ids`` then at a fixed address)."""
    layers, _, blocks, frame, heads, head_dim = pool.shape
    if tokens % frame or ids.numel() * frame < tokens or ids.dtype != torch.int32:
        raise ValueError(f"{tokens} history tokens need {tokens // frame} int32 block ids of {frame} tokens; "
                         f"got {ids.numel()} {ids.dtype}")
    if not pool.is_contiguous() or cos.stride(0) != head_dim // 2 or sin.stride(0) != head_dim // 2:
        raise ValueError("the pool and the rotary tables must be contiguous")
    if tokens == 0:
        mirror.scales[:, :, segment].fill_(1.0)
        return
    rows_per_part = _BLOCK_S * triton.cdiv(tokens, _BLOCK_S * _MAX_PARTS)
    parts = triton.cdiv(tokens, rows_per_part)
    partials = torch.empty((layers * heads, parts), dtype=torch.float32, device=pool.device)
    common = dict(H=heads, HALF=head_dim // 2, BLOCK_S=_BLOCK_S, num_warps=4, enable_fp_fusion=False)
    scales = mirror.scales  # [layers, 2 (k, v), 2 (segments), 1, heads]
    # (layer, head, row, channel) strides: K [layers, S_max, heads, head_dim]; V [layers, heads, head_dim, S_pad].
    k, v = mirror.k, mirror.v
    for kv, dst, strides in ((0, k, (k.stride(0), k.stride(2), k.stride(1), k.stride(3))),
                             (1, v, (v.stride(0), v.stride(1), v.stride(3), v.stride(2)))):
        args = (pool, ids, cos, sin, partials, kv, tokens, frame, blocks, parts, rows_per_part)
        _history_amax[(parts, layers * heads)](*args, ROTATE=kv == 0, **common)
        _history_cast[(parts, layers * heads)](
            *args[:5], dst, scales[:, kv, segment, 0], *args[5:], *strides, scales.stride(0),
            ROTATE=kv == 0, BLOCK_P=_MAX_PARTS, INVERSE_MAX=fa._INVERSE_FP8_MAX, **common,
        )
