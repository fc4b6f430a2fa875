"""Streaming TAEHV decode: a tiny causal decoder for Wan2.1 latents, with the causal memory owned by the session.

TAEHV ("Tiny AutoEncoder for Hunyuan Video", Ollin Boer Bohan, MIT licence) has a decoder for Wan2.1's
latent space (16 channels, 8x spatial, 4x temporal compression) built from 2-D convs only. It trades
some fidelity (softer detail, more flicker) for a decode that costs a small fraction of the Wan VAE's.
Its authors publish the weights as ``taew2_1.pth``; this module builds the same network under the same
state-dict names, so that file loads as it is (its ``encoder.*`` half is ignored).

Layer list for the Wan2.1 widths (256, 128, 64, 64); ``i`` is the key prefix ``decoder.{i}.``::

    0 soft clamp   1 conv 16->256   2 ReLU
    3-5   memory blocks (256)   6  upsample x2   7  grow x1 (1x1 conv)   8  conv 256->128
    9-11  memory blocks (128)   12 upsample x2   13 grow x2              14 conv 128->64
    15-17 memory blocks (64)    18 upsample x2   19 grow x2              20 conv 64->64
    21 ReLU   22 conv 64->3     then clamp to [0, 1]

A memory block sees its input frame and the input it saw one frame earlier at the same depth (zeros
before the first): that previous input is the whole causal state, 9 tensors per session. A grow layer
turns one frame into ``stride`` frames (output channel group ``g`` is frame ``g``), so one latent frame
becomes 1 -> 1 -> 2 -> 4 frames through the three stages.

Frame arithmetic (4x temporal)::

    latent frames     f0          | f1          | f2 ...
    decoder frames    r0 r1 r2 r3 | r4 r5 r6 r7 | ...
    kept              .  .  .  r3 | r4 r5 r6 r7 |      the first 3 are start-up frames: 4T - 3, then 4T

which lines the output up with the Wan VAE's (its first latent frame also gives 1 pixel frame).

Latent space: TAEHV was trained on the latents the diffusion model produces, normalised with the Wan
VAE's ``latents_mean`` / ``latents_std``; it applies no shift or scale of its own. So
:meth:`TAEHVStreamingDecoder.denormalize` is the identity, where the Wan VAE's undoes the normalisation
(the tiny preset's own TAEHV-class codec, trained here, passes its latent statistics instead).

Every latent frame goes through the decoder alone, so every kernel sees the same shapes however a
session is chunked: chunked decode equals one-call decode bit for bit. Inside one latent frame the 2
frames of the last stage go through each memory block together (the second one's "previous input" is
the first one's input, known before the block runs), which is the same function as one at a time.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from decoders.latent_stats import LatentStats
from decoders.video import frames_to_uint8, frames_to_uint8_tensor

log = logging.getLogger("arstream.taehv")

# Where load_taehv looks in a model directory, in order (see docs/DECODERS.md).
TAEHV_SUBFOLDER = "taehv"
TAEHV_WEIGHT_NAMES = ("taew2_1.safetensors", "taew2_1.pth")
_SHOWN_KEYS = 4


@dataclass(frozen=True)
class TAEHVConfig:
    """The decoder's geometry; the defaults are the Wan2.1 decoder of the published ``taew2_1`` weights."""

    latent_channels: int = 16
    widths: tuple[int, int, int, int] = (256, 128, 64, 64)  # stage 0, 1, 2 and the final conv's input
    blocks_per_stage: int = 3
    time_upscale: tuple[bool, bool, bool] = (False, True, True)  # a 2x grow after stage i
    space_upscale: tuple[bool, bool, bool] = (True, True, True)  # a 2x upsample after stage i
    patch_size: int = 1  # pixel-shuffle factor of the output (1 for Wan2.1)
    image_channels: int = 3
    # Add latent channels 0-2, upsampled, to the output pixels (the tiny codec's; see colour_shortcut()).
    colour_shortcut: bool = False

    def __post_init__(self) -> None:
        if len(self.widths) != 4 or min(self.widths) <= 0:
            raise ValueError(f"widths must be 4 positive channel counts, got {self.widths}")
        if len(self.time_upscale) != 3 or len(self.space_upscale) != 3:
            raise ValueError("time_upscale and space_upscale need one flag per stage (3)")
        if self.latent_channels <= 0 or self.blocks_per_stage <= 0 or self.patch_size <= 0:
            raise ValueError("latent_channels, blocks_per_stage and patch_size must be positive")

    @property
    def frames_per_latent(self) -> int:
        return 2 ** sum(self.time_upscale)

    @property
    def spatial_upscale(self) -> int:
        return 2 ** sum(self.space_upscale) * self.patch_size

    def stage_scales(self) -> list[int]:
        """Each stage's resolution as a multiple of the latent's (1, 2, 4 for Wan2.1)."""
        return [2 ** sum(self.space_upscale[:stage]) for stage in range(3)]


# Tiny widths for CPU tests and toy presets: same layer list, same frame arithmetic.
TINY_TAEHV_CONFIG = TAEHVConfig(widths=(8, 8, 4, 4))


def colour_shortcut(latent: torch.Tensor, scale: int) -> torch.Tensor:
    """``[n, C, h, w]`` latents -> ``[n, 3, scale h, scale w]``: channels 0-2 as a nearest-upsampled RGB image.

    The tiny codec's encoder writes each latent cell's mean colour into these channels and its decoder
    adds them back to its output (a space-to-channel shortcut, as DC-AE's residual autoencoding): a
    flat background's colour passes through by construction, and the convs learn only the detail
    (edges, shapes, motion) on top.
    """
    return F.interpolate(latent[:, :3], scale_factor=scale, mode="nearest")


# ---------------------------------------------------------------------------
# The network


def _conv3x3(channels_in: int, channels_out: int, *, bias: bool = True) -> nn.Conv2d:
    return nn.Conv2d(channels_in, channels_out, 3, padding=1, bias=bias)


class SoftClamp(nn.Module):
    """``3 tanh(x / 3)``: keeps out-of-range latents from driving the first conv to extremes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x / 3) * 3


class MemoryBlock(nn.Module):
    """Residual 3-conv block over ``[frame, previous frame's input]`` stacked on channels."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        # Attribute names and Sequential indices are the published checkpoint's keys (conv.0/2/4).
        self.conv = nn.Sequential(
            _conv3x3(2 * channels, channels), nn.ReLU(), _conv3x3(channels, channels), nn.ReLU(),
            _conv3x3(channels, channels),
        )
        self.skip = nn.Identity()  # every decoder block keeps its width, so the skip has no weights
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor, past: torch.Tensor) -> torch.Tensor:
        return self.act(self.conv(torch.cat([x, past], 1)) + self.skip(x))

    def stream(self, x: torch.Tensor, previous: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Frames ``x`` (``[T, C, h, w]``) that follow ``previous`` (the stage's input one frame earlier; None,
        zeros, at a stream's start) -> the block's output and the memory to carry: ``x``'s last frame."""
        if previous is None:
            previous = torch.zeros_like(x[:1])
        past = torch.cat([previous, x[:-1]]) if x.shape[0] > 1 else previous
        # A slice of a multi-frame input would keep all its frames resident: copy the last one.
        kept = x[-1:].clone() if x.shape[0] > 1 else x
        return self(x, past), kept


class TemporalGrow(nn.Module):
    """1x1 conv to ``stride`` channel groups, each group one output frame (earliest first)."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(channels, channels * stride, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        frames, channels, height, width = x.shape
        grown = self.conv(x)
        if self.stride == 1:
            return grown
        # [n, s*C, H, W] -> [n*s, C, H, W]: frame n*s + g is channel group g of input frame n.
        return grown.unflatten(1, (self.stride, channels)).flatten(0, 1)


class TAEHVDecoder(nn.Module):
    """TAEHV's decoder as a plain module; ``state_dict()`` keys are ``decoder.{i}.…`` as published.

    :meth:`decode_latent_frame` is a pure function of one latent frame and the memory blocks' previous
    inputs; it owns no per-stream state.
    """

    def __init__(self, config: TAEHVConfig = TAEHVConfig()) -> None:
        super().__init__()
        self.config = config
        widths = config.widths
        layers: list[nn.Module] = [SoftClamp(), _conv3x3(config.latent_channels, widths[0]), nn.ReLU()]
        for stage in range(3):
            layers += [MemoryBlock(widths[stage]) for _ in range(config.blocks_per_stage)]
            layers += [
                nn.Upsample(scale_factor=2 if config.space_upscale[stage] else 1),
                TemporalGrow(widths[stage], 2 if config.time_upscale[stage] else 1),
                _conv3x3(widths[stage], widths[stage + 1], bias=False),
            ]
        layers += [nn.ReLU(), _conv3x3(widths[3], config.image_channels * config.patch_size**2)]
        self.decoder = nn.Sequential(*layers)
        self.memory_block_count = sum(isinstance(layer, MemoryBlock) for layer in self.decoder)

    def decode_latent_frame(
        self, latent: torch.Tensor, memory: list[torch.Tensor | None], *, channels_last: bool = False
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``[1, C, h, w]`` + memory -> ``[frames_per_latent, 3, H, W]`` in ``[0, 1]`` and the new memory.

        ``memory[k]``: the ``k``-th memory block's input at the previous frame of its stage, or ``None``
        (zeros) at the start of a stream. The old list is not modified.
        """
        x = latent.contiguous(memory_format=torch.channels_last) if channels_last else latent
        new_memory: list[torch.Tensor] = []
        for layer in self.decoder:
            if isinstance(layer, MemoryBlock):
                x, kept = layer.stream(x, memory[len(new_memory)])
                new_memory.append(kept)
            else:
                x = layer(x)
                if channels_last and isinstance(layer, TemporalGrow):
                    x = x.contiguous(memory_format=torch.channels_last)  # the frame split copies to NCHW
        if self.config.patch_size > 1:
            x = F.pixel_shuffle(x, self.config.patch_size)
        if self.config.colour_shortcut:
            x = x + colour_shortcut(latent, self.config.spatial_upscale)
        return x.clamp(0.0, 1.0), new_memory

    def decode_video(self, latents: torch.Tensor, *, clamp: bool = True) -> torch.Tensor:
        """``[B, C, N, h, w]`` -> ``[B, 3, 4N - 3, H, W]`` in ``[-1, 1]``: whole clips, every frame at once.

        The function a fresh session's streaming decode computes (a memory block's past is its input one
        frame earlier, zeros first; the start-up frames are dropped), batched, with gradients: what
        training and the checks run. ``clamp=False`` leaves the output unclamped: a clamp passes no
        gradient to an output beyond it, so a pixel that overshoots there would stay stuck.
        """
        x = latents.transpose(1, 2)  # [B, N, C, h, w]
        batch, count = x.shape[:2]
        for layer in self.decoder:
            if isinstance(layer, MemoryBlock):
                past = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
                flat = layer(x.flatten(0, 1), past.flatten(0, 1))
            else:  # a grow layer turns frame n of the flat batch into frames n*s .. n*s + s - 1, in order
                flat = layer(x.flatten(0, 1))
            x = flat.view(batch, -1, *flat.shape[1:])
        if self.config.patch_size > 1:
            shuffled = F.pixel_shuffle(x.flatten(0, 1), self.config.patch_size)
            x = shuffled.view(batch, -1, *shuffled.shape[1:])
        if self.config.colour_shortcut:  # every frame grown from a latent gets that latent's colours
            shortcut = colour_shortcut(latents.transpose(1, 2).flatten(0, 1), self.config.spatial_upscale)
            x = x + shortcut.view(batch, count, *shortcut.shape[1:]).repeat_interleave(self.config.frames_per_latent, dim=1)
        frames = x[:, self.config.frames_per_latent - 1 :].transpose(1, 2)
        if clamp:
            frames = frames.clamp(0.0, 1.0)
        return frames * 2 - 1


# ---------------------------------------------------------------------------
# Streaming over sessions


@dataclass
class TAEHVDecodeState:
    """One session's causal memory: each memory block's input at the previous frame of its stage.

    It cannot be rebuilt from anything else: releasing it ends the stream, and the next decode starts a
    new one (with its 3 start-up frames dropped again).
    """

    session_id: str
    memory: list[torch.Tensor | None]
    owner: object = field(repr=False, compare=False)
    frames_decoded: int = 0  # latent frames
    chunks_decoded: int = 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.memory if t is not None)

    @property
    def started(self) -> bool:
        return self.frames_decoded > 0

    def release(self) -> None:
        self.memory = [None] * len(self.memory)
        self.frames_decoded = 0
        self.chunks_decoded = 0


class TAEHVStreamingDecoder:
    """Streaming decode over a :class:`TAEHVDecoder`, one state per session; the interface of ``WanStreamingDecoder``.

    ``channels_last``: run the convs on NHWC tensors (default on CUDA, where cuDNN's bf16 convs prefer
    it). ``compile_frames``: ``torch.compile`` the per-frame function for frames after a session's
    first (whose memory is all zeros, a different input); a failed compile falls back to eager for good.
    """

    def __init__(
        self,
        model: TAEHVDecoder,
        *,
        channels_last: bool | None = None,
        compile_frames: bool = False,
        latents_mean: list[float] | None = None,
        latents_std: list[float] | None = None,
    ) -> None:
        if not isinstance(model, TAEHVDecoder):
            raise TypeError(f"TAEHVStreamingDecoder needs a TAEHVDecoder, got {type(model).__name__}")
        config = model.config
        # The engine and the protocol are built on Wan2.1's geometry: 4 frames per latent, 8x8 pixels.
        if config.frames_per_latent != 4 or config.spatial_upscale != 8:
            raise ValueError(
                f"TAEHV config upscales {config.frames_per_latent}x in time and {config.spatial_upscale}x in space; "
                "streaming Wan2.1 latents needs 4x and 8x"
            )
        self.model = model.eval()
        parameter = next(model.parameters())
        self.device = parameter.device
        self.dtype = parameter.dtype
        self.channels_last = self.device.type == "cuda" if channels_last is None else bool(channels_last)
        self.startup_frames = config.frames_per_latent - 1
        self._latent_stats = LatentStats.optional(latents_mean, latents_std, config.latent_channels)
        self._compiled = None
        if compile_frames:
            self._compiled = torch.compile(
                functools.partial(model.decode_latent_frame, channels_last=self.channels_last), dynamic=False
            )
        self.compile_failed = False

    @property
    def spatial_upscale(self) -> int:
        """Output pixels per latent pixel along each side."""
        return self.model.config.spatial_upscale

    # -- session lifecycle -------------------------------------------------

    def new_state(self, session_id: str) -> TAEHVDecodeState:
        if not isinstance(session_id, str) or not session_id:
            raise ValueError("session_id must be a non-empty string")
        return TAEHVDecodeState(session_id=session_id, memory=[None] * self.model.memory_block_count, owner=self)

    def release(self, state: TAEHVDecodeState) -> None:
        self._check_owner(state)
        state.release()

    # -- decode ------------------------------------------------------------

    def denormalize(self, latents: torch.Tensor) -> torch.Tensor:
        """Model-space latents -> the decoder's latent space.

        The identity for the published TAEHV weights (trained on the model's normalised latents); the
        tiny codec's latents were normalised per channel for its DiT, and are scaled back here.
        """
        return latents if self._latent_stats is None else self._latent_stats.denormalize(latents)

    @torch.inference_mode()
    def decode_chunk(self, latents: torch.Tensor, state: TAEHVDecodeState) -> torch.Tensor:
        """Decode ``latents`` as the continuation of ``state``'s session; advances ``state``.

        ``latents``: ``[1, 16, T, h, w]`` model-space latents. Returns ``[1, 3, T', 8h, 8w]`` in
        ``[-1, 1]``, ``T' = 4T``, or ``4T - 3`` when the chunk opens the session. The state advances
        one latent frame at a time, so after an error it is consistent but the chunk is part-decoded:
        release it.
        """
        self._check_owner(state)
        config = self.model.config
        if latents.ndim != 5:
            raise ValueError(f"latents must be [1, C, T, h, w]; got shape {tuple(latents.shape)}")
        if latents.shape[0] != 1:
            raise ValueError(f"one session per call: batch must be 1, got {latents.shape[0]}")
        if latents.shape[1] != config.latent_channels:
            raise ValueError(f"latents must have {config.latent_channels} channels, got {latents.shape[1]}")
        if latents.shape[2] == 0:
            raise ValueError("latents carry no frames")

        latents = latents.to(self.device, self.dtype)
        pixel_frames = []
        for index in range(latents.shape[2]):
            frames, state.memory = self._decode_frame(latents[:, :, index].contiguous(), state)
            if not state.started:
                frames = frames[self.startup_frames :]
            pixel_frames.append(frames)
            state.frames_decoded += 1
        state.chunks_decoded += 1
        # [T', 3, H, W] in [0, 1] -> [1, 3, T', H, W] in [-1, 1]
        out = torch.cat(pixel_frames).permute(1, 0, 2, 3).unsqueeze(0)
        return out.mul(2.0).sub(1.0).contiguous()

    def _decode_frame(self, latent: torch.Tensor, state: TAEHVDecodeState):
        if self._compiled is not None and not self.compile_failed and state.started:
            try:
                return self._compiled(latent, state.memory)
            except Exception:
                self.compile_failed = True
                log.warning("compiled TAEHV decode unavailable; decoding eagerly", exc_info=True)
        return self.model.decode_latent_frame(latent, state.memory, channels_last=self.channels_last)

    to_uint8 = staticmethod(frames_to_uint8)
    to_uint8_tensor = staticmethod(frames_to_uint8_tensor)  # on the device: the runner copies it without a wait

    # -- admission ---------------------------------------------------------

    def declared_state_bytes(self, height: int, width: int, dtype: torch.dtype) -> int:
        """Resident memory bytes of one session at this output size, once it has decoded a frame.

        Exact, from the geometry: each memory block holds one frame of its stage's width at its
        stage's resolution (for Wan2.1, 3 x (256 at 1/8 + 128 at 1/4 + 64 at 1/2 of each side)
        = 84 values per output pixel).
        """
        config = self.model.config
        upscale = config.spatial_upscale
        if height <= 0 or width <= 0 or height % upscale or width % upscale:
            raise ValueError(f"height and width must be positive multiples of {upscale}; got {height}x{width}")
        latent_pixels = (height // upscale) * (width // upscale)
        values = sum(
            config.blocks_per_stage * config.widths[stage] * latent_pixels * scale**2
            for stage, scale in enumerate(config.stage_scales())
        )
        return values * torch.empty((), dtype=dtype).element_size()

    def _check_owner(self, state: TAEHVDecodeState) -> None:
        if not isinstance(state, TAEHVDecodeState):
            raise ValueError(f"expected a TAEHVDecodeState, got {type(state).__name__}")
        if state.owner is not self:
            raise ValueError(f"decode state of session {state.session_id!r} belongs to another decoder")


# ---------------------------------------------------------------------------
# Weights


class TAEHVWeightsError(ValueError):
    """A TAEHV weights file that cannot be loaded; the message names the file and the keys."""


def random_taehv(
    seed: int = 0,
    config: TAEHVConfig = TAEHVConfig(),
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> TAEHVDecoder:
    """A decoder with seeded random weights (benchmarks, tests); the global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TAEHVDecoder(config)
    return model.to(device, dtype).eval()


def find_taehv_weights(model_dir: str | Path) -> Path:
    """``MODEL_DIR/taehv/taew2_1.safetensors``, else ``MODEL_DIR/taehv/taew2_1.pth``."""
    folder = Path(model_dir) / TAEHV_SUBFOLDER
    for name in TAEHV_WEIGHT_NAMES:
        if (folder / name).is_file():
            return folder / name
    raise TAEHVWeightsError(f"{folder}: no TAEHV weights (expected {' or '.join(TAEHV_WEIGHT_NAMES)})")


def taehv_decoder_from_model_dir(
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    **options,
) -> TAEHVStreamingDecoder:
    """The streaming decoder over the model directory's TAEHV weights (``options``: channels_last, compile_frames)."""
    return TAEHVStreamingDecoder(load_taehv(find_taehv_weights(model_dir), device, dtype), **options)


def load_taehv(
    path: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    config: TAEHVConfig = TAEHVConfig(),
) -> TAEHVDecoder:
    """The decoder with the weights of a local ``.pth`` / ``.safetensors`` file; never downloads.

    The file's ``decoder.*`` tensors must match the config's decoder exactly (no missing, unknown or
    mis-shaped key); its ``encoder.*`` half, as in the published files, is ignored. A ``.pth`` is only
    read with ``torch.load(weights_only=True)``.
    """
    path = Path(path)
    tensors = _read_state_dict(path)
    model = TAEHVDecoder(config)
    expected = model.state_dict()
    decoder_tensors = {key: value for key, value in tensors.items() if key.startswith("decoder.")}
    unknown = sorted(key for key in tensors if not key.startswith(("decoder.", "encoder.")))
    unknown += sorted(key for key in decoder_tensors if key not in expected)
    missing = sorted(key for key in expected if key not in decoder_tensors)
    _fit_grow_weights(model, decoder_tensors)
    check_tensors(path, f"a TAEHV decoder with widths {config.widths}", decoder_tensors, expected, missing, unknown)
    model.load_state_dict({key: decoder_tensors[key] for key in expected}, strict=True)
    log.info("TAEHV weights loaded", extra={"path": str(path), "dtype": str(dtype)})
    return model.to(device, dtype).eval()


def check_tensors(path: Path, what: str, tensors: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                  missing: list[str], unknown: list[str]) -> None:
    """Raise one :class:`TAEHVWeightsError` naming the file and every problem (missing and unknown keys as the
    caller found them, tensors of another shape or not floating point), or return when there is none."""
    wrong_shape = sorted(
        f"{key} {tuple(tensors[key].shape)} (expected {tuple(value.shape)})"
        for key, value in expected.items()
        if key in tensors and tensors[key].shape != value.shape
    )
    not_float = sorted(f"{key} ({value.dtype})" for key, value in tensors.items() if not value.is_floating_point())
    problems = [
        f"{len(keys)} {label}: {_show(keys)}"
        for keys, label in (
            (missing, "missing key(s)"),
            (unknown, "unknown key(s)"),
            (wrong_shape, "key(s) of another shape"),
            (not_float, "non-float tensor(s)"),
        )
        if keys
    ]
    if problems:
        raise TAEHVWeightsError(f"{path}: not {what}: " + "; ".join(problems))


def _fit_grow_weights(model: TAEHVDecoder, tensors: dict[str, torch.Tensor]) -> None:
    """A grow layer trained at a larger stride than the config's keeps its last frame's channels.

    This is how TAEHV's authors run a checkpoint with a temporal upsample switched off; it matters
    only for such files.
    """
    for index, layer in enumerate(model.decoder):
        key = f"decoder.{index}.conv.weight"
        if not isinstance(layer, TemporalGrow) or key not in tensors:
            continue
        stored, wanted = tensors[key], layer.conv.weight
        if stored.ndim == 4 and stored.shape[1:] == wanted.shape[1:] and stored.shape[0] > wanted.shape[0]:
            if stored.shape[0] % wanted.shape[0] == 0:
                tensors[key] = stored[-wanted.shape[0] :]


def _torch_load_mapped(path: Path):
    """``torch.load(weights_only=True)``, memory-mapped where the file allows (the zip format): the start-up's
    encoder-half check and the decoder's and encoder's loads of one file then each read only the tensors they use,
    not the whole file three times. A legacy (non-zip) file is read whole."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as error:
        if "mmap can only be used" not in str(error):
            raise
    return torch.load(path, map_location="cpu", weights_only=True)


def _read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise TAEHVWeightsError(f"TAEHV weights {path}: no such file")
    suffix = path.suffix.lower()
    if suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path), device="cpu")
        except (SafetensorError, OSError) as error:
            raise TAEHVWeightsError(f"TAEHV weights {path}: cannot be read as safetensors ({error})") from error
    if suffix not in (".pth", ".pt"):
        raise TAEHVWeightsError(
            f"TAEHV weights {path}: unknown file type {suffix or '(none)'}; use .safetensors or .pth"
        )
    try:
        loaded = _torch_load_mapped(path)
    except Exception as error:  # an unpickler refusal, a truncated file: one message naming the file
        raise TAEHVWeightsError(
            f"TAEHV weights {path}: cannot be read with torch.load(weights_only=True) ({type(error).__name__}: "
            f"{str(error).splitlines()[0] if str(error) else ''})"
        ) from error
    if not isinstance(loaded, dict) or not all(isinstance(k, str) and torch.is_tensor(v) for k, v in loaded.items()):
        raise TAEHVWeightsError(f"TAEHV weights {path}: not a flat state dict of named tensors")
    return loaded


def _show(keys: list[str]) -> str:
    shown = ", ".join(keys[:_SHOWN_KEYS])
    return shown + (f" (+{len(keys) - _SHOWN_KEYS} more)" if len(keys) > _SHOWN_KEYS else "")
