"""Streaming audio decode: audio latent frames -> waveform, with a halo instead of a causal cache.

The audio codec is diffusers' ``AutoencoderOobleck`` family: non-causal 1-D
convolutions (dilated residual units, transposed-conv upsamplers, Snake
activations). An output sample depends on latent frames on *both* sides, so
a stream cannot be decoded block by block as it stands. It can be decoded
exactly with a halo: every output frame whose decode window holds its
``left`` frames of history and its ``right`` frames of lookahead equals the
whole-clip decode, because nothing else reaches it (:func:`receptive_field`
derives the two numbers from the module structure).

Frame arithmetic (hop = product of ``downsampling_ratios``, e.g. 600)::

    audio latent frame k  ->  samples [k * hop, (k + 1) * hop)
    48 kHz, 16 fps: 3000 samples per video frame, 12000 per video latent frame,
    A = 12000 / hop audio latent frames per video latent frame, 3A per AR block

One decode window of the stream (``L`` = left, ``R`` = right)::

    clip:    ... | emitted earlier | held back (R) | new block ...............|
    window:        |<---- L ---->|<----------- emitted now ----------->|<- R ->|
                   context only   each has L behind and R ahead inside  held back
                                  the window (or the clip's own start)  until the
                                                                        next block

The convolutions pad with zeros at a window's edge, which is right only at
the clip's own edges. So the first window starts at the clip's start (true
left edge), the held-back tail is decoded by :meth:`AudioStreamingDecoder.flush`
with the clip's true end, and :func:`plan_tiles` treats clip edges as context.

With odd strides the transposed convolutions crop one sample more than they
add, so a clip of ``n`` frames decodes to ``n * hop - d`` samples (``d`` = 24
for hop 600 = 2*2*5*5*6): the shortfall sits at the clip's end, exactly where
the whole-clip decode has it (:func:`decoded_samples`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
from diffusers import AutoencoderOobleck
from diffusers.models.autoencoders.autoencoder_oobleck import OobleckResidualUnit, Snake1d
from torch import nn



class WindowGraphs(Protocol):
    """A faster decode of one window (``decoders.audio_graphs.AudioDecodeGraphs``); named here by shape
    only, so that module, which builds on this one, is not imported back."""

    vae: AutoencoderOobleck

    def decode(self, latents: torch.Tensor, *, tail_is_clip_end: bool = True) -> torch.Tensor: ...

    def warmup(self, device: torch.device | str) -> None: ...

# Modules that act on each time step alone, so they leave the receptive field unchanged.
_POINTWISE_MODULES = (Snake1d, nn.Identity, nn.ELU, nn.GELU, nn.SiLU, nn.Tanh, nn.ReLU, nn.LeakyReLU)


# ---------------------------------------------------------------------------
# Receptive field, derived from the module structure


@dataclass(frozen=True)
class TimeLayer:
    """How one layer maps time indices (everything else in the decoder is pointwise).

    ``conv``: output ``o`` reads inputs ``o*stride - padding + tap*dilation``.
    ``transposed``: input ``i`` writes outputs ``i*stride - padding + tap*dilation``.
    ``upsample``: output ``o`` reads input ``o // stride`` (nearest).
    Taps run over ``[0, kernel)``. An index outside ``[0, length)`` reads zero.
    """

    kind: str
    kernel: int = 1
    stride: int = 1
    dilation: int = 1
    padding: int = 0
    output_padding: int = 0

    def output_length(self, length: int) -> int:
        reach = self.dilation * (self.kernel - 1)
        if self.kind == "conv":
            return (length + 2 * self.padding - reach - 1) // self.stride + 1
        if self.kind == "transposed":
            return (length - 1) * self.stride - 2 * self.padding + reach + self.output_padding + 1
        return length * self.stride

    def input_span(self, low: int, high: int) -> tuple[int, int]:
        """The input indices that outputs ``[low, high]`` read."""
        reach = self.dilation * (self.kernel - 1)
        if self.kind == "conv":
            return low * self.stride - self.padding, high * self.stride - self.padding + reach
        if self.kind == "transposed":
            return math.ceil((low + self.padding - reach) / self.stride), (high + self.padding) // self.stride
        return low // self.stride, high // self.stride


def decoder_time_layers(vae: AutoencoderOobleck) -> list[TimeLayer]:
    """The decoder's time-mixing layers in forward order.

    Oobleck registers its submodules in the order it runs them, and its only
    branches are residual units whose skip path is the identity: their conv
    branch keeps the length and centres its kernel, so it reads a superset of
    what the skip path reads. Anything this walk cannot place is refused
    rather than guessed at.
    """
    decoder = getattr(vae, "decoder", None)
    if not isinstance(decoder, nn.Module):
        raise TypeError(f"expected an AutoencoderOobleck-family VAE with a .decoder, got {type(vae).__name__}")
    layers: list[TimeLayer] = []
    for name, module in decoder.named_modules():
        if isinstance(module, OobleckResidualUnit):
            conv = module.conv1
            if 2 * conv.padding[0] != conv.dilation[0] * (conv.kernel_size[0] - 1):
                raise TypeError(f"residual unit {name} changes the length; its skip path is not the identity")
        elif isinstance(module, nn.ConvTranspose1d):
            layers.append(
                TimeLayer("transposed", module.kernel_size[0], module.stride[0], module.dilation[0],
                          module.padding[0], module.output_padding[0])
            )
        elif isinstance(module, nn.Conv1d):
            if module.padding_mode != "zeros" or isinstance(module.padding, str):
                raise TypeError(f"conv {name}: only explicit zero padding is supported")
            layers.append(
                TimeLayer("conv", module.kernel_size[0], module.stride[0], module.dilation[0], module.padding[0])
            )
        elif isinstance(module, nn.Upsample):
            scale = module.scale_factor
            if module.mode != "nearest" or scale is None or float(scale) != int(scale):
                raise TypeError(f"upsample {name}: only nearest with an integer scale is supported")
            layers.append(TimeLayer("upsample", stride=int(scale)))
        elif not list(module.children()) and not isinstance(module, _POINTWISE_MODULES):
            raise TypeError(f"cannot derive the receptive field through {name} ({type(module).__name__})")
    return layers


def hop_length(vae: AutoencoderOobleck) -> int:
    """Output samples per latent frame (the product of the upsampling strides)."""
    hop = 1
    for layer in decoder_time_layers(vae):
        if layer.kind in ("transposed", "upsample"):
            hop *= layer.stride
        elif layer.stride != 1:
            raise TypeError("a strided conv in the decoder: the hop is not a whole number of samples")
    return hop


def decoded_samples(vae: AutoencoderOobleck, frames: int) -> int:
    """Length of the decoder's output for ``frames`` latent frames (``frames * hop`` minus the odd-stride crop)."""
    length = frames
    for layer in decoder_time_layers(vae):
        length = layer.output_length(length)
    return length


def _input_spans(layers: list[TimeLayer], low: int, high: int) -> list[tuple[int, int]]:
    """Indices read at each layer's input by outputs ``[low, high]``; entry 0 is the latents."""
    spans = []
    for layer in reversed(layers):
        low, high = layer.input_span(low, high)
        spans.append((low, high))
    return spans[::-1]


def receptive_field(vae: AutoencoderOobleck) -> tuple[int, int]:
    """``(left, right)``: latent frames of history and lookahead an output frame needs to decode exactly.

    A frame decoded inside a window equals the whole-clip decode when, at
    every layer, the indices it reads lie inside that layer's input in the
    window (outside, the window reads zero padding where the clip has data).
    ``left`` is the fewest frames before it and ``right`` the fewest after
    it for which that holds; a window edge that is the clip's own edge needs
    no context. The right side also covers the samples that odd-stride
    upsamplers crop at a window's end, which is why it can exceed the frames
    that merely *influence* the frame (see :func:`measure_receptive_field`).
    """
    layers = decoder_time_layers(vae)
    hop = hop_length(vae)

    def spans_of(frame: int) -> list[tuple[int, int]]:
        return _input_spans(layers, frame * hop, (frame + 1) * hop - 1)

    def lengths_of(window: int) -> list[int]:
        lengths = [window]
        for layer in layers:
            lengths.append(layer.output_length(lengths[-1]))
        return lengths

    # Everything is shift-equivariant by one frame (= hop samples at the
    # output), so search for the first frame whose reads all start at >= 0 ...
    left = 0
    while any(low < 0 for low, _ in spans_of(left)):
        left += 1
    # ... and for the shortest window after it whose every layer holds those reads.
    spans = spans_of(left) + [(left * hop, (left + 1) * hop - 1)]
    window = left + 1
    while any(high >= length for (_, high), length in zip(spans, lengths_of(window))):
        window += 1
    return left, window - left - 1


@torch.inference_mode()
def measure_receptive_field(vae: AutoencoderOobleck, *, seed: int = 0) -> tuple[int, int]:
    """``(left, right)`` measured: how far one perturbed latent frame changes the output, in latent frames.

    Decodes a random clip twice, the second time with its middle frame
    perturbed, and compares the outputs sample for sample: frames up to
    ``left`` after the perturbed one change (it is their history), frames up
    to ``right`` before it change (it is their lookahead). The clip is made
    wider than twice the derived field so that the clip edges stay out of reach.
    """
    derived_left, derived_right = receptive_field(vae)
    hop = hop_length(vae)
    margin = 2 * max(derived_left, derived_right) + 8
    frames = 2 * margin + 1
    parameter = next(vae.parameters())
    generator = torch.Generator().manual_seed(seed)
    latents = torch.randn(1, vae.config.decoder_input_channels, frames, generator=generator)
    perturbed = latents.clone()
    perturbed[:, :, margin] += torch.randn(latents.shape[1], generator=generator)
    base = vae.decoder(latents.to(parameter.device, parameter.dtype))
    moved = vae.decoder(perturbed.to(parameter.device, parameter.dtype))
    changed = (base != moved).any(dim=1)[0].nonzero().flatten()
    if changed.numel() == 0:
        return 0, 0
    first_frame, last_frame = int(changed[0]) // hop, int(changed[-1]) // hop
    return last_frame - margin, margin - first_frame


# ---------------------------------------------------------------------------
# Tile planning


def plan_tiles(
    frames: int, tile: int, left: int, right: int, sizes: tuple[int, ...] | list[int] = ()
) -> list[tuple[int, int, int, int]]:
    """Split a clip of ``frames`` latent frames into decode windows ``(window_start, window_frames, emit_start, emit_end)``.

    ::

        clip   |0 ........................................................ frames|
        win 0  |emit ................|R|                      (starts at the clip start)
        win 1               |L|emit ..............|R|
        last                       |L ......|emit ................|  (pinned to the clip end)

    Each window is ``tile`` frames and emits the frames that have ``left``
    frames of it before them and ``right`` after them, except at the clip's
    own edges, which need no context. Emitted ranges tile ``[0, frames)`` in
    order, once each. The last window is pinned to the clip's end and shrunk
    to the smallest of ``sizes`` (compiled buckets, at most ``tile``) that
    holds the remaining frames plus their left context, so a clip just past a
    tile boundary does not pay for a whole extra tile. A clip of at most
    ``tile`` frames is one window of its own length.
    """
    if frames < 0:
        raise ValueError(f"frames must be >= 0, got {frames}")
    if left < 0 or right < 0:
        raise ValueError(f"context must be >= 0, got left={left} right={right}")
    if tile <= left + right:
        raise ValueError(f"tile={tile} must exceed the decoder context left + right = {left} + {right}")
    if frames == 0:
        return []
    if frames <= tile:
        return [(0, frames, 0, frames)]
    windows = []
    emit_start, window_start = 0, 0
    while window_start + tile < frames:
        emit_end = window_start + tile - right
        windows.append((window_start, tile, emit_start, emit_end))
        emit_start, window_start = emit_end, emit_end - left
    needed = left + frames - emit_start
    width = min((size for size in sizes if needed <= size <= tile), default=tile)
    windows.append((frames - width, width, emit_start, frames))
    return windows


# ---------------------------------------------------------------------------
# Per-session streaming


@dataclass
class AudioDecodeState:
    """One session's audio decode history: the latent frames the next window still needs.

    ``history`` is ``[1, latent_dim, h]``: up to ``left`` frames already
    emitted (context for the next window), then ``pending_frames`` frames not
    emitted yet (they wait for their lookahead). Only latents are kept, never
    activations, so the state is tiny and exact to rebuild from.
    """

    session_id: str
    owner: object = field(repr=False, compare=False)
    history: torch.Tensor | None = None
    frames_received: int = 0
    frames_emitted: int = 0
    samples_emitted: int = 0
    flushed: bool = False

    @property
    def pending_frames(self) -> int:
        """Frames received but not emitted yet (at most ``right`` once a block has been decoded)."""
        return self.frames_received - self.frames_emitted

    def nbytes(self) -> int:
        history = self.history
        return 0 if history is None else history.numel() * history.element_size()

    def release(self) -> None:
        """Drop the history; the next decode starts a new clip."""
        self.history = None
        self.frames_received = 0
        self.frames_emitted = 0
        self.samples_emitted = 0
        self.flushed = False


class AudioStreamingDecoder:
    """Streaming decode over an ``AutoencoderOobleck``, one :class:`AudioDecodeState` per session.

    Contract: for any split of a clip into blocks, the concatenation of every
    :meth:`decode_block` output and the final :meth:`flush` equals
    ``vae.decode(whole clip)`` to float tolerance (windows of other lengths
    may round differently; ~1e-7 in float32). Audio trails the latents by
    ``lookahead_samples``. State per session is ``left + right`` latent frames.

    ``graphs``: decode windows through an :class:`~decoders.audio_graphs.AudioDecodeGraphs`
    (CUDA graphs / compiled buckets) instead of the eager decoder.
    """

    def __init__(self, vae: AutoencoderOobleck, *, graphs: WindowGraphs | None = None) -> None:
        self.vae = vae
        self.graphs = graphs
        if graphs is not None and graphs.vae is not vae:
            raise ValueError("graphs were built for another VAE")
        parameter = next(vae.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        self.latent_dim = int(vae.config.decoder_input_channels)
        self.channels = int(vae.config.audio_channels)
        self.hop = hop_length(vae)
        self.left_frames, self.right_frames = receptive_field(vae)

    @property
    def lookahead_samples(self) -> int:
        """Samples of the latest block held back until the next block (or flush) brings their lookahead."""
        return self.right_frames * self.hop

    # -- session lifecycle -------------------------------------------------

    def new_state(self, session_id: str) -> AudioDecodeState:
        if not isinstance(session_id, str) or not session_id:
            raise ValueError("session_id must be a non-empty string")
        return AudioDecodeState(session_id=session_id, owner=self)

    def release(self, state: AudioDecodeState) -> None:
        self._check_owner(state)
        state.release()

    def declared_state_bytes(self, dtype: torch.dtype | None = None) -> int:
        """Resident bytes of one session's state once streaming: ``left + right`` latent frames of history."""
        element_size = torch.empty((), dtype=dtype or self.dtype).element_size()
        return (self.left_frames + self.right_frames) * self.latent_dim * element_size

    # -- decode ------------------------------------------------------------

    @torch.inference_mode()
    def decode_block(self, latents: torch.Tensor, state: AudioDecodeState) -> torch.Tensor:
        """Decode ``latents`` ``[1, latent_dim, n]`` as the continuation of ``state``'s clip.

        Returns ``[channels, samples]``: every frame that now has its full
        lookahead, i.e. up to ``right`` frames before the end of what was
        received (possibly none: a ``[channels, 0]`` tensor).
        """
        self._check_owner(state)
        if state.flushed:
            raise ValueError(f"audio stream of session {state.session_id!r} was flushed; release it to start anew")
        latents = self._check_latents(latents)
        window = latents if state.history is None else torch.cat([state.history, latents], dim=2)
        window_start = state.frames_emitted - self._context_frames(state)
        frames_received = state.frames_received + latents.shape[2]
        emit_end = max(state.frames_emitted, frames_received - self.right_frames)

        if emit_end > state.frames_emitted:
            # The window's last `right` frames are held back, so padding a
            # compiled bucket past the window's end cannot reach what is kept.
            samples = self._decode_window(window, tail_is_clip_end=False)
            out = samples[:, (state.frames_emitted - window_start) * self.hop : (emit_end - window_start) * self.hop]
        else:
            out = window.new_empty(self.channels, 0)
        # The state moves only once the decode has succeeded. It keeps a copy,
        # so it owns exactly its frames and never pins the caller's tensor.
        keep_start = max(0, emit_end - self.left_frames)
        state.history = window[:, :, keep_start - window_start :].clone()
        state.frames_received = frames_received
        return self._account(state, out, emit_end)

    @torch.inference_mode()
    def flush(self, state: AudioDecodeState) -> torch.Tensor:
        """Decode the held-back tail with the clip's true end; the stream then ends (``[channels, samples]``)."""
        self._check_owner(state)
        if state.flushed:
            raise ValueError(f"audio stream of session {state.session_id!r} was already flushed")
        out = torch.empty(self.channels, 0, device=self.device, dtype=self.dtype)
        if state.pending_frames:
            window_start = state.frames_emitted - self._context_frames(state)
            samples = self._decode_window(state.history, tail_is_clip_end=True)
            out = samples[:, (state.frames_emitted - window_start) * self.hop :]
        out = self._account(state, out, state.frames_received)
        state.history, state.flushed = None, True
        return out

    # -- internals ---------------------------------------------------------

    def _context_frames(self, state: AudioDecodeState) -> int:
        history = 0 if state.history is None else state.history.shape[2]
        return history - state.pending_frames

    def _decode_window(self, window: torch.Tensor, *, tail_is_clip_end: bool) -> torch.Tensor:
        """``[channels, samples]`` of the whole window."""
        if self.graphs is not None:
            return self.graphs.decode(window, tail_is_clip_end=tail_is_clip_end)[0]
        return self.vae.decoder(window)[0]

    def _account(self, state: AudioDecodeState, out: torch.Tensor, emit_end: int) -> torch.Tensor:
        state.frames_emitted = emit_end
        state.samples_emitted += out.shape[1]
        # A copy: graph outputs are views of buffers the next replay overwrites,
        # and an eager slice would pin the whole window's waveform.
        return out.clone()

    def _check_latents(self, latents: torch.Tensor) -> torch.Tensor:
        return check_latents(latents, self.latent_dim).to(self.device, self.dtype)

    def _check_owner(self, state: AudioDecodeState) -> None:
        if not isinstance(state, AudioDecodeState):
            raise ValueError(f"expected an AudioDecodeState, got {type(state).__name__}")
        if state.owner is not self:
            raise ValueError(f"audio decode state of session {state.session_id!r} belongs to another decoder")


def check_latents(latents: torch.Tensor, latent_dim: int) -> torch.Tensor:
    """Refuse anything but one clip of ``[1, latent_dim, n >= 1]`` floating-point latents."""
    if not torch.is_tensor(latents):
        raise ValueError(f"latents must be a tensor, got {type(latents).__name__}")
    if latents.ndim != 3:
        raise ValueError(f"latents must be [1, {latent_dim}, frames]; got shape {tuple(latents.shape)}")
    if latents.shape[0] != 1:
        # One state is one clip's history; a batch would mix several streams.
        raise ValueError(f"one clip per call: batch must be 1, got {latents.shape[0]}")
    if latents.shape[1] != latent_dim:
        raise ValueError(f"latents must have {latent_dim} channels (latent dim), got {latents.shape[1]}")
    if latents.shape[2] == 0:
        raise ValueError("latents carry no frames")
    if not latents.is_floating_point():
        raise ValueError(f"latents must be floating point, got {latents.dtype}")
    return latents


def streaming_window_frames(vae: AutoencoderOobleck, block_frames: int) -> int:
    """Latent frames of a steady-state streaming window for blocks of ``block_frames`` (a good compiled bucket)."""
    left, right = receptive_field(vae)
    return left + right + block_frames
