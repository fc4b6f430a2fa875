"""Build the model bundle the runner drives, from the engine's config.

This is the engine's job, not the model code's: the modules under ``engine/models/`` take plain values
(sizes, dtypes, paths) and never see :class:`~engine.config.EngineConfig`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from diffusers import AutoencoderKLWan, AutoencoderOobleck, WanTransformer3DModel

from decoders.audio import AudioStreamingDecoder, hop_length
from decoders.audio_graphs import AudioDecodeGraphs
from decoders.taehv import TAEHVStreamingDecoder, find_taehv_weights, random_taehv, taehv_decoder_from_model_dir
from decoders.taehv_encoder import WAN_TAEHV_ENCODER, TAEHVStreamingEncoder, load_taehv_encoder, random_taehv_encoder
from decoders.video import WanStreamingDecoder
from decoders.video_encode import WanStreamingEncoder
from engine.config import FP8_ATTENTION, FP8_LINEAR, EngineConfig
from engine.models.audio_tokens import AudioTiming, AudioTokenProjections
from engine.models.causal_wan import CausalWanTransformer
from engine.models.dtypes import cast_keeping_fp32_modules
from engine.models.fp8_linear import FP8Conversion, quantize_linears
from engine.models.loading import load_model_dir
from engine.models.pipeline import CausalWanPipeline
from engine.models.presets import ModelPreset, get_preset
from engine.models.random_text import random_umt5_text_encoder
from engine.models.rope import ROPE_THETA
from engine.models.schedule import shifted_sigmas
from engine.models.text_encoder import TinyTextEncoder
from engine.models.trained import TrainedWeights, trained_weights

log = logging.getLogger("arstream.bundle")


@dataclass
class ModelBundle:
    preset: ModelPreset
    pipeline: CausalWanPipeline
    decoder: VideoDecoder
    height: int
    width: int
    audio_decoder: AudioStreamingDecoder | None = None
    audio_timing: AudioTiming | None = None
    fp8: FP8Conversion | None = None  # what --fp8 linear / all converted; None otherwise
    # The codec's encoder half for pictures and live input; None where it has none (a decode-only TAEHV).
    encoder: VideoEncoder | None = None

    @property
    def audio_channels(self) -> int | None:
        return None if self.audio_decoder is None else self.audio_decoder.channels


def build_models(config: EngineConfig) -> ModelBundle:
    """Everything the runner drives, on ``config.device`` in ``config.dtype``; nothing is downloaded."""
    preset = get_preset(config.preset)
    device = torch.device(config.device)
    height, width = config.resolved_height, config.resolved_width
    trained = None
    if config.model_dir is not None:
        # A local model directory (+ causal weights): its configs decide the geometry, the preset only the frame size.
        loaded = load_model_dir(
            config.model_dir,
            device=device,
            dtype=config.torch_dtype,
            causal_weights=config.causal_weights,
            text_len=preset.text_len,
            text_encoder_graphs=config.cuda_graphs,
            text_encoder_device=config.resolved_text_encoder_device,
        )
        transformer, vae, text_encoder = loaded.transformer, loaded.vae, loaded.text_encoder
    else:
        trained = trained_weights(preset.weights, config.random_weights)
        with torch.device(device):
            torch.manual_seed(config.seed)
            transformer = WanTransformer3DModel(**preset.transformer_config)
            vae = None
            if preset.vae_config is not None:
                torch.manual_seed(config.seed + 1)
                vae = AutoencoderKLWan(**preset.vae_config)
        if trained:
            trained.load("transformer", transformer)
        transformer = cast_keeping_fp32_modules(transformer, config.torch_dtype).eval()
        if vae is not None:
            vae = cast_keeping_fp32_modules(vae, config.torch_dtype).eval()
        if trained:
            text_encoder = trained.text_encoder()
        elif config.random_text_encoder == "umt5-xxl":
            text_encoder = random_umt5_text_encoder(
                config.resolved_text_encoder_device, config.torch_dtype, text_len=preset.text_len,
                seed=config.seed + 5, cuda_graphs=config.cuda_graphs,
            )
        else:
            text_encoder = TinyTextEncoder(transformer.config.text_dim, preset.text_len, seed=config.seed)
    fp8 = _quantize_dit(transformer, config)
    audio = None
    if config.model_dir is None:
        audio = _build_audio(preset, config, transformer.config, trained)
    decoder = _video_decoder(config, preset, vae, trained)
    encoder = _video_encoder(config, preset, vae, trained)
    scale = decoder.spatial_upscale  # pixels per latent pixel, from the decoder's own config
    if height % scale or width % scale:
        raise ValueError(f"{width}x{height} is not a multiple of the codec's {scale}x spatial compression")
    causal = CausalWanTransformer(
        transformer,
        latent_height=height // scale,
        latent_width=width // scale,
        audio=audio[0] if audio else None,
        fp8_attention=config.fp8 in FP8_ATTENTION,
        # bf16 keeps every fused step bit-identical to eager; the FP8 modes (judged by their quality delta
        # against bf16) also take the steps that round differently (docs/ENGINE.md).
        exact_kernels=config.fp8 == "off",
        rope_spatial_theta=trained.rope_spatial_theta() if trained else ROPE_THETA,
    )
    pipeline = CausalWanPipeline(
        causal,
        text_encoder,
        sigmas=shifted_sigmas(config.timesteps, config.shift),
        frames_per_block=config.frames_per_block,
        sink_frames=config.sink_frames,
        window_frames=config.window_frames,
        guidance_scale=config.guidance_scale,
        gather_history_once=config.resolved_gather_history_once,
        cuda_graphs=config.cuda_graphs,
        text_encode_in_background=config.resolved_text_encode_in_background,
        batch_slots=config.batch_sessions,
    )
    if causal.fp8_attention:
        mirror_bytes = sum(workspace.fp8.nbytes for workspace in pipeline.context_kv.values())
        log.info("fp8 attention", extra={"fp8_mirror_bytes": mirror_bytes, "branches": len(pipeline.context_kv)})
    return ModelBundle(
        preset=preset,
        pipeline=pipeline,
        decoder=decoder,
        height=height,
        width=width,
        audio_decoder=audio[1] if audio else None,
        audio_timing=audio[2] if audio else None,
        fp8=fp8,
        encoder=encoder,
    )


def _quantize_dit(transformer: WanTransformer3DModel, config: EngineConfig) -> FP8Conversion | None:
    """``fp8 = linear | all``: the DiT blocks' per-forward linears to FP8, on the cast, loaded weights (docs/FP8.md).

    (``attention`` converts no weights: its kernel is switched on in the :class:`CausalWanTransformer`.)"""
    if config.fp8 not in FP8_LINEAR:
        return None
    conversion = quantize_linears(transformer.blocks, fast_accum=config.resolved_fp8_fast_accum)
    log.info(
        "fp8 linears",
        extra={"layers_converted": conversion.converted, "weight_bytes_saved": conversion.bytes_saved,
               "kept_bf16": conversion.kept, "fast_accum": config.resolved_fp8_fast_accum},
    )
    return conversion


VideoDecoder = WanStreamingDecoder | TAEHVStreamingDecoder  # the same streaming interface


def checked_decode_convs(asked: str, resolved: str, device: str, dtype: torch.dtype) -> str:
    """``resolved``, except that a kernel ``auto`` chose and that fails its self-check here (a Triton build or a
    card it does not run on) falls back to cuDNN, with the reason logged; a kernel asked for by name is kept,
    and fails loudly at the warm-up if it cannot run."""
    if asked != "auto" or not resolved.startswith("triton"):
        return resolved
    from decoders.shifted_rows_conv import self_check

    reason = self_check(device, dtype)
    if reason is None:
        return resolved
    log.warning("decode_convs auto: the shifted-rows kernel failed its self-check; decoding with cuDNN",
                extra={"reason": reason})
    return "cudnn"


def _video_decoder(
    config: EngineConfig, preset: ModelPreset, vae: AutoencoderKLWan | None, trained: TrainedWeights | None
) -> VideoDecoder:
    """The configured streaming video decoder; compiled steady state on CUDA unless switched off.

    ``vae``: the Wan VAE (a model directory's, or a Wan preset's random one), None for a preset with its
    own TAEHV-class codec; ``trained``: the preset's shipped weights, or None.
    """
    compile_steady = config.compile_decoder and torch.device(config.device).type == "cuda"
    kind = config.resolved_video_decoder
    if kind == "wan":
        convs = checked_decode_convs(config.decode_convs, config.resolved_decode_convs, config.device,
                                     config.torch_dtype)
        decoder = WanStreamingDecoder(vae, compile_steady_state=compile_steady, conv_kernel=convs.startswith("triton"),
                                      conv_kernel_fp8=convs == "triton_fp8")
        log.info("wan video decoder", extra={"decode_convs": convs, "asked": config.decode_convs,
                                             "kernel_convs": decoder.kernel_convs,
                                             "compiled_steady_state": compile_steady})
        return decoder
    if config.model_dir is not None and not config.random_weights:
        return taehv_decoder_from_model_dir(
            config.model_dir, config.device, config.torch_dtype, compile_frames=compile_steady
        )
    if preset.codec_decoder is None:  # a Wan preset with random weights, asked for TAEHV
        model = random_taehv(config.seed + 4, device=config.device, dtype=config.torch_dtype)
        return TAEHVStreamingDecoder(model, compile_frames=compile_steady)
    model = random_taehv(config.seed + 1, config=preset.codec_decoder)
    if trained is None:
        return TAEHVStreamingDecoder(model.to(config.device, config.torch_dtype), compile_frames=compile_steady)
    trained.load_codec_half(model)
    return TAEHVStreamingDecoder(
        model.to(config.device, config.torch_dtype), compile_frames=compile_steady, **trained.latent_stats()
    )


VideoEncoder = WanStreamingEncoder | TAEHVStreamingEncoder  # the same streaming interface


def _video_encoder(config: EngineConfig, preset: ModelPreset, vae: AutoencoderKLWan | None, trained) -> VideoEncoder | None:
    """The encoder whose latents the configured decoder reads (``EngineConfig.resolved_video_encoder``): the Wan
    VAE's, the TAEHV file's encoder half for a Wan model streamed through TAEHV, the tiny codec's encoder half for
    the tiny preset; None with video input off or without a VAE (the engine then refuses pictures clearly)."""
    kind = config.resolved_video_encoder
    if kind is None:
        return None
    if kind == "wan":
        return WanStreamingEncoder(vae) if vae is not None else None
    if config.wan_model:  # the TAEHV file's encoder half
        if config.model_dir is not None and not config.random_weights:
            model = load_taehv_encoder(find_taehv_weights(config.model_dir), config.device, config.torch_dtype)
        else:
            model = random_taehv_encoder(config.seed + 5, WAN_TAEHV_ENCODER, config.device, config.torch_dtype)
        return TAEHVStreamingEncoder(model)
    model = random_taehv_encoder(config.seed + 5, preset.codec_encoder)
    if trained is None:
        return TAEHVStreamingEncoder(model.to(config.device, config.torch_dtype))
    trained.load_codec_half(model)
    return TAEHVStreamingEncoder(model.to(config.device, config.torch_dtype), **trained.latent_stats())


def _build_audio(preset: ModelPreset, config: EngineConfig, transformer_config, trained=None):
    """The preset's audio path (token projections, streaming codec decoder, timing), or None without audio."""
    if not config.audio or preset.audio_vae_config is None:
        return None
    device = torch.device(config.device)
    inner_dim = transformer_config.num_attention_heads * transformer_config.attention_head_dim
    with torch.device(device):
        torch.manual_seed(config.seed + 2)
        vae = AutoencoderOobleck(**preset.audio_vae_config)
    if trained:
        trained.load("audio_vae", vae)
    vae = cast_keeping_fp32_modules(vae, config.torch_dtype).eval()
    timing = AudioTiming(sample_rate=vae.config.sampling_rate, fps=config.fps, hop=hop_length(vae))
    with torch.device(device):
        torch.manual_seed(config.seed + 3)
        projections = AudioTokenProjections(vae.config.decoder_input_channels, inner_dim, timing.tokens_per_frame)
    if trained:
        trained.load("audio_tokens", projections)
    projections = projections.to(config.torch_dtype).eval()
    graphs = AudioDecodeGraphs(vae) if device.type == "cuda" else None
    return projections, AudioStreamingDecoder(vae, graphs=graphs), timing
