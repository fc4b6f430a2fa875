"""CUDA tiers for the audio decode: compiled bucket graphs, plain graphs, eager.

The Oobleck decoder is a few hundred small kernels (weight norms, Snake
activations, dilated convs) over short sequences, so on a GPU it is bound by
launch overhead, not arithmetic. Replaying it as a CUDA graph removes that
overhead. Three tiers, best first:

compiled  Built by :meth:`AudioDecodeGraphs.warmup` at start-up: the decoder
          through ``torch.compile`` (Inductor fuses the Snake chains), one
          graph captured per bucket of ``compile_shapes``. A shorter window
          is right-padded with zero latents (Oobleck's decode has no latent
          normalisation, so zero is what the first conv's own padding reads);
          the padding reaches the window's last frames only through the right
          receptive field, so a bucket serves a short window only where those
          frames are not kept (a streaming window's held-back tail, a tile
          that is not the clip's last). Fused kernels round differently:
          close to eager, not bit-identical.
graph     Captured on demand, one per exact window length, replaying eager's
          own kernels: bit-identical to eager. All of them share ONE private
          memory pool and are retired together when ``max_graphs`` is
          reached: graphs in a pool reuse each other's freed blocks, so
          dropping one frees nothing and a later capture could be handed
          memory an older graph still writes; a whole generation dropped at
          once leaves no graph behind that holds an address of the old pool.
eager     Off the accelerator, when disabled, and when called while an outer
          CUDA graph is being captured (nested capture is not allowed).

Clips longer than ``tile_frames`` are decoded in windows from
:func:`decoders.audio.plan_tiles` with a halo of the receptive field, so the
stitched waveform equals the whole-clip decode and memory stays bounded.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch
from diffusers import AutoencoderOobleck

from decoders.audio import check_latents, decoded_samples, hop_length, plan_tiles, receptive_field
from decoders.graph_capture import GraphCache, capture

logger = logging.getLogger(__name__)

# Latent-frame buckets. Each costs one Inductor compilation at start-up and one
# graph; clips past the largest are tiled over it. Pick them from the
# streaming window (decoders.audio.streaming_window_frames): at hop 600 a
# 60-frame block plus a 12 + 12 halo is 84 frames.
DEFAULT_COMPILE_SHAPES: tuple[int, ...] = (64, 128, 256)

MODES = ("compiled", "graph", "eager", "tiled")


@dataclass
class _GraphEntry:
    graph: torch.cuda.CUDAGraph
    static_latents: torch.Tensor  # [1, latent_dim, frames]
    static_samples: torch.Tensor  # [1, channels, decoded samples]


class AudioDecodeGraphs:
    """Decode ``[1, latent_dim, frames]`` Oobleck latents through the fastest tier that is exact enough.

    ``last_mode`` says which served the last :meth:`decode`: ``"compiled"``,
    ``"graph"``, ``"eager"``, or ``"tiled"`` (then ``last_window_modes`` lists
    the tier of each window). ``tile_frames``: window for long clips; None =
    the largest bucket (no tiling when that does not exceed the halo), 0 = never tile.
    """

    def __init__(
        self,
        vae: AutoencoderOobleck,
        *,
        compile_shapes: Sequence[int] = DEFAULT_COMPILE_SHAPES,
        max_graphs: int = 32,
        tile_frames: int | None = None,
        enabled: bool = True,
    ) -> None:
        shapes = sorted({int(size) for size in compile_shapes})
        if shapes and shapes[0] < 1:
            raise ValueError(f"compile_shapes must be positive frame counts, got {list(compile_shapes)}")
        self.vae = vae
        self.enabled = bool(enabled)
        self.max_graphs = int(max_graphs)
        self.compile_shapes = tuple(shapes)
        self.left_frames, self.right_frames = receptive_field(vae)
        self.hop = hop_length(vae)
        # decoded samples = frames * hop - crop for every frames >= 1 (each layer is affine in length)
        self.crop_samples = self.hop - decoded_samples(vae, 1)
        self.latent_dim = int(vae.config.decoder_input_channels)
        parameter = next(vae.parameters())
        self.device, self.dtype = parameter.device, parameter.dtype
        halo = self.left_frames + self.right_frames
        if tile_frames is None:
            tile_frames = shapes[-1] if shapes and shapes[-1] > halo else 0
        if tile_frames and tile_frames <= halo:
            raise ValueError(f"tile_frames={tile_frames} must exceed the decoder halo {self.left_frames} + {self.right_frames}")
        self.tile_frames = max(0, int(tile_frames))

        # One exact-length graph per window length, retired together at max_graphs (see the module docstring).
        self._plain: GraphCache[_GraphEntry] = GraphCache("audio decode", int(max_graphs), on_full="retire")
        # One graph per bucket of compile_shapes, all kept for this object's life (captured at warm-up only).
        self._compiled: GraphCache[_GraphEntry] = GraphCache("audio decode compiled", max(1, len(shapes)))
        self.compile_errors: dict[int, str] = {}
        self.last_mode: str | None = None
        self.last_window_modes: list[str] = []

    # -- decode ------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, *, tail_is_clip_end: bool = True) -> torch.Tensor:
        """``[1, channels, frames * hop - crop_samples]``, in memory the caller owns.

        ``tail_is_clip_end=False`` promises that the caller drops the samples
        of the last ``right_frames`` frames (a streaming window's held-back
        tail), which lets a compiled bucket serve the window with padding.
        """
        latents = check_latents(latents, self.latent_dim).to(self.device, self.dtype)
        frames = latents.shape[2]
        if self.tile_frames and frames > self.tile_frames:
            samples = latents.new_empty(1, self.vae.config.audio_channels, self._samples(frames))
            modes = []
            for emit_start, chunk in self.decode_tiles(latents, tail_is_clip_end=tail_is_clip_end):
                offset = emit_start * self.hop
                samples[:, :, offset : offset + chunk.shape[2]].copy_(chunk)
                modes.append(self.last_mode)
            self.last_mode, self.last_window_modes = "tiled", modes
            return samples
        samples = self._decode_window(latents, padding_allowed=not tail_is_clip_end)
        self.last_window_modes = [self.last_mode]
        return samples.clone()

    def decode_tiles(self, latents: torch.Tensor, *, tail_is_clip_end: bool = True) -> Iterator[tuple[int, torch.Tensor]]:
        """Yield ``(emit_start_frame, samples [1, channels, s])`` per window of :func:`plan_tiles`, in order.

        The samples may be views of graph buffers that the next window
        overwrites: consume (or copy) each before advancing.
        """
        latents = check_latents(latents, self.latent_dim).to(self.device, self.dtype)
        frames = latents.shape[2]
        if self.tile_frames and frames > self.tile_frames:
            plan = plan_tiles(frames, self.tile_frames, self.left_frames, self.right_frames, self._ready_buckets())
        else:
            plan = [(0, frames, 0, frames)]
        for start, width, emit_start, emit_end in plan:
            at_clip_end = start + width == frames
            samples = self._decode_window(
                latents[:, :, start : start + width], padding_allowed=not (at_clip_end and tail_is_clip_end)
            )
            yield emit_start, samples[:, :, (emit_start - start) * self.hop : (emit_end - start) * self.hop]

    def _decode_window(self, latents: torch.Tensor, *, padding_allowed: bool) -> torch.Tensor:
        """One window through the best tier; graph results are views of static buffers."""
        # The capture query is asked last: it needs a CUDA runtime.
        if not self.enabled or not latents.is_cuda or torch.cuda.is_current_stream_capturing():
            self.last_mode = "eager"
            return self.vae.decoder(latents)
        frames = latents.shape[2]
        bucket = self.compiled_bucket(frames, padding_allowed=padding_allowed)
        if bucket is not None:
            entry, self.last_mode = self._compiled.get(bucket), "compiled"
        else:
            entry = self._plain_graph(frames, latents.device)
            if entry is None:
                self.last_mode = "eager"
                return self.vae.decoder(latents)
            self.last_mode = "graph"
        entry.static_latents[:, :, :frames].copy_(latents)
        if entry.static_latents.shape[2] > frames:
            entry.static_latents[:, :, frames:].zero_()  # what the first conv's own padding reads
        entry.graph.replay()
        return entry.static_samples[:, :, : self._samples(frames)]

    def _samples(self, frames: int) -> int:
        return frames * self.hop - self.crop_samples

    # -- compiled buckets --------------------------------------------------

    def compiled_bucket(self, frames: int, *, padding_allowed: bool = True) -> int | None:
        """The smallest captured bucket that serves ``frames``: exactly, or with padding where allowed."""
        for size in self._ready_buckets():
            if size == frames or (padding_allowed and size > frames):
                return size
        return None

    def _ready_buckets(self) -> tuple[int, ...]:
        return tuple(sorted(self._compiled.keys()))

    def warmup(self, device: torch.device | str) -> None:
        """Compile the decoder and capture one graph per bucket (start-up cost: one compilation each).

        A bucket whose capture fails is recorded in ``compile_errors`` and logged, and
        no further bucket is captured (the graph caches' one rule for a failure); their
        windows go to plain graphs. Does nothing off CUDA, when disabled, or inside an
        outer capture.
        """
        device = torch.device(device)
        if not self.enabled or not self.compile_shapes or len(self._compiled) or device.type != "cuda":
            return
        if not torch.cuda.is_available() or torch.cuda.is_current_stream_capturing():
            return
        try:
            compiled = torch.compile(self.vae.decoder, dynamic=False)
        except Exception as error:  # noqa: BLE001 - any compile failure leaves the plain tiers
            logger.warning("audio decode: torch.compile failed; plain CUDA graphs only: %r", error)
            self.compile_errors = {size: repr(error) for size in self.compile_shapes}
            return
        # Bucket graphs live as long as this object, in their cache's one pool.
        for size in self.compile_shapes:
            captured = self._compiled.capture(
                size, lambda pool, size=size: self._capture(size, device, compiled, warm_iters=3, pool=pool))
            if captured is None:  # the cache logged why, and is off from now on
                self.compile_errors[size] = "capture failed or skipped after an earlier failure (see the log)"
        logger.info("audio decode: compiled buckets %s of %s", self._ready_buckets(), self.compile_shapes)

    # -- plain graphs ------------------------------------------------------

    @property
    def plain_graph_lengths(self) -> tuple[int, ...]:
        return self._plain.keys()

    @property
    def plain_graphs(self) -> tuple[_GraphEntry, ...]:
        return self._plain.entries()

    @property
    def plain_pool(self):
        """The current generation's graph pool handle (None before the first capture or after retirement)."""
        return self._plain.pool

    @property
    def retired_generations(self) -> int:
        return self._plain.retired_generations

    def retire_plain_graphs(self) -> None:
        """Drop every plain graph and their shared pool together; the next capture starts a new pool."""
        self._plain.retire()

    def _plain_graph(self, frames: int, device: torch.device) -> _GraphEntry | None:
        """The exact-length graph (captured now if new); None: eager (a capture failed, from then on)."""
        entry = self._plain.get(frames)
        if entry is None:
            entry = self._plain.capture(frames, lambda pool: self._capture(frames, device, self.vae.decoder,
                                                                           warm_iters=2, pool=pool))
        return entry

    def _capture(
        self, frames: int, device: torch.device, decode: Callable[[torch.Tensor], torch.Tensor], *, warm_iters: int, pool
    ) -> _GraphEntry:
        """Capture ``decode`` on zero latents of ``frames`` frames (the warm iterations let cuDNN choose its
        algorithms and Inductor finish compiling before anything is recorded)."""
        static_latents = torch.zeros(1, self.latent_dim, frames, device=device, dtype=self.dtype)
        with torch.inference_mode():
            graph, static_samples = capture(lambda: decode(static_latents), warm_runs=warm_iters, pool=pool,
                                            device=device)
        return _GraphEntry(graph=graph, static_latents=static_latents, static_samples=static_samples)


__all__ = ["DEFAULT_COMPILE_SHAPES", "MODES", "AudioDecodeGraphs"]
