"""A TAEHV-class causal video encoder: frames -> Wan2.1-geometry latents (16 channels, 8x spatial, 4x temporal).

The tiny preset's codec is this encoder with :class:`decoders.taehv.TAEHVDecoder` (docs/TINY_MODEL.md):
plain 3x3 convs and ReLUs, no normalisation layer, so a colour is a linear function of the input all the
way down and back (the tiny Wan VAE's RMS norms over 4-16 channels made colour slow to learn). The
published TAEHV checkpoints for Wan2.1 (``taew2_1``) ship an encoder of this shape too, at widths
(64, 64, 64, 64) with 3 memory blocks a stage and no colour shortcut (:data:`WAN_TAEHV_ENCODER`):
:func:`load_taehv_encoder` reads their ``encoder.*`` half (a temporal pool's weight is ``f`` there, ``conv``
here), so a Wan model streamed through TAEHV encodes its pictures and camera with the same file's tiny
encoder instead of the Wan VAE's (docs/DECODERS.md).

Layer list (``w`` = ``config.widths``)::

    conv 3->w0, ReLU                                              full resolution, every frame
    stage s = 0, 1, 2:  temporal pool (x2, x2, x1) 1x1 conv over the pooled frames' channels
                        conv 3x3 stride 2 (w_s -> w_{s+1}), blocks_per_stage memory blocks (w_{s+1})
    conv w3->latent_channels                                      1/8 resolution, one frame per latent

Frame arithmetic (the Wan VAE's, so the DiT and the decoders see the same latents)::

    video frames   v0          | v1 v2 v3 v4 | v5 ...
    padded         v0 v0 v0 v0 | v1 v2 v3 v4 | ...      the first frame repeated 3 times in front
    latents        z0          | z1          | ...      1 + 4 (N - 1) frames -> N latents

Causal: latent ``k`` depends on video frames ``0 .. 4k`` only (a memory block sees its input one frame
earlier at its depth; a temporal pool joins consecutive frames). :meth:`TAEHVEncoder.encode_video` runs
every layer on all frames at once, which is the same function.

Streaming (:class:`TAEHVStreamingEncoder`, the mirror of ``decoders.taehv.TAEHVStreamingDecoder``): a
session's input frames arrive a block at a time, and its encoder state carries what the next frames need
of the earlier ones: each memory block's input at the previous frame of its stage, and the frames of a
latent group not yet complete (at most 3, held as pixels: fewer bytes than each pool's partial features,
and every group then goes through the layers with the same shapes)::

    call 1: v0 v1 .. v8          -> groups [v0 v0 v0 v0] [v1..v4] [v5..v8]   -> z0 z1 z2
    call 2: v9 v10               -> pending v9 v10                           -> (none)
    call 3: v11 .. v16           -> groups [v9..v12] [v13..v16]              -> z3 z4

So encoding a clip in any chunks with the carried state equals encoding it in one call, bit for bit (the
same group shapes), and equals :meth:`TAEHVEncoder.encode_video` to float rounding.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from decoders.latent_stats import LatentStats
from decoders.taehv import MemoryBlock, TAEHVWeightsError, _conv3x3, _read_state_dict, check_tensors, find_taehv_weights

FRAMES_PER_LATENT = 4


@dataclass(frozen=True)
class TAEHVEncoderConfig:
    latent_channels: int = 16
    widths: tuple[int, int, int, int] = (16, 32, 48, 64)  # full-resolution conv, then stages at 1/2, 1/4, 1/8
    blocks_per_stage: int = 1
    time_downscale: tuple[bool, bool, bool] = (True, True, False)  # a 2x temporal pool before stage s
    image_channels: int = 3
    # Add each latent cell's mean colour (over its 4 frames and 8x8 pixels) to latent channels 0-2,
    # the half of decoders.taehv.colour_shortcut that the decoder adds back.
    colour_shortcut: bool = True

    def __post_init__(self) -> None:
        if len(self.widths) != 4 or min(self.widths) <= 0:
            raise ValueError(f"widths must be 4 positive channel counts, got {self.widths}")
        if len(self.time_downscale) != 3 or 2 ** sum(self.time_downscale) != FRAMES_PER_LATENT:
            raise ValueError(f"time_downscale must pool {FRAMES_PER_LATENT}x over 3 stages, got {self.time_downscale}")


class TemporalPool(nn.Module):
    """Joins ``stride`` consecutive frames: their channels stacked, then a 1x1 conv back to ``channels``."""

    def __init__(self, channels: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(channels * stride, channels, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, C, H, W]`` -> ``[B, T / stride, C, H, W]``."""
        batch, frames, channels, height, width = x.shape
        if frames % self.stride:
            raise ValueError(f"{frames} frames do not pool by {self.stride}")
        stacked = x.reshape(batch * frames // self.stride, self.stride * channels, height, width)
        return self.conv(stacked).view(batch, frames // self.stride, channels, height, width)


class TAEHVEncoder(nn.Module):
    """The encoder as a plain module; ``state_dict()`` keys are ``encoder.{i}.…``."""

    def __init__(self, config: TAEHVEncoderConfig = TAEHVEncoderConfig()) -> None:
        super().__init__()
        self.config = config
        w = config.widths
        layers: list[nn.Module] = [_conv3x3(config.image_channels, w[0]), nn.ReLU()]
        for stage in range(3):
            layers += [
                TemporalPool(w[stage], 2 if config.time_downscale[stage] else 1),
                nn.Conv2d(w[stage], w[stage + 1], 3, stride=2, padding=1, bias=False),
            ]
            layers += [MemoryBlock(w[stage + 1]) for _ in range(config.blocks_per_stage)]
        layers.append(_conv3x3(w[3], config.latent_channels))
        self.encoder = nn.Sequential(*layers)

    def encode_video(self, video: torch.Tensor) -> torch.Tensor:
        """``[B, 3, 1 + 4 (N - 1), H, W]`` in ``[-1, 1]`` -> ``[B, latent_channels, N, H / 8, W / 8]`` (raw latents)."""
        if video.ndim != 5 or video.shape[1] != self.config.image_channels:
            raise ValueError(f"video must be [B, {self.config.image_channels}, T, H, W]; got {tuple(video.shape)}")
        frames = video.shape[2]
        if (frames - 1) % FRAMES_PER_LATENT:
            raise ValueError(f"{frames} frames: a clip has 1 + {FRAMES_PER_LATENT} (N - 1) frames")
        if video.shape[3] % 8 or video.shape[4] % 8:
            raise ValueError(f"height and width must be multiples of 8; got {video.shape[3]}x{video.shape[4]}")
        x = (video.transpose(1, 2) + 1) / 2  # [B, T, 3, H, W] in [0, 1], TAEHV's pixel range
        x = torch.cat([x[:, :1].expand(-1, FRAMES_PER_LATENT - 1, -1, -1, -1), x], dim=1)
        pixels = x
        for layer in self.encoder:
            if isinstance(layer, MemoryBlock):
                past = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
                x = layer(x.flatten(0, 1), past.flatten(0, 1)).view_as(x)
            elif isinstance(layer, TemporalPool):
                x = layer(x)
            else:
                batch, count = x.shape[:2]
                x = layer(x.flatten(0, 1))
                x = x.view(batch, count, *x.shape[1:])
        if self.config.colour_shortcut:
            x = x + F.pad(mean_colours(pixels), (0, 0, 0, 0, 0, x.shape[2] - 3))
        return x.transpose(1, 2)


def mean_colours(pixels: torch.Tensor) -> torch.Tensor:
    """``[B, 4N, 3, H, W]`` (padded frames) -> ``[B, N, 3, H / 8, W / 8]``: each latent cell's mean colour."""
    batch, frames, channels, height, width = pixels.shape
    cells = F.avg_pool2d(pixels.flatten(0, 1), 8).view(batch, frames // FRAMES_PER_LATENT, FRAMES_PER_LATENT, channels, height // 8, width // 8)
    return cells.mean(dim=2)


# ---------------------------------------------------------------------------
# Streaming over sessions


@dataclass
class TAEHVEncodeState:
    """One session's input stream: each memory block's input at the previous frame of its stage, and the
    frames of the latent group not yet complete (``[k, 3, H, W]`` in ``[0, 1]``, ``k < 4``).

    Like the decoder's state it cannot be rebuilt from anything else: releasing it ends the input stream,
    and the next frame starts a new one (its first frame a latent group of its own again).
    """

    session_id: str
    memory: list[torch.Tensor | None]
    owner: object = field(repr=False, compare=False)
    pending: torch.Tensor | None = None
    frames_encoded: int = 0  # input frames taken, pending ones included
    latents_encoded: int = 0

    def nbytes(self) -> int:
        held = [t for t in self.memory if t is not None] + ([self.pending] if self.pending is not None else [])
        return sum(t.numel() * t.element_size() for t in held)

    @property
    def started(self) -> bool:
        return self.frames_encoded > 0

    def release(self) -> None:
        self.memory = [None] * len(self.memory)
        self.pending = None
        self.frames_encoded = 0
        self.latents_encoded = 0


def frames_from_uint8(frames: np.ndarray, device, dtype) -> torch.Tensor:
    """``[T, H, W, 3]`` uint8 -> ``[1, 3, T, H, W]`` in ``[-1, 1]`` on ``device`` (the inverse of the decoders'
    ``to_uint8``): every streaming encoder's input."""
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"frames must be uint8 [T, H, W, 3]; got {frames.dtype} {tuple(frames.shape)}")
    tensor = torch.from_numpy(np.ascontiguousarray(frames))
    if torch.device(device).type == "cuda":
        # From pinned memory without blocking: a pageable copy would make the host wait for every queued kernel.
        tensor = tensor.pin_memory().to(device, non_blocking=True)
    return tensor.permute(3, 0, 1, 2).unsqueeze(0).to(device, dtype).mul_(2.0 / 255.0).sub_(1.0)


class TAEHVStreamingEncoder:
    """Streaming encode over a :class:`TAEHVEncoder`, one state per session; the decoder's interface mirrored:
    ``new_state``, ``encode_chunk``, ``normalize`` (the inverse of the decoder's ``denormalize``), ``release``,
    ``declared_state_bytes``."""

    def __init__(
        self,
        model: TAEHVEncoder,
        *,
        latents_mean: list[float] | None = None,
        latents_std: list[float] | None = None,
    ) -> None:
        if not isinstance(model, TAEHVEncoder):
            raise TypeError(f"TAEHVStreamingEncoder needs a TAEHVEncoder, got {type(model).__name__}")
        self.model = model.eval()
        parameter = next(model.parameters())
        self.device = parameter.device
        self.dtype = parameter.dtype
        self.memory_block_count = sum(isinstance(layer, MemoryBlock) for layer in model.encoder)
        self._latent_stats = LatentStats.optional(latents_mean, latents_std, model.config.latent_channels)

    spatial_downscale = 8
    frames_per_latent = FRAMES_PER_LATENT

    # -- session lifecycle -------------------------------------------------

    def new_state(self, session_id: str) -> TAEHVEncodeState:
        if not isinstance(session_id, str) or not session_id:
            raise ValueError("session_id must be a non-empty string")
        return TAEHVEncodeState(session_id=session_id, memory=[None] * self.memory_block_count, owner=self)

    def release(self, state: TAEHVEncodeState) -> None:
        self._check_owner(state)
        state.release()

    def frames_needed(self, latents: int, state: TAEHVEncodeState) -> int:
        """Input frames that complete ``latents`` more latent frames of ``state``'s stream (its first latent
        frame takes one frame, every later one four, less any frames already waiting)."""
        pending = 0 if state.pending is None else state.pending.shape[0]
        opening = 0 if state.started else FRAMES_PER_LATENT - 1
        return max(0, FRAMES_PER_LATENT * latents - opening - pending)

    # -- encode ------------------------------------------------------------

    def normalize(self, latents: torch.Tensor) -> torch.Tensor:
        """The encoder's latents -> model space: ``(z - mean) / std`` per channel (the identity without statistics)."""
        return latents if self._latent_stats is None else self._latent_stats.normalize(latents)

    def from_uint8(self, frames: np.ndarray) -> torch.Tensor:
        return frames_from_uint8(frames, self.device, self.dtype)

    @torch.inference_mode()
    def encode_chunk(self, frames: torch.Tensor, state: TAEHVEncodeState) -> torch.Tensor:
        """Encode ``frames`` as the continuation of ``state``'s stream; advances ``state``.

        ``frames``: ``[1, 3, T, H, W]`` in ``[-1, 1]``, ``T >= 0``. Returns the raw latents of every latent
        group the frames complete, ``[1, C, n, H / 8, W / 8]`` (``n`` may be 0); frames of a group still
        incomplete wait in the state. After an error the state is part-advanced: release it.
        """
        self._check_owner(state)
        config = self.model.config
        if frames.ndim != 5 or frames.shape[0] != 1 or frames.shape[1] != config.image_channels:
            raise ValueError(f"frames must be [1, {config.image_channels}, T, H, W]; got {tuple(frames.shape)}")
        height, width = frames.shape[3], frames.shape[4]
        if height % self.spatial_downscale or width % self.spatial_downscale or height == 0 or width == 0:
            raise ValueError(f"height and width must be positive multiples of 8; got {height}x{width}")
        pixels = (frames[0].to(self.device, self.dtype).transpose(0, 1) + 1) / 2  # [T, 3, H, W] in [0, 1]
        if state.pending is not None:
            if state.pending.shape[1:] != pixels.shape[1:]:
                raise ValueError(f"frames of {height}x{width} continue a stream of another size")
            pixels = torch.cat([state.pending, pixels])
        elif not state.started and pixels.shape[0]:
            # The stream's first frame is a latent group of its own: repeated in front, as encode_video pads it.
            pixels = torch.cat([pixels[:1].expand(FRAMES_PER_LATENT - 1, -1, -1, -1), pixels])
        state.frames_encoded += int(frames.shape[2])
        whole = pixels.shape[0] // FRAMES_PER_LATENT * FRAMES_PER_LATENT
        latents = []
        for start in range(0, whole, FRAMES_PER_LATENT):
            latent, state.memory = self._encode_group(pixels[start : start + FRAMES_PER_LATENT], state.memory)
            latents.append(latent)
            state.latents_encoded += 1
        state.pending = pixels[whole:].clone() if whole < pixels.shape[0] else None
        if not latents:
            return pixels.new_zeros(1, config.latent_channels, 0, height // 8, width // 8)
        return torch.stack(latents, dim=1).unsqueeze(0)

    def _encode_group(self, group: torch.Tensor, memory: list[torch.Tensor | None]):
        """``[4, 3, H, W]`` in ``[0, 1]`` + memory -> ``[C, H / 8, W / 8]`` and the new memory (the old list is not
        modified): one latent frame, every layer as encode_video runs it on these frames."""
        x = group
        new_memory: list[torch.Tensor] = []
        for layer in self.model.encoder:
            if isinstance(layer, MemoryBlock):
                x, kept = layer.stream(x, memory[len(new_memory)])
                new_memory.append(kept)
            elif isinstance(layer, TemporalPool):
                x = layer(x.unsqueeze(0)).squeeze(0)
            else:
                x = layer(x)
        latent = x[0]
        if self.model.config.colour_shortcut:
            colours = mean_colours(group.unsqueeze(0))[0, 0]  # [3, h, w]
            latent = torch.cat([latent[:3] + colours, latent[3:]])
        return latent, new_memory

    # -- admission ---------------------------------------------------------

    def declared_state_bytes(self, height: int, width: int, dtype: torch.dtype) -> int:
        """Resident bytes of one session's stream at this input size, at most: each memory block holds one
        frame of its stage's width at its stage's resolution, and up to 3 input frames wait for their group.
        Exact, from the geometry (a test holds it equal to the state's measured bytes)."""
        if height <= 0 or width <= 0 or height % 8 or width % 8:
            raise ValueError(f"height and width must be positive multiples of 8; got {height}x{width}")
        config = self.model.config
        values = sum(
            config.blocks_per_stage * config.widths[stage + 1] * (height >> (stage + 1)) * (width >> (stage + 1))
            for stage in range(3)
        )
        values += (FRAMES_PER_LATENT - 1) * config.image_channels * height * width
        return values * torch.empty((), dtype=dtype).element_size()

    def _check_owner(self, state: TAEHVEncodeState) -> None:
        if not isinstance(state, TAEHVEncodeState):
            raise ValueError(f"expected a TAEHVEncodeState, got {type(state).__name__}")
        if state.owner is not self:
            raise ValueError(f"encode state of session {state.session_id!r} belongs to another encoder")


# The published Wan2.1 TAEHV encoder (taew2_1's ``encoder.*`` half): works in the Wan model's normalised latent
# space, as its decoder does, so it comes with no latent statistics.
WAN_TAEHV_ENCODER = TAEHVEncoderConfig(widths=(64, 64, 64, 64), blocks_per_stage=3, colour_shortcut=False)


def model_dir_has_taehv_encoder(model_dir: str | Path) -> bool:
    """Whether the model directory's TAEHV file (``find_taehv_weights``) holds an encoder half; False without
    a readable file (loading the decoder then says why). Read once per file version."""
    try:
        path = find_taehv_weights(model_dir)
        stat = path.stat()
    except (TAEHVWeightsError, OSError):
        return False
    return _has_encoder_half(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _has_encoder_half(path: str, _mtime_ns: int, _size: int) -> bool:
    try:
        if path.endswith(".safetensors"):
            from safetensors import safe_open

            with safe_open(path, framework="pt") as handle:
                return any(key.startswith("encoder.") for key in handle.keys())
        return any(key.startswith("encoder.") for key in _read_state_dict(Path(path)))
    except Exception:  # unreadable: the decoder's load names the problem
        return False


def load_taehv_encoder(
    path: str | Path, device="cpu", dtype=torch.float32, config: TAEHVEncoderConfig = WAN_TAEHV_ENCODER
) -> TAEHVEncoder:
    """The encoder with the ``encoder.*`` tensors of a local TAEHV file (``.pth`` / ``.safetensors``); never
    downloads. Every tensor must match the config's encoder exactly (no missing, unknown or mis-shaped key);
    the file's ``decoder.*`` half is :func:`decoders.taehv.load_taehv`'s."""
    path = Path(path)
    tensors = {key: value for key, value in _read_state_dict(path).items() if key.startswith("encoder.")}
    if not tensors:
        raise TAEHVWeightsError(f"{path}: no TAEHV encoder in the file (no encoder.* tensors)")
    model = TAEHVEncoder(config)
    pools = {f"encoder.{index}.f.weight": f"encoder.{index}.conv.weight"
             for index, layer in enumerate(model.encoder) if isinstance(layer, TemporalPool)}
    tensors = {pools.get(key, key): value for key, value in tensors.items()}
    expected = model.state_dict()
    missing = sorted(key for key in expected if key not in tensors)
    unknown = sorted(key for key in tensors if key not in expected)
    check_tensors(path, f"a TAEHV encoder with widths {config.widths}", tensors, expected, missing, unknown)
    model.load_state_dict(tensors, strict=True)
    return model.to(device, dtype).eval()


def random_taehv_encoder(
    seed: int = 0, config: TAEHVEncoderConfig = TAEHVEncoderConfig(), device="cpu", dtype=torch.float32
) -> TAEHVEncoder:
    """An encoder with seeded random weights (tests, random-weight presets); the global RNG is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TAEHVEncoder(config)
    return model.to(device, dtype).eval()
