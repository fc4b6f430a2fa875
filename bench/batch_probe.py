"""What would batching sessions give? (issue 31, part 2) One DiT forward of B sessions' blocks against B forwards of one.

The engine runs one session's block per forward: at 1.3B / 832x480 a forward is 4,680 query tokens, and several
live viewers take turns. This measures, per session, what the same work costs when B sessions' blocks go through
one forward, in its two parts:

- the forward without the self-attention's history: ``--fp8 linear`` (the products, norms and quantizers the
  engine runs), the block's own keys only (a ``DenseContext``; the engine's gathered FP8 path takes one session a
  forward), every kernel profiled and summed by kind;
- the FP8 self-attention kernel at the engine's shapes (4,680 queries over ``--keys`` keys, 12 heads of 128) with
  B sessions in one launch, the inputs quantized once beforehand.

Prints ONE JSON line; per B, ms per session. CUDA graphs are off (kernel sums, not block times: what the graphs
would save between kernels is not in these figures). On the CPU it checks shapes only.

    python bench/batch_probe.py --device cuda --dtype bfloat16 --preset wan2.1-1.3b --batches 1,2,3
    python bench/batch_probe.py --batches 1,3 --reps 1                     # a CPU smoke run (tiny preset)
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from engine.bundle import build_models
from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.models.attention import DenseContext
from engine.models.latents import BlockLatents
from kernel_sums import DIT_KINDS, cuda_kernel_sums, profiled
from shifted_rows_conv_gpu import timed_ms

def forward_per_session(args, pipeline, cross_kv, batch: int, cuda: bool) -> dict:
    transformer = pipeline.transformer
    frames = pipeline.latent_shape[2]
    generator = torch.Generator(device=transformer.device).manual_seed(batch)
    video = torch.randn((batch,) + tuple(pipeline.latent_shape[1:]), generator=generator, device=transformer.device)
    audio = None
    if pipeline.audio_shape is not None:
        audio = torch.randn((batch,) + tuple(pipeline.audio_shape[1:]), generator=generator, device=transformer.device)
    latents = BlockLatents(video, audio)
    cos, sin = transformer.rotary(frames)
    context = DenseContext(cos=cos, sin=sin)
    timesteps = torch.full((batch, frames), 500.0, device=transformer.device)
    cross = cross_kv.unsqueeze(0).expand(batch, *cross_kv.shape)

    def forward() -> None:
        transformer(latents, timesteps, context, cross)

    for _ in range(args.warmup):
        forward()
    ms = timed_ms(forward, transformer.device, args.reps)
    by_kind, named = cuda_kernel_sums(profiled(forward, 2, cuda), DIT_KINDS, 90)
    per = 2 * batch * 1000  # µs over two forwards -> ms a session
    return {
        "forward_ms_per_session": round(ms / batch, 2),
        "kernel_ms_per_session_by_kind": {k: round(v / per, 3) for k, v in sorted(by_kind.items())},
        "kernel_ms_per_session_total": round(sum(by_kind.values()) / per, 3),
        "largest_kernels_ms_per_session": [(name, round(us / per, 3), calls / 2) for name, (us, calls) in
                                           sorted(named.items(), key=lambda item: -item[1][0])[:args.top]],
    }


def attention_per_session(args, transformer, batch: int, cuda: bool) -> dict | None:
    from engine.models import fp8_attention

    if not cuda:
        return None
    heads, head_dim = transformer.num_heads, transformer.head_dim
    queries = args.queries
    generator = torch.Generator(device=transformer.device).manual_seed(batch)

    def draw(tokens: int) -> torch.Tensor:
        return torch.randn(batch, tokens, heads, head_dim, generator=generator, device=transformer.device,
                           dtype=torch.bfloat16)

    q_fp8, q_scale = fp8_attention.quantize_per_head(draw(queries))
    k_fp8, k_scale = fp8_attention.quantize_per_head(draw(args.keys))
    v_fp8, v_scale = fp8_attention.quantize_per_head(draw(args.keys), transpose=True)

    def attend() -> None:  # as the engine calls it: the history and the block as two key segments
        fp8_attention.fp8_attention_segments(q_fp8, q_scale, k_fp8, (k_scale, k_scale), v_fp8, (v_scale, v_scale),
                                             args.keys - queries)

    ms = timed_ms(attend, transformer.device, 20)
    flops = 4 * batch * heads * queries * args.keys * head_dim
    return {"ms_per_session": round(ms / batch, 4), "tflops": round(flops / ms / 1e9, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", default="1,3")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--top", type=int, default=16)
    parser.add_argument("--queries", type=int, default=4680, help="the attention's queries (a fast block's)")
    parser.add_argument("--keys", type=int, default=18720, help="its keys: the fast window's 12 frames")
    args = parser.parse_args()
    cuda = args.device.startswith("cuda")
    bundle = build_models(EngineConfig(preset=args.preset, device=args.device, dtype=args.dtype, random_weights=True,
                                       fp8="linear", cuda_graphs=False))
    pipeline = bundle.pipeline
    kv = KVCacheManager(pipeline.kv_spec(), 1, args.device).open_session("probe")
    progress = pipeline.new_progress(seed=0, prompt="a red circle bouncing on a blue background")
    cross_kv = pipeline._cross_kv(kv, progress, "cond")
    runs = {}
    for batch in (int(b) for b in args.batches.split(",")):
        runs[str(batch)] = {"forward": forward_per_session(args, pipeline, cross_kv, batch, cuda),
                            "fp8_attention": attention_per_session(args, pipeline.transformer, batch, cuda)}
        if cuda:
            torch.cuda.empty_cache()
    print(json.dumps({
        "bench": "batch_probe",
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "preset": args.preset,
        "tokens_per_session": pipeline.latent_shape[2] * pipeline.transformer.tokens_per_frame,
        "runs": runs,
    }))


if __name__ == "__main__":
    main()
