"""Host memory for the engine on the CPU: what is available, and whether one session fits at all.

On CUDA the engine sizes its pools from free device memory after a measured warm-up. On the CPU
nothing measures for it, so a budget from ``max_sessions`` alone can ask for far more than the
machine has (4 sessions of the 1.3B geometry in float32 are ~41 GB). Two checks use the memory the
kernel says is available (``MemAvailable``: free plus reclaimable page cache):

- :func:`check_fits_in_memory`, *before anything is built*: the weights plus one session's KV state,
  estimated from configs and file headers without allocating a tensor, must fit, else the entry
  point refuses with one line;
- :func:`cpu_session_budget`, *after the build*: the bytes left for session state, keeping a reserve
  for activations, the encoders and the rest of the process; the engine takes
  ``min(max_sessions, budget // per_session_bytes)`` sessions.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.models.presets import get_preset

# Kept free on the CPU besides session state: activations of a step (attention over the context),
# the media encoders, Python and the allocator's slack.
CPU_RESERVE_FRACTION = 0.25
CPU_RESERVE_MIN_BYTES = 1 * 2**30
VAE_SPATIAL_COMPRESSION = 8  # Wan2.1's VAE; the preflight estimate only needs it approximately


class InsufficientMemory(ValueError):
    """The machine cannot hold the model and one session; raised before anything is allocated."""


def available_memory_bytes() -> int | None:
    """``MemAvailable`` from /proc/meminfo (Linux), else free physical pages; None if unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def cpu_session_budget(available: int | None = None) -> int | None:
    """Bytes of session state the CPU can hold now, after the reserve (None if memory is unknown)."""
    available = available_memory_bytes() if available is None else available
    if available is None:
        return None
    reserve = max(CPU_RESERVE_MIN_BYTES, int(CPU_RESERVE_FRACTION * available))
    return max(0, available - reserve)


def check_fits_in_memory(config: EngineConfig, available: int | None = None) -> None:
    """Refuse (``InsufficientMemory``) a CPU engine whose weights plus one session cannot fit.

    Estimates only (no tensor is allocated): weights from the preset's configs on the meta device or
    the model directory's safetensors headers; one session's self- and cross-attention KV from the
    geometry, and its video decoder state where the decoder knows its VAE's figure. The engine sizes
    its slots from the exact per-session bytes after the build.
    """
    if torch.device(config.device).type != "cpu":
        return
    available = available_memory_bytes() if available is None else available
    if available is None:
        return
    weights = estimate_weight_bytes(config)
    session = estimate_kv_session_bytes(config) + estimate_decoder_session_bytes(config)
    budget = cpu_session_budget(available - weights)
    if budget is None or budget < session:
        raise InsufficientMemory(
            f"not enough memory for preset {config.preset} at {config.resolved_width}x{config.resolved_height} "
            f"on the CPU: weights ~{_gib(weights)} + one session ~{_gib(session)} (+ reserve) > "
            f"{_gib(available)} available; use a GPU (--device cuda), a smaller --height/--width or --window-frames"
        )


def estimate_weight_bytes(config: EngineConfig) -> int:
    """Bytes the model's weights take in the engine's dtype."""
    element = torch.empty((), dtype=config.torch_dtype).element_size()
    if config.model_dir is not None:
        return _model_dir_elements(config) * element
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    from decoders.taehv import TAEHVDecoder

    preset = get_preset(config.preset)
    with torch.device("meta"):
        codec = AutoencoderKLWan(**preset.vae_config) if preset.vae_config is not None else TAEHVDecoder(preset.codec_decoder)
        modules = [WanTransformer3DModel(**preset.transformer_config), codec]
    return sum(p.numel() for module in modules for p in module.parameters()) * element + estimate_text_encoder_bytes(config)


def estimate_text_encoder_bytes(config: EngineConfig) -> int:
    """The text encoder's weights in the engine's dtype (0 for the tiny presets' host-side lookups)."""
    element = torch.empty((), dtype=config.torch_dtype).element_size()
    if config.model_dir is not None:
        files = sorted((Path(config.model_dir) / "text_encoder").glob("*.safetensors"))
        return sum(_safetensors_elements(f) for f in files) * element
    if config.random_text_encoder == "umt5-xxl":
        from engine.models.random_text import UMT5_XXL, parameter_bytes

        return parameter_bytes(UMT5_XXL, config.torch_dtype)
    return 0


def check_text_encoder_fits_host(config: EngineConfig, available: int | None = None) -> None:
    """A text encoder that runs on the CPU beside a GPU engine must fit in the host's memory."""
    if torch.device(config.device).type == "cpu" or config.resolved_text_encoder_device != "cpu":
        return  # a CPU engine's own check counts it with the rest
    available = available_memory_bytes() if available is None else available
    needed = estimate_text_encoder_bytes(config)
    if available is not None and needed and available - needed < CPU_RESERVE_MIN_BYTES:
        raise InsufficientMemory(
            f"the text encoder on the CPU needs ~{_gib(needed)} of host memory (+ {_gib(CPU_RESERVE_MIN_BYTES)} "
            f"reserve), {_gib(available)} available; use --text-encoder device (with room for it on the GPU)"
        )


def meta_wan_vae(config: EngineConfig):
    """The config's Wan VAE on the meta device (shapes only, nothing allocated), from its preset or its model
    directory's ``vae/config.json``; None when that file cannot be read (the loader names it)."""
    from diffusers import AutoencoderKLWan

    vae_config = get_preset(config.preset).vae_config
    if config.model_dir is not None:
        try:
            vae_config = json.loads((Path(config.model_dir) / "vae" / "config.json").read_text())
        except (OSError, ValueError):
            return None
    with torch.device("meta"):
        return AutoencoderKLWan.from_config(vae_config)


def estimate_decoder_session_bytes(config: EngineConfig) -> int:
    """One session's streaming Wan-VAE decoder state and, with video input on, its Wan-VAE encoder state (a Wan
    model's pictures are encoded by its VAE whichever decoder streams them), from the VAE's config on the meta
    device (0 for neither, or when the model directory's VAE config cannot be read: the loader names it)."""
    from decoders.video import WanStreamingDecoder

    wan_decoder = config.resolved_video_decoder == "wan"
    wan_encoder = config.resolved_video_encoder == "wan"
    if not wan_decoder and not wan_encoder:
        return 0  # TAEHV's state is small next to the KV; the engine sizes its slots from the exact figure
    vae = meta_wan_vae(config)
    if vae is None:
        return 0
    with torch.device("meta"):
        decoder = WanStreamingDecoder(vae, fast_path=False)
    # A VAE without a recorded figure is measured by a decode that, on the meta device, only propagates shapes.
    size = (config.resolved_height, config.resolved_width, config.torch_dtype)
    total = decoder.declared_state_bytes(*size) if wan_decoder else 0
    if wan_encoder:  # every session reserves its live-input encoder state too
        from decoders.video_encode import WanStreamingEncoder

        total += WanStreamingEncoder(vae).declared_state_bytes(*size)
    return total


def estimate_kv_session_bytes(config: EngineConfig) -> int:
    """One session's resident self-attention KV plus its text cross-attention KV, every branch."""
    transformer = _transformer_config(config)
    heads, head_dim = transformer["num_attention_heads"], transformer["attention_head_dim"]
    layers = transformer["num_layers"]
    _, patch_h, patch_w = transformer.get("patch_size", (1, 2, 2))
    tokens_per_frame = (config.resolved_height // VAE_SPATIAL_COMPRESSION // patch_h) * (
        config.resolved_width // VAE_SPATIAL_COMPRESSION // patch_w
    )
    element = torch.empty((), dtype=config.torch_dtype).element_size()
    per_token = layers * 2 * heads * head_dim * element
    text_len = get_preset(config.preset).text_len
    resident = config.sink_frames + config.window_frames
    return len(config.kv_branch_names) * (resident * tokens_per_frame + text_len) * per_token


def _transformer_config(config: EngineConfig) -> dict:
    if config.model_dir is not None:
        path = Path(config.model_dir) / "transformer" / "config.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            pass  # the loader reports a bad directory with the file named; estimate with the preset
    return get_preset(config.preset).transformer_config


def _model_dir_elements(config: EngineConfig) -> int:
    """Tensor elements the loader will read: transformer (or the causal weights), VAE, text encoder."""
    root = Path(config.model_dir)
    parts = ["vae", "text_encoder"] + ([] if config.causal_weights is not None else ["transformer"])
    elements = sum(_safetensors_elements(file) for part in parts for file in sorted((root / part).glob("*.safetensors")))
    if config.causal_weights is not None:
        causal = Path(config.causal_weights)
        if causal.suffix == ".safetensors":
            elements += _safetensors_elements(causal)
        elif causal.is_file():
            elements += causal.stat().st_size // 2  # a pickle: assume 16-bit tensors
    return elements


def _safetensors_elements(path: Path) -> int:
    """Elements in a safetensors file, from its JSON header alone (no tensor is read)."""
    try:
        with open(path, "rb") as file:
            (header_len,) = struct.unpack("<Q", file.read(8))
            if header_len > 100 * 2**20:
                return 0
            header = json.loads(file.read(header_len))
    except (OSError, ValueError, struct.error):
        return 0  # the loader reports unreadable files with their names
    total = 0
    for name, entry in header.items():
        if name == "__metadata__" or not isinstance(entry, dict):
            continue
        count = 1
        for size in entry.get("shape", []):
            count *= int(size)
        total += count
    return total


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
