"""A Wan block's layer norms writing their FP8 products' e4m3 rows directly (engine/models/norm_quantize.py),
against the eager path they stand for (the residual, the norm, then ``quantize_rows``): the real Triton kernel
through the interpreter (in a subprocess: ``TRITON_INTERPRET=1`` must precede Triton's import), the block that
runs on those rows, and the kernel's sm_90 cross-compile (no GPU needed).

Bounds: the residual's hidden states are the eager ones bit for bit (the same float32 operations, unfused). The
normalized values carry float32 noise from another summation order than torch's, which can move a bf16 value
across a rounding tie: a row's scale within one bf16 step (2^-8) of eager's where its largest value moved, and
otherwise equal; each e4m3 value within one e4m3 step (1/8 of its magnitude, or the smallest subnormal) of
eager's, and nearly all equal: dividing by the scale as eager does, only a moved tie differs (measured on these
inputs: none); multiplied by the inverse scale (the default configuration), ~0.1 % of the values.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import pytest
import torch

from engine.kv_cache import KVCacheManager
from engine.models import norm_quantize as nq
from engine.models.fp8_linear import FP8Linear, QuantizedRows, project_shared, quantize_rows
from tests.engine_helpers import build_small

BF16_STEP = 2.0**-8

try:
    from tests.triton_interpreted import interpreter_checks, interpreter_job, patch_interpreter
    import triton  # noqa: F401

    BACKGROUND_JOBS = (interpreter_job(__file__),)
except ImportError:  # no Triton: the interpreter checks skip
    BACKGROUND_JOBS = ()


def _case_inputs(name: str, generator: torch.Generator):
    """Hidden states and the norm's operands as a Wan block passes them (frames of ``tokens`` rows, per-frame
    float32 modulation as views of one [B, F, 6, D] table), for norm1 / norm2 / norm3 at two widths."""
    # 5 tokens a frame: programs straddle frames (ONE_FRAME off); 8: they never do (on)
    width, batch, frames, tokens = {"narrow": (96, 2, 3, 5), "wan": (1536, 1, 3, 8)}[name.split("_")[0]]
    x = (3 * torch.randn(batch, frames * tokens, width, generator=generator)).bfloat16()
    x[0, 1] = 0  # a zero row: norm2's bias and the modulation's shift still give it values
    mod = torch.randn(batch, frames, 6, width, generator=generator) * 0.5
    shift, scale, gate = (mod[:, :, i].unsqueeze(2) for i in range(3))
    update = torch.randn(batch, frames * tokens, width, generator=generator).bfloat16()
    weight = (1 + 0.2 * torch.randn(width, generator=generator))
    bias = 0.1 * torch.randn(width, generator=generator)
    kind = name.split("_")[1]
    operands = {
        "norm1": dict(scale=scale, shift=shift),
        "norm2": dict(update=update, gate=gate, weight=weight, bias=bias),
        "norm3": dict(update=update, scale=scale, shift=shift),
    }[kind]
    return x, operands


CASES = [f"{width}_{kind}" for width in ("narrow", "wan") for kind in ("norm1", "norm2", "norm3")]


def _tiny_blocks(quantized_norms: bool, blocks: int = 2, fp8: str = "linear"):
    """Two blocks of the tiny FP8 engine with its kernel set's ``quantized_norms`` as given (on the CPU the
    kernel set is the eager one, so only that flag differs); ``fp8="off"``: the bf16 engine, the reference."""
    _, bundle = build_small(dtype="bfloat16", fp8=fp8, sink_frames=1, window_frames=1)
    pipeline = bundle.pipeline
    model = pipeline.transformer
    model.kernels = dataclasses.replace(model.kernels, quantized_norms=quantized_norms and fp8 != "off")
    kv = KVCacheManager(pipeline.kv_spec(), 1, "cpu").open_session("s")
    progress = pipeline.new_progress(seed=3, prompt="a kite over dunes")
    return [pipeline.run_block(kv, progress).video for _ in range(blocks)]


# --- run in the interpreter subprocess ------------------------------------------------------------------


def interpreter_friendly() -> None:
    """The default configuration with 64 rows a program, for the engine runs in the interpreter: it runs the
    programs one by one (two rows a program made the tiny engine's norms ~20 s), and a program's row count
    changes no value (the kernel cases above run two and four)."""
    config = nq.DEFAULT_CONFIG
    nq.DEFAULT_CONFIG = nq.NormQuantizeConfig(64, config.num_warps, divide=config.divide)


def _interpreter_checks() -> dict:
    from bench.norm_quantize_gpu import compare  # the bench's comparison: hidden states, scales, one e4m3 step

    patch_interpreter()
    assert nq._interpreted(), "TRITON_INTERPRET=1 was not seen by triton"
    generator = torch.Generator().manual_seed(0)
    results = {}
    for name in CASES:
        x, operands = _case_inputs(name, generator)
        reference = nq.norm_quantize_reference(x, 1e-6, **operands)
        results[name] = compare(nq.norm_quantize(x, 1e-6, **operands), reference)
        # The other arithmetic and four rows a program: the bench's variants.
        results[name + "_multiply"] = compare(
            nq.norm_quantize(x, 1e-6, **operands, config=nq.NormQuantizeConfig(4, 4, divide=False)), reference)
    # The tiny engine's blocks on the kernel's rows against the same blocks on eager's, counting the kernel's
    # launches (norm_quantize) and the reference's (none where the kernel runs).
    calls = {"kernel": 0, "reference": 0}
    kernel, reference = nq.norm_quantize, nq.norm_quantize_reference

    def counted(name, fn):
        return lambda *args, **kwargs: calls.__setitem__(name, calls[name] + 1) or fn(*args, **kwargs)

    nq.norm_quantize, nq.norm_quantize_reference = counted("kernel", kernel), counted("reference", reference)
    interpreter_friendly()
    ours = _tiny_blocks(True)
    nq.norm_quantize, nq.norm_quantize_reference = kernel, reference
    theirs, bf16 = _tiny_blocks(False), _tiny_blocks(False, fp8="off")
    relative = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())  # noqa: E731
    results["tiny_engine"] = {"kernel_vs_eager": [relative(a, b) for a, b in zip(ours, theirs)],
                              "kernel_vs_bf16": [relative(a, b) for a, b in zip(ours, bf16)],
                              "eager_vs_bf16": [relative(a, b) for a, b in zip(theirs, bf16)], "calls": calls}
    return results


@pytest.fixture(scope="module")
def interpreted() -> dict:
    pytest.importorskip("triton")
    return interpreter_checks(__file__)


@pytest.mark.parametrize("name", CASES + [name + "_multiply" for name in CASES])
def test_norm_quantize_kernel_writes_the_eager_hidden_states_and_rows_within_one_step(interpreted, name):
    case = interpreted[name]
    divides = nq.DEFAULT_CONFIG.divide and not name.endswith("_multiply")
    assert case["dtype"] == "torch.float8_e4m3fn" and case["scale_shape"] == [case["shape"][0] * case["shape"][1], 1]
    assert case["hidden_equal"], case  # the residual: eager's float32 operations, unfused
    assert case["scales_rel_max"] <= BF16_STEP * 1.0001, case
    assert case["scales_equal_fraction"] >= 0.9, case  # a moved amax is a rare tie; a wrong norm moves every row
    assert case["within_one_step"], case
    # Eager's own division: only a moved tie differs; multiplied by the inverse scale, ~0.1 % of the values.
    assert case["values_equal_fraction"] > (0.999 if divides else 0.99), case


def test_tiny_engine_on_the_kernels_rows_errs_as_on_eagers(interpreted):
    """The whole FP8 engine, two blocks, on the kernel's rows and on eager's, each against bf16 on the same weights
    and noise: the kernel's rows differ from eager's only where a rounding fell the other way (dividing as eager
    does, measured here: none, the same latents), so its error is eager's (tests/test_fp8_linear.py bounds that,
    ~6e-3), within a quarter of it either way. The kernel ran for every norm of every forward, the reference
    for none."""
    engine = interpreted["tiny_engine"]
    calls = engine["calls"]
    assert calls["reference"] == 0 and calls["kernel"] > 0 and calls["kernel"] % 3 == 0, calls
    for ours, eagers in zip(engine["kernel_vs_bf16"], engine["eager_vs_bf16"]):
        assert 0.75 * eagers <= ours <= 1.25 * eagers, engine
    if nq.DEFAULT_CONFIG.divide:
        assert max(engine["kernel_vs_eager"]) < 1e-3, engine


# --- here, on the CPU ---------------------------------------------------------------------------------------


def test_a_block_on_quantized_norms_computes_the_block_bit_for_bit_where_the_reference_runs():
    """On the CPU (no kernel) the quantized-norm block runs :func:`norm_quantize_reference`: the same residuals,
    norms and quantizations as the block's own path, so the same latents to the bit — the plumbing (rows in
    place of activations, q/k/v sharing them, the FFN on them) adds nothing."""
    if nq._interpreted():
        pytest.skip("this session runs Triton interpreted: the kernel would run, not the reference")
    on, off = _tiny_blocks(True), _tiny_blocks(False)
    for ours, theirs in zip(on, off):
        assert torch.isfinite(ours).all() and torch.equal(ours, theirs)


def test_the_engine_takes_quantized_norms_only_where_every_product_is_fp8():
    from engine.models.kernels import Kernels

    assert Kernels.make(True, exact=False).quantized_norms  # the FP8 modes' set (engine/bundle.py)
    assert not Kernels.make(True).quantized_norms and not Kernels.make(False).quantized_norms
    _, bundle = build_small(dtype="bfloat16", fp8="linear", sink_frames=1, window_frames=1)
    block = bundle.pipeline.transformer.transformer.blocks[0]
    assert nq.takes_quantized_inputs(block)
    dense = block.ffn.net[2]
    block.ffn.net[2] = torch.nn.Linear(dense.in_features, dense.out_features)
    assert not nq.takes_quantized_inputs(block)
    _, bundle = build_small(dtype="bfloat16", sink_frames=1, window_frames=1)  # bf16 products: the norms write bf16
    assert not nq.takes_quantized_inputs(bundle.pipeline.transformer.transformer.blocks[0])


def test_quantized_rows_stand_for_their_activation_and_refuse_what_does_not_fit():
    torch.manual_seed(0)
    layers = [FP8Linear.from_linear(torch.nn.Linear(32, 16).bfloat16()) for _ in range(3)]
    x = torch.randn(2, 5, 32).bfloat16()
    rows = QuantizedRows(*quantize_rows(x.reshape(-1, 32)), x.shape, x.dtype)
    assert all(torch.equal(a, b) for a, b in zip(project_shared(rows, *layers), project_shared(x, *layers)))
    assert torch.equal(layers[0](rows), layers[0](x)) and layers[0](rows).shape == (2, 5, 16)
    with pytest.raises(TypeError, match="FP8 linears only"):
        project_shared(rows, layers[0], torch.nn.Linear(32, 16).bfloat16())
    with pytest.raises(ValueError, match="do not stand for"):
        QuantizedRows(rows.values[:-1], rows.scale[:-1], x.shape, x.dtype)
    with pytest.raises(ValueError, match="do not match"):
        FP8Linear.from_linear(torch.nn.Linear(64, 16).bfloat16())(rows)


def test_norm_quantize_refuses_operands_that_do_not_fit():
    x = torch.zeros(1, 6, 8, dtype=torch.bfloat16)
    per_frame = torch.zeros(1, 2, 1, 8)
    with pytest.raises(ValueError, match="come in pairs"):
        nq.norm_quantize(x, 1e-6, scale=per_frame)
    with pytest.raises(ValueError, match="not both"):
        nq.norm_quantize(x, 1e-6, weight=torch.ones(8), bias=torch.zeros(8), scale=per_frame, shift=per_frame)
    with pytest.raises(ValueError, match="needs the update"):
        nq.norm_quantize(x, 1e-6, gate=per_frame)
    with pytest.raises(ValueError, match="per frame"):
        nq.norm_quantize(x, 1e-6, scale=torch.zeros(1, 4, 1, 8), shift=torch.zeros(1, 4, 1, 8))
    with pytest.raises(ValueError, match=r"\[batch, tokens, dim\]"):
        nq.norm_quantize(x[0], 1e-6)


@pytest.mark.background  # compiles only: the idle core's work
def test_norm_quantize_compiles_for_sm90_as_launched_with_16_byte_accesses(monkeypatch):
    """The three norms at Wan 1.3B's shape (4,680 tokens of 1,536, three frames), launched by the wrapper and
    compiled for Hopper with the launcher's specialisation: no local memory, Hopper's e4m3 conversion, rows moved
    in 16-byte vectors (only the row's scale is stored as one value)."""
    pytest.importorskip("triton")
    from tests.sm90 import compile_launch_for_sm90, narrow_accesses, record_launches

    recorder = record_launches(monkeypatch, nq, "_norm_quantize_rows")
    monkeypatch.setattr(nq, "available", lambda x: True)
    x = torch.zeros(1, 4680, 1536, dtype=torch.bfloat16)

    def per_frame():
        return torch.zeros(1, 3, 1, 1536)

    nq.norm_quantize(x, 1e-6, scale=per_frame(), shift=per_frame())  # norm1
    nq.norm_quantize(x, 1e-6, update=x.clone(), gate=per_frame(), weight=torch.ones(1536).bfloat16(),
                     bias=torch.zeros(1536).bfloat16())  # norm2
    nq.norm_quantize(x, 1e-6, update=x.clone(), scale=per_frame(), shift=per_frame())  # norm3
    for index in range(3):
        accesses = compile_launch_for_sm90(recorder, index)
        assert narrow_accesses(accesses) <= 1 and accesses.get("ld.global.v4.b32", 0) >= 8, (index, accesses)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device with e4m3 (8.9+)")
@pytest.mark.parametrize("kind", ["norm1", "norm2", "norm3"])
def test_cuda_norm_quantize_matches_eager_within_one_step_and_captures(kind):
    """At the engine's shape (4,680 tokens of 1,536) on the GPU: the bounds of the interpreter checks, and the
    same bits replayed from a CUDA graph."""
    generator = torch.Generator().manual_seed(1)
    width, frames, tokens = 1536, 3, 1560
    x = (3 * torch.randn(1, frames * tokens, width, generator=generator)).bfloat16().cuda()
    mod = (torch.randn(1, frames, 6, width, generator=generator) * 0.5).cuda()
    shift, scale, gate = (mod[:, :, i].unsqueeze(2) for i in range(3))
    update = torch.randn(1, frames * tokens, width, generator=generator).bfloat16().cuda()
    operands = {"norm1": dict(scale=scale, shift=shift),
                "norm2": dict(update=update, gate=gate, weight=1 + 0.2 * torch.randn(width, device="cuda"),
                              bias=0.1 * torch.randn(width, device="cuda")),
                "norm3": dict(update=update, scale=scale, shift=shift)}[kind]
    from bench.norm_quantize_gpu import compare

    result = nq.norm_quantize(x, 1e-6, **operands)
    case = compare(result, nq.norm_quantize_reference(x, 1e-6, **operands))
    assert case["hidden_equal"] and case["within_one_step"], case
    assert case["scales_rel_max"] <= BF16_STEP * 1.0001 and case["values_equal_fraction"] > 0.99, case
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        nq.norm_quantize(x, 1e-6, **operands)
        with torch.cuda.graph(graph, stream=stream):
            captured = nq.norm_quantize(x, 1e-6, **operands)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], result[0])
    assert torch.equal(captured[1].values.view(torch.uint8), result[1].values.view(torch.uint8))
    assert torch.equal(captured[1].scale, result[1].scale)


if __name__ == "__main__" and sys.argv[1:] == ["--interpreter-checks"]:
    print(json.dumps(_interpreter_checks()))
