"""FP8 linears (``fp8 = "linear"``): the quantization arithmetic, its error against bf16, a tiny engine's
blocks against the same weights in bf16, and the config / CLI plumbing. Real modules, seeded; CPU
(``torch._scaled_mm`` runs there with rowwise scales), plus one CUDA check for the device machine."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from engine.config import EngineConfig
from engine.kv_cache import KVCacheManager
from engine.models.fp8_linear import (
    BLOCK_LINEARS,
    FP8_MAX,
    FP8Linear,
    gelu_quantize_rows,
    project_shared,
    quantize_linears,
    quantize_rows,
)
from tests.engine_helpers import build_small

BF16_UNIT_ROUNDOFF = 2.0**-8  # round-to-nearest with bf16's 8-bit significand
# e4m3 keeps 3 mantissa bits: a value in [2^e, 2^e+1) is off by at most 2^(e-4), i.e. a relative error of at
# most 2^-4 at the bottom of the binade, uniformly spread: RMS at most 2^-4 / sqrt(3) per factor. A product
# carries two independent roundings (activation, weight): RMS at most sqrt(2/3) * 2^-4 = 0.051. For random-sign
# terms the dot products' error norm relative to their norm is that same RMS.
FP8_PRODUCT_RMS_BOUND = (2 / 3) ** 0.5 * 2.0**-4


def _linear(in_features: int, out_features: int, bias: bool = True, seed: int = 0) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(in_features, out_features, bias=bias).bfloat16()


def _activations(*shape: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("bias", [True, False])
def test_fp8_linear_is_the_product_of_the_dequantized_operands(bias):
    linear = _linear(64, 48, bias=bias)
    x = _activations(3, 5, 64)
    x[1, 2] = 0  # a zero token: its scale must stay finite and its output be the bias alone
    layer = FP8Linear.from_linear(linear)

    # The scales: amax / 448 per output channel and per token, in float32.
    weight = linear.weight.float()
    assert torch.equal(layer.weight_scale, (weight.abs().amax(dim=1) / FP8_MAX).reshape(1, -1))
    rows = x.reshape(-1, 64)
    q, scale = quantize_rows(rows)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (15, 1)
    assert torch.equal(scale[rows.abs().amax(1) > 0], rows.float().abs().amax(1, keepdim=True)[rows.abs().amax(1) > 0] / FP8_MAX)
    # Round to nearest e4m3: each amax element lands on +-448, every other within half a step.
    dequantized_w = layer.dequantized_weight()
    half_step = torch.maximum(2.0**-4 * weight.abs(), 2.0**-10 * layer.weight_scale.t())  # normal / subnormal
    assert ((dequantized_w - weight).abs() <= half_step).all()
    assert torch.equal(layer.weight_fp8.float().abs().amax(dim=1), torch.full((48,), FP8_MAX))

    out = layer(x)
    assert out.shape == (3, 5, 48) and out.dtype == torch.bfloat16
    product = (q.float() * scale) @ dequantized_w.t()
    expected = product + (linear.bias.float() if bias else 0)
    # One bf16 rounding of the product, and one of the sum where the bias is added after it.
    tolerance = BF16_UNIT_ROUNDOFF * (product.abs() + expected.abs()) + 1e-6
    assert ((out.reshape(15, 48).float() - expected).abs() <= tolerance).all()
    assert torch.equal(out[1, 2], linear.bias if bias else torch.zeros(48, dtype=torch.bfloat16))


def test_fp8_linear_error_against_the_bf16_linear_is_e4m3_sized():
    linear = _linear(256, 512)
    x = _activations(64, 256)
    with torch.no_grad():
        reference = linear(x).float()
        out = FP8Linear.from_linear(linear)(x).float()
    error = float((out - reference).norm() / reference.norm())
    # Well above bf16's own rounding (~2^-8 / sqrt(3)): the layer really is FP8; within e4m3's bound. Measured 0.036.
    assert 4 * BF16_UNIT_ROUNDOFF < error < FP8_PRODUCT_RMS_BOUND, error


def test_fp8_linear_keeps_its_weight_through_casts_and_refuses_what_it_cannot_run():
    layer = FP8Linear.from_linear(_linear(32, 16))
    layer.float()
    assert layer.weight_fp8.dtype == torch.float8_e4m3fn and layer.weight_scale.dtype == torch.float32
    assert layer.bias.dtype == torch.float32  # the bias follows the activation dtype
    with pytest.raises(ValueError, match="multiples of 16"):
        FP8Linear.from_linear(_linear(24, 16))
    with pytest.raises(TypeError, match="needs an nn.Linear"):
        FP8Linear.from_linear(torch.nn.Conv1d(16, 16, 1))
    with pytest.raises(ValueError, match="expects 32 input features"):
        layer(torch.zeros(2, 16))


def test_shared_projection_quantizes_the_input_once_and_equals_each_layer(monkeypatch):
    """q, k and v read the same input: one quantization for the three, the same products as each layer alone."""
    layers = [FP8Linear.from_linear(_linear(64, out, seed=seed)) for seed, out in enumerate((64, 32, 48))]
    x = _activations(2, 7, 64)
    alone = [layer(x) for layer in layers]
    calls = []
    quantize = FP8Linear.quantize_input
    monkeypatch.setattr(FP8Linear, "quantize_input", lambda self, *a, **k: calls.append(self) or quantize(self, *a, **k))
    shared = project_shared(x, *layers)
    assert len(calls) == 1
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(shared, alone))
    # A bf16 layer among them (or widths that differ): each layer quantizes its own input, as before.
    dense = _linear(64, 16, seed=9)
    calls.clear()
    mixed = project_shared(x, layers[0], dense)
    assert len(calls) == 1 and torch.equal(mixed[0], alone[0]) and torch.equal(mixed[1], dense(x))
    with pytest.raises(ValueError, match="do not match"):
        layers[0].forward_quantized(x[:1], *layers[0].quantize_input(x))


def test_gelu_inside_the_quantizer_is_the_product_of_the_gelu():
    """The FFN's second product with its GELU inside the input's quantizer: eagerly (the CPU), the very same
    rows, scales and products as the GELU module then the layer; compiled on CUDA, see the GPU test."""
    layer = FP8Linear.from_linear(_linear(96, 32))
    x = 3 * _activations(4, 5, 96)
    gelu = torch.nn.functional.gelu(x, approximate="tanh")
    quantized, scale = gelu_quantize_rows(x.reshape(-1, 96))
    expected_quantized, expected_scale = quantize_rows(gelu.reshape(-1, 96))
    assert torch.equal(quantized.float(), expected_quantized.float()) and torch.equal(scale, expected_scale)
    assert torch.equal(layer.forward_gelu(x), layer(gelu))


def test_the_engine_feed_forward_takes_the_fused_gelu_and_computes_the_module():
    """An FP8 block's FFN through the engine's ``_feed_forward``: the GELU inside the second product's quantizer,
    equal to diffusers' module (its GELU, dropout, then the layer) on the same weights."""
    from engine.models.causal_wan import _feed_forward
    from engine.models.kernels import EAGER_KERNELS

    _, bundle = build_small(dtype="bfloat16", fp8="linear", sink_frames=1, window_frames=1)
    block = bundle.pipeline.transformer.transformer.blocks[0]
    width = block.ffn.net[0].proj.in_features
    x = _activations(1, 12, width)
    calls = []
    fused = block.ffn.net[2].forward_gelu
    block.ffn.net[2].forward_gelu = lambda y: calls.append(y) or fused(y)
    out = _feed_forward(block.ffn, x, EAGER_KERNELS)
    assert len(calls) == 1
    assert torch.equal(out, block.ffn(x))


def _run_blocks(fp8: str, blocks: int = 2):
    config, bundle = build_small(dtype="bfloat16", fp8=fp8, sink_frames=1, window_frames=1)
    pipeline = bundle.pipeline
    kv = KVCacheManager(pipeline.kv_spec(), 1, "cpu").open_session("s")
    progress = pipeline.new_progress(seed=3, prompt="a kite over dunes")
    return bundle, [pipeline.run_block(kv, progress) for _ in range(blocks)]


def test_tiny_engine_blocks_in_fp8_stay_close_to_bf16_on_the_same_weights_and_noise():
    reference_bundle, reference = _run_blocks("off")
    bundle, fp8 = _run_blocks("linear")
    assert reference_bundle.fp8 is None
    model = bundle.pipeline.transformer.transformer
    layers = len(model.blocks)
    assert bundle.fp8.converted == len(BLOCK_LINEARS) * layers == 8 * layers and bundle.fp8.kept == []
    dense = reference_bundle.pipeline.transformer.transformer.blocks[0]
    saved = sum(dense.get_submodule(name).weight.numel() for name in BLOCK_LINEARS)  # 2 -> 1 byte per weight
    saved -= sum(dense.get_submodule(name).out_features * 4 for name in BLOCK_LINEARS)  # + the float32 scales
    assert bundle.fp8.bytes_saved == saved * layers
    for block in model.blocks:
        assert all(isinstance(block.get_submodule(name), FP8Linear) for name in BLOCK_LINEARS)
        # the text K/V projections run once per prompt: kept bf16
        assert type(block.attn2.to_k) is torch.nn.Linear and block.attn2.to_v.weight.dtype == torch.bfloat16
    # The first block and one attending to history. The latents are x0 = x_t - sigma * v over the steps:
    # the FP8 error enters through v, each linear's output carrying at most FP8_PRODUCT_RMS_BOUND of
    # relative error, and the residual stream and the x_t term carry it without amplifying it. Measured: ~6e-3.
    for ours, theirs in zip(fp8, reference):
        assert torch.isfinite(ours.video).all()
        error = float((ours.video.float() - theirs.video.float()).norm() / theirs.video.float().norm())
        assert 1e-4 < error < FP8_PRODUCT_RMS_BOUND, error


def test_quantize_linears_keeps_misaligned_layers_and_refuses_a_second_pass():
    torch.manual_seed(0)
    block = torch.nn.Module()
    block.ffn = torch.nn.Module()
    block.ffn.net = torch.nn.ModuleList([torch.nn.Linear(32, 40).bfloat16(), torch.nn.Linear(32, 32).bfloat16()])
    result = quantize_linears([block], names=("ffn.net.0", "ffn.net.1"))
    assert result.converted == 1 and result.kept == ["blocks.0.ffn.net.0 (32->40)"]
    assert type(block.ffn.net[0]) is torch.nn.Linear and isinstance(block.ffn.net[1], FP8Linear)
    with pytest.raises(ValueError, match="already FP8"):
        quantize_linears([block], names=("ffn.net.1",))


def test_fast_accumulation_reaches_every_converted_layer_and_needs_fp8_linears(monkeypatch):
    """``fp8_fast_accum`` is each FP8 layer's own setting (it is what the product is asked for on CUDA), and an
    option of the FP8 linears only: asked for without them it is refused, not ignored."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for fast in (False, True):
        _, bundle = build_small(dtype="bfloat16", fp8="linear", fp8_fast_accum=fast)
        layers = [m for m in bundle.pipeline.transformer.modules() if isinstance(m, FP8Linear)]
        assert len(layers) == bundle.fp8.converted > 0
        assert {layer.fast_accum for layer in layers} == {fast}
        assert f"fast_accum={fast}" in repr(layers[0])
    # Unset: on wherever there are FP8 linears (the default since it was measured), off elsewhere.
    assert EngineConfig(dtype="bfloat16", fp8="linear").resolved_fp8_fast_accum is True
    assert EngineConfig(dtype="bfloat16", fp8="linear", fp8_fast_accum=False).resolved_fp8_fast_accum is False
    assert EngineConfig(dtype="bfloat16").resolved_fp8_fast_accum is False
    for fast in (True, False):
        with pytest.raises(ValidationError, match="fp8_fast_accum is an option of the FP8 linears .* fp8=off"):
            EngineConfig(dtype="bfloat16", fp8_fast_accum=fast)


def test_config_refuses_fp8_without_bf16(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert EngineConfig().fp8 == "off"
    assert EngineConfig(dtype="bfloat16", fp8="linear").fp8 == "linear"
    with pytest.raises(ValidationError, match="fp8=linear needs dtype=bfloat16 .* got dtype=float32"):
        EngineConfig(fp8="linear")
    with pytest.raises(ValidationError, match="dtype float16 needs a CUDA device"):
        EngineConfig(dtype="float16", fp8="linear")
    for value in ("attention", "all"):  # the attention kernel's own rules: tests/test_fp8_attention_engine.py
        with pytest.raises(ValidationError, match=f"fp8={value} needs dtype=bfloat16"):
            EngineConfig(fp8=value)
        with pytest.raises(ValidationError, match=f"fp8={value} runs its FP8 attention kernel on a Hopper GPU"):
            EngineConfig(dtype="bfloat16", fp8=value)
    with pytest.raises(ValidationError, match="fp8"):
        EngineConfig(dtype="bfloat16", fp8="e5m2")


def test_fp8_flag_and_variable_reach_the_config(monkeypatch, capsys):
    from app.cli import _engine_config, _settings_from, build_parser, main
    from app.settings import Settings

    args = build_parser().parse_args(["generate", "--prompt", "x", "--dtype", "bfloat16", "--fp8", "linear"])
    assert _engine_config(args).fp8 == "linear"
    args = build_parser().parse_args(["serve", "--dtype", "bfloat16", "--fp8", "linear"])
    assert _settings_from(args).engine.fp8 == "linear"
    assert _settings_from(build_parser().parse_args(["serve"])).engine.fp8 == "off"
    monkeypatch.setenv("ARSTREAM_ENGINE__DTYPE", "bfloat16")
    monkeypatch.setenv("ARSTREAM_ENGINE__FP8", "linear")
    assert Settings().engine.fp8 == "linear"
    # A refusal is one line naming the flag, before anything is built.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("ARSTREAM_ENGINE__FP8", "attention")
    assert main(["serve"]) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("arstream serve: --fp8=attention runs its FP8 attention kernel on a Hopper GPU"), line
    monkeypatch.setenv("ARSTREAM_ENGINE__FP8", "bogus")
    assert main(["serve"]) == 2
    assert capsys.readouterr().err.startswith("arstream serve: --fp8 (ARSTREAM_ENGINE__FP8): ")
    assert main(["serve", "--fp8", "linear", "--dtype", "float32"]) == 2
    assert "--fp8=linear needs --dtype=bfloat16" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device with FP8 (8.9+)")
def test_cuda_fp8_linear_matches_the_dequantized_product():
    """On CUDA: the compiled quantization kernel equals the eager one, and _scaled_mm (bias in its epilogue)
    is the dequantized product to bf16 rounding, under a CUDA graph too."""
    linear = _linear(256, 512).cuda()
    layer = FP8Linear.from_linear(linear)
    x = _activations(2, 96, 256).cuda()
    rows = x.reshape(-1, 256)
    from engine.models.fp8_linear import _quantizer

    q, scale = _quantizer(256)(rows)
    eager_q, eager_scale = quantize_rows(rows)
    assert not _quantizer(256)._failed
    # The GELU inside the quantizer (compiled): Inductor's tanh and its float32 intermediate (eager rounds the
    # GELU to bf16 first) move a value by at most one e4m3 step, a scale by bf16's rounding of the row's amax.
    gelu_q, gelu_scale = _quantizer(256, "gelu_rows")(rows)
    eager_gelu_q, eager_gelu_scale = gelu_quantize_rows(rows)
    assert not _quantizer(256, "gelu_rows")._failed
    assert torch.allclose(gelu_scale, eager_gelu_scale, rtol=2.0**-8, atol=0)
    assert ((gelu_q.float() * gelu_scale - eager_gelu_q.float() * eager_gelu_scale).abs()
            <= 2.0**-3 * (eager_gelu_q.float() * eager_gelu_scale).abs() + 2.0**-9 * eager_gelu_scale).all()
    # What the layer's GELU input takes on CUDA: the one-pass kernel (tests/test_gelu_quantize.py bounds it).
    from engine.models import gelu_quantize

    wired_q, wired_scale = layer.quantize_input(x, gelu=True)
    one_pass_q, one_pass_scale = gelu_quantize.gelu_quantize_rows(rows)
    assert torch.equal(wired_q.float(), one_pass_q.float()) and torch.equal(wired_scale, one_pass_scale)
    # The fused kernel may divide by its reciprocal: at most one e4m3 step apart, where a value sits on a tie.
    assert torch.allclose(scale, eager_scale, rtol=1e-6, atol=0)
    assert ((q.float() - eager_q.float()).abs() <= 2.0**-3 * eager_q.float().abs() + 2.0**-9).all()
    product = (q.float() * scale) @ layer.dequantized_weight().t()
    expected = product + linear.bias.float()
    out = layer(x)
    # bf16 rounding, plus float32 accumulation in another order than the CPU's
    tolerance = BF16_UNIT_ROUNDOFF * (product.abs() + expected.abs()) + 1e-4 * expected.abs().max()
    assert ((out.reshape(-1, 512).float() - expected).abs() <= tolerance).all()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        layer(x)
        with torch.cuda.graph(graph, stream=stream):
            captured = layer(x)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, out)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device with FP8 (8.9+)")
def test_cuda_fast_accumulation_stays_near_the_dequantized_product():
    """``fast_accum``: the tensor cores' accumulator without float32 promotion. Over K = 1,536 (the 1.3B's width)
    each output stays within 2^-8 of the sum of its products' magnitudes of the exact float32 product, plus bf16's
    rounding; and the whole output within 1 % (Frobenius) of it, where the promoted path is bf16-exact."""
    linear = _linear(1536, 512).cuda()
    x = _activations(4, 128, 1536).cuda()
    exact, fast = FP8Linear.from_linear(linear), FP8Linear.from_linear(linear, fast_accum=True)
    quantized, scale = exact.quantize_input(x)
    terms = (quantized.float() * scale).abs() @ exact.dequantized_weight().abs().t()
    expected = (quantized.float() * scale) @ exact.dequantized_weight().t() + linear.bias.float()
    out = fast(x).reshape(-1, 512).float()
    tolerance = 2.0**-8 * terms + BF16_UNIT_ROUNDOFF * 2 * expected.abs() + 1e-4 * expected.abs().max()
    assert ((out - expected).abs() <= tolerance).all()
    assert (out - expected).norm() <= 0.01 * expected.norm()
