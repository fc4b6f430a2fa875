"""Decoding what clients send (app/media_input.py): any picture mode to RGB at the session's size, clips sampled at
the session's frame rate, and every bound checked before it costs anything."""

import io

import numpy as np
import pytest
from PIL import Image

from app.media_input import FrameSize, MediaRejected, decode_clip, decode_image, sniff
from tests.input_helpers import clip_bytes, jpeg_bytes, png_bytes, png_header_claiming

SIZE = FrameSize(64, 48)
IMAGE = {"max_bytes": 1 << 20, "max_pixels": 4096 * 4096}
CLIP = {"fps": 16, "max_frames_kept": 13, "max_bytes": 1 << 22, "max_seconds": 10.0, "max_pixels": 1920 * 1080}


def _halves(width: int = 96, height: int = 48) -> np.ndarray:
    """Left half red, right half blue, a green stripe in the middle third."""
    frame = np.zeros((height, width, 3), dtype=np.uint8)
    frame[:, : width // 2, 0] = 255
    frame[:, width // 2 :, 2] = 255
    frame[:, width // 3 : 2 * width // 3, 1] = 255
    return frame


def _rejected(call, code: str) -> str:
    with pytest.raises(MediaRejected) as caught:
        call()
    assert caught.value.code == code, caught.value.message
    return caught.value.message


def test_every_picture_mode_becomes_rgb_at_the_sessions_size_by_cover_and_centre_crop():
    picture = _halves()  # 96 x 48 -> 64 x 48: scaled by 1 (it covers already), 16 px cut off each side
    for mode in ("RGB", "RGBA", "P", "L", "LA", "1", "CMYK", "I;16"):
        if mode == "CMYK":
            data = _encode(Image.fromarray(picture).convert("CMYK"), "JPEG")
        elif mode == "I;16":
            data = _encode(Image.fromarray((picture[:, :, 0].astype(np.uint16) * 257)), "PNG")
        else:
            data = png_bytes(picture, mode)
        frame = decode_image(data, SIZE, **IMAGE)
        assert frame.shape == (48, 64, 3) and frame.dtype == np.uint8, mode
    frame = decode_image(png_bytes(picture), SIZE, **IMAGE)
    # Centre crop: the stripe (a third of 96 = 32 px) is now half of 64, the halves' edges are cut evenly.
    assert frame[24, 0, 0] > 200 and frame[24, 63, 2] > 200 and frame[24, 32, 1] > 200
    assert frame[24, 10, 1] < 50 and frame[24, 53, 1] < 50
    # Alpha is flattened onto black.
    transparent = np.dstack([picture, np.zeros(picture.shape[:2], np.uint8)])
    assert decode_image(_encode(Image.fromarray(transparent, "RGBA"), "PNG"), SIZE, **IMAGE).max() == 0
    # WebP and JPEG too; a small picture is scaled up to cover the frame.
    tiny = _halves(24, 12)
    for data in (_encode(Image.fromarray(tiny), "WEBP", lossless=True), jpeg_bytes(tiny, 95)):
        assert decode_image(data, SIZE, **IMAGE).shape == (48, 64, 3)


def _encode(picture: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    picture.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def test_exif_orientation_is_applied():
    picture = Image.fromarray(_halves(48, 96).transpose(1, 0, 2).copy())  # red on top, blue below
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to view: red then ends up on the right
    frame = decode_image(_encode(picture, "JPEG", exif=exif.tobytes(), quality=95), SIZE, **IMAGE)
    assert frame[24, 60, 0] > 200 and frame[24, 3, 2] > 200


def test_bad_pictures_are_refused_with_the_protocols_codes():
    assert _rejected(lambda: decode_image(b"not a picture at all", SIZE, **IMAGE), "invalid_media")
    assert "empty" in _rejected(lambda: decode_image(b"", SIZE, **IMAGE), "invalid_media")
    truncated = png_bytes(_halves())[:-40]
    _rejected(lambda: decode_image(truncated, SIZE, **IMAGE), "invalid_media")
    # 20,000 x 20,000 claimed by a 100-byte file: refused from its header, nothing allocated.
    bomb = png_header_claiming(20_000, 20_000)
    assert len(bomb) < 200
    _rejected(lambda: decode_image(bomb, SIZE, **IMAGE), "media_too_large")
    _rejected(lambda: decode_image(png_header_claiming(5000, 5000), SIZE, **IMAGE), "media_too_large")
    _rejected(lambda: decode_image(png_bytes(_halves()), SIZE, max_bytes=100, max_pixels=1 << 20), "media_too_large")
    # A clip is not a picture, and a picture is not a clip.
    clip = clip_bytes(np.zeros((5, 48, 64, 3), np.uint8))
    assert sniff(clip) == "mp4"
    _rejected(lambda: decode_image(clip, SIZE, **IMAGE), "invalid_media")
    _rejected(lambda: decode_clip(png_bytes(_halves()), SIZE, **CLIP), "invalid_media")


def _numbered(count: int) -> np.ndarray:
    """Frames whose red level numbers them (k * 9), on a grey field."""
    frames = np.full((count, 48, 64, 3), 128, dtype=np.uint8)
    for k in range(count):
        frames[k, :, :, 0] = min(255, 9 * k)
    return frames


def test_a_clip_is_sampled_at_the_sessions_rate_and_its_last_window_kept():
    # 16 fps in: frame for frame; 21 frames -> the last 13 (1 + 4 x 3, the context's bound here).
    frames = decode_clip(clip_bytes(_numbered(21), fps=16), SIZE, **CLIP)
    assert frames.shape == (13, 48, 64, 3)
    assert [round(level / 9) for level in frames[:, 24, 32, 0]] == list(range(8, 21))
    # 32 fps in: every other frame; 20 frames (0.625 s) -> 10 at 16 fps -> 9 kept (1 + 4 x 2).
    frames = decode_clip(clip_bytes(_numbered(20), fps=32), SIZE, **CLIP)
    assert [round(level / 9) for level in frames[:, 24, 32, 0]] == [2, 4, 6, 8, 10, 12, 14, 16, 18]
    # WebM / VP9, 8 fps: each frame shown twice.
    frames = decode_clip(clip_bytes(_numbered(3), fps=8, container="webm", codec="libvpx-vp9"), SIZE, **CLIP)
    assert [round(level / 9) for level in frames[:, 24, 32, 0]] == [0, 0, 1, 1, 2]


def test_clips_over_the_bounds_are_refused():
    long = clip_bytes(_numbered(23), fps=2)  # 11.5 s
    assert "longer than 10 s" in _rejected(lambda: decode_clip(long, SIZE, **CLIP), "media_too_large")
    big = clip_bytes(np.zeros((2, 96, 128, 3), np.uint8))
    _rejected(lambda: decode_clip(big, SIZE, **{**CLIP, "max_pixels": 64 * 64}), "media_too_large")
    _rejected(lambda: decode_clip(clip_bytes(_numbered(5))[:400], SIZE, **CLIP), "invalid_media")
    _rejected(lambda: decode_clip(b"\x1a\x45\xdf\xa3" + b"\0" * 64, SIZE, **CLIP), "invalid_media")
