"""Pictures and clips from clients -> uint8 RGB frames at the session's size (docs/PROTOCOL.md, "Pictures and video in").

Everything here reads bytes a client chose, so every step is bounded before it costs anything:

- the format is recognised from the content (magic bytes) and only that decoder or demuxer runs: no probing,
  so a file cannot pick one of ffmpeg's other demuxers (some open further files or URLs);
- an image's pixel count is read from its header before a pixel is decoded (Pillow's own decompression-bomb
  check stays as a second guard); a clip's every decoded frame is checked, and its duration, and the number
  of frames decoded;
- any mode becomes RGB (palette, grey, 16-bit, CMYK; alpha flattened onto black; EXIF orientation applied),
  then the picture is scaled (bicubic) to cover the session's frame and cropped around its centre.

Every failure is a :class:`MediaRejected` with the protocol's code and a message that names no client data.
The functions are pure and block: callers run them off the event loop.
"""

from __future__ import annotations

import io
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Literal

import av
import numpy as np
from PIL import Image, ImageOps

ImageFormat = Literal["png", "jpeg", "webp"]
ClipFormat = Literal["mp4", "webm"]
IMAGE_FORMATS: dict[str, str] = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}  # ours -> Pillow's plugin
CLIP_DEMUXERS: dict[str, str] = {"mp4": "mov", "webm": "matroska"}  # ours -> ffmpeg's demuxer
CLIP_CODECS = frozenset({"h264", "hevc", "vp8", "vp9", "av1"})
MAX_DECODED_FPS = 120  # a clip may hold at most this many frames per second of its bound


class MediaRejected(Exception):
    """Bytes a client sent that the server will not use; ``code`` is the protocol's error code."""

    def __init__(self, code: Literal["invalid_media", "media_too_large"], message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class FrameSize:
    """The session's frame: what every picture is scaled and cropped to."""

    width: int
    height: int


def sniff(data: bytes) -> str | None:
    """The format of ``data`` by its first bytes: ``png``, ``jpeg``, ``webp``, ``mp4`` (ISO BMFF), ``webm``
    (Matroska), or None."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "png"
    if data.startswith(b"\xff\xd8\xff"):
        return "jpeg"
    if len(data) >= 12 and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    if len(data) >= 12 and data[4:8] == b"ftyp":
        return "mp4"
    if data.startswith(b"\x1a\x45\xdf\xa3"):
        return "webm"
    return None


def decode_image(data: bytes, size: FrameSize, *, max_bytes: int, max_pixels: int, what: str = "image") -> np.ndarray:
    """One PNG, JPEG or WebP picture -> ``[H, W, 3]`` uint8 at ``size`` (an animated one: its first frame)."""
    _check_bytes(data, max_bytes, what)
    kind = sniff(data)
    if kind not in IMAGE_FORMATS:
        raise MediaRejected("invalid_media", f"the {what} is not a PNG, JPEG or WebP picture")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            picture = Image.open(io.BytesIO(data), formats=[IMAGE_FORMATS[kind]])
            width, height = picture.size  # from the header: nothing decoded yet
            if width <= 0 or height <= 0:
                raise MediaRejected("invalid_media", f"the {what} has no pixels")
            if width * height > max_pixels:
                raise MediaRejected("media_too_large", f"the {what} has {width}x{height} pixels; at most {max_pixels} are accepted")
            if kind == "jpeg":
                picture.draft("RGB", (size.width, size.height))  # decode at a reduced scale where JPEG allows
            picture.load()
            picture = ImageOps.exif_transpose(picture)
            return _fit(_to_rgb(picture), size)
    except MediaRejected:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise MediaRejected("media_too_large", f"the {what} has more pixels than accepted") from None
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, MemoryError) as error:
        # Pillow reports a truncated or corrupt file in these; the client learns only that it is unreadable.
        raise MediaRejected("invalid_media", f"the {what} cannot be read ({type(error).__name__})") from None


def decode_clip(
    data: bytes, size: FrameSize, *, fps: int, max_frames_kept: int, max_bytes: int, max_seconds: float,
    max_pixels: int,
) -> np.ndarray:
    """An MP4 or WebM clip -> its last ``1 + 4 (n - 1)`` frames at ``fps`` (``n`` as many latent frames as it
    fills, at most ``max_frames_kept`` frames), ``[T, H, W, 3]`` uint8 at ``size``.

    Sampled by timestamps: output frame ``k`` is the clip's frame showing at ``k / fps`` s after its first.
    """
    _check_bytes(data, max_bytes, "clip")
    kind = sniff(data)
    if kind not in CLIP_DEMUXERS:
        raise MediaRejected("invalid_media", "the clip is not an MP4 or WebM file")
    kept: deque[np.ndarray] = deque(maxlen=max_frames_kept)
    try:
        with av.open(io.BytesIO(data), format=CLIP_DEMUXERS[kind], options={"enable_drefs": "0"}) as container:
            if not container.streams.video:
                raise MediaRejected("invalid_media", "the clip has no video track")
            stream = container.streams.video[0]
            if stream.codec_context.name not in CLIP_CODECS:
                raise MediaRejected("invalid_media", f"the clip's video is not one of {', '.join(sorted(CLIP_CODECS))}")
            stream.codec_context.thread_count = 1  # one core per clip: other sessions share this machine
            if stream.duration is not None and stream.time_base is not None:
                if float(stream.duration * stream.time_base) > max_seconds + 1e-3:
                    raise MediaRejected("media_too_large", f"the clip is longer than {max_seconds:g} s")
            _sample(container.decode(stream), kept, size, fps=fps, max_seconds=max_seconds, max_pixels=max_pixels)
    except MediaRejected:
        raise
    except (av.FFmpegError, ValueError, OSError, EOFError, MemoryError) as error:
        raise MediaRejected("invalid_media", f"the clip cannot be read ({type(error).__name__})") from None
    if not kept:
        raise MediaRejected("invalid_media", "the clip has no frame that decodes")
    frames = np.stack(kept)
    usable = 1 + (frames.shape[0] - 1) // 4 * 4  # whole latent frames: 1, then 4 per latent frame
    return frames[frames.shape[0] - usable :]


def _sample(decoded, kept: deque, size: FrameSize, *, fps: int, max_seconds: float, max_pixels: int) -> None:
    """Append to ``kept`` the frame showing at every ``k / fps`` s of the decoded stream, fitted to ``size``."""
    first_time = None
    previous = None  # (time, frame) of the last decoded frame
    target = 0  # index of the next output frame
    count = 0
    for frame in decoded:
        count += 1
        if count > max_seconds * MAX_DECODED_FPS + 1:
            raise MediaRejected("media_too_large", f"the clip has more than {MAX_DECODED_FPS} frames per second")
        if frame.width * frame.height > max_pixels or frame.width <= 0 or frame.height <= 0:
            raise MediaRejected("media_too_large", f"the clip's frames have {frame.width}x{frame.height} pixels; "
                                                   f"at most {max_pixels} are accepted")
        time = frame.time if frame.time is not None else count - 1
        if first_time is None:
            first_time = time
        time -= first_time
        if time > max_seconds + 1e-3:
            raise MediaRejected("media_too_large", f"the clip is longer than {max_seconds:g} s")
        if previous is not None:
            # Every output time before this frame shows the previous frame.
            while target / fps < time - 1e-6:
                kept.append(fit_video_frame(previous[1], size))
                target += 1
        previous = (time, frame)
    if previous is not None:
        while target / fps <= previous[0] + 1e-6:
            kept.append(fit_video_frame(previous[1], size))
            target += 1


def fit_video_frame(frame: av.VideoFrame, size: FrameSize) -> np.ndarray:
    """A decoded video frame (a clip's, a camera's) scaled to cover ``size`` and cropped around its centre."""
    return _fit(frame.to_image(), size)


def _check_bytes(data: bytes, max_bytes: int, what: str) -> None:
    if not data:
        raise MediaRejected("invalid_media", f"the {what} is empty (0 bytes)")
    if len(data) > max_bytes:
        raise MediaRejected("media_too_large", f"the {what} has {len(data)} bytes; at most {max_bytes} are accepted")


def _to_rgb(picture: Image.Image) -> Image.Image:
    """Any Pillow mode -> RGB: 16- and 32-bit grey scaled to 8 bits, alpha flattened onto black."""
    if picture.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):
        values = np.asarray(picture, dtype=np.float64)
        top = 1.0 if picture.mode == "F" else 65535.0
        grey = np.clip(np.round(values / top * 255.0), 0, 255).astype(np.uint8)
        return Image.fromarray(grey).convert("RGB")
    if picture.mode in ("RGBA", "LA", "PA", "RGBa", "La") or (picture.mode == "P" and "transparency" in picture.info):
        rgba = picture.convert("RGBA")
        black = Image.new("RGBA", rgba.size, (0, 0, 0, 255))
        return Image.alpha_composite(black, rgba).convert("RGB")
    return picture.convert("RGB")


def _fit(picture: Image.Image, size: FrameSize) -> np.ndarray:
    """Scaled to cover ``size`` and cropped around the centre (nothing stretched), as uint8 ``[H, W, 3]``."""
    if picture.mode != "RGB":
        picture = _to_rgb(picture)
    fitted = ImageOps.fit(picture, (size.width, size.height), method=Image.Resampling.BICUBIC, centering=(0.5, 0.5))
    return np.asarray(fitted, dtype=np.uint8).copy()
