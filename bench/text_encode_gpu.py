"""Time one prompt's encode by a UMT5-XXL-geometry text encoder; prints ONE JSON line.

With random weights the engine's builder uses a tiny text encoder, so a service benchmark's time to first media
leaves out what a real Wan model pays for its prompt: this measures that part. The geometry is UMT5-XXL's
(Wan 2.1's `text_encoder/config.json`: d_model 4096, 24 layers, 64 heads of 64, d_ff 10240, gated GELU,
vocabulary 256384), built by transformers' `UMT5EncoderModel` with random weights made directly on the device
(constructed on the meta device in the target dtype, then `to_empty` + in-place normal draws: no CPU copy, no
float32 detour). Two calls, per attention implementation: the engine's (the prompt's tokens only, with their
mask, states copied to the host in float32) and Wan's own as the reference (512 token ids padded after the
prompt's tokens, the attention mask), with the largest difference of the prompt's states between them.
Median of `--runs` after `--warmup`, synchronised.

    python bench/text_encode_gpu.py --device cuda --dtype bfloat16
    python bench/text_encode_gpu.py --geometry tiny    # the code path on a CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.models.random_text import UMT5_TINY as TINY
from engine.models.random_text import UMT5_XXL
from engine.models.random_text import random_umt5 as build
from engine.models.text_graphs import GraphedTextEncoder

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def set_attention(model, name: str) -> str:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name
    return model.config._attn_implementation


def relative(states: torch.Tensor, reference: torch.Tensor) -> float:
    return float((states - reference).abs().max() / reference.abs().max())


def time_encode(encode, ids, mask, device, runs: int, warmup: int) -> tuple[dict, torch.Tensor]:
    """``encode(ids, mask) -> states``, timed; the summary and the last states on the host."""
    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    forward_ms, encode_ms, states = [], [], None
    with torch.no_grad():
        for run in range(warmup + runs):
            sync()
            start = time.perf_counter()
            states = encode(ids, mask)
            sync()
            mid = time.perf_counter()
            host = states.float().cpu()  # what the engine does with the states
            end = time.perf_counter()
            if run >= warmup:
                forward_ms.append((mid - start) * 1000)
                encode_ms.append((end - start) * 1000)
    return {
        "forward_ms_median": round(statistics.median(forward_ms), 2),
        "encode_ms_median": round(statistics.median(encode_ms), 2),
        "encode_ms_min": round(min(encode_ms), 2),
        "encode_ms_max": round(max(encode_ms), 2),
        "states_finite": bool(torch.isfinite(host).all()),
        "states_std": round(float(host.std()), 4),
    }, host


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", choices=["xxl", "tiny"], default="xxl")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None, help="default bfloat16 on CUDA, else float32")
    parser.add_argument("--tokens", type=int, default=512, help="the reference's padded length (Wan's text_len)")
    parser.add_argument("--prompt-tokens", type=int, default=24, help="tokens of the prompt itself (the mask)")
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--attention", default="sdpa,eager", help="implementations to time, first is the headline")
    parser.add_argument("--padded", action=argparse.BooleanOptionalAction, default=True,
                        help="also time Wan's call on all --tokens positions (the reference; slow on a CPU)")
    parser.add_argument("--layers", type=int, default=None,
                        help="build only this many of the geometry's layers (a small machine); the encode time is "
                             "also reported scaled to all of them (`encode_ms_median_scaled`)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype or ("bfloat16" if device.type == "cuda" else "float32")]
    geometry = dict(UMT5_XXL if args.geometry == "xxl" else TINY)
    full_layers = geometry["num_layers"]
    if args.layers is not None:
        geometry["num_layers"] = args.layers
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    began = time.perf_counter()
    model = build(geometry, device, dtype)
    if device.type == "cuda":
        torch.cuda.synchronize()
    build_s = time.perf_counter() - began
    generator = torch.Generator().manual_seed(1)
    ids = torch.zeros(1, args.tokens, dtype=torch.long)
    ids[0, : args.prompt_tokens] = torch.randint(2, geometry["vocab_size"], (args.prompt_tokens,), generator=generator)
    ids[0, args.prompt_tokens - 1] = geometry["eos_token_id"]
    mask = torch.zeros(1, args.tokens, dtype=torch.long)
    mask[0, : args.prompt_tokens] = 1
    ids, mask = ids.to(device), mask.to(device)

    n = args.prompt_tokens
    results, padded_states = {}, {}
    for name in args.attention.split(","):
        try:
            used = set_attention(model, name)
            def eager(i, m):
                return model(input_ids=i, attention_mask=m).last_hidden_state

            tokens, states = time_encode(eager, ids[:, :n], mask[:, :n], device, args.runs, args.warmup)
            results[name] = {"used": used, **tokens}
            if args.padded:
                padded, reference = time_encode(eager, ids, mask, device, args.runs, args.warmup)
                reference = reference[:, :n]
                padded_states[name] = reference
                results[name].update(padded_reference=padded, max_rel_error_vs_padded=relative(states, reference))
            if device.type == "cuda":  # the engine's path: the prompt's tokens padded to a bucket, one graph replay
                graphed = GraphedTextEncoder(eager, args.tokens, device)
                timed, replayed = time_encode(graphed, ids[:, :n], mask[:, :n], device, args.runs, args.warmup)
                results[name]["graphs"] = {**timed, "graphs": graphed.num_graphs, "replays": graphed.replays,
                                           "max_rel_error_vs_eager_tokens": relative(replayed, states)}
        except Exception as error:  # an implementation this transformers lacks: say so, time the others
            results[name] = {"error": repr(error)[:300]}
    import transformers

    if len(padded_states) == 2:  # two implementations of Wan's own call: the floor any difference is judged by
        a, b = padded_states.values()
        results["padded_implementations_max_rel_error"] = relative(a, b)
    headline = next((r for r in results.values() if isinstance(r, dict) and "encode_ms_median" in r), {})
    print(json.dumps({
        "bench": "text_encode",
        "date": time.strftime("%Y-%m-%d"),
        "geometry": "umt5-xxl" if args.geometry == "xxl" else "tiny",
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "parameters_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 3),
        "build_s": round(build_s, 2),
        "gpu_allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 2) if device.type == "cuda" else None,
        "tokens": args.tokens,
        "prompt_tokens": args.prompt_tokens,
        "runs": args.runs,
        "layers": geometry["num_layers"],
        "threads": torch.get_num_threads(),
        "encode_ms_median": headline.get("encode_ms_median"),
        "encode_ms_median_scaled": (round(headline["encode_ms_median"] * full_layers / geometry["num_layers"], 1)
                                    if headline.get("encode_ms_median") is not None else None),
        "padded_encode_ms_median": headline.get("padded_reference", {}).get("encode_ms_median"),
        "graphs_encode_ms_median": headline.get("graphs", {}).get("encode_ms_median"),
        "by_attention": results,
    }))


if __name__ == "__main__":
    main()
