"""The one-pass GELU quantizer (engine/models/gelu_quantize.py) against the eager path it stands for
(``quantize_rows(GELU(h))``, engine/models/fp8_linear.py): the real Triton kernel through the interpreter (in a
subprocess: ``TRITON_INTERPRET=1`` must precede Triton's import), its argument checks here, and its sm_90
cross-compile (no GPU needed).

Bounds: the GELU is rounded to bf16 as eager's is, so the rows' amax and scales agree (the kernel's sigmoid form
of the tanh may move a bf16 GELU value by one step where float32 rounding sits on a bf16 tie: measured in none
of these rows, allowed in 0.5 % of the values); each value is multiplied by ``448 / amax`` where eager divides by
``amax / 448``, one rounding apart, so an e4m3 value sitting on a tie can land one e4m3 step (1/8 of its
magnitude, or the smallest subnormal) away.
"""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("triton")

import torch

from engine.models import gelu_quantize as gq
from engine.models.fp8_linear import gelu_quantize_rows as eager_gelu_quantize_rows
from tests.triton_interpreted import interpreter_checks, interpreter_job, patch_interpreter


def _compare(rows: torch.Tensor) -> dict:
    from bench.gelu_quantize_gpu import against  # the bench's comparison: scales, equal values, one e4m3 step

    quantized, scale = gq.gelu_quantize_rows(rows)
    return {
        **against((quantized, scale), eager_gelu_quantize_rows(rows)),
        "dtype": str(quantized.dtype), "shape": list(quantized.shape), "scale_shape": list(scale.shape),
        "zero_row_scale": float(scale[0]), "zero_row_values_zero": bool((quantized[0].float() == 0).all()),
    }


def _interpreter_checks() -> dict:
    patch_interpreter()
    assert gq._interpreted(), "TRITON_INTERPRET=1 was not seen by triton"
    generator = torch.Generator().manual_seed(0)
    results = {}
    for name, width, gain in (("narrow_96", 96, 3.0), ("wan_8960", 8960, 2.0), ("peaked_300", 300, 40.0)):
        rows = (gain * torch.randn(5, width, generator=generator)).bfloat16()
        rows[0] = 0  # a zero row: finite scale, zero values
        results[name] = _compare(rows)
    return results


BACKGROUND_JOBS = (interpreter_job(__file__),)


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return interpreter_checks(__file__)


@pytest.mark.parametrize("name", ["narrow_96", "wan_8960", "peaked_300"])
def test_one_pass_gelu_quantizer_computes_the_eager_rows_and_scales(interpreted, name):
    case = interpreted[name]
    assert case["dtype"] == "torch.float8_e4m3fn" and case["scale_shape"] == [5, 1]
    assert case["scales_rel_max"] == 0.0, case  # the same bf16 GELU, so the same amax and the same division
    assert case["within_one_step"], case
    assert case["values_equal_fraction"] > 0.995, case  # ties are rare; a wrong scale or GELU moves most values
    assert case["zero_row_values_zero"] and case["zero_row_scale"] == pytest.approx(gq.AMAX_FLOOR / gq.FP8_MAX)


def test_one_pass_gelu_quantizer_refuses_what_it_cannot_run():
    if gq._interpreted():
        pytest.skip("this session runs Triton interpreted")
    with pytest.raises(ValueError, match="2-D floating-point"):
        gq.gelu_quantize_rows(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="runs on CUDA"):
        gq.gelu_quantize_rows(torch.zeros(2, 64, dtype=torch.bfloat16))
    assert not gq.available(torch.zeros(1, gq.MAX_WIDTH + 16))


@pytest.mark.background  # compiles only: the idle core's work
def test_one_pass_gelu_quantizer_compiles_for_sm90_as_launched_with_16_byte_accesses(monkeypatch):
    """The Wan FFN's width (8,960 = 8,192 + 512 + 256 over 8 warps), launched by the wrapper and compiled for
    Hopper with the launcher's specialisation: one row's registers fit (no local memory), the cast is Hopper's
    e4m3 conversion, and the first part, 32 of a thread's 35 values, moves in 16-byte vectors (the 512- and
    256-wide parts are two values and one a thread)."""
    from tests.sm90 import compile_launch_for_sm90, narrow_accesses, record_launches

    recorder = record_launches(monkeypatch, gq, "_gelu_quantize_rows")
    monkeypatch.setattr(gq, "available", lambda x: True)
    gq.gelu_quantize_rows(torch.zeros(4, 8960, dtype=torch.bfloat16))
    accesses = compile_launch_for_sm90(recorder)
    assert accesses.get("ld.global.v4.b32", 0) == 4 and narrow_accesses(accesses) <= 5, accesses


def test_row_parts_cover_the_width_in_at_most_three_powers_of_two():
    assert gq.row_parts(8960) == (8192, 512, 256) and gq.row_parts(1536) == (1024, 512, 0)
    assert gq.row_parts(300) == (256, 32, 16) and gq.row_parts(16384) == (16384, 0, 0) and gq.row_parts(1) == (1, 0, 0)
    for width in range(1, 3000):
        first, second, last = gq.row_parts(width)
        assert first + second <= width <= first + second + last and last < 2 * max(1, width - first - second)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device with e4m3 (8.9+)")
def test_cuda_one_pass_gelu_quantizer_matches_eager_within_one_step_and_captures():
    """On the GPU the kernel's exp2 is the hardware's approximation, so a bf16 GELU value may round the other
    way: a row's scale within bf16's rounding of its amax, every value within one e4m3 step of eager's; and the
    same bits replayed from a CUDA graph."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = (2 * torch.randn(512, 8960, device="cuda", generator=generator)).bfloat16()
    rows[3] = 0
    quantized, scale = gq.gelu_quantize_rows(rows)
    expected, expected_scale = eager_gelu_quantize_rows(rows)
    assert torch.allclose(scale, expected_scale, rtol=2.0**-8, atol=0)
    ours, theirs = quantized.float() * scale, expected.float() * expected_scale
    assert ((ours - theirs).abs() <= 2.0**-3 * theirs.abs() + 2.0**-9 * expected_scale).all()
    assert (quantized.float() == expected.float()).float().mean() > 0.99
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        gq.gelu_quantize_rows(rows)
        with torch.cuda.graph(graph, stream=stream):
            captured, captured_scale = gq.gelu_quantize_rows(rows)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.view(torch.uint8), quantized.view(torch.uint8))
    assert torch.equal(captured_scale, scale)


if __name__ == "__main__" and sys.argv[1:] == ["--interpreter-checks"]:
    print(json.dumps(_interpreter_checks()))
