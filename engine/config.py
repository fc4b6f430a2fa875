"""The engine's configuration: one validated pydantic model.

The service's settings hold this as a nested model; the CLI builds it from
flags. Geometry that depends on the model (layers, heads, tokens per latent
frame) is *not* here: it is derived from the model config (see KVSpec).
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.models.presets import PRESETS, get_preset

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# Wan's VAE compresses 8x in space and the DiT patches 2x2 on top: 16-pixel alignment.
PIXEL_ALIGNMENT = 16

# Presets that ship no weights: without a model directory they would run on seeded random weights,
# which make noise (fine for benchmarks, never what a user means), so those must be asked for.
PRESETS_WITHOUT_WEIGHTS = frozenset({"wan2.1-1.3b"})

FP8_LINEAR = frozenset({"linear", "all"})  # fp8 values that convert the block linears
FP8_ATTENTION = frozenset({"attention", "all"})  # fp8 values that run self-attention through the FP8 kernel
FP8_MIN_CAPABILITY = (8, 9)
UMT5_XXL_WIDTH = 4096  # Wan's text encoder's d_model, the DiT's text_dim  # torch._scaled_mm's e4m3 GEMMs: Ada (8.9), Hopper (9.0) and newer


DECODE_KERNEL_CAPABILITY = (9, 0)  # Hopper: where the shifted-rows kernel was measured faster through the service


def auto_decode_convs(video_decoder: str, device: str, dtype: str, compile_decoder: bool,
                      capability: tuple[int, int] | None, triton_available: bool) -> str:
    """What ``decode_convs = auto`` runs: the shifted-rows kernel where it was measured faster than cuDNN
    through the service and as close to diffusers as diffusers' own compiled decode (bf16 on a Hopper GPU, the
    Wan VAE's compiled steady state: docs/DECODERS.md), cuDNN elsewhere. Never e4m3: that trades quality and is
    asked for. Pure, so the rule is checked without a GPU."""
    hopper = capability is not None and tuple(capability[:2]) == DECODE_KERNEL_CAPABILITY
    measured = video_decoder == "wan" and dtype == "bfloat16" and compile_decoder and hopper
    if measured and device.startswith("cuda") and triton_available:
        return "triton"
    return "cudnn"


def fp8_attention_refusal(value: str, device: str, capability: tuple[int, int] | None, interpreter: bool) -> str | None:
    """Why ``fp8 = value`` cannot run its attention kernel on ``device`` (``None``: it can, or it has none).

    ``capability``: the CUDA device's (ignored on the CPU); ``interpreter``: whether ``TRITON_INTERPRET=1``
    is set, the only way the kernel runs on a CPU (tests). Pure, so the rules are checked without a GPU.
    """
    if value not in FP8_ATTENTION:
        return None
    if importlib.util.find_spec("triton") is None:
        return f"fp8={value} needs Triton (the FP8 attention kernel), which is not installed"
    if device.startswith("cuda"):
        from engine.models.fp8_attention import ENGINE_MIN_CAPABILITY  # the kernel's own rule (Triton is there)

        if capability is not None and tuple(capability) < ENGINE_MIN_CAPABILITY:
            return (
                f"fp8={value} needs a Hopper GPU or newer (compute capability 9.0+) for the FP8 attention kernel; "
                f"this GPU is {capability[0]}.{capability[1]} (fp8=linear runs on 8.9+)"
            )
        return None
    if not interpreter:
        return (
            f"fp8={value} runs its FP8 attention kernel on a Hopper GPU (--device cuda); on the CPU only under the "
            f"Triton interpreter, for tests (TRITON_INTERPRET=1)"
        )
    return None


class EngineConfig(BaseModel):
    """Everything the engine needs to build its model, pools and scheduler."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    preset: Literal["tiny", "wan2.1-1.3b"] = "tiny"
    model_dir: Path | None = Field(
        default=None, description="local diffusers-layout model directory; its arstream.json fills fields not given"
    )
    causal_weights: Path | None = Field(
        default=None, description="original-format causal DiT weights (.safetensors or .pt) replacing transformer/'s"
    )
    device: str = "cpu"
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    fp8: Literal["off", "linear", "attention", "all"] = Field(
        default="off",
        description="FP8 (e4m3) for a bf16 DiT: linear: weights and activations of every block's per-forward linears "
        "(attention projections and FFN; the text K/V projections stay bf16); attention: self-attention through a "
        "Triton FP8 kernel (Q, K, V and P in e4m3; Hopper GPUs); all: both. Quality vs bf16: bench/fp8_quality.py "
        "(docs/FP8.md)",
    )
    fp8_fast_accum: bool | None = Field(
        default=None,
        description="with fp8=linear | all on CUDA: the FP8 products accumulate in the tensor cores' own precision, "
        "without promoting partial sums to float32 (cuBLAS's fast accumulation; unset: on with the FP8 linears). "
        "Error and speed: docs/FP8.md",
    )
    height: int | None = Field(default=None, ge=PIXEL_ALIGNMENT, le=2048, description="pixels; preset default if unset")
    width: int | None = Field(default=None, ge=PIXEL_ALIGNMENT, le=2048)
    fps: int = Field(default=16, ge=1, le=60)
    frames_per_block: int = Field(default=3, ge=1, le=16, description="latent frames per AR block")
    timesteps: list[float] = Field(default_factory=lambda: [1000.0, 750.0, 500.0, 250.0], min_length=1, max_length=50)
    shift: float = Field(default=5.0, gt=0)
    sink_frames: int = Field(default=3, ge=0, le=64, description="first committed latent frames kept forever")
    window_frames: int = Field(default=15, ge=1, le=256, description="most recent committed frames kept besides the sink")
    guidance_scale: float = Field(default=1.0, ge=1.0, le=20.0, description="CFG scale; > 1 runs a cond and an uncond KV branch")
    max_sessions: int = Field(default=4, ge=1, le=256)
    kv_memory_budget_bytes: int | None = Field(
        default=None, ge=1, description="bytes for per-session state; None: max_sessions decides"
    )
    seed: int = Field(default=0, ge=0, description="weight seed for random-weight presets")
    random_weights: bool = Field(
        default=False,
        description="seeded random weights instead of real ones (benchmarks; speed does not depend on weight values)",
    )
    audio: bool = Field(default=True, description="generate audio when the preset has it (tiny does)")
    step_mode: Literal["grouped", "stepwise"] = "grouped"
    lead_chunks: int = Field(
        default=2, ge=1, le=32,
        description="the most a session's lead (media made, not yet released) and work in flight hold, in blocks",
    )
    playout_margin_s: float = Field(
        default=0.15, ge=0.0, le=5.0,
        description="a paced session's media leaves this long before it plays on the viewer's clock (its jitter margin)",
    )
    media_granularity: Literal["latent_frame", "block"] = Field(
        default="latent_frame",
        description="what a paced session's chunk holds at the least: one latent frame's frames (4; they leave as "
                    "they are decoded) or a whole block's (best-effort sessions always get whole blocks)",
    )
    supersede: bool | None = Field(
        default=None,
        description="a soft or recache prompt change replaces media made ahead (the block made again from where the "
                    "viewer is) instead of waiting behind it; None: on where a session's decoder state is small "
                    "(<= 256 MiB: the tiny codec, TAEHV) or its kept copies fit an eighth of the GPU's memory (the Wan "
                    "VAE's 1.8 GiB per kept block on an 80 or 141 GB card, not in a 24 GiB mode)",
    )
    supersede_reserve: bool = Field(
        default=True,
        description="where prompt changes supersede the lead, a paced session keeps one block's device time more lead "
                    "than just in time needs, so a block can be made again whenever a change comes, also where a "
                    "block takes most of its playback (the standard config; docs/ENGINE.md); False: just in time",
    )
    cut_on_reset: bool = Field(
        default=True,
        description="a reset drops the media made ahead of the viewer and shows at once (False: after what was made)",
    )
    stop_block_on_restart: bool = Field(
        default=True,
        description="a reset (or a prompt change with policy reset) stops its session's block being queued between two "
                    "denoising forwards when the block's frames would be cut anyway and the media ahead covers the new "
                    "content's first block: the new content no longer waits for the rest of that block. Forwards are "
                    "then queued at most one ahead of the GPU (docs/ENGINE.md)",
    )
    split_first_block: bool | None = Field(
        default=None,
        description="send a session's first block as two chunks, its opening frame as soon as it is denoised "
        "(shorter time to first media); None: on CUDA",
    )
    blocks_in_flight: int | None = Field(
        default=None,
        ge=1,
        le=2,
        description="works a session may have dispatched to the device ahead of its delivered chunks: 2 queues "
        "block N+1 while the device still runs block N (the GPU never waits for the host between blocks); "
        "None: 2 on CUDA, 1 elsewhere",
    )
    overlap_encode: bool = Field(
        default=True,
        description="a session's next block may run while its previous chunk is encoded and sent "
        "(off: the next block waits until that chunk's media is on the wire)",
    )
    detach_grace_s: float = Field(default=30.0, ge=0, le=3600, description="a session without a socket lives this long")
    idle_timeout_s: float = Field(default=300.0, gt=0, le=86400, description="created or paused sessions close after this")
    max_session_s: float = Field(default=4 * 3600.0, gt=0, le=7 * 86400, description="hard cap on a session's life")
    cpu_threads: int | None = Field(default=None, ge=1, le=256, description="torch intra-op threads; None: every core up to 2, three quarters beyond (engine/cpu_threads.py)")
    warmup_blocks: int = Field(default=1, ge=0, le=16, description="throwaway blocks at start; they seed the block cost")
    video_decoder: Literal["wan", "taehv"] | None = Field(
        default=None,
        description="None: the preset's own codec (the tiny preset's TAEHV-class codec; the Wan VAE otherwise); "
        "wan: the full Wan VAE; taehv: the tiny TAEHV decoder (model_dir/taehv/taew2_1.*, or random weights with "
        "random_weights), many times faster, lower quality",
    )
    video_encoder: Literal["wan", "taehv"] | None = Field(
        default=None,
        description="whose encoder turns pictures and live input into latents. None: the decoder's kind (a Wan "
        "model streamed through TAEHV uses the TAEHV file's encoder half, or the Wan VAE's if the file has none); "
        "wan: the Wan VAE's (1.07 GiB of state per session at 832x480); taehv: the TAEHV encoder (a few MiB, "
        "many times faster, lower fidelity)",
    )
    cuda_graphs: bool = Field(
        default=True,
        description="on CUDA, replay each DiT forward shape and the text encoder (per padded prompt length) as CUDA "
        "graphs (captured at warm-up)",
    )
    gather_history_once: bool | None = Field(
        default=None,
        description="gather (and rotate) a block's attention history once for its forwards into a buffer of one "
        "session's whole context per KV branch (5.6 GiB for the standard 1.3B window at 832x480; the DiT "
        "forwards replay as CUDA graphs) instead of in every forward; None: on, except under gpu_memory_gib "
        "without FP8 attention (a small card keeps that memory for sessions); FP8 attention needs it",
    )
    batch_sessions: int = Field(
        default=1, ge=1, le=8,
        description="the most sessions whose plain blocks (no control, no live input, the same history length) run "
        "as one batch, one forward a step for all of them, each session's cost its share of the batch's; 1: each "
        "block alone. Each slot holds a gathered context and a commit staging slot (the fast 1.3B window: ~5.2 GiB "
        "a slot with FP8 attention). Paced sessions due within a block join a tick that runs another's block; a "
        "restart stops its session's block between two of the batch's steps (docs/ENGINE.md)",
    )
    compile_decoder: bool = Field(
        default=True, description="on CUDA, compile the video decoder's steady state (the warm-up compiles it)"
    )
    decode_convs: Literal["auto", "cudnn", "triton", "triton_fp8"] = Field(
        default="auto",
        description="the Wan VAE decoder's 3x3(x3) convolutions: cudnn (diffusers' conv3d), triton (one GEMM over "
        "shifted rows, decoders/shifted_rows_conv.py; CUDA), triton_fp8 (the same, the residual blocks' "
        "convolutions in e4m3; quality: docs/FP8.md); auto: triton in bf16 on a Hopper GPU with the compiled "
        "decode, else cudnn",
    )
    gpu_memory_gib: float | None = Field(
        default=None,
        gt=0,
        le=4096,
        description="on CUDA, the device memory the engine may use, in GiB, as on a card of that size: torch's "
        "allocator is capped at it less the CUDA context's allowance, the session pools are sized within it, the "
        "text encoder runs on the CPU (text_encoder_device=auto), and a configuration in which not even one "
        "session fits is refused at start-up (docs/MODELS.md)",
    )
    text_encoder_device: Literal["auto", "device", "cpu"] = Field(
        default="auto",
        description="where the text encoder runs: device = the engine's device; cpu = the CPU, new prompts encoded "
        "off the device thread and each prompt's embedding cached (its ~11 GB off a small card); auto = cpu when "
        "gpu_memory_gib is set, else device",
    )
    text_encode_in_background: bool | None = Field(
        default=None,
        description="encode a new prompt on its own thread as soon as it arrives and open the session (or change "
        "its prompt) once it is encoded, other sessions streaming meanwhile; None: when the text encoder is on "
        "the CPU beside a CUDA engine",
    )
    random_text_encoder: Literal["tiny", "umt5-xxl"] = Field(
        default="tiny",
        description="with random_weights: the text encoder to build: tiny = a seeded byte embedding; umt5-xxl = "
        "Wan's UMT5-XXL geometry with random weights (5.7 B parameters: a real model's memory and encode time, "
        "for benchmarks)",
    )
    realtime_admission: bool = Field(
        default=True, description="admit a live (paced) session only while every live session keeps real time"
    )
    realtime_headroom: float = Field(
        default=1.1, ge=1.0, le=100.0, description="live sessions' summed block cost x this must fit one block's playback time"
    )
    deadline_tolerance_s: float = Field(
        default=0.05, ge=0.0, le=5.0, description="a live chunk emitted this much after its playback time counts as a miss"
    )
    video_input: bool | None = Field(
        default=None,
        description="build the codec's encoder for pictures and live input (each session reserves its encoder state: "
        "1.07 GiB at 832x480 bf16 for the Wan VAE, 55 MiB for TAEHV's); off: pictures are refused (input_unsupported); "
        "None: on, except under gpu_memory_gib with the Wan VAE's encoder (a small card keeps that memory for sessions)",
    )
    live_input_fps: float = Field(
        default=30.0, gt=0, le=240, description="live input frames a session takes per second; more are dropped unread"
    )
    live_input_burst: int = Field(default=8, ge=1, le=240, description="live input frames taken at once above the rate")
    live_input_jitter_frames: int = Field(
        default=1, ge=0, le=1024,
        description="live frames beyond a block's own that may wait when it begins; older ones are dropped as stale "
        "(frames arrive as fast as blocks take them: a standing queue would delay every frame after it)",
    )
    live_input_buffer_frames: int | None = Field(
        default=None, ge=1, le=1024,
        description="decoded live frames waiting for blocks (the oldest dropped beyond); None: one block's frames + 4",
    )

    @model_validator(mode="before")
    @classmethod
    def _model_dir_settings(cls, data):
        """Fields not given (or given as None) take the model directory's arstream.json values, or, for a preset's
        shipped weights, the settings they are served with (``ModelPreset.weights_settings``)."""
        if not isinstance(data, dict):
            return data
        if data.get("model_dir") is not None:
            from engine.models.loading import with_model_settings

            return with_model_settings(data)
        preset = PRESETS.get(data.get("preset") or cls.model_fields["preset"].default)  # unknown: the field says so
        if preset is not None and preset.weights is not None and not data.get("random_weights"):
            data = {**data, **{key: value for key, value in preset.weights_settings.items() if data.get(key) is None}}
        return data

    @field_validator("device")
    @classmethod
    def _device_usable(cls, value: str) -> str:
        """A device this torch can run on, checked before anything is built."""
        try:
            device = torch.device(value)
        except (RuntimeError, ValueError):
            raise ValueError(f"device {value!r} is not a torch device; use cpu or cuda[:N]") from None
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device {value!r}: only cpu and cuda[:N] are supported")
        if device.type == "cuda":
            if torch.version.cuda is None:
                raise ValueError(f"device {value!r}: this torch {torch.__version__} is a CPU-only build; use --device cpu")
            if not torch.cuda.is_available():
                raise ValueError(f"device {value!r}: no CUDA device is visible to this process; use --device cpu")
            if device.index is not None and device.index >= torch.cuda.device_count():
                raise ValueError(f"device {value!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
        return value

    @field_validator("timesteps")
    @classmethod
    def _timesteps_descending(cls, value: list[float]) -> list[float]:
        if any(not 0 < t <= 1000 for t in value):
            raise ValueError("timesteps must lie in (0, 1000]")
        if any(a <= b for a, b in zip(value, value[1:])):
            raise ValueError("timesteps must be strictly descending")
        return value

    @model_validator(mode="after")
    def _check_size(self) -> "EngineConfig":
        for name in ("height", "width"):
            value = getattr(self, name)
            if value is not None and value % PIXEL_ALIGNMENT:
                raise ValueError(f"{name}={value} must be a multiple of {PIXEL_ALIGNMENT}")
        # bfloat16 runs on the CPU too (slowly): bf16 and FP8 numerics are checked there against the same weights.
        if self.dtype == "float16" and not self.device.startswith("cuda"):
            raise ValueError(f"dtype {self.dtype} needs a CUDA device; use float32 or bfloat16 on {self.device}")
        if self.gather_history_once is False and self.fp8 in FP8_ATTENTION:
            raise ValueError(
                f"fp8={self.fp8} attends through the gathered history's FP8 mirror: it needs gather_history_once"
            )
        if self.batch_sessions > 1 and (self.step_mode != "grouped" or not self.resolved_gather_history_once):
            raise ValueError(
                f"batch_sessions={self.batch_sessions} batches whole blocks over gathered contexts: it needs "
                f"step_mode=grouped and gather_history_once (got {self.step_mode}, "
                f"{self.resolved_gather_history_once})"
            )
        if self.fp8 != "off" and self.dtype != "bfloat16":
            raise ValueError(
                f"fp8={self.fp8} needs dtype=bfloat16 (FP8 quantizes a bf16 model's matrix products); "
                f"got dtype={self.dtype}"
            )
        if self.fp8_fast_accum is not None and self.fp8 not in FP8_LINEAR:
            raise ValueError(f"fp8_fast_accum is an option of the FP8 linears (fp8=linear | all); fp8={self.fp8}")
        capability = None
        if self.fp8 != "off" and self.device.startswith("cuda"):
            capability = torch.cuda.get_device_capability(self.device)
            if capability < FP8_MIN_CAPABILITY:
                raise ValueError(
                    f"fp8={self.fp8} needs a GPU with FP8 matrix units (compute capability 8.9+: Ada, Hopper or "
                    f"newer); {torch.cuda.get_device_name(self.device)} is {capability[0]}.{capability[1]}"
                )
        if self.fp8 in FP8_ATTENTION:
            refusal = fp8_attention_refusal(self.fp8, self.device, capability, os.environ.get("TRITON_INTERPRET") == "1")
            if refusal:
                raise ValueError(refusal)
        if self.decode_convs.startswith("triton") and self.resolved_video_decoder != "wan":
            raise ValueError(f"decode_convs={self.decode_convs} is the Wan VAE decoder's option; this config decodes "
                             f"with {self.resolved_video_decoder}")
        if self.decode_convs.startswith("triton") and not self.device.startswith("cuda"):
            raise ValueError(f"decode_convs={self.decode_convs} runs on CUDA; got device={self.device} (use auto or cudnn)")
        if self.decode_convs.startswith("triton") and importlib.util.find_spec("triton") is None:
            raise ValueError(f"decode_convs={self.decode_convs} needs Triton, which is not installed (use auto or cudnn)")
        for field in ("video_decoder", "video_encoder"):  # the Wan VAE asked for where there is none
            if getattr(self, field) == "wan" and self.model_dir is None and get_preset(self.preset).vae_config is None:
                raise ValueError(
                    f"preset {self.preset} has no Wan VAE (its codec is a TAEHV-class encoder and decoder); "
                    f"{field}=wan needs a Wan preset or a model directory"
                )
        if self.video_encoder == "taehv" and self.wan_model and self.resolved_video_decoder != "taehv":
            raise ValueError("video_encoder=taehv reads the TAEHV file's encoder half: it needs video_decoder=taehv")
        if self.gpu_memory_gib is not None and not self.device.startswith("cuda"):
            raise ValueError(f"gpu_memory_gib caps a CUDA device's memory; this engine runs on {self.device}")
        if self.random_text_encoder != "tiny":
            text_dim = get_preset(self.preset).transformer_config.get("text_dim")
            if not self.random_weights or self.model_dir is not None or text_dim != UMT5_XXL_WIDTH:
                raise ValueError(
                    f"random_text_encoder={self.random_text_encoder} is for the random weights of a preset whose DiT "
                    f"reads {UMT5_XXL_WIDTH}-wide text (wan2.1-1.3b with random_weights, no model_dir)"
                )
        if self.causal_weights is not None and self.model_dir is None:
            raise ValueError("causal_weights needs model_dir (the VAE, text encoder and transformer config come from it)")
        if self.preset in PRESETS_WITHOUT_WEIGHTS and self.model_dir is None and not self.random_weights:
            raise ValueError(
                f"preset {self.preset} ships no weights: give a model directory (--model DIR, "
                "ARSTREAM_ENGINE__MODEL_DIR; docs/MODELS.md), or ask for seeded random weights explicitly "
                "(--random-weights, ARSTREAM_ENGINE__RANDOM_WEIGHTS=true; benchmarks only: the output is noise)"
            )
        return self

    @property
    def splits_first_block(self) -> bool:
        if self.split_first_block is None:
            return self.device.startswith("cuda")
        return self.split_first_block

    @property
    def resolved_blocks_in_flight(self) -> int:
        if self.blocks_in_flight is None:
            return 2 if self.device.startswith("cuda") else 1
        return self.blocks_in_flight

    @property
    def resolved_decode_convs(self) -> str:
        """``decode_convs`` with ``auto`` resolved (:func:`auto_decode_convs`; asks CUDA for the card's
        compute capability)."""
        if self.decode_convs != "auto":
            return self.decode_convs
        cuda = self.device.startswith("cuda") and torch.cuda.is_available()
        return auto_decode_convs(self.resolved_video_decoder, self.device, self.dtype, self.compile_decoder,
                                 torch.cuda.get_device_capability(self.device) if cuda else None,
                                 importlib.util.find_spec("triton") is not None)

    @property
    def resolved_fp8_fast_accum(self) -> bool:
        """Fast accumulation in the FP8 linears: as set, else on wherever there are FP8 linears."""
        return self.fp8 in FP8_LINEAR if self.fp8_fast_accum is None else self.fp8_fast_accum

    @property
    def resolved_video_decoder(self) -> str:
        """The video decoder sessions stream through: the one asked for, else the model's own."""
        if self.video_decoder is not None:
            return self.video_decoder
        return "wan" if self.model_dir is not None else get_preset(self.preset).video_codec

    @property
    def wan_model(self) -> bool:
        """A Wan model (a model directory, or a preset without a codec of its own): its pictures are encoded by the
        Wan VAE or by the TAEHV file's encoder half, never by the tiny preset's codec."""
        return self.model_dir is not None or get_preset(self.preset).codec_encoder is None

    @property
    def resolved_video_input(self) -> bool:
        """On unless turned off, or under ``gpu_memory_gib`` with the Wan VAE's encoder (its 1.07 GiB of state per
        session at 832x480 is a session's worth on a small card; TAEHV's few MiB are not)."""
        if self.video_input is not None:
            return self.video_input
        return self.gpu_memory_gib is None or self._video_encoder_kind() == "taehv"

    @property
    def resolved_video_encoder(self) -> str | None:
        """Whose encoder makes a session's input latents: "wan", a Wan model's own VAE; "taehv", the TAEHV
        encoder (the tiny preset's codec, or the published Wan2.1 TAEHV file's encoder half where a Wan model
        streams through TAEHV: its latents are the ones that decoder reads); None with video input off. Without
        a choice, the decoder's kind; but a model directory whose TAEHV file has no encoder half gets the Wan VAE's."""
        return self._video_encoder_kind() if self.resolved_video_input else None

    def _video_encoder_kind(self) -> str:
        if self.video_encoder is not None:
            return self.video_encoder
        if self.resolved_video_decoder == "taehv" and self.model_dir is not None and not self.random_weights:
            from decoders.taehv_encoder import model_dir_has_taehv_encoder

            return "taehv" if model_dir_has_taehv_encoder(self.model_dir) else "wan"
        return self.resolved_video_decoder

    @property
    def resolved_gather_history_once(self) -> bool:
        if self.gather_history_once is not None:
            return self.gather_history_once
        return self.gpu_memory_gib is None or self.fp8 in FP8_ATTENTION

    @property
    def resolved_live_input_buffer_frames(self) -> int:
        """A block's frames plus one latent frame's: input jitter up to a latent frame drops nothing, and the
        input's latency stays near one block."""
        if self.live_input_buffer_frames is not None:
            return self.live_input_buffer_frames
        return 4 * self.frames_per_block + 4

    @property
    def resolved_text_encoder_device(self) -> str:
        """The device the text encoder runs on."""
        if self.text_encoder_device == "cpu" or (self.text_encoder_device == "auto" and self.gpu_memory_gib is not None):
            return "cpu"
        return self.device

    @property
    def resolved_text_encode_in_background(self) -> bool:
        if self.text_encode_in_background is not None:
            return self.text_encode_in_background
        return self.resolved_text_encoder_device == "cpu" and self.device.startswith("cuda")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def resolved_height(self) -> int:
        return self.height or get_preset(self.preset).height

    @property
    def resolved_width(self) -> int:
        return self.width or get_preset(self.preset).width

    @property
    def kv_branch_names(self) -> tuple[str, ...]:
        return ("cond", "uncond") if self.guidance_scale > 1.0 else ("cond",)
