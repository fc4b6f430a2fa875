"""Pictures and clips for the input tests: world scenes as uint8 frames, the codec's round trip, sessions
run through the runner (the engine's device side) with an image, a clip or live input, and readings."""

from __future__ import annotations

import io
import struct
import zlib

import av
import numpy as np
import torch
from PIL import Image

from engine.plan import LiveFrames, OpenSession, SessionWork, StepPlan
from world import measure
from world.clips import make_clip
from world.grammar import Scene
from world.render import Shades, render_with_coverage


def scene_frames(scene: Scene, seed: int, latent_frames: int) -> np.ndarray:
    """The world's clip of ``scene``: ``[1 + 4 (n - 1), 144, 256, 3]`` uint8."""
    video = make_clip(scene, seed, latent_frames).video  # [3, T, H, W] in [-1, 1]
    return ((video.permute(1, 2, 3, 0) + 1) / 2 * 255).round().clamp(0, 255).to(torch.uint8).numpy()


def scene_picture(scene: Scene, x: float, y: float, shades: Shades | None = None) -> np.ndarray:
    """One frame of ``scene`` with its object centred at ``(x, y)`` pixels: ``[1, 144, 256, 3]`` uint8
    (``shades``: in those colours, not the palette's)."""
    picture = render_with_coverage(scene, np.array([x]), np.array([y]), shades=shades)[0]  # [3, 1, H, W] in [0, 1]
    return (picture.permute(1, 2, 3, 0) * 255).round().clamp(0, 255).to(torch.uint8).numpy()


def round_trip(bundle, frames: np.ndarray) -> np.ndarray:
    """``frames`` through the engine's codec in one call each way (a fresh stream): what the model sees of them."""
    encoder, decoder = bundle.encoder, bundle.decoder
    latents = encoder.encode_chunk(encoder.from_uint8(frames), encoder.new_state("round-trip"))
    return decoder.to_uint8(decoder.decode_chunk(latents, decoder.new_state("round-trip")))


def run_session(runner, session_id: str, prompt: str, *, blocks: int, seed: int = 0, context=None,
                live: np.ndarray | None = None, strength: float = 0.0) -> list[np.ndarray]:
    """A session's chunks (uint8 frames each): opened (from ``context`` frames, when given), then ``blocks`` blocks,
    each offered the next frames of ``live`` at ``strength`` (a block's worth: the opening block takes 4 fewer; the
    core's bookkeeping: what the runner says a work took leaves the offer). Released at the end."""
    outputs = []
    first_step = runner.pipeline.first_step_for(strength)
    used = 0

    def work(item: SessionWork) -> None:
        nonlocal used
        dispatch = runner.dispatch(StepPlan(work=[item]))
        assert not dispatch.failures and not dispatch.fatal, dispatch.failures
        pieces = []  # a block's latent frames come as pieces: one output per block, as a client plays them
        for pending in dispatch.pending:
            output, _ = pending.wait()
            used += pending.input_frames_taken
            if output is not None:
                pieces.append(output.frames)
                if output.last_piece or output.opening_frame:
                    outputs.append(np.concatenate(pieces))
                    pieces = []

    try:
        work(SessionWork(session_id, open=OpenSession(seed, prompt, "", context)))
        while len(outputs) < blocks + (context is not None):
            block = 4 * runner.pipeline.frames_per_block
            offer = None if live is None else LiveFrames(first_step, tuple(live[used : used + block]), used)
            work(SessionWork(session_id, run=True, live=offer))
    finally:
        runner.release(session_id, "test")
    return outputs


def centroid(frame: np.ndarray) -> np.ndarray | None:
    reading = measure.read_frame(frame)
    return np.array(reading.centroid) if reading.has_object else None


def mean_abs_step(a: np.ndarray, b: np.ndarray) -> float:
    """Mean absolute difference of two uint8 frames, in levels (0-255)."""
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).mean())


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(((a.astype(np.float64) - b.astype(np.float64)) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


def png_bytes(frame: np.ndarray, mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(frame).convert(mode).save(buffer, format="PNG")
    return buffer.getvalue()


def jpeg_bytes(frame: np.ndarray, quality: int = 90) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def clip_bytes(frames: np.ndarray, fps: int = 16, container: str = "mp4", codec: str = "libx264") -> bytes:
    """``frames`` (uint8 ``[T, H, W, 3]``) as an MP4/H.264 (or WebM/VP9) file."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format=container) as output:
        stream = output.add_stream(codec, rate=fps)
        stream.width, stream.height, stream.pix_fmt = frames.shape[2], frames.shape[1], "yuv420p"
        if codec == "libx264":
            stream.options = {"crf": "12"}
        for frame in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                output.mux(packet)
        for packet in stream.encode():
            output.mux(packet)
    return buffer.getvalue()


def png_header_claiming(width: int, height: int) -> bytes:
    """A tiny, well-formed PNG whose header claims ``width x height`` pixels (a decompression bomb's shape)."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
