"""The Wan decoder's convolutions as one GEMM over shifted rows (decoders/shifted_rows_conv.py).

In this process: the torch reference of the algorithm against ``F.conv3d`` (every kernel shape the decoder has,
frames and sizes that leave partial tiles), the weight packing, which convolutions are eligible, the config's
checks, and the engine option. The Triton kernel itself runs in a subprocess under ``TRITON_INTERPRET=1``
(float32, ``input_precision="ieee"``: the interpreter's bf16 dot is not the GPU's): against the reference,
through diffusers' ``WanCausalConv3d`` contract (no cache, a 1-frame and a 2-frame cache), through
``nn.Conv2d``, and a whole small Wan decoder's streaming decode with the kernel installed against the same
decode with diffusers' convolutions. GPU tests (marked ``gpu``) check the bf16 kernel against cuDNN at the
decoder's own shapes and the compiled steady-state decode against the reference path.

Bounds: float32 sums in a different order differ by a few ulps of the sum's terms (~1e-6 here, bound 1e-4);
in bf16 on the GPU the kernel and cuDNN both accumulate in float32 and round once to bf16 at the end, so they
differ by at most ~1 bf16 ulp of the output (2^-8 relative: bound 1 % of the output's largest magnitude); a
decoded frame in uint8 may flip by a level where a bf16 rounding crosses a half level (bound 2 levels, mean < 0.05).
"""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kl_wan import AutoencoderKLWan, WanCausalConv3d

from decoders import shifted_rows_conv as src

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def small_vae() -> AutoencoderKLWan:
    """A Wan VAE with the 2.1 layout at 16 base channels (the kernel takes >= 16 input channels)."""
    torch.manual_seed(0)
    return AutoencoderKLWan(base_dim=16, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                            temperal_downsample=[False, True, True], latents_mean=[0.0] * 4,
                            latents_std=[1.0] * 4).eval()


# --- run in the interpreter subprocess ------------------------------------------------------------------------


def _interpreter_checks() -> dict:
    from tests.triton_interpreted import patch_interpreter

    patch_interpreter()
    torch.set_num_threads(1)  # the job's one idle core (tests/triton_interpreted.py)
    from decoders.video import WanStreamingDecoder

    assert type(src._shifted_rows_conv_kernel).__name__ == "InterpretedFunction", "TRITON_INTERPRET=1 not seen"
    results = {}
    generator = torch.Generator().manual_seed(0)
    small = src.ConvKernelConfig(16, 16, 16, 4, 2)
    # (frames, Hp, Wp, C_in, C_out, kernel, config): rows not a multiple of block_m, C_out not of block_n,
    # more than one K chunk, a 2-D kernel, a temporal-only kernel.
    for name, (t, hp, wp, c_in, c_out, kernel, config) in {
        "3x3x3": (4, 7, 9, 32, 24, (3, 3, 3), small),
        "3x3x3_one_frame_out": (3, 5, 6, 16, 40, (3, 3, 3), src.ConvKernelConfig(32, 32, 16, 4, 2)),
        "1x3x3": (3, 6, 8, 32, 16, (1, 3, 3), src.ConvKernelConfig(32, 16, 32, 4, 2)),
        "3x1x1": (4, 3, 5, 16, 48, (3, 1, 1), small),
        # KW * C_in = 96 in chunks of 64: the last chunk is half past the run (the masked tail).
        "3x3x3_k_tail": (3, 5, 7, 32, 24, (3, 3, 3), src.ConvKernelConfig(16, 16, 64, 4, 2)),
    }.items():
        padded = torch.randn(t, hp, wp, c_in, generator=generator)
        weight = torch.randn(c_out, c_in, *kernel, generator=generator)
        bias = torch.randn(c_out, generator=generator)
        want = src.shifted_rows_conv_reference(padded, weight, bias)
        got = src.shifted_rows_conv(padded, src.pack_weight(weight), bias, config)
        no_bias = src.shifted_rows_conv(padded, src.pack_weight(weight), None, config)
        results[name] = {"shape": list(got.shape), "want_shape": list(want.shape),
                         "max_diff": (got - want).abs().max().item(), "scale": want.abs().max().item(),
                         "bias_diff": (got - no_bias - bias).abs().max().item()}
        if kernel == (3, 3, 3) and c_in % 32 == 0:
            # e4m3: against the reference on the dequantized operands (the products are exact in float32, only
            # the summation order differs) and against the float32 convolution (e4m3's rounding of both).
            fp8_weight = src.pack_weight_fp8(weight)
            input_scale = padded.abs().max().item() / src.FP8_MAX
            quantized = src.quantize_input(padded, input_scale)
            fp8_config = src.ConvKernelConfig(16, 16, max(32, config.block_k), 4, 2)  # K_TAIL in the tail case
            got8 = src.shifted_rows_conv(quantized, fp8_weight, bias, fp8_config,
                                         input_scale=input_scale, out_dtype=torch.float32)
            dequantized = src.shifted_rows_conv_reference(quantized.float() * input_scale,
                                                          fp8_weight.dequantized(), bias)
            results[name + "_fp8"] = {
                "dtype": str(got8.dtype), "max_diff_dequantized": (got8 - dequantized).abs().max().item(),
                "rel_fro_vs_float32": ((got8 - want).norm() / want.norm()).item(), "scale": want.abs().max().item()}

    results["self_check"] = src.self_check("cpu", torch.float32)

    conv = WanCausalConv3d(16, 24, 3, padding=1)
    reference = copy.deepcopy(conv)
    installed = src.install(torch.nn.Sequential(conv), {(16, 24, 27): small})
    x = torch.randn(1, 16, 2, 5, 6, generator=generator)
    results["causal_conv3d"] = {"installed": installed, "max_diff": {
        cache: (conv(x, c) - reference(x, c)).abs().max().item()
        for cache, c in (("none", None), ("one_frame", torch.randn(1, 16, 1, 5, 6, generator=generator)),
                         ("two_frames", torch.randn(1, 16, 2, 5, 6, generator=generator)))}}
    conv2d = torch.nn.Conv2d(32, 16, 3, padding=1)
    reference2d = copy.deepcopy(conv2d)
    src.install(torch.nn.Sequential(conv2d), {(32, 16, 9): small})
    x2 = torch.randn(3, 32, 5, 7, generator=generator)
    results["conv2d"] = {"max_diff": (conv2d(x2) - reference2d(x2)).abs().max().item()}

    # A whole decoder: two chunks (the opening frame's eager path, then steady frames) vs diffusers' convs.
    # Large tiles: the interpreter's time goes mostly into per-program and per-step overhead.
    vae = small_vae()
    for module in vae.decoder.modules():
        if src.eligible(module):
            key = (module.in_channels, module.out_channels, module.weight[0, 0].numel())
            block_k = min(64, module.in_channels)
            src.MEASURED_CONFIGS[key] = src.ConvKernelConfig(1024, 64, block_k, 4, 2)
            src.MEASURED_CONFIGS[key + ("fp8",)] = src.ConvKernelConfig(1024, 64, max(block_k, 32), 4, 2)
    plain = copy.deepcopy(vae)
    kernel_decoder = WanStreamingDecoder(vae, fast_path=False, conv_kernel=True)
    plain_decoder = WanStreamingDecoder(plain, fast_path=False)
    latents = torch.randn(1, 4, 3, 2, 2, generator=generator)
    state_k, state_p = kernel_decoder.new_state("k"), plain_decoder.new_state("p")
    diffs = []
    for chunk in (latents[:, :, :1], latents[:, :, 1:]):
        got, want = kernel_decoder.decode_chunk(chunk, state_k), plain_decoder.decode_chunk(chunk, state_p)
        diffs.append({"shape": list(got.shape), "max_diff": (got - want).abs().max().item()})
    results["decoder"] = {"installed": kernel_decoder.kernel_convs, "chunks": diffs}

    # The residual blocks' convolutions in e4m3: every value stays within the static bound of its scale.
    fp8_vae = copy.deepcopy(plain)
    scales = src.fp8_input_scales(fp8_vae.decoder)
    seen = []
    hooks = [conv.register_forward_pre_hook(
        lambda module, args, scale=scale: seen.append(args[0].abs().max().item() / (scale * src.FP8_MAX)))
        for conv, scale in scales.items()]
    src.install(fp8_vae.decoder, fp8=True)
    fp8_decoder = WanStreamingDecoder(fp8_vae, fast_path=False)
    state_8, state_p = fp8_decoder.new_state("8"), plain_decoder.new_state("p2")
    got = torch.cat([fp8_decoder.decode_chunk(c, state_8) for c in (latents[:, :, :1], latents[:, :, 1:])], dim=2)
    want = torch.cat([plain_decoder.decode_chunk(c, state_p) for c in (latents[:, :, :1], latents[:, :, 1:])], dim=2)
    for hook in hooks:
        hook.remove()
    results["decoder_fp8"] = {"fp8_convs": len(scales), "largest_input_over_bound": max(seen),
                              "rel_fro": ((got - want).norm() / want.norm()).item()}
    return results


# --- the tests --------------------------------------------------------------------------------------------------

pytest.importorskip("triton")

from tests.triton_interpreted import interpreter_checks, interpreter_job  # noqa: E402

BACKGROUND_JOBS = (interpreter_job(__file__),)  # started with the session (tests/background.py)


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return interpreter_checks(__file__)


@pytest.mark.parametrize(
    "frames,height,width,kernel",
    [(1, 1, 1, (3, 3, 3)), (2, 5, 7, (3, 3, 3)), (3, 4, 9, (1, 3, 3)), (2, 6, 5, (3, 1, 1)), (1, 3, 3, (1, 1, 1))],
)
def test_reference_equals_conv3d(frames, height, width, kernel):
    generator = torch.Generator().manual_seed(frames * 100 + height)
    kt, kh, kw = kernel
    padded = torch.randn(frames + kt - 1, height + kh - 1, width + kw - 1, 8, generator=generator)
    weight = torch.randn(12, 8, *kernel, generator=generator)
    bias = torch.randn(12, generator=generator)
    want = F.conv3d(padded.permute(3, 0, 1, 2).unsqueeze(0), weight, bias)[0].permute(1, 2, 3, 0)
    got = src.shifted_rows_conv_reference(padded, weight, bias)
    assert got.shape == (frames, height, width, 12)
    assert (got - want).abs().max().item() < 1e-4


def test_pack_weight_is_tap_major_then_input_channel_with_zero_columns():
    weight = torch.arange(5 * 4 * 27, dtype=torch.float32).view(5, 4, 3, 3, 3)
    packed = src.pack_weight(weight)
    assert packed.data.shape == (27 * 4, src.WEIGHT_COLUMNS_ALIGN) and not packed.fp8
    dt, dy, dx, c_in, c_out = 2, 0, 1, 3, 4
    assert packed.data[(dt * 9 + dy * 3 + dx) * 4 + c_in, c_out] == weight[c_out, c_in, dt, dy, dx]
    assert packed.data[:, 5:].abs().sum() == 0
    assert torch.equal(packed.dequantized(), weight)
    assert src.pack_weight(weight[:, :, 0]).data.shape == (9 * 4, src.WEIGHT_COLUMNS_ALIGN)  # a 2-D conv's weight


def test_pack_weight_fp8_is_reduction_contiguous_per_channel_scaled():
    generator = torch.Generator().manual_seed(3)
    weight = torch.randn(5, 32, 3, 3, 3, generator=generator) * torch.tensor([1.0, 10, 0.1, 3, 1e-3]).view(5, 1, 1, 1, 1)
    packed = src.pack_weight_fp8(weight)
    assert packed.fp8 and packed.data.dtype == torch.float8_e4m3fn
    assert packed.data.shape == (src.WEIGHT_COLUMNS_ALIGN, 27 * 32) and packed.data.stride(1) == 1
    assert packed.data[:5].float().abs().amax(dim=1).tolist() == [448.0] * 5  # each channel's largest maps to 448
    error = (packed.dequantized() - weight).abs() / weight.abs().amax(dim=(1, 2, 3, 4), keepdim=True)
    assert error.max().item() <= 2**-4 * 1.01  # half an e4m3 step (3 mantissa bits) of the channel's range
    assert packed.data[5:].float().abs().sum() == 0


def test_silu_rms_norm_bound_holds_and_is_attained_in_one_channel():
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm

    torch.manual_seed(0)
    norm = WanRMS_norm(64, images=False)
    with torch.no_grad():
        norm.gamma.copy_(torch.randn_like(norm.gamma))
    bound = src.silu_rms_norm_bound(norm)
    x = torch.randn(1, 64, 2, 8, 8) * 100
    assert F.silu(norm(x)).abs().max().item() <= bound
    spike = torch.zeros(1, 64, 1, 1, 1)
    spike[0, norm.gamma.abs().flatten().argmax()] = 1.0  # all of a pixel's energy in the largest-gamma channel
    assert F.silu(norm(spike)).abs().max().item() > 0.99 * bound


def test_wan_2_1_decoder_eligible_convolutions():
    from engine.models.presets import WAN_2_1_VAE_CONFIG

    with torch.device("meta"):
        decoder = AutoencoderKLWan(**WAN_2_1_VAE_CONFIG).decoder
    chosen = {name for name, module in decoder.named_modules() if src.eligible(module)}
    # Every 3x3x3 conv but conv_out (3 output channels), and the three upsamplers' 3x3 Conv2d; not the
    # temporal-only time_conv (3x1x1), the 1x1x1 shortcut or the attention's 1x1 projections.
    assert "conv_in" in chosen and "up_blocks.3.resnets.2.conv2" in chosen
    assert "up_blocks.2.upsamplers.0.resample.1" in chosen
    assert not chosen & {"conv_out", "up_blocks.0.upsamplers.0.time_conv", "up_blocks.1.resnets.0.conv_shortcut",
                         "mid_block.attentions.0.to_qkv"}
    assert len(chosen) == 29 + 3  # conv_in, mid 4, up_blocks 4 x 6; three upsamplers


def test_config_and_argument_checks():
    with pytest.raises(ValueError, match="power of two"):
        src.ConvKernelConfig(block_m=96)
    with pytest.raises(ValueError, match="block_n"):
        src.ConvKernelConfig(block_n=512)
    assert src.config_for(16, 384, 27).block_k == 16  # conv_in: the block's K shrinks to divide 16 channels
    with pytest.raises(ValueError, match="Triton interpreter|CUDA"):  # this process runs compiled Triton
        src.shifted_rows_conv(torch.zeros(3, 3, 3, 16), src.pack_weight(torch.zeros(16, 16, 3, 3, 3)), None)


def test_engine_option_refuses_the_kernel_off_cuda_and_auto_resolves():
    from engine.config import EngineConfig

    with pytest.raises(ValueError, match="decode_convs=triton runs on CUDA"):
        EngineConfig(preset="wan2.1-1.3b", random_weights=True, decode_convs="triton")
    with pytest.raises(ValueError, match="Wan VAE decoder's option; this config decodes with taehv"):
        EngineConfig(preset="tiny", decode_convs="triton_fp8")
    assert EngineConfig(preset="tiny").resolved_decode_convs == "cudnn"
    assert EngineConfig(preset="wan2.1-1.3b", random_weights=True, decode_convs="cudnn").resolved_decode_convs == "cudnn"


def test_auto_runs_the_kernel_for_a_bf16_wan_decode_on_a_hopper_gpu_with_the_compiled_decode_only():
    from engine.config import auto_decode_convs

    hopper = ("wan", "cuda", "bfloat16", True, (9, 0), True)
    assert auto_decode_convs(*hopper) == "triton"
    assert auto_decode_convs("wan", "cuda:1", "bfloat16", True, (9, 0), True) == "triton"
    for changed in ({0: "taehv"}, {1: "cpu"}, {2: "float32"}, {2: "float16"}, {3: False}, {4: (8, 0)}, {4: (8, 9)},
                    {4: (10, 0)}, {4: None}, {5: False}):
        arguments = list(hopper)
        for index, value in changed.items():
            arguments[index] = value
        assert auto_decode_convs(*arguments) == "cudnn", changed


def test_auto_falls_back_to_cudnn_where_the_kernel_fails_its_self_check():
    """This process runs compiled Triton on a CPU, where the kernel cannot run: the self-check says why, and a
    kernel ``auto`` chose gives way to cuDNN, while one asked for by name is kept (it fails at the warm-up)."""
    from engine.bundle import checked_decode_convs

    reason = src.self_check("cpu", torch.float32)
    assert reason is not None and "CUDA" in reason
    assert checked_decode_convs("auto", "triton", "cpu", torch.float32) == "cudnn"
    assert checked_decode_convs("triton", "triton", "cpu", torch.float32) == "triton"
    assert checked_decode_convs("auto", "cudnn", "cpu", torch.float32) == "cudnn"


def test_packed_weight_bytes_is_what_the_packers_allocate():
    """The memory plan's figure, from shapes alone, equals the bytes the packers make for every eligible
    convolution (bf16; and e4m3 with its scales where install puts it)."""
    decoder = small_vae().decoder.to(torch.bfloat16)
    in_fp8 = set(src.fp8_input_scales(decoder))
    bf16 = fp8 = 0
    for module in decoder.modules():
        if src.eligible(module):
            packed = src.pack_weight(module.weight.detach())
            bf16 += packed.data.nbytes
            if module in in_fp8:
                packed = src.pack_weight_fp8(module.weight.detach())
                fp8 += packed.data.nbytes + packed.scale.nbytes
            else:
                fp8 += packed.data.nbytes
    assert in_fp8 and bf16 > fp8 > 0
    assert src.packed_weight_bytes(decoder) == bf16
    assert src.packed_weight_bytes(decoder, fp8=True) == fp8
    assert src.packed_weight_bytes(decoder.to(torch.float32), element_size=2) == bf16


def test_self_check_passes_where_the_kernel_runs(interpreted):
    assert interpreted["self_check"] is None


def test_kernel_equals_reference(interpreted):
    for name in ("3x3x3", "3x3x3_one_frame_out", "1x3x3", "3x1x1", "3x3x3_k_tail"):
        case = interpreted[name]
        assert case["shape"] == case["want_shape"], name
        assert case["max_diff"] < 1e-4 * max(1.0, case["scale"]), (name, case)
        assert case["bias_diff"] < 1e-4 * max(1.0, case["scale"]), (name, case)


@pytest.mark.parametrize("name", ["3x3x3_fp8", "3x3x3_k_tail_fp8"])
def test_fp8_kernel_computes_its_dequantized_operands_and_stays_near_float32(interpreted, name):
    case = interpreted[name]
    assert case["dtype"] == "torch.float32"
    assert case["max_diff_dequantized"] < 1e-4 * max(1.0, case["scale"]), case
    # Two e4m3 roundings (~2.6 % RMS each, relative) on every product, averaged over 864 of them: ~3.7 %.
    assert 0.005 < case["rel_fro_vs_float32"] < 0.06, case


def test_fp8_decoder_inputs_stay_within_their_static_bound(interpreted):
    case = interpreted["decoder_fp8"]
    # mid 4 + up_blocks 4 x 4 residual convolutions, less the four of up_blocks.3 (16 input channels)
    assert case["fp8_convs"] == 16
    assert case["largest_input_over_bound"] <= 1.0, case
    # 16 e4m3 convolutions in series (~3.7 % each, above), on random weights that do not damp it: measured
    # 12 %; a wrong scale or a clipped input would be ~100 %.
    assert case["rel_fro"] < 0.25, case


def test_kernel_keeps_diffusers_contracts(interpreted):
    assert interpreted["causal_conv3d"]["installed"] == 1
    for cache, diff in interpreted["causal_conv3d"]["max_diff"].items():
        assert diff < 1e-4, cache
    assert interpreted["conv2d"]["max_diff"] < 1e-4


def test_decoder_with_the_kernel_equals_diffusers_convolutions(interpreted):
    decoder = interpreted["decoder"]
    # mid 4 + up_blocks 4 x 4 causal 3x3x3 convs (not conv_in: 4 input channels, nor conv_out: 3 output), and the
    # three upsamplers' conv2d
    assert decoder["installed"] == 20 + 3
    assert [c["shape"][2] for c in decoder["chunks"]] == [1, 8]
    for chunk in decoder["chunks"]:
        assert chunk["max_diff"] < 1e-4, chunk


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("c_in,c_out,kernel,frames,height,width", [
    (96, 96, (3, 3, 3), 4, 48, 80), (192, 96, (1, 3, 3), 4, 48, 80), (384, 384, (3, 3, 3), 2, 30, 52),
    (16, 384, (3, 3, 3), 1, 30, 52)])
def test_gpu_bf16_kernel_matches_cudnn(c_in, c_out, kernel, frames, height, width):
    generator = torch.Generator(device="cuda").manual_seed(0)
    kt, kh, kw = kernel
    padded = torch.randn(frames + kt - 1, height + kh - 1, width + kw - 1, c_in, device="cuda",
                         dtype=torch.bfloat16, generator=generator)
    weight = torch.randn(c_out, c_in, *kernel, device="cuda", dtype=torch.bfloat16,
                         generator=generator) / (c_in * kt * kh * kw) ** 0.5
    bias = torch.randn(c_out, device="cuda", dtype=torch.bfloat16, generator=generator)
    want = F.conv3d(padded.permute(3, 0, 1, 2).unsqueeze(0), weight, bias)[0].permute(1, 2, 3, 0)
    got = src.shifted_rows_conv(padded, src.pack_weight(weight), bias)
    assert (got.float() - want.float()).abs().max().item() < 0.01 * want.float().abs().max().item()
    if kernel == (3, 3, 3) and c_in % 32 == 0:
        input_scale = padded.float().abs().max().item() / src.FP8_MAX
        got8 = src.shifted_rows_conv(src.quantize_input(padded, input_scale), src.pack_weight_fp8(weight), bias,
                                     input_scale=input_scale)
        relative = ((got8.float() - want.float()).norm() / want.float().norm()).item()
        assert relative < 0.08, relative  # e4m3 on both operands: a few per cent


def _decode_pixels(vae, latents, *, compiled: bool, kernel: bool):
    from decoders.video import WanStreamingDecoder

    decoder = WanStreamingDecoder(copy.deepcopy(vae), compile_steady_state=compiled, conv_kernel=kernel)
    state = decoder.new_state("gpu-test")
    chunks = [decoder.to_uint8_tensor(decoder.decode_chunk(latents[:, :, start:stop], state)).int()
              for start, stop in ((0, 1), (1, 4), (4, 7), (7, 10))]
    if compiled:
        assert decoder.steady_state.calls >= 6 and not decoder.steady_state.failed
    return torch.cat(chunks)


@pytest.mark.gpu
@needs_cuda
def test_gpu_self_check_passes_so_auto_keeps_the_kernel():
    assert src.self_check("cuda", torch.bfloat16) is None


@pytest.mark.gpu
@needs_cuda
def test_gpu_compiled_decode_with_the_kernel_equals_its_eager_decode_as_closely_as_diffusers_does():
    """The compiled steady state with the kernel against the same decode eager, bounded by what compiling does to
    diffusers' own path (Inductor fuses the norms and activations, so bf16 roundings move); and the kernel's
    eager decode against diffusers' eager decode, bounded the same way (per convolution the two differ by about
    a bf16 rounding: test_gpu_bf16_kernel_matches_cudnn)."""
    vae = small_vae().cuda().to(torch.bfloat16)
    generator = torch.Generator(device="cuda").manual_seed(0)
    latents = torch.randn(1, 4, 10, 12, 20, device="cuda", dtype=torch.bfloat16, generator=generator)
    plain_eager = _decode_pixels(vae, latents, compiled=False, kernel=False)
    plain_compiled = _decode_pixels(vae, latents, compiled=True, kernel=False)
    kernel_eager = _decode_pixels(vae, latents, compiled=False, kernel=True)
    kernel_compiled = _decode_pixels(vae, latents, compiled=True, kernel=True)
    floor = (plain_compiled - plain_eager).abs()
    for got, want in ((kernel_compiled, kernel_eager), (kernel_eager, plain_eager)):
        diff = (got - want).abs()
        assert diff.max().item() <= 2 * max(floor.max().item(), 1) + 1
        assert diff.float().mean().item() <= 3 * max(floor.float().mean().item(), 0.01) + 0.05


if __name__ == "__main__" and sys.argv[1:] == ["--interpreter-checks"]:
    print(json.dumps(_interpreter_checks()))
