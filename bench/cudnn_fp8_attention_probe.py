"""Is cuDNN's FP8 attention faster than ours? (issue 31) One attention call at the engine's shapes, four ways.

Attention is two thirds of the standard block's GPU time (docs/BENCHMARKS.md, *Why FP8 linears give so little*):
our Triton FP8 kernel runs the standard window's keys at ~480 TFLOP/s on an H100, far from the FP8 tensor cores'
peak. cuDNN has its own FP8 flash-attention forward (``sdpa_fp8`` of the cuDNN frontend's graph API; torch does
not expose it). This probe measures, on one call of the engine's shape (queries: one block's 3 latent frames,
keys: history + current; 12 heads of 128), before anything is built on it:

* ``bf16_cudnn``: torch's SDPA on cuDNN, bf16 — the engine's default path (the reference for speed);
* ``triton_fp8``: ours, per-head scales, history and current keys each with their own (the engine's ``--fp8
  attention``);
* ``cudnn_fp8``: cuDNN's FP8 forward, one scale per tensor (its only kind), e4m3 output (Hopper's only kind; the
  scale of the output is v's: a row of weights summing to 1 keeps every output within v's largest magnitude);
* ``cudnn_fp8_graph``: the same recorded in a CUDA graph (the engine replays graphs), if capture works.

Each: median ms of ``--iters`` calls (CUDA events), TFLOP/s (4·Sq·Sk·D·H), and the error against a float32
reference (relative Frobenius norm, largest absolute difference). The inputs are seeded normals with a different
magnitude per head (per-tensor scaling loses the small heads' precision; this shows how much). Prints ONE JSON
line; the cuDNN rows carry ``error`` instead where the frontend is missing or refuses the graph.

    python bench/cudnn_fp8_attention_probe.py --keys 18720,32760 [--iters 20]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
import traceback

import torch

from engine.models import fp8_attention as fa

HEADS, HEAD_DIM, QUERIES = 12, 128, 4680  # Wan 1.3B at 832x480: 3 latent frames of 1,560 tokens


def inputs(keys: int, device, seed: int = 0):
    """q [1, Sq, H, D], k and v [1, Sk, H, D] in bf16; head h's values scaled by 2**(h/4 - 1.5) (x0.35 .. x2.4)."""
    generator = torch.Generator(device=device).manual_seed(seed)
    scale = torch.tensor([2 ** (h / 4 - 1.5) for h in range(HEADS)], device=device)[None, None, :, None]

    def normal(seq):
        return (torch.randn(1, seq, HEADS, HEAD_DIM, generator=generator, device=device) * scale).bfloat16()

    return normal(QUERIES), normal(keys), normal(keys)


def reference(q, k, v) -> torch.Tensor:
    """float32 attention, one head at a time (a head's scores are Sq x Sk floats)."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for h in range(HEADS):
        scores = (q[0, :, h].float() @ k[0, :, h].float().T) / math.sqrt(HEAD_DIM)
        out[0, :, h] = torch.softmax(scores, dim=-1) @ v[0, :, h].float()
        del scores
    return out


def errors(out: torch.Tensor, ref: torch.Tensor) -> dict:
    diff = out.float() - ref
    return {"rel_fro": round(float(diff.norm() / ref.norm()), 5), "max_abs": round(float(diff.abs().max()), 5)}


def timed(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bf16_cudnn(q, k, v):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))

    def call():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qt, kt, vt)

    return call, lambda: call().transpose(1, 2)


def triton_fp8(q, k, v, history: int):
    """As the engine's FP8 path: history and current keys quantized each with their own per-head scales."""
    qq, qs = fa.quantize_per_head(q)
    kh, ksh = fa.quantize_per_head(k[:, :history])
    kc, ksc = fa.quantize_per_head(k[:, history:])
    vh, vsh = fa.quantize_per_head(v[:, :history])
    vc, vsc = fa.quantize_per_head(v[:, history:])
    k8 = torch.cat([kh, kc], dim=1)
    v8, _ = fa.quantize_per_head(v, transpose=True)  # storage of the right layout, overwritten below
    v8.copy_(torch.cat([vh, vc], dim=1))
    out = torch.empty_like(q)

    def call():
        return fa.fp8_attention_segments(qq, qs, k8, (ksh, ksc), v8, (vsh, vsc), history, out=out)

    return call, call


def per_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 ``x / descale`` and its float32 ``descale = amax / 448`` as a [1, 1, 1, 1] tensor."""
    amax = x.abs().amax().float().clamp_min(1e-12)
    descale = (amax / fa.FP8_MAX).reshape(1, 1, 1, 1)
    return (x.float() / descale.reshape(())).to(fa.FP8_DTYPE), descale


def cudnn_fp8(q, k, v):
    """cuDNN's FP8 forward on per-tensor-scaled e4m3 q, k, v (BSHD storage, given to cuDNN as BHSD strides)."""
    import cudnn

    device = q.device
    handle = cudnn.create_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(device).cuda_stream)
    e4m3, fp32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=e4m3, intermediate_data_type=fp32, compute_data_type=fp32, handle=handle)
    (q8, dq), (k8, dk), (v8, dv) = per_tensor(q), per_tensor(k), per_tensor(v)
    out8 = torch.empty(q.shape, dtype=fa.FP8_DTYPE, device=device)

    def bhsd(x):  # BSHD storage described as [B, H, S, D]
        b, s, h, d = x.shape
        return [b, h, s, d], [s * h * d, d, h * d, 1]

    def described(name, x):
        dim, stride = bhsd(x)
        return graph.tensor(name=name, dim=dim, stride=stride, data_type=e4m3)

    tq, tk, tv = described("q", q8), described("k", k8), described("v", v8)
    scalar = dict(dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=fp32)
    tdq, tdk, tdv, tds, tss, tso = (graph.tensor(name=n, **scalar) for n in ("dq", "dk", "dv", "ds", "ss", "so"))
    o, _, amax_s, amax_o = graph.sdpa_fp8(
        q=tq, k=tk, v=tv, descale_q=tdq, descale_k=tdk, descale_v=tdv, descale_s=tds, scale_s=tss, scale_o=tso,
        attn_scale=1.0 / math.sqrt(HEAD_DIM), generate_stats=False, name="probe",
    )
    dim, stride = bhsd(out8)
    o.set_output(True).set_dim(dim).set_stride(stride).set_data_type(e4m3)
    amax_s_t = torch.empty(1, 1, 1, 1, dtype=torch.float32, device=device)
    amax_o_t = torch.empty_like(amax_s_t)
    for amax in (amax_s, amax_o):
        amax.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(fp32)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    workspace = torch.empty(max(1, graph.get_workspace_size()), dtype=torch.uint8, device=device)
    scale_s = torch.full((1, 1, 1, 1), fa.FP8_MAX, dtype=torch.float32, device=device)  # P in [0, 1] -> [0, 448]
    descale_s = 1.0 / scale_s
    scale_o = 1.0 / dv  # |out| <= amax(v): every output is a convex combination of v's rows
    pack = {tq: q8, tk: k8, tv: v8, tdq: dq, tdk: dk, tdv: dv, tds: descale_s, tss: scale_s, tso: scale_o,
            o: out8, amax_s: amax_s_t, amax_o: amax_o_t}

    def call():
        graph.execute(pack, workspace, handle=handle)
        return out8

    def result():
        call()
        return out8.float() * dv.reshape(())

    def set_stream(stream):
        cudnn.set_stream(handle=handle, stream=stream.cuda_stream)

    return call, result, set_stream


def captured(call, set_stream):
    """``call`` recorded in a CUDA graph (cuDNN's handle pointed at the capture stream while recording)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    set_stream(stream)
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        call()
    set_stream(torch.cuda.current_stream())
    return graph.replay


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keys", default="18720,32760", help="key counts (history + one block of 4,680)")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    record = {"bench": "cudnn_fp8_attention_probe", "date": time.strftime("%Y-%m-%d"),
              "device": torch.cuda.get_device_name(device), "torch": torch.__version__,
              "cudnn_backend": torch.backends.cudnn.version(), "queries": QUERIES, "heads": HEADS,
              "head_dim": HEAD_DIM, "runs": []}
    try:
        import cudnn
        record["cudnn_frontend"] = getattr(cudnn, "__version__", "?")
        record["cudnn_frontend_backend"] = cudnn.backend_version()
    except Exception as error:  # noqa: BLE001 - the probe reports what failed and goes on
        record["cudnn_frontend_error"] = repr(error)
    for keys in (int(x) for x in args.keys.split(",")):
        q, k, v = inputs(keys, device)
        ref = reference(q, k, v)
        flops = 4 * QUERIES * keys * HEAD_DIM * HEADS
        run = {"keys": keys, "history": keys - QUERIES}

        def measure(name, build):
            try:
                built = build()
                call, result = built[0], built[1]
                ms = timed(call, args.iters)
                run[name] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1), **errors(result(), ref)}
                return built
            except Exception as error:  # noqa: BLE001
                run[name] = {"error": repr(error)[:400]}
                print(f"{name} at {keys} keys:\n{traceback.format_exc()}", file=sys.stderr)
                return None

        measure("bf16_cudnn", lambda: bf16_cudnn(q, k, v))
        measure("triton_fp8", lambda: triton_fp8(q, k, v, keys - QUERIES))
        built = measure("cudnn_fp8", lambda: cudnn_fp8(q, k, v))
        if built is not None:
            call, result, set_stream = built
            measure("cudnn_fp8_graph", lambda: (captured(call, set_stream), result))
        quant_ms = timed(lambda: (per_tensor(q), per_tensor(k), per_tensor(v)), args.iters)
        run["per_tensor_quantize_qkv_ms_eager"] = round(quant_ms, 4)
        for name in ("triton_fp8", "cudnn_fp8", "cudnn_fp8_graph"):
            if "ms" in run.get(name, {}) and "ms" in run.get("bf16_cudnn", {}):
                run[f"{name}_speedup_vs_bf16"] = round(run["bf16_cudnn"]["ms"] / run[name]["ms"], 3)
        if "ms" in run.get("cudnn_fp8", {}) and "ms" in run.get("triton_fp8", {}):
            run["cudnn_fp8_speedup_vs_triton_fp8"] = round(run["triton_fp8"]["ms"] / run["cudnn_fp8"]["ms"], 3)
        record["runs"].append(run)
        del q, k, v, ref
        torch.cuda.empty_cache()
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
