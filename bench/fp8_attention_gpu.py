"""FP8 Triton attention (engine/models/fp8_attention.py) against bf16 cuDNN SDPA, at Wan 2.1 1.3B / 832x480.

Shape: batch 1, 12 heads of 128, 4680 queries (3 latent frames x 1560 tokens), keys Sk in {4680, 18720,
32760}, K/V as the engine holds them (slices of a [2, S_max, H, D] buffer). Per Sk: the cuDNN baseline, a sweep
of kernel configs on pre-quantized inputs (each: median ms, TFLOP/s = 4*Sq*Sk*H*D / t, relative error vs float32
attention of the original inputs and vs the cuDNN output, NaN count of an output poisoned with NaN, wgmma in
the PTX), three variants of the best config (precise PV accumulation, no P scaling, v not transposed), the
quantize cost (inside a CUDA graph, which also checks it captures), the end-to-end fp8_attention, and the
engine's path (``engine_path``: the history quantized once into mirror buffers by the Triton quantizer, the
two-segment kernel vs the single-scale one, and one forward's quantize + kernel in a CUDA graph). One JSON
line per Sk on stdout, appended to --out, then a summary line; progress on stderr. A failing variant records
its error and the run goes on; variants past --budget-s are recorded as skipped.

    python3 bench/fp8_attention_gpu.py --out $OUT/fp8attn.jsonl
    python3 bench/fp8_attention_gpu.py --engine-sweep 4680,9360,14040,18720,28080,32760 --out $OUT/sweep.jsonl
    python3 bench/fp8_attention_gpu.py --quantize-sweep 4680,9360,14040,18720,28080,32760 --out $OUT/quant.jsonl
    python3 bench/fp8_attention_gpu.py --compile-only                    # no GPU: cross-compile for sm_90
    TRITON_INTERPRET=1 python3 bench/fp8_attention_gpu.py --smoke         # no GPU: this script's code paths
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace

sys.path.insert(0, ".")

import torch
import torch.nn.functional as F
import triton

from engine.models import fp8_attention as fa
from engine.models.context_kv import CURRENT, HISTORY, FP8ContextKV

C = fa.Fp8AttentionConfig
# Pruned from BLOCK_M {64,128} x BLOCK_N {64,128} x warps {4,8} x stages {2,3,4}: 8 warps only with a 128-row
# block (one warpgroup per 64 rows), 4 warps for 64-row blocks; stages bounded by shared memory (227 KB).
SWEEP = (
    C(128, 128, 8, 3), C(128, 128, 8, 2), C(128, 64, 8, 3), C(128, 64, 8, 4),
    C(128, 64, 4, 3), C(128, 64, 4, 4), C(64, 128, 4, 3), C(64, 64, 4, 3), C(64, 64, 4, 4),
    C(128, 128, 8, 4), C(64, 128, 4, 2),
)
SMOKE_SWEEP = (C(64, 32, 4, 2), C(32, 64, 4, 2))
CONFIG_KEYS = ("block_m", "block_n", "num_warps", "num_stages")
GOOD_ENOUGH = 0.1  # a config whose error vs float32 exceeds this is broken, not fast


@dataclass(frozen=True)
class Shape:
    batch: int
    sq: int
    heads: int
    head_dim: int
    sk_values: tuple[int, ...]

    def tflops(self, ms: float, sk: int) -> float:
        return 4 * self.batch * self.sq * sk * self.heads * self.head_dim / (ms * 1e-3) / 1e12


WAN_480P = Shape(batch=1, sq=4680, heads=12, head_dim=128, sk_values=(4680, 18720, 32760))
SMOKE = Shape(batch=1, sq=100, heads=2, head_dim=32, sk_values=(150, 300))


def log(message: str) -> None:
    print(f"[fp8attn {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def describe(error: BaseException, limit: int = 2000) -> str:
    return f"{type(error).__name__}: {error}"[:limit]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- what the compiled kernel is --------------------------------------------------------------------------


def kernel_facts(compiled) -> dict:
    """wgmma (Hopper's async tensor-core path) or only mma.sync in the PTX, shared memory, registers, spills."""
    if compiled is None or not hasattr(compiled, "asm"):  # the interpreter compiles nothing
        return {}
    facts = {}
    try:
        ptx = compiled.asm.get("ptx", "")
        facts.update(wgmma="wgmma" in ptx, mma_sync="mma.sync" in ptx, shared_bytes=compiled.metadata.shared)
        for name in ("n_regs", "n_spills"):  # filled in when the kernel is loaded on a device
            facts[name] = getattr(compiled, name, None)
    except Exception as error:  # noqa: BLE001 - facts are extras; never lose the timing for them
        facts["facts_error"] = describe(error, 500)
    return facts


def cuobjdump(compiled, *flags: str) -> str:
    """The output of the cuobjdump that ships with Triton on the compiled cubin (no GPU needed)."""
    from triton.backends import nvidia

    tool = os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(compiled.asm["cubin"])
        file.flush()
        return subprocess.run([tool, *flags, file.name], capture_output=True, text=True, check=False).stdout


def cubin_usage(compiled) -> dict:
    """Registers / stack of the cubin."""
    found = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", cuobjdump(compiled, "--dump-resource-usage"))
    return {"regs": int(found[1]), "stack_bytes": int(found[2]), "local_bytes": int(found[3])} if found else {}


def cross_compile(config: fa.Fp8AttentionConfig, *, head_dim: int = 128, v_transposed: bool = True, arch: int = 90):
    """Compile the kernel for sm_``arch`` without a GPU, specialised as a launch on the bench's tensors would be."""
    fn = fa._attn_fwd
    pointers = {"Q": "*fp8e4nv", "K": "*fp8e4nv", "V": "*fp8e4nv", "Out": "*bf16", "QScale": "*fp32",
                "KScaleH": "*fp32", "KScaleC": "*fp32", "VScaleH": "*fp32", "VScaleC": "*fp32", "Part": "*fp32",
                "PartM": "*fp32", "PartL": "*fp32"}
    constants = {"HEAD_DIM": head_dim, "BLOCK_M": config.block_m, "BLOCK_N": config.block_n,
                 "P_SHIFT": config.p_shift, "PRECISE_PV": config.precise_pv, "TAIL_SPLIT": config.tail_split,
                 ("stride_vs" if v_transposed else "stride_vd"): 1}  # Triton makes an int equal to 1 a constant
    # H = 12; SQ, SK, SH, FULL, KSPLIT are not specialised; the rest divide by 16
    return _compile(fn, pointers, constants, ("H", "SQ", "SK", "SH", "sm_scale", "FULL", "KSPLIT"), config.num_warps,
                    config.num_stages, arch)


def _compile(fn, pointers: dict, constants: dict, unaligned: tuple[str, ...], num_warps: int, num_stages: int,
             arch: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constants:
            signature[name] = "constexpr"
            continue
        signature[name] = pointers.get(name, "fp32" if name == "sm_scale" else "i32")
        if name not in unaligned:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, signature, constants, attrs), target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def cross_compile_quantizer(*, transposed: bool, rows: int, head_dim: int = 128, arch: int = 90) -> list:
    """Both passes of quantize_per_head_into for sm_``arch``, specialised as on the engine's K rows (``transposed``
    False: the destination's head_dim contiguous) or its transposed V (the key axis contiguous), ``rows`` keys
    (28,080 history keys at the 1.3B standard window are a multiple of 16, 4,680 current keys are not). As
    quantize_per_head_into launches it: Dst 16-byte aligned (``_aligned_rows``), ROWS_PER_PART a multiple of 64,
    the row shift ROW0 never specialised."""
    pointers = {"X": "*bf16", "Dst": "*fp8e4nv", "Partial": "*fp32", "Scale": "*fp32"}
    constants = {"HEAD_DIM": head_dim, "BLOCK_S": fa._QUANT_BLOCK_S, "BLOCK_P": fa._QUANT_MAX_PARTS,
                 "INVERSE_MAX": fa._INVERSE_FP8_MAX, "stride_xd": 1, "stride_sh": 1, ("stride_ys" if transposed else "stride_yd"): 1}
    unaligned = ("H", "NUM_PARTS", "ROW0") + (() if rows % 16 == 0 else ("S",))
    return [_compile(fn, pointers, {k: v for k, v in constants.items() if k in fn.arg_names}, unaligned, 4, 1, arch)
            for fn in (fa._amax_partials, fa._quantize_cast)]


def compile_only() -> None:
    """One JSON line per compiled kernel: ``kernel`` "attention" (the sweep at head_dim 128, two variants: precise
    PV, natural v; the other head dims' default configs) or "quantize" (both passes, per
    destination layout)."""
    variants = [(config, True, 128) for config in SWEEP]
    variants += [(replace(SWEEP[0], precise_pv=True), True, 128), (SWEEP[0], False, 128)]
    variants += [(fa.default_config(head_dim), True, head_dim) for head_dim in (32, 64)]  # tiny preset: 32
    for config, v_transposed, head_dim in variants:
        row = {"kernel": "attention", "head_dim": head_dim, **asdict(config),
               "v_layout": "transposed" if v_transposed else "natural"}
        try:
            started = time.monotonic()
            compiled = cross_compile(config, head_dim=head_dim, v_transposed=v_transposed)
            row.update(compile_s=round(time.monotonic() - started, 2), **kernel_facts(compiled))
            row.update(cubin_usage(compiled))
            del row["n_regs"], row["n_spills"]
        except Exception as error:  # noqa: BLE001 - report every variant
            row["error"] = describe(error)
        print(json.dumps(row), flush=True)
    for transposed in (False, True):
        for head_dim, rows in ((32, 4680), (128, 4680), (128, 28080)):
            row = {"kernel": "quantize", "head_dim": head_dim, "layout": "transposed" if transposed else "natural",
                   "rows": rows, "rows_multiple_of_16": rows % 16 == 0}
            try:
                passes = cross_compile_quantizer(transposed=transposed, head_dim=head_dim, rows=rows)
                usage = [cubin_usage(compiled) for compiled in passes]
                row.update(regs=max(u["regs"] for u in usage), stack_bytes=max(u["stack_bytes"] for u in usage),
                           local_bytes=max(u["local_bytes"] for u in usage), cast_regs=usage[1]["regs"])
                # The cast's global store instructions by width (one tile's per thread: 64 rows x head_dim bytes
                # over 128 threads), unpredicated (the full tiles' loop) and predicated (the masked first / last
                # tile, where a row mask that is not constant over 16 bytes makes byte stores; and the scale's).
                stores = re.findall(r"^\s*(@!?%p\d+\s+)?(st\.global[.\w]*)", passes[1].asm["ptx"], re.M)
                row["cast_unmasked_stores"] = dict(Counter(op for guard, op in stores if not guard))
                row["cast_masked_stores"] = dict(Counter(op for guard, op in stores if guard))
            except Exception as error:  # noqa: BLE001
                row["error"] = describe(error)
            print(json.dumps(row), flush=True)


# --- timing -------------------------------------------------------------------------------------------------


def time_ms(fn, device: torch.device, warmup: int = 10, rep: int = 50) -> float:
    """Median ms: Triton's do_bench on CUDA (L2 flushed between calls), wall clock elsewhere (smoke runs)."""
    if device.type == "cuda":
        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    times = []
    for _ in range(3):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return sorted(times)[1]


def time_graphed_ms(fn, replays: int = 20) -> float:
    """Capture one call of ``fn`` in a CUDA graph (so it must be capturable), replay it, mean ms per replay."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def float32_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """Reference: float32 softmax attention in query chunks (TF32 off), [B, S, H, D]."""
    q, k, v = (x.float().transpose(1, 2) for x in (q, k, v))
    scale = 1.0 / math.sqrt(q.shape[-1])
    out = torch.empty_like(q)
    for start in range(0, q.shape[2], chunk):
        scores = torch.matmul(q[:, :, start:start + chunk], k.transpose(-1, -2)) * scale
        out[:, :, start:start + chunk] = torch.matmul(torch.softmax(scores, dim=-1), v)
    return out.transpose(1, 2)


class Budget:
    def __init__(self, seconds: float) -> None:
        self.deadline = time.monotonic() + seconds

    def left(self) -> float:
        return self.deadline - time.monotonic()


# --- the measurements ---------------------------------------------------------------------------------------


def run_config(config, quantized, ref32, ref_cudnn, sk, shape: Shape, budget: Budget) -> dict:
    row = asdict(config)
    row["v_layout"] = "transposed" if quantized[4].stride(1) == 1 else "natural"
    if budget.left() <= 0:
        row["error"] = "skipped: time budget"
        return row
    device = quantized[0].device
    try:
        out = torch.full(quantized[0].shape, float("nan"), dtype=torch.bfloat16, device=device)  # poisoned
        _, compiled = fa._launch(*quantized, out, config)
        sync(device)
        nan_count = int(out.isnan().sum().item())
        row.update(nan_count=nan_count, all_written_no_nan=nan_count == 0,
                   rel_err_fp32=rel_err(out, ref32), **kernel_facts(compiled))
        if ref_cudnn is not None:
            row["rel_err_cudnn"] = rel_err(out, ref_cudnn)
        row["ms"] = time_ms(lambda: fa.fp8_attention_quantized(*quantized, out=out, config=config), device)
        row["tflops"] = shape.tflops(row["ms"], sk)
    except Exception as error:  # noqa: BLE001 - one failing variant must not end the run
        row["error"] = describe(error)
        sync(device)
    return row


def time_quantize(q, k, v, device: torch.device) -> dict:
    quantize = {}
    for name, fn in (("q", lambda: fa.quantize_per_head(q)),
                     ("kv", lambda: (fa.quantize_per_head(k), fa.quantize_per_head(v, transpose=True)))):
        try:
            if device.type != "cuda":
                raise RuntimeError("CUDA graphs need CUDA")
            quantize[f"{name}_ms_graphed"] = time_graphed_ms(fn)
        except Exception as error:  # noqa: BLE001 - not capturable is a finding; time it eagerly then
            quantize[f"{name}_graph_error"] = describe(error, 1000)
            sync(device)
            try:
                quantize[f"{name}_ms"] = time_ms(fn, device)
            except Exception as again:  # noqa: BLE001
                quantize[f"{name}_error"] = describe(again, 1000)
    return quantize


def timed(fn, device: torch.device) -> dict:
    """ms of ``fn`` captured in a CUDA graph (so also: it is capturable); eager on CPU or if capture fails."""
    result = {}
    if device.type == "cuda":
        try:
            result["ms_graphed"] = time_graphed_ms(fn)
            return result
        except Exception as error:  # noqa: BLE001 - not capturable is a finding; time it eagerly then
            result["graph_error"] = describe(error, 1000)
            sync(device)
    result["ms"] = time_ms(fn, device)
    return result


def engine_mirror(q: torch.Tensor, k: torch.Tensor) -> tuple[FP8ContextKV, torch.Tensor, torch.Tensor]:
    """The engine's own FP8 mirror (:class:`FP8ContextKV`, one layer, room for k's keys) and q's fp8 buffer and
    scale: the bench times the layout and strides the engine runs, not a copy of them."""
    heads, dim = k.shape[2], k.shape[3]
    mirror = FP8ContextKV(num_layers=1, max_tokens=k.shape[1], num_heads=heads, head_dim=dim, device=k.device)
    return mirror, torch.empty(q.shape, dtype=fa.FP8_DTYPE, device=q.device), torch.ones(1, heads, device=q.device)


def engine_inputs(shape: Shape, sk: int, device: torch.device):
    """Seeded q, k, v (batch 1) for ``sk`` keys, the history length ``sk - sq``, and :func:`engine_mirror`'s
    mirror, q buffer and scale: the engine sweep's and the quantize sweep's inputs."""
    generator = torch.Generator(device=device).manual_seed(sk)
    dims = (shape.heads, shape.head_dim)
    q = torch.randn(1, shape.sq, *dims, device=device, generator=generator).bfloat16()
    kv = torch.randn(2, sk, *dims, device=device, generator=generator).bfloat16()
    k, v = kv[0].unsqueeze(0), kv[1].unsqueeze(0)
    return (q, k, v, sk - shape.sq, *engine_mirror(q, k))


def quantized_engine_operands(shape: Shape, sk: int, device: torch.device):
    """:func:`engine_inputs` quantized as the engine does (q by the fast quantizer, the history's and the current
    block's K/V into the mirror): (q, k, v, history length, the operands of ``fp8_attention_segments`` without
    the history length)."""
    q, k, v, sh, mirror, q8, q_scale = engine_inputs(shape, sk, device)
    fa.quantize_per_head_into(q, q8, q_scale)
    mirror.quantize(0, HISTORY, 0, k[0, :sh], v[0, :sh])
    mirror.quantize(0, CURRENT, sh, k[0, sh:], v[0, sh:])
    return q, k, v, sh, (q8, q_scale, *mirror.segments(0, sk))


def run_engine_path(q, k, v, sk: int, config, ref32, ref_cudnn, device: torch.device) -> dict:
    """What the engine runs with fp8=attention (history = all keys but the current block's Sq):

    * ``quantize_history``: the per-block cost, the history's K and V into the engine's mirror (K rows,
      transposed V; :meth:`FP8ContextKV.quantize`), with GB/s of one bf16 read + one fp8 write;
    * ``kernel``: fp8_attention_segments over both segments vs fp8_attention_quantized (one scale) on the same
      bytes and config: what the second segment costs; rel err vs float32 / cuDNN;
    * ``forward``: the per-forward cost, quantize q and the current block's K/V into the mirror + the kernel,
      one CUDA graph: the number to hold against cuDNN's ms (``speedup_vs_cudnn``).
    """
    sq, heads, dim = q.shape[1], q.shape[2], q.shape[3]
    sh = sk - sq
    mirror, q8, q_scale = engine_mirror(q, k)
    operands = (q8, q_scale, *mirror.segments(0, sk))  # what FP8ContextKV.attend passes the kernel
    record = {"history_tokens": sh, "config": {key: getattr(config, key) for key in CONFIG_KEYS}}

    def quantize_history():
        mirror.quantize(0, HISTORY, 0, k[0, :sh], v[0, :sh])

    def quantize_current():
        fa.quantize_per_head_into(q, q8, q_scale)
        mirror.quantize(0, CURRENT, sh, k[0, sh:], v[0, sh:])

    out = torch.empty(q.shape, dtype=torch.bfloat16, device=device)

    def kernel():
        return fa.fp8_attention_segments(*operands, sh, out=out, config=config)

    def forward():
        quantize_current()
        return kernel()

    try:
        if sh:
            quantize_history()
            record["quantize_history"] = timed(quantize_history, device)
            ms = record["quantize_history"].get("ms_graphed", record["quantize_history"].get("ms"))
            record["quantize_history"]["gb_per_s"] = 2 * sh * heads * dim * 3 / (ms * 1e-3) / 1e9  # bf16 in, fp8 out
            exact = [fa.quantize_per_head(x[:, :sh], transpose=t) for x, t in ((k, False), (v, True))]
            record["quantize_history"]["bits_equal_quantize_per_head"] = bool(
                torch.equal(mirror.keys(0, 0, sh).view(torch.uint8), exact[0][0].view(torch.uint8))
                and torch.equal(mirror.values(0, 0, sh).float(), exact[1][0].float())
                and torch.equal(mirror.scales[0, 0, HISTORY], exact[0][1])
                and torch.equal(mirror.scales[0, 1, HISTORY], exact[1][1]))
        forward()
        sync(device)
        record["kernel"] = {**timed(kernel, device), "rel_err_fp32": rel_err(out, ref32),
                            "nan_count": int(out.isnan().sum().item())}
        if ref_cudnn is not None:
            record["kernel"]["rel_err_cudnn"] = rel_err(out, ref_cudnn)
        # The same bytes under one scale (what the single-scale kernel costs here): the current segment's.
        q_op, q_scale_op, keys, (_, k_current), values, (_, v_current) = operands
        single = lambda: fa.fp8_attention_quantized(q_op, q_scale_op, keys, k_current, values, v_current,  # noqa: E731
                                                    out=out, config=config)
        record["kernel_single_scale"] = timed(single, device)
        record["quantize_current"] = timed(quantize_current, device)
        record["forward"] = timed(forward, device)
    except Exception as error:  # noqa: BLE001 - the sweep's results stay
        record["error"] = describe(error)
        sync(device)
    return record


def cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """cuDNN's bf16 SDPA over ``[B, S, H, D]`` inputs, as a callable, and its output as ``[B, Sq, H, D]``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))

    return cudnn, cudnn().transpose(1, 2)


def run_sk(sk: int, shape: Shape, sweep, env: dict, device: torch.device, budget: Budget) -> dict:
    record = {"sk": sk, "sq": shape.sq, "batch": shape.batch, "heads": shape.heads, "head_dim": shape.head_dim, **env}
    generator = torch.Generator(device=device).manual_seed(sk)
    dims = (shape.heads, shape.head_dim)
    q = torch.randn(shape.batch, shape.sq, *dims, device=device, generator=generator).bfloat16()
    kv_buffer = torch.randn(2, max(shape.sk_values), *dims, device=device, generator=generator).bfloat16()
    k, v = kv_buffer[0, :sk].unsqueeze(0), kv_buffer[1, :sk].unsqueeze(0)  # strided over S, as the engine's
    if shape.batch != 1:
        raise ValueError("the bench's K/V are batch 1, as the engine's")
    ref32 = float32_attention(q, k, v)

    ref_cudnn = None
    try:
        cudnn, ref_cudnn = cudnn_attention(q, k, v)
        ms = time_ms(cudnn, device)
        record["cudnn"] = {"ms": ms, "tflops": shape.tflops(ms, sk), "rel_err_fp32": rel_err(ref_cudnn, ref32)}
    except Exception as error:  # noqa: BLE001
        record["cudnn"] = {"error": describe(error)}
    log(f"Sk={sk} cuDNN {record['cudnn']}")

    quantized = (*fa.quantize_per_head(q), *fa.quantize_per_head(k), *fa.quantize_per_head(v, transpose=True))
    dequantized = [fa.dequantize_per_head(quantized[i], quantized[i + 1]) for i in (0, 2, 4)]
    record["rel_err_fp32_of_dequantized_inputs"] = rel_err(float32_attention(*dequantized), ref32)
    del dequantized
    record["quantize"] = time_quantize(q, k, v, device)
    log(f"Sk={sk} quantize {record['quantize']}")

    rows = []
    for config in sweep:
        rows.append(run_config(config, quantized, ref32, ref_cudnn, sk, shape, budget))
        log(f"Sk={sk} {rows[-1]}")
    good = [row for row in rows if "ms" in row and row["nan_count"] == 0 and row["rel_err_fp32"] < GOOD_ENOUGH]
    best_row = min(good, key=lambda row: row["ms"]) if good else None
    if best_row is not None:
        best = C(*(best_row[key] for key in CONFIG_KEYS))
        natural_v = (*quantized[:4], quantized[4].contiguous(), quantized[5])  # D contiguous, as Blackwell allows
        for config, inputs in ((replace(best, precise_pv=True), quantized), (replace(best, p_shift=0), quantized),
                               (best, natural_v)):
            rows.append(run_config(config, inputs, ref32, ref_cudnn, sk, shape, budget))
            log(f"Sk={sk} variant {rows[-1]}")
        record["best"] = best_row
        if "ms" in record["cudnn"]:
            record["speedup_vs_cudnn"] = record["cudnn"]["ms"] / best_row["ms"]
        try:
            end_to_end = fa.fp8_attention(q, k, v, config=best)
            ms = time_ms(lambda: fa.fp8_attention(q, k, v, config=best), device)
            record["end_to_end"] = {
                "ms": ms, "tflops": shape.tflops(ms, sk), "rel_err_fp32": rel_err(end_to_end, ref32),
                "nan_count": int(end_to_end.isnan().sum().item()),
            }
            if "ms" in record["cudnn"]:
                record["end_to_end"]["speedup_vs_cudnn"] = record["cudnn"]["ms"] / ms
        except Exception as error:  # noqa: BLE001
            record["end_to_end"] = {"error": describe(error)}
    engine_config = fa.default_config(shape.head_dim, sk) if shape.head_dim in (128,) else sweep[0]
    if budget.left() > 0:
        record["engine_path"] = run_engine_path(q, k, v, sk, engine_config, ref32, ref_cudnn, device)
        forward = record["engine_path"].get("forward", {})
        forward_ms = forward.get("ms_graphed", forward.get("ms"))
        if forward_ms and "ms" in record["cudnn"]:
            record["engine_path"]["forward_speedup_vs_cudnn"] = record["cudnn"]["ms"] / forward_ms
        log(f"Sk={sk} engine path {record['engine_path']}")
    record["configs"] = rows
    return record


def config_key(config) -> str:
    return "x".join(str(getattr(config, key)) for key in CONFIG_KEYS)


def engine_sweep(shape: Shape, sweep, env: dict, device: torch.device, sk_values: tuple[int, ...]) -> list[dict]:
    """The engine's kernel (two segments: history quantized once, current per forward) for every config of
    ``sweep`` at each key count of ``sk_values`` (history = Sk - Sq): ms (L2 flushed), TFLOP/s, error vs
    float32 and vs cuDNN, the cuDNN ms on the same inputs, and the config :func:`fa.default_config` picks."""
    records = []
    for sk in sk_values:
        q, k, v, sh, operands = quantized_engine_operands(shape, sk, device)
        ref32 = float32_attention(q, k, v)
        record = {"engine_sweep": True, "sk": sk, "history_tokens": sh, **env,
                  "default_config": asdict(fa.default_config(shape.head_dim, sk))}
        try:
            cudnn, ref_cudnn = cudnn_attention(q, k, v)
            record["cudnn_ms"] = time_ms(cudnn, device)
        except Exception as error:  # noqa: BLE001
            ref_cudnn, record["cudnn_error"] = None, describe(error)
        rows = []
        for config in sweep:
            row = {key: getattr(config, key) for key in CONFIG_KEYS}
            try:
                out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device=device)

                def kernel(config=config, out=out):
                    return fa.fp8_attention_segments(*operands, sh, out=out, config=config)

                _, compiled = fa._launch(*operands, out, config, sh)
                sync(device)
                row.update(nan_count=int(out.isnan().sum().item()), rel_err_fp32=rel_err(out, ref32),
                           **kernel_facts(compiled))
                if ref_cudnn is not None:
                    row["rel_err_cudnn"] = rel_err(out, ref_cudnn)
                row["ms"] = time_ms(kernel, device)
                row["tflops"] = shape.tflops(row["ms"], sk)
            except Exception as error:  # noqa: BLE001 - one failing config must not end the sweep
                row["error"] = describe(error)
                sync(device)
            rows.append(row)
            log(f"engine sweep Sk={sk} {row}")
        good = [r for r in rows if "ms" in r and r["nan_count"] == 0 and r["rel_err_fp32"] < GOOD_ENOUGH]
        record["best"] = min(good, key=lambda r: r["ms"]) if good else None
        record["configs"] = rows
        records.append(record)
    return records


def quantize_sweep(shape: Shape, env: dict, device: torch.device, sk_values: tuple[int, ...]) -> list[dict]:
    """The quantizer into the engine's mirror at each key count (history = Sk - Sq, the current block after it):
    per cast, ms in a CUDA graph (eager on CPU) and GB/s of one bf16 read + one fp8 write (pass 1 reads again),
    and whether its bits equal quantize_per_head's. ``v_current`` is the transposed V slice that starts at key
    ``history_tokens``: 8 bytes off a 16-byte boundary at odd multiples of 1,560 (``v_current_lead``)."""
    records = []
    for sk in sk_values:
        q, k, v, sh, mirror, q8, q_scale = engine_inputs(shape, sk, device)
        values = mirror.values(0, sh, sk)
        record = {"quantize_sweep": True, "sk": sk, "history_tokens": sh, **env,
                  "v_current_lead": fa._aligned_rows(values)[1]}
        casts = {
            "q": (q, lambda: fa.quantize_per_head_into(q, q8, q_scale), lambda: (q8, q_scale), False),
            "k_current": (k[:, sh:], lambda: fa.quantize_per_head_into(k[:, sh:], mirror.keys(0, sh, sk),
                                                                       mirror.scales[0, 0, CURRENT]),
                          lambda: (mirror.keys(0, sh, sk), mirror.scales[0, 0, CURRENT]), False),
            "v_current": (v[:, sh:], lambda: fa.quantize_per_head_into(v[:, sh:], values, mirror.scales[0, 1, CURRENT]),
                          lambda: (values, mirror.scales[0, 1, CURRENT]), True),
        }
        if sh:
            casts["kv_history"] = (k[:, :sh], lambda: mirror.quantize(0, HISTORY, 0, k[0, :sh], v[0, :sh]), None, None)
        for name, (x, fn, result, transpose) in casts.items():
            try:
                fn()
                row = timed(fn, device)
                ms = row.get("ms_graphed", row.get("ms"))
                row["gb_per_s"] = (2 if name == "kv_history" else 1) * x.numel() * 3 / (ms * 1e-3) / 1e9
                if result is not None:
                    got, got_scale = result()
                    want, want_scale = fa.quantize_per_head(x, transpose=transpose)
                    row["bits_equal_quantize_per_head"] = bool(
                        torch.equal(got.float(), want.float()) and torch.equal(got_scale, want_scale))
            except Exception as error:  # noqa: BLE001 - the other casts still run
                row = {"error": describe(error)}
                sync(device)
            record[name] = row
        log(f"quantize sweep {record}")
        records.append(record)
    return records


def emit(line: str, out_path: str | None) -> None:
    print(line, flush=True)
    if out_path:
        with open(out_path, "a", encoding="utf-8") as file:
            file.write(line + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="append the JSON lines to this file")
    parser.add_argument("--budget-s", type=float, default=130.0, help="skip variants after this many seconds")
    parser.add_argument("--compile-only", action="store_true", help="cross-compile the sweep for sm_90, no GPU")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")
    parser.add_argument("--engine-sweep", default=None, help="only the engine's two-segment kernel, every config, "
                        "at these comma-separated key counts (e.g. 18720,28080,32760)")
    parser.add_argument("--quantize-sweep", default=None, help="only the quantizer into the engine's mirror (q, the "
                        "current K and V, the history) at these comma-separated key counts")
    args = parser.parse_args()
    if args.compile_only:
        compile_only()
        return
    budget = Budget(args.budget_s)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if args.smoke:
        from tests.triton_interpreted import patch_interpreter

        patch_interpreter()  # the interpreter's fp8 / bf16 casts and NumPy 2.4 (see the test's docstring)
        shape, sweep, device = SMOKE, SMOKE_SWEEP, torch.device("cpu")
        env = {"torch": torch.__version__, "triton": triton.__version__, "device": "cpu (Triton interpreter)"}
    else:
        shape, sweep, device = WAN_480P, SWEEP, torch.device("cuda")
        env = {"torch": torch.__version__, "triton": triton.__version__, "device": torch.cuda.get_device_name(),
               "capability": list(torch.cuda.get_device_capability())}
    log(f"start {env}")
    if args.quantize_sweep:
        for record in quantize_sweep(shape, env, device, tuple(int(x) for x in args.quantize_sweep.split(","))):
            emit(json.dumps(record), args.out)
        if not args.engine_sweep:
            return
    if args.engine_sweep:
        sk_values = tuple(int(x) for x in args.engine_sweep.split(","))
        summary = {"engine_sweep_summary": True, **env, "ms": {}}  # per Sk: cuDNN and each variant's ms
        for record in engine_sweep(shape, sweep, env, device, sk_values):
            emit(json.dumps(record), args.out)
            summary["ms"][record["sk"]] = {"cudnn": record.get("cudnn_ms"), **{
                config_key(C(*(r[key] for key in CONFIG_KEYS))): r.get("ms")
                for r in record["configs"]}}
        emit(json.dumps(summary), args.out)
        return
    summary = {"summary": True, **env, "per_sk": []}
    for sk in shape.sk_values:
        try:
            record = run_sk(sk, shape, sweep, env, device, budget)
        except Exception as error:  # noqa: BLE001 - the other Sk still run
            record = {"sk": sk, **env, "error": describe(error)}
        emit(json.dumps(record), args.out)
        best = record.get("best") or {}
        summary["per_sk"].append({
            "sk": sk, "cudnn_ms": record.get("cudnn", {}).get("ms"), "best_ms": best.get("ms"),
            "best_tflops": best.get("tflops"), "speedup_vs_cudnn": record.get("speedup_vs_cudnn"),
            "best_config": {key: best.get(key) for key in CONFIG_KEYS} if best else None,
            "best_rel_err_fp32": best.get("rel_err_fp32"), "best_wgmma": best.get("wgmma"),
            "end_to_end_ms": record.get("end_to_end", {}).get("ms"), "error": record.get("error"),
            "engine_forward": record.get("engine_path", {}).get("forward"),
            "engine_forward_speedup_vs_cudnn": record.get("engine_path", {}).get("forward_speedup_vs_cudnn"),
            "engine_quantize_history": record.get("engine_path", {}).get("quantize_history"),
            "engine_kernel": record.get("engine_path", {}).get("kernel"),
            "engine_kernel_single_scale": record.get("engine_path", {}).get("kernel_single_scale"),
        })
        log(f"Sk={sk} done, {budget.left():.0f} s of budget left")
    emit(json.dumps(summary), args.out)


if __name__ == "__main__":
    main()
