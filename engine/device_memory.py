"""Device memory on CUDA under ``gpu_memory_gib``: what must fit, the allocator's cap, and the refusal.

``gpu_memory_gib`` runs the engine as on a card of that size: torch's caching allocator is capped at it less
the CUDA context (which lives outside the allocator), the session pools are sized from what is left under the
cap after the warm-up measured the activation peak (``engine/startup.py``), and the text encoder runs on the
CPU unless asked otherwise (its weights are the largest part a session can do without on the device).

What one engine holds on the device, for the 1.3B model at 832x480, standard window, bf16 (the figures are
worked out from the geometry by :func:`estimate_device_memory`; docs/MODELS.md tabulates them)::

    weights       DiT + video decoder                       resident
    text encoder  UMT5-XXL, only where it runs on the device
    workspace     the gathered context per KV branch (+ its FP8 mirror) and the commit staging
    session       KV blocks, text K/V, decoder state, latents  x capacity (at least one)
    reserve       the CUDA context, cuBLAS/cuDNN workspaces, the activation peak (measured after the build)

Before anything is built, :func:`check_fits_on_device` refuses a cap that cannot hold the resident parts and
one session even before activations (one line, exit 2); after the warm-up the measured activation peak decides
the capacity, and a cap that then holds no session is refused there with the same figures (exit 3).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import FP8_ATTENTION, EngineConfig
from engine.memory import (
    InsufficientMemory,
    _safetensors_elements,
    _transformer_config,
    estimate_decoder_session_bytes,
    estimate_kv_session_bytes,
    estimate_text_encoder_bytes,
    meta_wan_vae,
)
from engine.models.presets import get_preset

GIB = 2**30
CUDA_CONTEXT_BYTES = GIB // 2  # the context and its kernels' code: outside torch's allocator, inside the card
DEVICE_RESERVE_BYTES = 2 * GIB  # cuBLAS/cuDNN workspaces, graph pools, allocator slack (kept free besides sessions)
VAE_SPATIAL_COMPRESSION = 8
FP8_V_ROW_ALIGN = 16  # the FP8 mirror's V rows (engine/models/fp8_attention.py V_ROW_ALIGN)


@dataclass(frozen=True)
class DeviceMemoryEstimate:
    """Bytes each part of one engine holds on the device (estimates from configs; nothing allocated)."""

    weights: int  # DiT and video decoder in the engine's dtype
    text_encoder: int  # its weights: on the device only where it runs there
    text_encoder_on_device: bool
    workspace: int  # gathered context per branch (+ FP8 mirror) and commit staging
    session: int  # one session's KV blocks, text K/V, decoder state and latents
    reserve: int = CUDA_CONTEXT_BYTES + DEVICE_RESERVE_BYTES  # before the measured activation peak

    @property
    def resident(self) -> int:
        """What the engine holds whatever its sessions: weights, the text encoder if on the device, workspaces."""
        return self.weights + (self.text_encoder if self.text_encoder_on_device else 0) + self.workspace

    def sessions_fitting(self, limit: int, activation_peak: int = 0) -> int:
        """Sessions a card of ``limit`` bytes holds beside the resident parts, the reserve and ``activation_peak``."""
        return max(0, (limit - self.resident - self.reserve - activation_peak) // self.session)

    def describe(self) -> str:
        text = (f"text encoder {_gib(self.text_encoder)} on the device" if self.text_encoder_on_device
                else "text encoder on the CPU")
        return (f"weights {_gib(self.weights)}, {text}, workspaces {_gib(self.workspace)}, "
                f"one session {_gib(self.session)}, reserve {_gib(self.reserve)}")


def allocator_limit_bytes(config: EngineConfig) -> int | None:
    """The cap on torch's allocator for ``gpu_memory_gib`` (the card's size less the CUDA context), or None."""
    if config.gpu_memory_gib is None:
        return None
    return int(config.gpu_memory_gib * GIB) - CUDA_CONTEXT_BYTES


def estimate_device_memory(config: EngineConfig) -> DeviceMemoryEstimate:
    """Each part's bytes on the device, from the preset's or the model directory's configs."""
    dit = _transformer_config(config)
    element = torch.empty((), dtype=config.torch_dtype).element_size()
    layers, heads, head_dim = dit["num_layers"], dit["num_attention_heads"], dit["attention_head_dim"]
    _, patch_h, patch_w = dit.get("patch_size", (1, 2, 2))
    tokens_per_frame = (config.resolved_height // VAE_SPATIAL_COMPRESSION // patch_h) * (
        config.resolved_width // VAE_SPATIAL_COMPRESSION // patch_w)
    branches = len(config.kv_branch_names)
    context_tokens = (config.sink_frames + config.window_frames + config.frames_per_block) * tokens_per_frame
    workspace = 0
    if config.resolved_gather_history_once:  # ContextKV, per branch
        workspace += branches * layers * 2 * context_tokens * heads * head_dim * element
    if config.fp8 in FP8_ATTENTION:  # its e4m3 mirror (docs/FP8.md)
        padded = -(-context_tokens // FP8_V_ROW_ALIGN) * FP8_V_ROW_ALIGN
        workspace += branches * (layers * heads * head_dim * (context_tokens + padded) + 16 * layers * heads)
    frame_bytes = layers * 2 * tokens_per_frame * heads * head_dim * element
    workspace += branches * config.frames_per_block * frame_bytes  # the commit staging
    workspace += get_preset(config.preset).text_len * layers * 2 * heads * head_dim * element  # the spare text slot
    session = estimate_kv_session_bytes(config) + estimate_decoder_session_bytes(config)
    latent_frame = 4 * dit.get("in_channels", 16) * tokens_per_frame * patch_h * patch_w
    session += (config.sink_frames + config.window_frames + 2 * config.frames_per_block) * latent_frame
    return DeviceMemoryEstimate(
        weights=_weights_bytes(config, element),
        text_encoder=estimate_text_encoder_bytes(config),
        text_encoder_on_device=config.resolved_text_encoder_device != "cpu",
        workspace=workspace,
        session=session,
    )


def check_fits_on_device(config: EngineConfig, device_total_bytes: int | None = None) -> None:
    """Refuse (:class:`InsufficientMemory`) a ``gpu_memory_gib`` the device does not have, or one that cannot
    hold the resident parts and one session even before the activation peak. ``device_total_bytes``: the
    device's memory (asked of CUDA when not given)."""
    if config.gpu_memory_gib is None:
        return
    gib = config.gpu_memory_gib
    if device_total_bytes is None:
        device_total_bytes = torch.cuda.get_device_properties(torch.device(config.device)).total_memory
    if gib * GIB > device_total_bytes:
        raise InsufficientMemory(
            f"gpu_memory_gib {gib:g}: the device has {_gib(device_total_bytes)}; give at most that"
        )
    estimate = estimate_device_memory(config)
    if estimate.sessions_fitting(int(gib * GIB)) < 1:
        raise InsufficientMemory(refusal(config, estimate))


def refusal(config: EngineConfig, estimate: DeviceMemoryEstimate, activation_peak: int | None = None,
            out_of_memory: str | None = None) -> str:
    """Why ``gpu_memory_gib`` holds no session, with every figure and what would make room. ``out_of_memory``:
    the allocator's own message where the build's probe or warm-up ran out of memory under the cap."""
    measured = "" if activation_peak is None else f", the measured activation peak {_gib(activation_peak)}"
    if out_of_memory is not None:
        measured += f"; the warm-up ran out of memory under the cap ({out_of_memory.split('. ')[0]})"
    hints = ["a smaller --window-frames", "--height/--width"]
    if config.resolved_video_decoder == "wan":
        hints.insert(1, "the TAEHV decoder (ARSTREAM_ENGINE__VIDEO_DECODER=taehv)")
    if estimate.text_encoder_on_device and estimate.text_encoder:
        hints.insert(0, "--text-encoder cpu")
    if config.fp8 in FP8_ATTENTION and config.gpu_memory_gib is not None:  # it keeps the gathered context
        hints.insert(0, "FP8 attention off (it needs the gathered context and its FP8 mirror)")
    return (
        f"gpu_memory_gib {config.gpu_memory_gib:g} holds not even one session at "
        f"{config.resolved_width}x{config.resolved_height}: {estimate.describe()}{measured}; "
        f"try {', '.join(hints)}, or a larger card"
    )


def _weights_bytes(config: EngineConfig, element: int) -> int:
    """DiT and video decoder (the text encoder apart), in the engine's dtype; with the shifted-rows kernel, its
    packed copy of the Wan decoder's convolution weights too."""
    return _model_weights_bytes(config, element) + _packed_conv_bytes(config)


def _packed_conv_bytes(config: EngineConfig) -> int:
    convs = config.resolved_decode_convs
    if config.resolved_video_decoder != "wan" or not convs.startswith("triton"):
        return 0
    from decoders.shifted_rows_conv import packed_weight_bytes

    vae = meta_wan_vae(config)
    if vae is None:
        return 0
    return packed_weight_bytes(vae.decoder, fp8=convs == "triton_fp8", element_size=config.torch_dtype.itemsize)


def _model_weights_bytes(config: EngineConfig, element: int) -> int:
    if config.model_dir is not None:
        root = Path(config.model_dir)
        elements = sum(_safetensors_elements(f) for f in sorted((root / "vae").glob("*.safetensors")))
        if config.causal_weights is not None:
            causal = Path(config.causal_weights)
            elements += _safetensors_elements(causal) if causal.suffix == ".safetensors" else causal.stat().st_size // 2
        else:
            elements += sum(_safetensors_elements(f) for f in sorted((root / "transformer").glob("*.safetensors")))
        return elements * element
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    from decoders.taehv import TAEHVDecoder

    preset = get_preset(config.preset)
    with torch.device("meta"):
        modules = [WanTransformer3DModel(**preset.transformer_config)]
        # The Wan VAE stays loaded when it decodes, or encodes the input for another decoder.
        if preset.vae_config is not None and "wan" in (config.resolved_video_decoder, config.resolved_video_encoder):
            modules.append(AutoencoderKLWan(**preset.vae_config))
        elif preset.codec_decoder is not None:
            modules.append(TAEHVDecoder(preset.codec_decoder))
    return sum(p.numel() for module in modules for p in module.parameters()) * element


def _gib(n: int) -> str:
    return f"{n / GIB:.2f} GiB"

