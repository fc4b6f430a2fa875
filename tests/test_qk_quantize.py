"""The FP8 attention's q and k in one pass each (engine/models/qk_quantize.py): RMS norm, rotation and e4m3 cast
with a scale bound by the norm's weights. The real Triton kernel through the interpreter (in a subprocess:
``TRITON_INTERPRET=1`` must precede Triton's import) against the eager path it stands for, the bound itself, the
tiny FP8 engine on it against bf16 beside the per-head-amax path's error, and the sm_90 cross-compile.

Bounds: the kernel computes the reference's roundings (the norm's and the rotation's bf16 outputs, then the
scaling) but sums the mean square in another order, which can move a bf16 value across a tie: nearly all e4m3
values equal, all within one e4m3 step (measured here: all equal). The static scale puts values lower in e4m3's
range than a per-head amax would, which costs nothing among e4m3's normal numbers: the engine's error against
bf16 is held to the per-head-amax path's own (tests/test_fp8_attention_engine.py bounds that one) within a
quarter of it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys

import pytest
import torch

from engine.models import kernels as K
from engine.models import qk_quantize as qq
from engine.models.rope import FrameRotaryEmbedding

try:
    import triton  # noqa: F401

    from tests.triton_interpreted import interpreter_checks, interpreter_job, patch_interpreter

    BACKGROUND_JOBS = (interpreter_job(__file__),)
except ImportError:  # no Triton: the interpreter checks skip
    BACKGROUND_JOBS = ()

CASES = {"small_3x32": (3, 32, 10), "wan_12x128": (12, 128, 6)}


def _inputs(heads: int, head_dim: int, tokens: int, generator: torch.Generator):
    x = (2 * torch.randn(1, tokens, heads * head_dim, generator=generator)).bfloat16()
    weight = (1 + 0.3 * torch.randn(heads * head_dim, generator=generator)).bfloat16()
    x[0, 1] = 0
    x[0, 1, weight[:head_dim].float().abs().argmax()] = 40.0  # a row's energy in head 0's largest-weight channel:
    # the bound's own worst case
    cos, sin = FrameRotaryEmbedding(head_dim, 2, 5, 8).for_frames(4, "cpu")
    return x, weight, cos[-tokens:], sin[-tokens:]


def _tiny_engine(fp8: str, quantized_norms: bool, blocks: int = 2):
    from engine.kv_cache import KVCacheManager
    from tests.engine_helpers import build_small, small_dit_tiny_preset

    with small_dit_tiny_preset():  # two denoising steps: the interpreted kernel's time is per forward
        _, bundle = build_small(dtype="bfloat16", fp8=fp8, sink_frames=1, window_frames=2, timesteps=[1000.0, 500.0])
    pipeline = bundle.pipeline
    if fp8 != "off":  # the CPU's kernel set is eager: only this flag differs between the two FP8 runs
        pipeline.transformer.kernels = dataclasses.replace(pipeline.transformer.kernels, quantized_norms=quantized_norms)
    kv = KVCacheManager(pipeline.kv_spec(), 1, "cpu").open_session("s")
    progress = pipeline.new_progress(seed=3, prompt="a kite over dunes")
    return [pipeline.run_block(kv, progress).video for _ in range(blocks)]


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# --- run in the interpreter subprocess ------------------------------------------------------------------


def _interpreter_checks() -> dict:
    from tests.test_norm_quantize import interpreter_friendly

    patch_interpreter()
    assert qq._interpreted(), "TRITON_INTERPRET=1 was not seen by triton"
    generator = torch.Generator().manual_seed(0)
    results = {}
    for name, (heads, head_dim, tokens) in CASES.items():
        x, weight, cos, sin = _inputs(heads, head_dim, tokens, generator)
        scale, inverse = qq.static_scales(weight, heads)
        dst = torch.empty(1, tokens, heads, head_dim, dtype=torch.float8_e4m3fn)
        stage = torch.empty(tokens, heads, head_dim, dtype=torch.bfloat16)
        qq.rms_rotate_quantize(x, weight, 1e-6, heads, cos, sin, inverse, dst, stage)
        expected, normed = qq.rms_rotate_quantize_reference(x, weight, 1e-6, heads, cos, sin, inverse)
        ours, theirs = dst.float() * scale.view(heads, 1), expected.float() * scale.view(heads, 1)
        step = torch.maximum(theirs.abs() / 8, scale.view(heads, 1) * 2.0**-9)
        # Before the cast's clamp: the rotated values over the scale (<= 448 is the bound), and the one-channel
        # row's pair norm (the rotation keeps it: the bound's value, less its slack).
        scaled = K.rotate_pairs(normed, cos, sin).float() * inverse.view(heads, 1)
        results[name] = {
            "values_equal_fraction": float((dst.float() == expected.float()).float().mean()),
            "within_one_step": bool(((ours - theirs).abs() <= step * 1.0001).all()),
            "stage_equal": bool(torch.equal(stage, normed[0])),
            "largest_scaled": float(scaled.abs().max()),
            "one_channel_pair_norm": float(scaled[0, 1, 0].unflatten(-1, (-1, 2)).norm(dim=-1).max()),
        }
    # The tiny FP8 engine: its q and k through the kernel (quantized_norms) or through the norm, the rotation and
    # the per-head amax quantizer, both against bf16 on the same weights and noise.
    calls = {"kernel": 0}
    kernel = qq.rms_rotate_quantize

    def counted(*args, **kwargs):
        calls["kernel"] += 1
        return kernel(*args, **kwargs)

    qq.rms_rotate_quantize = counted
    interpreter_friendly()  # the norms' kernel with more rows a program: the same values, fewer interpreted programs
    fused = _tiny_engine("all", True)
    qq.rms_rotate_quantize = kernel
    from tests.engine_helpers import fp8_batched_against_serial

    # one denoising step: the commit pass and the history are what the batch changes; the steps repeat
    results["batched"] = fp8_batched_against_serial(fused_qk=True, blocks=2, sink_frames=1, window_frames=2,
                                                    timesteps=[1000.0])
    amax = _tiny_engine("all", False)
    reference = _tiny_engine("off", False)
    results["engine"] = {
        "static_vs_bf16": [_relative(a, b) for a, b in zip(fused, reference)],
        "amax_vs_bf16": [_relative(a, b) for a, b in zip(amax, reference)],
        "static_vs_amax": [_relative(a, b) for a, b in zip(fused, amax)],
        "kernel_calls": calls["kernel"],
    }
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict:
    pytest.importorskip("triton")
    return interpreter_checks(__file__)


@pytest.mark.parametrize("name", list(CASES))
def test_the_kernel_computes_the_eager_norm_rotation_and_cast(interpreted, name):
    case = interpreted[name]
    assert case["stage_equal"], case  # the normalized rows for the commit pass: F.rms_norm's bf16 output
    assert case["within_one_step"] and case["values_equal_fraction"] > 0.999, case
    # Nothing needs the clamp, and the one-channel row meets the bound (less its slack): it is tight.
    assert case["largest_scaled"] <= qq.FP8_MAX, case
    assert qq.FP8_MAX / qq.BOUND_SLACK * 0.99 < case["one_channel_pair_norm"] <= qq.FP8_MAX, case


def test_the_tiny_fp8_engine_on_static_scales_errs_as_the_per_head_amax_path(interpreted):
    engine = interpreted["engine"]
    blocks = len(engine["static_vs_bf16"])
    layers_forwards = engine["kernel_calls"] / 2 / blocks  # q and k each forward of each layer
    assert engine["kernel_calls"] and layers_forwards == int(layers_forwards), engine
    for static, amax, apart in zip(engine["static_vs_bf16"], engine["amax_vs_bf16"], engine["static_vs_amax"]):
        assert static <= 1.25 * amax, engine
        assert apart > 0, engine  # the static path really ran (its q and k round differently)


def test_batched_sessions_through_the_kernel_make_their_own_blocks(interpreted):
    """The kernel launched once per session of a batched forward, into the session's slot of the mirror and of
    the commit staging: each session's blocks as it makes them alone (the same kernels, the same scales)."""
    batched = interpreted["batched"]
    assert batched["fused"] and batched["history_frames"] == [3, 3] and max(batched["errors"]) <= 1e-2, batched


def test_static_scales_bound_each_heads_normalized_rotated_values():
    """Against the definition: sqrt(channels) times the head's largest |weight|, with the slack of two bf16
    roundings, mapped to 448; a row with all its energy in one channel comes within the slack of it."""
    heads, head_dim = 4, 16
    weight = torch.linspace(-2.0, 1.5, heads * head_dim)
    scale, inverse = qq.static_scales(weight, heads)
    expected = weight.abs().view(heads, -1).amax(1) * math.sqrt(heads * head_dim) * qq.BOUND_SLACK / qq.FP8_MAX
    assert torch.allclose(scale, expected) and torch.allclose(inverse * scale, torch.ones(heads))
    x = torch.zeros(1, 2, heads * head_dim, dtype=torch.bfloat16)
    x[0, 0, 0] = 3.0  # head 0, channel 0: |y| = sqrt(C) * |w_0|
    x[0, 1] = torch.randn(heads * head_dim).bfloat16()
    cos, sin = FrameRotaryEmbedding(head_dim, 1, 2, 4).for_frames(1, "cpu")
    quantized, _ = qq.rms_rotate_quantize_reference(x, weight.bfloat16(), 1e-6, heads, cos, sin, inverse)
    assert quantized.float().abs().max() <= qq.FP8_MAX
    assert quantized[0, 0, 0].float().abs().max() > 0.95 * qq.FP8_MAX


def test_the_kernel_refuses_what_it_cannot_run():
    if qq._interpreted():
        pytest.skip("this session runs Triton interpreted")
    x = torch.zeros(1, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="runs on CUDA"):
        qq.rms_rotate_quantize(x, torch.ones(64), 1e-6, 2, torch.ones(2, 1, 16), torch.ones(2, 1, 16),
                               torch.ones(2), torch.empty(1, 2, 2, 32, dtype=torch.float8_e4m3fn))
    assert not qq.available(torch.zeros(1, 2, 64)) and not qq.available(x)  # float32; the CPU without the interpreter


@pytest.mark.background  # compiles only: the idle core's work
@pytest.mark.parametrize("stage", [False, True])
def test_the_kernel_compiles_for_sm90_as_launched_with_16_byte_accesses(monkeypatch, stage):
    """Wan 1.3B's q (12 heads of 128: a 16-head block), with and without the stage, launched by the wrapper and
    compiled for Hopper with the launcher's specialisation: no local memory, Hopper's e4m3 conversion, and the
    rows, weights, angles, e4m3 values and stage moved as 16-byte vectors (a [heads, pairs, 2] tile, as landed in
    the thirty-fifth session, moved one pair an instruction: 32 four-byte loads and 8 two-byte e4m3 stores a
    thread). Only the heads' inverse scales load one value a thread."""
    pytest.importorskip("triton")
    from tests.sm90 import compile_launch_for_sm90, narrow_accesses, record_launches

    recorder = record_launches(monkeypatch, qq, "_rms_rotate_quantize")
    monkeypatch.setattr(qq, "available", lambda x: True)
    heads, head_dim, tokens = 12, 128, 4
    cos, sin = torch.randn(tokens, 1, head_dim // 2), torch.randn(tokens, 1, head_dim // 2)
    qq.rms_rotate_quantize(torch.randn(1, tokens, heads * head_dim).bfloat16(), torch.ones(heads * head_dim).bfloat16(),
                           1e-6, heads, cos, sin, torch.ones(heads),
                           torch.empty(1, tokens, heads, head_dim, dtype=torch.float8_e4m3fn),
                           torch.empty(tokens, heads, head_dim, dtype=torch.bfloat16) if stage else None)
    accesses = compile_launch_for_sm90(recorder)
    assert narrow_accesses(accesses) <= 1 and accesses.get("st.global.v4.b32", 0) == 1 + 2 * stage, accesses


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device with e4m3 (8.9+)")
def test_cuda_kernel_matches_the_reference_and_captures():
    """At the engine's shape (4,680 tokens, 12 heads of 128), on the GPU: the interpreter's bounds, the stage
    equal, and the same bits replayed from a CUDA graph."""
    generator = torch.Generator().manual_seed(2)
    heads, head_dim, tokens = 12, 128, 4680
    x = (2 * torch.randn(1, tokens, heads * head_dim, generator=generator)).bfloat16().cuda()
    weight = (1 + 0.3 * torch.randn(heads * head_dim, generator=generator)).bfloat16().cuda()
    cos, sin = FrameRotaryEmbedding(head_dim, 30, 52, 21).for_frames(21, "cuda")
    cos, sin = cos[-tokens:], sin[-tokens:]
    scale, inverse = qq.static_scales(weight, heads)
    dst = torch.empty(1, tokens, heads, head_dim, dtype=torch.float8_e4m3fn, device="cuda")
    stage = torch.empty(tokens, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    qq.rms_rotate_quantize(x, weight, 1e-6, heads, cos, sin, inverse, dst, stage)
    expected, normed = qq.rms_rotate_quantize_reference(x, weight, 1e-6, heads, cos, sin, inverse)
    ours, theirs = dst.float() * scale.view(heads, 1), expected.float() * scale.view(heads, 1)
    step = torch.maximum(theirs.abs() / 8, scale.view(heads, 1) * 2.0**-9)
    assert ((ours - theirs).abs() <= step * 1.0001).all()
    assert (dst.float() == expected.float()).float().mean() > 0.99
    assert (stage.float() - normed[0].float()).abs().max() <= 2.0**-7 * normed.float().abs().max()
    graph = torch.cuda.CUDAGraph()
    captured = torch.empty_like(dst)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        qq.rms_rotate_quantize(x, weight, 1e-6, heads, cos, sin, inverse, captured)
        with torch.cuda.graph(graph, stream=side):
            qq.rms_rotate_quantize(x, weight, 1e-6, heads, cos, sin, inverse, captured)
    captured.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.view(torch.uint8), dst.view(torch.uint8))


if __name__ == "__main__" and sys.argv[1:] == ["--interpreter-checks"]:
    print(json.dumps(_interpreter_checks()))
