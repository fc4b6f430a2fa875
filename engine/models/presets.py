"""Model presets: the module configs each preset builds, and its default frame size.

Geometry (layers, heads, tokens per latent frame) is derived from these configs
everywhere else; nothing downstream writes those numbers as literals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from decoders.taehv import TAEHVConfig
from decoders.taehv_encoder import TAEHVEncoderConfig

# The embedded default: the same architecture class as Wan2.1 at toy size, so it
# runs live on a 2-core CPU. Its shipped weights were trained on the procedural
# world (world/, train/, docs/TINY_MODEL.md); random_weights gives seeded ones.
# Width and depth: 2 layers of 2 heads stopped learning (its loss flat over two training rounds); 3 layers of
# 4 heads with an FFN of 512 learned the world and streams ~33 frames/s on the 2-core CPU (docs/BENCHMARKS.md).
TINY_TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 4,
    "attention_head_dim": 32,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 32,
    "freq_dim": 32,
    "ffn_dim": 512,
    "num_layers": 3,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 1024,
}

# The tiny preset's video codec: a TAEHV-class encoder and decoder (decoders/taehv_encoder.py,
# decoders/taehv.py) in Wan2.1's latent geometry (16 channels, 8x spatial, 4x temporal), with a colour
# shortcut: latent channels 0-2 carry each 8x8 cell's mean colour, which the decoder adds back. Plain
# convs and ReLUs, no normalisation layer. Why not the toy Wan VAE below (sessions 1-5): its colour has
# to be learned through ~20 layers, 4-channel RMS norms and an output clamp, and in every GPU run it came
# out as one grey-purple tint (docs/TINY_MODEL.md). Decoder widths: decode cost on the 2-core CPU
# (docs/BENCHMARKS.md).
TINY_CODEC_DECODER = TAEHVConfig(widths=(64, 32, 16, 8), colour_shortcut=True)
TINY_CODEC_ENCODER = TAEHVEncoderConfig(widths=(16, 32, 48, 64), colour_shortcut=True)

# diffusers AutoencoderKLWan at toy size: 8x spatial, 4x temporal compression; decoder
# channels 16/16/8/4 from the latent level up to full resolution. The tiny preset's codec until
# session 5; now the toy Wan VAE of the tests and the CPU decode bench (the Wan decoder's fast path).
# num_res_blocks must stay >= 1: with 0 the encoder's resample convs get the wrong channel count.
TINY_VAE_CONFIG: dict[str, Any] = {
    "base_dim": 4,
    "z_dim": 16,
    "dim_mult": [1, 2, 4, 4],
    "num_res_blocks": 1,
    "attn_scales": [],
    "temperal_downsample": [False, True, True],
}

# diffusers AutoencoderOobleck (Stable Audio's codec family) at toy size: hop 2*2*5*5*6 = 600
# samples (12.5 ms at 48 kHz), which divides the 3000 samples of a 16 fps video frame, so a
# 3-latent-frame AR block carries 60 audio latent frames. Decoder width 8 (was 2 with random
# weights): enough to learn clean tones from the world's sound features; a block's window
# (84 latent frames) decodes in ~20-50 ms on one core of the 2-core CPU (~7-18 ms at width 2).
TINY_AUDIO_VAE_CONFIG: dict[str, Any] = {
    "encoder_hidden_size": 4,
    "downsampling_ratios": [2, 2, 5, 5, 6],
    "channel_multiples": [1, 2, 4, 4, 8],
    "decoder_channels": 8,
    "decoder_input_channels": 8,
    "audio_channels": 2,
    "sampling_rate": 48000,
}

# Stable Audio Open's Oobleck widths with a hop that divides 3000: 2*3*5*5*10 = 1500 (the
# original [2, 4, 4, 8, 8] = 2048 does not). For decode benchmarks with random weights.
STABLE_AUDIO_SIZED_VAE_CONFIG: dict[str, Any] = {
    "encoder_hidden_size": 128,
    "downsampling_ratios": [2, 3, 5, 5, 10],
    "channel_multiples": [1, 2, 4, 8, 16],
    "decoder_channels": 128,
    "decoder_input_channels": 64,
    "audio_channels": 2,
    "sampling_rate": 48000,
}

# Wan2.1-T2V-1.3B geometry (random weights unless a model directory is given).
WAN_1_3B_TRANSFORMER_CONFIG: dict[str, Any] = {
    "patch_size": (1, 2, 2),
    "num_attention_heads": 12,
    "attention_head_dim": 128,
    "in_channels": 16,
    "out_channels": 16,
    "text_dim": 4096,
    "freq_dim": 256,
    "ffn_dim": 8960,
    "num_layers": 30,
    "cross_attn_norm": True,
    "qk_norm": "rms_norm_across_heads",
    "eps": 1e-6,
    "rope_max_seq_len": 1024,
}

# diffusers' AutoencoderKLWan defaults are the Wan2.1 VAE.
WAN_2_1_VAE_CONFIG: dict[str, Any] = {}


@dataclass(frozen=True)
class ModelPreset:
    """What a preset builds and the frame size it runs at unless told otherwise."""

    name: str
    transformer_config: dict[str, Any]
    vae_config: dict[str, Any] | None  # an AutoencoderKLWan config, when the preset's codec is a Wan VAE
    height: int
    width: int
    text_len: int = 512
    audio_vae_config: dict[str, Any] | None = None  # an AutoencoderOobleck config when the preset has audio
    weights: str | None = None  # shipped weights under engine/models/weights/ (engine.models.trained); None: seeded random
    # EngineConfig fields the shipped weights are served with unless set (what a model directory's arstream.json
    # is to its weights); not applied to random_weights.
    weights_settings: dict[str, Any] = field(default_factory=dict)
    # "wan": the Wan VAE (vae_config) or, when asked, a TAEHV decoder of Wan2.1's latents;
    # "taehv": the preset's own TAEHV-class codec (codec_decoder / codec_encoder), always.
    video_codec: Literal["wan", "taehv"] = "wan"
    codec_decoder: TAEHVConfig | None = None
    codec_encoder: TAEHVEncoderConfig | None = None
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


PRESETS: dict[str, ModelPreset] = {
    "tiny": ModelPreset(
        name="tiny",
        transformer_config=TINY_TRANSFORMER_CONFIG,
        vae_config=None,
        height=144,
        width=256,
        audio_vae_config=TINY_AUDIO_VAE_CONFIG,
        weights="tiny",
        # Trained with blocks of 3 latent frames, served with 2: every check of tests/test_tiny_model.py holds, and a
        # control waits for at most a 0.5 s block instead of 0.75 s (docs/ENGINE.md, "The lead").
        weights_settings={"frames_per_block": 2},
        video_codec="taehv",
        codec_decoder=TINY_CODEC_DECODER,
        codec_encoder=TINY_CODEC_ENCODER,
        notes="toy-size Wan2.1-class model trained on a procedural world (shapes, colours, motion, sound); "
        "random_weights gives the seeded random model",
    ),
    "wan2.1-1.3b": ModelPreset(
        name="wan2.1-1.3b",
        transformer_config=WAN_1_3B_TRANSFORMER_CONFIG,
        vae_config=WAN_2_1_VAE_CONFIG,
        height=480,
        width=832,
        notes="Wan2.1-T2V-1.3B geometry; real weights only from a local model directory",
    ),
}


def get_preset(name: str) -> ModelPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; known presets: {sorted(PRESETS)}") from None
