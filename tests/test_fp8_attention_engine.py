"""FP8 attention in the engine (``fp8 = "attention" | "all"``): the tiny engine against bf16 on the same weights
and noise, the context's FP8 mirror, and the config / construction rules.

The kernel runs on the CPU only under the Triton interpreter, which must be switched on before Triton is
imported: the engine checks run in a subprocess (as tests/test_fp8_attention.py's kernel checks do, with its
interpreter patches); the rules run here. Two CUDA checks for the device machine (Hopper): graphs and quality.

Error bound of the engine check: each self-attention output carries the kernel's error, at most 7 % relative
on unit-variance inputs (tests/test_fp8_attention.py: q, k, v and P roundings); it enters the latents through
the output projection and the gated residual, and x0 = x_t - sigma * v does not amplify it (the same argument
as FP8 linears'), so 7 % bounds the latents' relative error. Measured on the seeded random tiny model: ~0.25 %
per block, flat over blocks. Above 1e-4: the FP8 kernel really ran (off and attention differ in nothing else).
"""

from __future__ import annotations


import json
import sys

import pytest

pytest.importorskip("triton")

import torch
from pydantic import ValidationError

from engine.config import EngineConfig, fp8_attention_refusal
from engine.kv_cache import KVCacheManager
from engine.models import fp8_attention as fa

from tests.triton_interpreted import interpreter_checks, interpreter_job  # noqa: E402

BACKGROUND_JOBS = (interpreter_job(__file__),)  # started with the session (tests/background.py)
FP8_ATTENTION_BOUND = 0.07
BLOCKS = 3
PROMPT = "a kite over dunes"
# Batched products sum their rows' terms in another order than one session's (the same scales, the same e4m3
# operands): bf16 noise, far below FP8_ATTENTION_BOUND's quantization error.
BATCHED_BOUND = 1e-2
GEOMETRY = {"sink_frames": 1, "window_frames": 2}  # the window evicts at block 2: history 3 frames from there


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _run(fp8: str, blocks: int = BLOCKS, **overrides):
    from tests.engine_helpers import build_small, small_dit_tiny_preset

    with small_dit_tiny_preset():  # the interpreted kernel's time grows with heads and layers; its error does not
        _, bundle = build_small(dtype="bfloat16", fp8=fp8, **GEOMETRY, **overrides)
    pipeline = bundle.pipeline
    device = pipeline.transformer.device
    kv = KVCacheManager(pipeline.kv_spec(), 1, device.type).open_session("s")
    progress = pipeline.new_progress(seed=3, prompt=PROMPT)
    return bundle, [pipeline.run_block(kv, progress) for _ in range(blocks)], kv


def _mirror_matches_quantized_history(workspace, pipeline, kv) -> dict:
    """The mirror's history rows and scales, loaded as the next block would load them (the session's resident
    frames; the last block's commit has rewritten an evicted block since its own load), against
    quantize_per_head of that history gathered from the pool, its keys rotated by the eager rotation (what the
    bf16 path's buffer held)."""
    from engine.models.kernels import rotate_pairs

    ids = kv.resident_block_ids("cond")
    cos, sin = pipeline.transformer.rotary(len(ids) + pipeline.frames_per_block)
    workspace.invalidate()
    workspace.load(("check",), kv.pool, ids, cos, sin, pipeline.transformer.kernels.rotate_pairs)
    tokens = workspace.history_tokens
    mirror = workspace.fp8
    history = kv.pool[:, :, list(workspace.history_block_ids)].flatten(2, 3)  # [layers, 2, tokens, H, D]
    cos, sin = pipeline.transformer.rotary(len(workspace.history_block_ids))
    keys_equal = values_equal = scales_equal = True
    for layer in range(history.shape[0]):
        k8, k_scale = fa.quantize_per_head(rotate_pairs(history[layer, 0], cos, sin).unsqueeze(0))
        v8, v_scale = fa.quantize_per_head(history[layer, 1].unsqueeze(0), transpose=True)
        keys_equal &= torch.equal(mirror.keys(layer, 0, tokens).view(torch.uint8), k8.view(torch.uint8))
        values_equal &= torch.equal(mirror.values(layer, 0, tokens).float(), v8.float())
        scales_equal &= torch.equal(mirror.scales[layer, 0, 0], k_scale) and torch.equal(mirror.scales[layer, 1, 0], v_scale)
    return {"history_tokens": tokens, "keys_equal": keys_equal, "values_equal": values_equal,
            "scales_equal": scales_equal}


# --- run in the interpreter subprocess ------------------------------------------------------------------


def _interpreter_checks() -> dict:
    from tests.triton_interpreted import patch_interpreter

    patch_interpreter()
    assert fa._interpreted(), "TRITON_INTERPRET=1 was not seen by triton"
    from engine.models.attention import GatheredContext, PagedContext

    _, reference, _ = _run("off")
    bundle, fp8, kv = _run("attention")
    pipeline = bundle.pipeline
    transformer = pipeline.transformer
    workspace = pipeline.context_kv["cond"]
    mirror = workspace.fp8
    results = {
        "errors": [_relative(a.video, b.video) for a, b in zip(fp8, reference)],
        "audio_errors": [_relative(a.audio, b.audio) for a, b in zip(fp8, reference) if a.audio is not None],
        "finite": all(bool(torch.isfinite(block.video).all()) for block in fp8),
        "fp8_attention": transformer.fp8_attention,
        "linears_converted": None if bundle.fp8 is None else bundle.fp8.converted,
        "mirror": _mirror_matches_quantized_history(workspace, pipeline, kv),
        "nbytes": workspace.nbytes,
        "buffer_bytes": workspace.buffer.numel() * workspace.buffer.element_size(),
        "mirror_bytes": mirror.nbytes,
        "geometry": [transformer.num_layers, workspace.buffer.shape[2], transformer.num_heads, transformer.head_dim],
        "mirror_v_shape": list(mirror.v.shape),
    }
    try:
        pipeline.variant(gather_history_once=False)
        results["per_forward_pipeline"] = "accepted"
    except ValueError as error:
        results["per_forward_pipeline"] = str(error)
    attn = transformer.transformer.blocks[0].attn1
    cos, sin = transformer.rotary(2)
    tokens = transformer.tokens_per_frame
    hidden = torch.randn(1, tokens, transformer.inner_dim, dtype=torch.bfloat16)
    try:  # a per-forward context (no gathered buffer): refused, never silently run in bf16
        attn(hidden, context=PagedContext(cos=cos, sin=sin, pool=torch.zeros(1), history_ids=None))
        results["per_forward_processor"] = "accepted"
    except ValueError as error:
        results["per_forward_processor"] = str(error)
    try:  # a gathered context without its mirror
        attn(hidden, context=GatheredContext(cos=cos, sin=sin, context_kv=workspace.buffer, history_tokens=tokens))
        results["no_mirror"] = "accepted"
    except ValueError as error:
        results["no_mirror"] = str(error)

    all_bundle, all_blocks, _ = _run("all", blocks=2)
    results["all"] = {
        "fp8_attention": all_bundle.pipeline.transformer.fp8_attention,
        "linears_converted": all_bundle.fp8.converted,
        "errors": [_relative(a.video, b.video) for a, b in zip(all_blocks, reference)],
        "finite": all(bool(torch.isfinite(block.video).all()) for block in all_blocks),
    }
    # The eager q / k path here; the fused kernel's per-session launches in tests/test_qk_quantize.py (whose
    # interpreted norms run more rows a program) and on the GPU (tests/test_batched_blocks.py).
    from tests.engine_helpers import fp8_batched_against_serial

    results["batched"] = fp8_batched_against_serial(fused_qk=False, blocks=3, **GEOMETRY)
    return results


# --- the tests --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return interpreter_checks(__file__)


def test_tiny_engine_with_fp8_attention_stays_close_to_bf16(interpreted):
    assert interpreted["fp8_attention"] is True and interpreted["linears_converted"] is None
    assert interpreted["finite"]
    errors = interpreted["errors"]
    assert len(errors) == BLOCKS
    assert all(1e-4 < error < FP8_ATTENTION_BOUND for error in errors), errors
    assert all(error < FP8_ATTENTION_BOUND for error in interpreted["audio_errors"]), interpreted["audio_errors"]


def test_the_mirror_holds_the_quantized_rotated_history(interpreted):
    mirror = interpreted["mirror"]
    layers, max_tokens, heads, head_dim = interpreted["geometry"]
    # After the last block's forwards the loaded history is sink + window frames (3 of them), not empty.
    assert mirror["history_tokens"] == 3 * max_tokens // 6 > 0  # context = 1 + 2 history + 3 current frames
    assert mirror["keys_equal"] and mirror["values_equal"] and mirror["scales_equal"], mirror


def test_the_mirror_is_counted_in_the_context_bytes(interpreted):
    layers, max_tokens, heads, head_dim = interpreted["geometry"]
    padded = -(-max_tokens // 16) * 16
    assert interpreted["mirror_v_shape"] == [layers, heads, head_dim, padded]
    expected = layers * heads * head_dim * (max_tokens + padded) + layers * 2 * 2 * heads * 4
    assert interpreted["mirror_bytes"] == expected
    assert interpreted["nbytes"] == interpreted["buffer_bytes"] + expected


def test_fp8_all_is_linears_and_attention(interpreted):
    result = interpreted["all"]
    assert result["fp8_attention"] is True and result["linears_converted"] > 0 and result["finite"]
    # Two error sources, each bounded as for one (FP8 linears: 5.1 %, attention: 7 %).
    assert all(1e-4 < error < 0.051 + FP8_ATTENTION_BOUND for error in result["errors"]), result


def test_batched_sessions_match_one_at_a_time_through_the_fp8_kernels(interpreted):
    """The batched forward's FP8 path (per-session q / k quantization into the mirror's slots, V's per (session,
    head) scales, one attention over the batch) makes each session's blocks as it makes them alone."""
    batched = interpreted["batched"]
    assert not batched["fused"] and batched["history_frames"] == [3, 3], batched
    assert max(batched["errors"]) <= BATCHED_BOUND, batched


def test_fp8_attention_refuses_the_per_forward_path(interpreted):
    assert "gather_history_once=True" in interpreted["per_forward_pipeline"]
    assert "gathered-history path only" in interpreted["per_forward_processor"]
    assert "FP8 mirror" in interpreted["no_mirror"]


# --- the rules, in this process ------------------------------------------------------------------------


def test_config_accepts_fp8_attention_on_the_cpu_only_under_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for value in ("attention", "all"):
        with pytest.raises(ValidationError, match=rf"fp8={value} runs its FP8 attention kernel on a Hopper GPU .*"
                                                  r"TRITON_INTERPRET=1"):
            EngineConfig(dtype="bfloat16", fp8=value)
        with pytest.raises(ValidationError, match=f"fp8={value} needs dtype=bfloat16"):
            EngineConfig(dtype="float32", fp8=value)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert EngineConfig(dtype="bfloat16", fp8="attention").fp8 == "attention"
    assert EngineConfig(dtype="bfloat16", fp8="all").fp8 == "all"
    assert EngineConfig(dtype="bfloat16", fp8="linear").fp8 == "linear"  # no interpreter needed


def test_fp8_attention_needs_hopper():
    for value in ("attention", "all"):
        refusal = fp8_attention_refusal(value, "cuda:0", (8, 9), interpreter=False)
        assert refusal and "Hopper" in refusal and "8.9" in refusal and "fp8=linear runs on 8.9+" in refusal
        assert fp8_attention_refusal(value, "cuda:0", (9, 0), interpreter=False) is None
        assert fp8_attention_refusal(value, "cuda", (10, 0), interpreter=False) is None
        assert fp8_attention_refusal(value, "cpu", None, interpreter=True) is None
        assert "TRITON_INTERPRET=1" in fp8_attention_refusal(value, "cpu", None, interpreter=False)
    for value in ("off", "linear"):
        assert fp8_attention_refusal(value, "cuda:0", (8, 0), interpreter=False) is None


def test_model_construction_refuses_what_the_kernel_cannot_run(monkeypatch):
    if fa._interpreted():
        pytest.skip("this session runs Triton interpreted")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        fa.check_engine_support(torch.device("cpu"), torch.bfloat16, 32)
    with pytest.raises(ValueError, match="bfloat16 model"):
        fa.check_engine_support(torch.device("cpu"), torch.float32, 32)
    with pytest.raises(ValueError, match="head_dim"):
        fa.check_engine_support(torch.device("cpu"), torch.bfloat16, 48)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 9))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA L40S")
    with pytest.raises(ValueError, match=r"Hopper GPU or newer .* NVIDIA L40S is 8\.9"):
        fa.check_engine_support(torch.device("cuda"), torch.bfloat16, 128)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    fa.check_engine_support(torch.device("cuda"), torch.bfloat16, 128)  # Hopper: accepted

    from diffusers import WanTransformer3DModel

    from engine.models.causal_wan import CausalWanTransformer
    from tests.engine_helpers import SMALL_TRANSFORMER_CONFIG

    model = WanTransformer3DModel(**SMALL_TRANSFORMER_CONFIG).to(torch.bfloat16)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        CausalWanTransformer(model, latent_height=6, latent_width=8, fp8_attention=True)
    assert CausalWanTransformer(model, latent_height=6, latent_width=8).fp8_attention is False


# --- on the device machine --------------------------------------------------------------------------------


HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="FP8 attention needs a Hopper GPU")
def test_cuda_fp8_attention_engine_replays_graphs_and_stays_close_to_bf16():
    """The tiny engine on the GPU: FP8 forwards captured as CUDA graphs (the quantizers and the kernel are
    capturable), equal to the same FP8 forwards run eagerly, within the bound of bf16, the mirror's history
    the quantized rotated history bit for bit (Triton's casts round to nearest even, as torch's)."""
    _, reference, _ = _run("off", device="cuda", cuda_graphs=True)
    bundle, graphed, kv = _run("attention", device="cuda", cuda_graphs=True)
    pipeline = bundle.pipeline
    assert pipeline.forwards.enabled, "a capture failed: the FP8 forwards fell back to eager"
    assert pipeline.forwards.num_graphs > 0 and pipeline.forwards.replays > 0
    mirror = _mirror_matches_quantized_history(pipeline.context_kv["cond"], pipeline, kv)
    eager = pipeline.variant(gather_history_once=True, cuda_graphs=False)
    kv = KVCacheManager(eager.kv_spec(), 1, "cuda").open_session("s")
    progress = eager.new_progress(seed=3, prompt=PROMPT)
    eager_blocks = [eager.run_block(kv, progress) for _ in range(BLOCKS)]
    errors = [_relative(ours.video, theirs.video) for ours, theirs in zip(graphed, reference)]
    replay = [_relative(ours.video, eager_block.video) for ours, eager_block in zip(graphed, eager_blocks)]
    assert all(torch.isfinite(block.video).all() for block in graphed)
    assert all(1e-4 < error < FP8_ATTENTION_BOUND for error in errors), errors
    assert all(error < 1e-3 for error in replay), replay  # the same kernels, replayed
    assert mirror["history_tokens"] > 0 and mirror["keys_equal"] and mirror["values_equal"] \
        and mirror["scales_equal"], mirror


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="FP8 attention needs a Hopper GPU")
def test_cuda_two_segment_kernel_and_quantizer_at_the_1_3b_head_geometry():
    """12 heads of 128, 3 frames of 1,560 queries, 2 history frames: quantizer bits = quantize_per_head's,
    the kernel within P's rounding of float32 attention of the dequantized segments, and the same under a
    CUDA graph."""
    from bench.fp8_attention_gpu import float32_attention

    torch.backends.cuda.matmul.allow_tf32 = False
    generator = torch.Generator(device="cuda").manual_seed(0)
    sq, sh, heads, dim = 4680, 3120, 12, 128
    q = torch.randn(1, sq, heads, dim, device="cuda", generator=generator).bfloat16()
    kv = torch.randn(2, sh + sq, heads, dim, device="cuda", generator=generator)
    kv[1, :sh] *= 10  # history V ten times the current block's
    kv = kv.bfloat16()
    mirror_k = torch.zeros(1, sh + sq, heads, dim, dtype=fa.FP8_DTYPE, device="cuda")
    storage = torch.zeros(1, heads, dim, sh + sq + 8, dtype=fa.FP8_DTYPE, device="cuda")
    mirror_v = storage[..., : sh + sq].permute(0, 3, 1, 2)
    scales = torch.ones(5, 1, heads, device="cuda")
    q8 = torch.empty(q.shape, dtype=fa.FP8_DTYPE, device="cuda")

    def forward():
        for lo, hi, k_scale, v_scale in ((0, sh, scales[1], scales[3]), (sh, sh + sq, scales[2], scales[4])):
            fa.quantize_per_head_into(kv[0, lo:hi].unsqueeze(0), mirror_k[:, lo:hi], k_scale)
            fa.quantize_per_head_into(kv[1, lo:hi].unsqueeze(0), mirror_v[:, lo:hi], v_scale)
        fa.quantize_per_head_into(q, q8, scales[0])
        return fa.fp8_attention_segments(q8, scales[0], mirror_k, (scales[1], scales[2]), mirror_v,
                                         (scales[3], scales[4]), sh)

    out = forward().clone()
    history = (torch.arange(sh + sq, device="cuda") < sh)[None, :, None, None]
    per_key = lambda h, c: torch.where(history, scales[h][:, None, :, None], scales[c][:, None, :, None])  # noqa: E731
    reference = float32_attention(q8.float() * scales[0][:, None, :, None], mirror_k.float() * per_key(1, 2),
                                  mirror_v.float() * per_key(3, 4))
    assert not out.isnan().any()
    assert _relative(out, reference) < 0.035
    from decoders.graph_capture import capture

    graph, graphed = capture(forward)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(graphed, out)
    mismatches = {}
    for lo, hi, k_index, v_index in ((0, sh, 1, 3), (sh, sh + sq, 2, 4)):
        k8, k_scale = fa.quantize_per_head(kv[0, lo:hi].unsqueeze(0))
        v8, v_scale = fa.quantize_per_head(kv[1, lo:hi].unsqueeze(0))
        mismatches[lo] = {
            "k_scale": not torch.equal(scales[k_index], k_scale), "v_scale": not torch.equal(scales[v_index], v_scale),
            "k_values": int((mirror_k[:, lo:hi].view(torch.uint8) != k8.view(torch.uint8)).sum()),
            "v_values": int((mirror_v[:, lo:hi].float() != v8.float()).sum()),
        }
    assert not any(any(m.values()) for m in mismatches.values()), mismatches  # same bits as quantize_per_head


if __name__ == "__main__" and sys.argv[1:] == ["--interpreter-checks"]:
    print(json.dumps(_interpreter_checks()))


def test_mirror_views_keep_every_non_unit_stride_a_multiple_of_16():
    """Triton specialises integer arguments on divisibility by 16 and vectorises the fp8 loads only when
    it can prove 16-byte-aligned rows: a view whose batch stride was its slice's key count (32,760 at the
    1.3B standard window) made the kernel 2-4x slower there. Every slice the kernel and the quantizer get
    keeps the layer's strides."""
    from engine.models.context_kv import FP8ContextKV

    mirror = FP8ContextKV(num_layers=2, max_tokens=1560 * 7, num_heads=2, head_dim=32, device=torch.device("cpu"))
    for start, end in ((0, 1560), (0, 4680), (4680, 9360), (1560, 1560 * 7), (3120, 3120 + 1560 * 3)):
        for view in (mirror.keys(1, start, end), mirror.values(1, start, end)):
            assert view.shape == (1, end - start, 2, 32)
            assert all(stride % 16 == 0 for stride in view.stride() if stride != 1), (start, end, view.stride())
        assert mirror.values(1, start, end).stride(1) == 1  # keys contiguous: PV's K-major operand
        assert mirror.keys(1, start, end).data_ptr() == mirror.k[1, start].data_ptr()
        assert mirror.values(1, start, end).data_ptr() == mirror.v[1, 0, 0, start].data_ptr()
    # A batched forward's views over slots [0, batch): the batch stride is a whole slot's.
    slotted = FP8ContextKV(num_layers=2, max_tokens=1560 * 7, num_heads=2, head_dim=32, device=torch.device("cpu"),
                           slots=3)
    for batch in (2, 3):
        for start, end in ((0, 4680), (3120, 3120 + 1560 * 3)):
            for view in (slotted.keys(1, start, end, batch), slotted.values(1, start, end, batch)):
                assert view.shape == (batch, end - start, 2, 32)
                assert all(stride % 16 == 0 for stride in view.stride() if stride != 1), (batch, view.stride())
            assert slotted.keys(1, start, end, batch)[batch - 1].data_ptr() == \
                slotted.slot(batch - 1).k[1, start].data_ptr()
