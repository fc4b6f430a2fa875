"""A Wan residual block's e4m3 convolution inputs in one pass (decoders/conv_input_fp8.py), against diffusers'
eager path they stand for (``WanRMS_norm``, SiLU, the causal cache, the padding, ``quantize_input``): the real
Triton kernel through the interpreter (in a subprocess: ``TRITON_INTERPRET=1`` must precede Triton's import), a
residual block on its inputs against the block with diffusers' forward (both with the e4m3 convolutions), a
small decoder's streamed chunks, and the sm_90 cross-compile.

Bounds: the kernel sums the squares in another order than torch and multiplies by ``1 / norm`` where eager
divides, so a value may cross a rounding tie: each cache value within one bf16 step (2^-8 of its magnitude) of
eager's and each e4m3 value within one e4m3 step (one unit of its byte), nearly all equal (on these inputs: all).
"""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch
from diffusers.models.autoencoders.autoencoder_kl_wan import WanResidualBlock

from decoders import conv_input_fp8 as cif
from decoders import shifted_rows_conv as src

try:
    import triton  # noqa: F401

    from tests.triton_interpreted import interpreter_checks, interpreter_job

    BACKGROUND_JOBS = (interpreter_job(__file__),)
except ImportError:  # no Triton: the interpreter checks skip
    BACKGROUND_JOBS = ()

BF16_STEP = 2.0**-8


def _block(c_in: int, c_out: int, dtype: torch.dtype, seed: int = 0, bias: bool = False,
           device: str = "cpu") -> WanResidualBlock:
    """A residual block with gammas away from 1 (and a norm bias where asked), its convolutions installed in e4m3
    (where the kernel runs: CUDA, or the CPU under the interpreter)."""
    torch.manual_seed(seed)
    block = WanResidualBlock(c_in, c_out).eval()
    with torch.no_grad():
        for norm in (block.norm1, block.norm2):
            norm.gamma.uniform_(0.5, 1.5)
            if bias:
                norm.bias = torch.nn.Parameter(0.3 * torch.randn_like(norm.gamma))
    block = block.to(device, dtype)
    assert src.install(torch.nn.Sequential(block), {}, fp8=True) == 2
    return block


def compare(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """The kernel's (padded e4m3, cache) against the reference's: shapes, e4m3 bytes apart, cache steps apart."""
    (got_q, got_c), (want_q, want_c) = got, want
    apart = (got_q.view(torch.uint8).int() - want_q.view(torch.uint8).int()).abs()
    cache_error = (got_c.float() - want_c.float()).abs() / want_c.float().abs().clamp_min(2.0**-126)
    return {"shapes_equal": got_q.shape == want_q.shape and got_c.shape == want_c.shape,
            "e4m3_unequal_fraction": (apart > 0).float().mean().item() if apart.numel() else 0.0,
            "e4m3_max_steps": apart.max().item() if apart.numel() else 0,
            "cache_max_rel": cache_error.max().item() if cache_error.numel() else 0.0}


# --- run in the interpreter subprocess ------------------------------------------------------------------------


def _interpreter_checks() -> dict:
    from tests.triton_interpreted import patch_interpreter

    patch_interpreter()
    torch.set_num_threads(1)
    assert cif._interpreted(), "TRITON_INTERPRET=1 was not seen by triton"
    results = {}
    generator = torch.Generator().manual_seed(1)
    # Every cache length and layout in bf16 at 32 channels; a norm bias at 96 (a 128-wide block, masked), and
    # float32, each once.
    for dtype, c_in, c_out, bias, caches, layouts in (
            (torch.bfloat16, 32, 32, False, (None, 1, 2), ("ncdhw", "ndhwc", "one_frame")),
            (torch.bfloat16, 96, 32, True, (2,), ("one_frame",)), (torch.float32, 32, 32, False, (1,), ("ncdhw",))):
        block = _block(c_in, c_out, dtype, bias=bias)
        x = (3 * torch.randn(1, c_in, 3, 5, 6, generator=generator)).to(dtype)
        x[0, :, 1, 2, 3] = 0  # a zero position: the norm's eps
        chunks = {"ncdhw": x, "ndhwc": x.permute(0, 2, 3, 4, 1).contiguous().permute(0, 4, 1, 2, 3),
                  "one_frame": x[:, :, 1:2]}
        for cache_frames in caches:
            cache = None if cache_frames is None else torch.randn(
                1, c_in, cache_frames, 5, 6, generator=generator).to(dtype)
            for layout in layouts:
                chunk = chunks[layout]
                name = f"{str(dtype)[6:]}_{c_in}{'_bias' if bias else ''}_cache{cache_frames}_{layout}"
                results[name] = compare(cif.conv_input(block.norm1, block.conv1, chunk, cache),
                                        cif.conv_input_reference(block.norm1, block.conv1, chunk, cache))

    # Another launch: 4 positions a program (two programs a padded line of 8), two warps.
    results["launch_4x2"] = compare(cif.conv_input(block.norm1, block.conv1, x, None, launch=(4, 2)),
                                     cif.conv_input_reference(block.norm1, block.conv1, x, None))

    # A residual block through two chunks (no cache, then the caches of the first): the fused forward against
    # diffusers' forward, both with the e4m3 convolutions.
    fused = _block(32, 64, torch.bfloat16, seed=2)
    plain = copy.deepcopy(fused)
    results["installed"] = cif.install(torch.nn.Sequential(fused))
    x = (3 * torch.randn(1, 32, 4, 5, 6, generator=generator)).bfloat16()
    outputs, caches = [], []
    for block in (fused, plain):
        feat_cache, chunks = [None, None], []
        for chunk in (x[:, :, :1], x[:, :, 1:]):
            chunks.append(block(chunk, feat_cache, [0]))
        outputs.append(torch.cat(chunks, dim=2))
        caches.append(feat_cache)
    results["block"] = {
        "out_rel_max": ((outputs[0].float() - outputs[1].float()).abs().max()
                        / outputs[1].float().abs().max()).item(),
        "caches_equal": all(torch.equal(a, b) for a, b in zip(*caches)),
        "cache_shapes": [list(c.shape) for c in caches[0]]}

    from tests.test_shifted_rows_conv import small_vae

    vae = small_vae()
    src.install(vae.decoder, fp8=True)
    results["small_vae_installed"] = cif.install(vae.decoder)
    return results


# --- the tests --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def interpreted() -> dict:
    pytest.importorskip("triton")
    return interpreter_checks(__file__)


def test_kernel_writes_eagers_padded_e4m3_input_and_cache_within_one_step(interpreted):
    cases = {name: case for name, case in interpreted.items() if "cache" in name and name != "block"}
    assert len(cases) == 11
    for name, case in cases.items():
        assert case["shapes_equal"], name
        assert case["e4m3_max_steps"] <= 1 and case["e4m3_unequal_fraction"] < 0.01, (name, case)
        assert case["cache_max_rel"] <= BF16_STEP, (name, case)


def test_another_launch_writes_the_same_input(interpreted):
    case = interpreted["launch_4x2"]
    assert case["shapes_equal"] and case["e4m3_max_steps"] <= 1 and case["cache_max_rel"] <= BF16_STEP, case


def test_block_on_the_fused_inputs_computes_diffusers_block(interpreted):
    assert interpreted["installed"] == 1
    block = interpreted["block"]
    assert block["caches_equal"], block
    assert block["cache_shapes"] == [[1, 32, 2, 5, 6], [1, 64, 2, 5, 6]]
    assert block["out_rel_max"] < 1e-2, block  # equal inputs: the same convolutions, one bf16 rounding apart


def test_without_the_kernel_the_block_keeps_diffusers_forward_bit_for_bit():
    """On the plain CPU (no interpreter) the installed forward hands back to diffusers' own."""
    if cif._interpreted():
        pytest.skip("this session runs Triton interpreted: the kernel would run")
    block = WanResidualBlock(32, 32).eval()
    plain = copy.deepcopy(block)
    block.forward = cif.residual_block_forward.__get__(block)
    x = torch.randn(1, 32, 2, 3, 4)
    cache_a, cache_b = [None, None], [None, None]
    assert torch.equal(block(x, cache_a, [0]), plain(x, cache_b, [0]))
    assert all(torch.equal(a, b) for a, b in zip(cache_a, cache_b))


def test_install_takes_the_blocks_whose_two_convolutions_run_in_e4m3_only(interpreted):
    from tests.test_shifted_rows_conv import small_vae

    assert cif.install(small_vae().decoder) == 0  # nothing runs in e4m3 yet
    # 16 base channels: the mid block's 2 and up_blocks 0-2's 2 each (32+ channels); up_blocks.3's 16-channel not
    assert interpreted["small_vae_installed"] == 2 + 2 * 3


def test_new_cache_frames_is_diffusers_rule():
    assert [cif.new_cache_frames(t, c) for t, c in ((1, 0), (1, 1), (1, 2), (2, 0), (4, 2))] == [1, 2, 2, 2, 2]


def test_conv_input_refuses_what_does_not_fit():
    block = _block_cpu()
    x = torch.zeros(1, 32, 2, 3, 4)
    with pytest.raises(ValueError, match="one stream"):
        cif.conv_input(block.norm1, block.conv1, torch.zeros(2, 32, 2, 3, 4), None)
    with pytest.raises(ValueError, match="does not precede"):
        cif.conv_input(block.norm1, block.conv1, x, torch.zeros(1, 32, 3, 3, 4))
    with pytest.raises(ValueError, match="does not precede"):
        cif.conv_input(block.norm1, block.conv1, x, torch.zeros(1, 32, 1, 3, 5))
    with pytest.raises(ValueError, match="powers of two"):
        cif.conv_input(block.norm1, block.conv1, x, None, launch=(24, 4))
    with pytest.raises(ValueError, match="channels-last"):  # the op itself, below conv_input's layout copy
        cif._conv_input_op(x.bfloat16(), None, torch.ones(32).bfloat16(), None, [2, 1, 1], 1.0, 1.0, [64, 4])


def _block_cpu() -> WanResidualBlock:
    """A block whose first convolution carries an e4m3 launch (set by hand: install() needs a runnable kernel)."""
    block = WanResidualBlock(32, 32).eval()
    setattr(block.conv1, src._LAUNCH, ([3, 3, 3], 32, [16, 16, 32, 4, 2], 0.01))
    return block


@pytest.mark.background  # compiles only: the idle core's work
@pytest.mark.parametrize("channels", [96, 384])
def test_conv_input_compiles_for_sm90_as_launched_with_16_byte_accesses(monkeypatch, channels):
    """A launch at the decoder's narrowest and widest stage, on channels-last chunks as the decoder passes them,
    compiled for Hopper with the launcher's own specialisation: no local memory, Hopper's e4m3 conversion, and
    a position's channels loaded and stored as 16-byte vectors (with its strides unspecialised, as landed in the
    thirty-sixth session, every value loaded on its own: 33 and 128 two-byte loads a thread). Only the norm's
    weights may load one value a thread."""
    pytest.importorskip("triton")
    from tests.sm90 import compile_launch_for_sm90, narrow_accesses, record_launches

    recorder = record_launches(monkeypatch, cif, "_conv_input_kernel")
    x = torch.randn(1, 3, 6, 10, channels).bfloat16().permute(0, 4, 1, 2, 3)  # channels-last
    cache = torch.randn(1, 2, 6, 10, channels).bfloat16().permute(0, 4, 1, 2, 3)
    cif._conv_input_op(x, cache, torch.ones(channels, dtype=torch.bfloat16), None, [2, 1, 1], 1.0, 0.5,
                       list(cif.default_launch(channels)))
    accesses = compile_launch_for_sm90(recorder)
    # The norm's weights: one value a thread a channel group.
    assert narrow_accesses(accesses) <= channels // cif.channel_group(channels), accesses
    assert accesses.get("ld.global.v4.b32", 0) >= 4, accesses


def test_default_launch_gives_each_thread_16_values_of_a_channel_group():
    """A group is the largest power of two dividing the channels (no lane computes a channel that is not there),
    at most 128; a program takes as many positions of a line as give each of 128 threads 16 values a group."""
    assert [cif.channel_group(c) for c in (96, 192, 384, 32, 40, 1024, 33)] == [32, 64, 128, 32, 8, 128, 1]
    assert cif.default_launch(96) == (64, 4) and cif.default_launch(192) == (32, 4)
    assert cif.default_launch(384) == (16, 4) and cif.default_launch(40) == (256, 4)
    # More than 8 groups a position (an odd channel count: 33 of one) keeps diffusers' forward.
    assert not cif.available(torch.zeros(1, 33, 1, 2, 2)) and not cif.available(torch.zeros(1, 1032, 1, 2, 2))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device with e4m3 (8.9+)")
@pytest.mark.parametrize("c_in,height,width,frames", [(96, 48, 80, 4), (384, 30, 52, 1)])
def test_cuda_conv_input_matches_eager_within_one_step_and_captures(c_in, height, width, frames):
    """At the decoder's channel counts on the GPU: the e4m3 values within one step of eager's (at most 1 %
    apart), both layouts, and the same bytes replayed from a CUDA graph. The cache within four bf16 steps: on
    the H100 (2026-12-07) one value was 2.3 steps from eager's (0.009 relative) where the e4m3 bytes were all
    equal: a normalized value one step apart (the multiplication by ``1 / norm``), carried through the three
    roundings after it and the GPU's fast exponential in SiLU."""
    block = _block(c_in, 96, torch.bfloat16, device="cuda")
    generator = torch.Generator(device="cuda").manual_seed(0)
    x = 3 * torch.randn(1, c_in, frames, height, width, device="cuda", generator=generator).bfloat16()
    cache = torch.randn(1, c_in, 2, height, width, device="cuda", generator=generator).bfloat16()
    for chunk in (x, x.permute(0, 2, 3, 4, 1).contiguous().permute(0, 4, 1, 2, 3)):
        got = cif.conv_input(block.norm1, block.conv1, chunk, cache)
        case = compare(got, cif.conv_input_reference(block.norm1, block.conv1, chunk, cache))
        assert case["shapes_equal"] and case["e4m3_max_steps"] <= 1, case
        assert case["e4m3_unequal_fraction"] < 0.01 and case["cache_max_rel"] <= 4 * BF16_STEP, case
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        cif.conv_input(block.norm1, block.conv1, x, cache)
        with torch.cuda.graph(graph, stream=stream):
            captured = cif.conv_input(block.norm1, block.conv1, x, cache)
    graph.replay()
    torch.cuda.synchronize()
    got = cif.conv_input(block.norm1, block.conv1, x, cache)
    assert torch.equal(captured[0].view(torch.uint8), got[0].view(torch.uint8))
    assert torch.equal(captured[1], got[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device with e4m3 (8.9+)")
def test_cuda_compiled_decode_on_fused_inputs_is_as_close_to_bf16_as_the_e4m3_decode():
    """A small Wan decoder's compiled streaming decode three ways: bf16 convolutions (the reference), e4m3
    convolutions with the compiled norms, and e4m3 convolutions on the fused inputs. The two e4m3 paths round
    the norms differently (the compiled norm in Inductor's order, the fused one in eager's), and a rounding moved
    early is carried through every e4m3 convolution after it: on the H100 they were 3.6 levels apart on average
    (39 at most), where an earlier version of this test asked for 1. What must hold is that the fused inputs
    cost no quality: their pixels as close to the bf16 decode as the e4m3 decode's are (at 832x480 both were
    4.8 levels from it on average, PSNR 32.33 dB). A wrong kernel is far outside that (a launch that wrote a
    quarter of the positions: PSNR 8.8 dB)."""
    from tests.test_shifted_rows_conv import small_vae
    from decoders.video import WanStreamingDecoder

    vae = small_vae().cuda().to(torch.bfloat16)
    generator = torch.Generator(device="cuda").manual_seed(0)
    latents = torch.randn(1, 4, 10, 12, 20, device="cuda", dtype=torch.bfloat16, generator=generator)
    pixels = {}
    for path in ("bf16", "e4m3", "e4m3_fused"):
        model = copy.deepcopy(vae)
        if path != "bf16":
            src.install(model.decoder, fp8=True)
        blocks = cif.install(model.decoder) if path == "e4m3_fused" else 0
        assert blocks == (8 if path == "e4m3_fused" else 0)
        decoder = WanStreamingDecoder(model, compile_steady_state=True)
        state = decoder.new_state("gpu-test")
        pixels[path] = torch.cat([decoder.to_uint8_tensor(decoder.decode_chunk(latents[:, :, a:b], state)).int()
                                  for a, b in ((0, 1), (1, 4), (4, 7), (7, 10))])
        assert decoder.steady_state.calls >= 6 and not decoder.steady_state.failed
    error = {path: (pixels[path] - pixels["bf16"]).abs().float() for path in ("e4m3", "e4m3_fused")}
    means = {path: e.mean().item() for path, e in error.items()}
    assert means["e4m3_fused"] <= 1.25 * means["e4m3"] + 0.5, means
    assert error["e4m3_fused"].max().item() <= 1.5 * error["e4m3"].max().item() + 8, means


if __name__ == "__main__" and sys.argv[1:] == ["--interpreter-checks"]:
    print(json.dumps(_interpreter_checks()))
