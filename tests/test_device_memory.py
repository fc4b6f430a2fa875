"""The 24 GiB mode's memory arithmetic and refusals, from configs alone (no GPU here, nothing allocated).

A CUDA config cannot be validated on a CPU-only torch, so the configs below are built without validation
(``model_construct``); what validation itself refuses is tested with real ``EngineConfig`` calls.
"""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from engine.config import EngineConfig
from engine.device_memory import (
    CUDA_CONTEXT_BYTES,
    DEVICE_RESERVE_BYTES,
    allocator_limit_bytes,
    check_fits_on_device,
    estimate_device_memory,
    refusal,
)
from engine.memory import InsufficientMemory, check_text_encoder_fits_host
from engine.startup import indexed_cuda_device

pytestmark = pytest.mark.background  # computes only: runs on the idle core (tests/background_pytest.py)

GIB = 2**30
H200_BYTES = 150_000_000_000  # what CUDA reports for an H200, near enough


def cuda_1_3b(**fields) -> EngineConfig:
    values = {"preset": "wan2.1-1.3b", "device": "cuda", "dtype": "bfloat16", "random_weights": True,
              "random_text_encoder": "umt5-xxl", "gpu_memory_gib": 24.0, **fields}
    return EngineConfig.model_construct(**values)


# Wan2.1-1.3B at 832x480 in bf16: 30 layers, 12 heads of 128, 1560 tokens per latent frame (60 x 104 latent / 2x2).
LAYER_TOKEN_BYTES = 30 * 2 * 12 * 128 * 2  # K and V of one token in every layer
FRAME_BYTES = 1560 * LAYER_TOKEN_BYTES  # one latent frame: 274.2 MiB
TEXT_BYTES = 512 * LAYER_TOKEN_BYTES  # one prompt's text K/V
DECODER_STATE_BYTES_MIB = 1801.1  # the Wan VAE's streaming state at 832x480 bf16, as the H200 measured it
LATENT_FRAME_BYTES = 16 * 60 * 104 * 4  # float32


def test_the_decode_kernel_adds_its_packed_weights():
    """decode_convs=triton* keeps a packed copy of the Wan decoder's 32 convolution weights (output columns padded
    to 256) beside diffusers' own: 184.4 MiB in bf16; in e4m3 the residual blocks' 28 take one byte a weight."""
    base = estimate_device_memory(cuda_1_3b(decode_convs="cudnn")).weights
    assert estimate_device_memory(cuda_1_3b()).weights == base  # auto without a Hopper GPU: cuDNN
    assert estimate_device_memory(cuda_1_3b(decode_convs="triton")).weights - base == 193_314_816
    assert estimate_device_memory(cuda_1_3b(decode_convs="triton_fp8")).weights - base == 99_135_488
    assert estimate_device_memory(cuda_1_3b(decode_convs="triton", video_decoder="taehv")).weights < base


def test_the_standard_1_3b_parts_add_up_from_the_geometry():
    estimate = estimate_device_memory(cuda_1_3b(gather_history_once=True))
    assert FRAME_BYTES == 287_539_200
    session_without_decoder = 18 * FRAME_BYTES + TEXT_BYTES + (18 + 2 * 3) * LATENT_FRAME_BYTES
    assert round((estimate.session - session_without_decoder) / 2**20, 1) == DECODER_STATE_BYTES_MIB
    assert estimate.workspace == 21 * FRAME_BYTES + 3 * FRAME_BYTES + TEXT_BYTES  # context, staging, spare text slot
    assert round(estimate.weights / 1e9, 2) == 3.09  # 1.42 B DiT + 127 M VAE parameters, 2 bytes each
    assert round(estimate.text_encoder / 1e9, 2) == 11.36  # UMT5-XXL's encoder: 5.68 B parameters
    assert not estimate.text_encoder_on_device  # the cap sends it to the CPU
    assert estimate.reserve == CUDA_CONTEXT_BYTES + DEVICE_RESERVE_BYTES
    # FP8 attention adds the e4m3 mirror: K and V at one byte, V's rows padded to 16 keys.
    fp8 = estimate_device_memory(cuda_1_3b(fp8="attention"))
    assert fp8.workspace - estimate.workspace == 30 * 12 * 128 * (32_760 + 32_768) + 16 * 30 * 12
    # The fast window with TAEHV: 3 + 6 + 3 frames of context, 9 resident, a small decoder state.
    fast = estimate_device_memory(cuda_1_3b(window_frames=6, video_decoder="taehv", gather_history_once=True))
    assert fast.workspace == 12 * FRAME_BYTES + 3 * FRAME_BYTES + TEXT_BYTES
    assert fast.session == 9 * FRAME_BYTES + TEXT_BYTES + (9 + 6) * LATENT_FRAME_BYTES


def test_under_a_cap_the_history_is_gathered_in_every_forward_unless_fp8_attention_needs_the_buffer():
    # The gathered context is one session's whole context again (21 frames): a 24 GiB card keeps it for sessions
    # (docs/MODELS.md); FP8 attention reads its mirror, so it keeps both; no cap, no change.
    assert not cuda_1_3b().resolved_gather_history_once
    assert cuda_1_3b(fp8="attention").resolved_gather_history_once
    assert cuda_1_3b(gpu_memory_gib=None).resolved_gather_history_once
    assert cuda_1_3b(gather_history_once=True).resolved_gather_history_once
    per_forward, gathered = estimate_device_memory(cuda_1_3b()), estimate_device_memory(cuda_1_3b(gather_history_once=True))
    assert gathered.workspace - per_forward.workspace == 21 * FRAME_BYTES  # 5.62 GiB
    assert per_forward.workspace == 3 * FRAME_BYTES + TEXT_BYTES
    with pytest.raises(ValidationError, match="fp8=attention attends through the gathered history's FP8 mirror"):
        EngineConfig(dtype="bfloat16", fp8="attention", gather_history_once=False)


def test_24_gib_holds_one_standard_session_only_with_the_text_encoder_on_the_cpu():
    on_cpu = estimate_device_memory(cuda_1_3b(gather_history_once=True))
    on_device = estimate_device_memory(cuda_1_3b(text_encoder_device="device", gather_history_once=True))
    assert on_device.text_encoder_on_device and on_device.resident - on_cpu.resident == on_cpu.text_encoder
    assert on_cpu.sessions_fitting(24 * GIB) == 1
    assert on_device.sessions_fitting(24 * GIB) == 0
    assert on_cpu.sessions_fitting(24 * GIB, activation_peak=6 * GIB) == 0  # a measured peak can still refuse
    # Gathering in every forward leaves room for the 5.72 GiB activation peak the H200 measured (with the buffer:
    # refused after the warm-up, docs/BENCHMARKS.md).
    assert estimate_device_memory(cuda_1_3b()).sessions_fitting(24 * GIB, activation_peak=int(1.25 * 5.72 * GIB)) == 1
    check_fits_on_device(cuda_1_3b(), device_total_bytes=H200_BYTES)
    with pytest.raises(InsufficientMemory) as refused:
        check_fits_on_device(cuda_1_3b(text_encoder_device="device", gather_history_once=True),
                             device_total_bytes=H200_BYTES)
    message = str(refused.value)
    assert "gpu_memory_gib 24 holds not even one session at 832x480" in message
    assert "text encoder 10.58 GiB on the device" in message and "--text-encoder cpu" in message
    # Without a cap nothing is checked here: the pools are sized from the free memory after the warm-up.
    check_fits_on_device(cuda_1_3b(gpu_memory_gib=None, text_encoder_device="device"), device_total_bytes=1)


def test_a_cap_beyond_the_device_or_below_one_session_is_refused_naming_every_part():
    with pytest.raises(InsufficientMemory, match=r"gpu_memory_gib 24: the device has 15\.00 GiB"):
        check_fits_on_device(cuda_1_3b(), device_total_bytes=15 * GIB)
    with pytest.raises(InsufficientMemory) as refused:
        check_fits_on_device(cuda_1_3b(gpu_memory_gib=16.0, gather_history_once=True), device_total_bytes=H200_BYTES)
    message = str(refused.value)
    for part in ("weights 2.88 GiB", "text encoder on the CPU", "workspaces 6.51 GiB", "one session 6.68 GiB",
                 "reserve 2.50 GiB", "a smaller --window-frames", "TAEHV"):
        assert part in message, part
    after_build = refusal(cuda_1_3b(), estimate_device_memory(cuda_1_3b()), activation_peak=7 * GIB)
    assert "the measured activation peak 7.00 GiB" in after_build
    assert allocator_limit_bytes(cuda_1_3b()) == 24 * GIB - CUDA_CONTEXT_BYTES
    assert allocator_limit_bytes(cuda_1_3b(gpu_memory_gib=None)) is None


def test_the_text_encoder_runs_on_the_cpu_under_a_cap_and_must_fit_in_host_memory():
    assert cuda_1_3b().resolved_text_encoder_device == "cpu"
    assert cuda_1_3b().resolved_text_encode_in_background
    assert cuda_1_3b(gpu_memory_gib=None).resolved_text_encoder_device == "cuda"
    assert not cuda_1_3b(gpu_memory_gib=None).resolved_text_encode_in_background
    assert cuda_1_3b(gpu_memory_gib=None, text_encoder_device="cpu").resolved_text_encoder_device == "cpu"
    assert cuda_1_3b(text_encoder_device="device").resolved_text_encoder_device == "cuda"
    assert not EngineConfig(text_encoder_device="cpu").resolved_text_encode_in_background  # a CPU engine: inline
    check_text_encoder_fits_host(cuda_1_3b(), available=32 * GIB)
    with pytest.raises(InsufficientMemory, match=r"text encoder on the CPU needs ~10\.6 GiB of host memory"):
        check_text_encoder_fits_host(cuda_1_3b(), available=8 * GIB)


def test_a_gpu_cap_on_the_cpu_and_the_umt5_encoder_for_a_tiny_preset_are_refused():
    with pytest.raises(ValidationError, match="gpu_memory_gib caps a CUDA device's memory"):
        EngineConfig(gpu_memory_gib=24)
    with pytest.raises(ValidationError, match="random_text_encoder=umt5-xxl is for the random weights"):
        EngineConfig(random_weights=True, random_text_encoder="umt5-xxl")
    with pytest.raises(ValidationError, match="random_text_encoder=umt5-xxl"):
        EngineConfig(preset="wan2.1-1.3b", random_text_encoder="umt5-xxl")  # no random weights


def test_the_allocator_cap_names_an_indexed_device():
    # torch's per-process memory fraction refuses a bare "cuda" (the first H200 run of the 24 GiB mode exited 3
    # on it); an explicit index is kept as given, and a bare one becomes the current device's.
    assert indexed_cuda_device("cuda:1") == torch.device("cuda", 1)
    if torch.cuda.is_available():
        assert indexed_cuda_device("cuda").index == torch.cuda.current_device()


def test_the_engine_builds_the_history_path_the_config_resolves():
    from engine.bundle import build_models

    per_forward = build_models(EngineConfig(gather_history_once=False)).pipeline
    assert per_forward.context_kv == {} and not per_forward.forwards.enabled
    assert set(build_models(EngineConfig()).pipeline.context_kv) == {"cond"}


def test_running_out_of_memory_in_the_warm_up_under_a_cap_is_the_refusal_with_every_figure():
    from engine.runner import WarmupFailed
    from engine.startup import refused_when_out_of_memory

    # What the H200 said when --fp8 attention's probe block met the 24 GiB cap (the runner's failure text).
    oom = WarmupFailed("warmup failed: OutOfMemoryError: CUDA out of memory. Tried to allocate 586.00 MiB. GPU 0 "
                       "has a total capacity of 139.80 GiB of which 115.95 GiB is free.", out_of_memory=True)
    with pytest.raises(InsufficientMemory) as refused:
        with refused_when_out_of_memory(cuda_1_3b(fp8="attention"), lambda: 5 * GIB):
            raise oom
    message = str(refused.value)
    assert message.startswith("gpu_memory_gib 24 holds not even one session at 832x480: weights 2.88 GiB")
    assert "the measured activation peak 5.00 GiB" in message
    assert "the warm-up ran out of memory under the cap (CUDA out of memory" in message
    assert "try FP8 attention off (it needs the gathered context and its FP8 mirror), a smaller" in message
    assert "Tried to allocate" not in message  # its first sentence only
    for config, error in ((cuda_1_3b(gpu_memory_gib=None), oom), (cuda_1_3b(), WarmupFailed("warmup failed: bad")),
                          (cuda_1_3b(), RuntimeError("OutOfMemoryError named in another failure"))):
        with pytest.raises(RuntimeError) as passed:  # no cap, or another failure: as it was
            with refused_when_out_of_memory(config, lambda: None):
                raise error
        assert passed.value is error
