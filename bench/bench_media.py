"""Benchmark app.media: encode time per 12-frame block, segment size, and how much of a block is held back.

Prints ONE JSON line. Compares our path (one fragment per block, written by app/fmp4.py) against the
naive reference (FFmpeg's mp4 muxer through PyAV with ``frag_keyframe``), which holds each fragment
until the next keyframe arrives: the held-back frames after each block are the latency we remove.

    python bench/bench_media.py [--blocks 12]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import struct
import sys
import time

import av
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from app import fmp4  # noqa: E402
from app.media import AudioSpec, FragmentedMp4Stream, open_h264_encoder_name  # noqa: E402

FPS, BLOCK, SR = 16, 12, 48000
SIZES = ((256, 144), (832, 480))


def synthetic_frames(first: int, count: int, width: int, height: int) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    out = np.empty((count, height, width, 3), np.uint8)
    for i in range(count):
        t = first + i
        out[i, ..., 0] = 128 + 100 * np.sin((x + 3 * t) / 23)
        out[i, ..., 1] = 128 + 100 * np.cos((y + 2 * t) / 17)
        out[i, ..., 2] = 128 + 80 * np.sin((x + y - 4 * t) / 31)
    return out


def synthetic_pcm(first: int, count: int) -> np.ndarray:
    t = np.arange(first, first + count) / SR
    return np.stack([0.4 * np.sin(2 * np.pi * 330 * t), 0.4 * np.sin(2 * np.pi * 440 * t)]).astype(np.float32)


def video_samples_in(data: bytes) -> int:
    """Video samples in all fragments of ``data`` (trun sample counts of track 1)."""
    total = 0
    for kind, start, end in fmp4.iter_boxes(data):
        if kind != b"moof":
            continue
        for traf_kind, traf_start, traf_end in fmp4.iter_boxes(data, start, end):
            if traf_kind != b"traf":
                continue
            children = {k: s for k, s, _ in fmp4.iter_boxes(data, traf_start, traf_end)}
            (track_id,) = struct.unpack_from(">I", data, children[b"tfhd"] + 4)
            if track_id == 1:
                total += struct.unpack_from(">I", data, children[b"trun"] + 4)[0]
    return total


def bench_ours(width: int, height: int, audio: bool, blocks: int, inputs) -> dict:
    started = time.perf_counter()
    stream = FragmentedMp4Stream(width, height, fps=FPS, audio=AudioSpec(SR, 2) if audio else None)
    init = stream.init_segment()
    init_ms = (time.perf_counter() - started) * 1e3
    times, sizes, held_back = [], [], []
    for n in range(blocks):
        frames, pcm = inputs[n % len(inputs)]
        t0 = time.perf_counter()
        segment = stream.encode_block(frames, pcm if audio else None)
        times.append((time.perf_counter() - t0) * 1e3)
        sizes.append(len(segment))
        held_back.append(len(frames) - video_samples_in(segment))  # frames of this block not in its bytes
    measured = times[2:]  # first blocks pay for encoder warm-up
    return {
        "encode_ms_median": round(statistics.median(measured), 2),
        "encode_ms_max": round(max(measured), 2),
        "segment_bytes_mean": int(statistics.mean(sizes)),
        "init_bytes": len(init),
        "init_ready_ms": round(init_ms, 2),
        "held_back_frames_max": max(held_back),
        "mime": stream.mime,
    }


def bench_reference_muxer(width: int, height: int, blocks: int, inputs) -> dict:
    """FFmpeg's fragmenting mp4 muxer (keyframe per block): what has reached the byte stream per block."""
    sink = io.BytesIO()
    container = av.open(sink, mode="w", format="mp4",
                        options={"movflags": "frag_keyframe+empty_moov+default_base_moof"})
    stream = container.add_stream("libx264", rate=FPS)
    stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
    stream.codec_context.options = {"preset": "ultrafast", "tune": "zerolatency", "forced-idr": "1"}
    times, held_back, emitted = [], [], 0
    for n in range(blocks):
        frames, _ = inputs[n % len(inputs)]
        t0 = time.perf_counter()
        for i, rgb in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
            frame.pict_type = av.video.frame.PictureType.I if i == 0 else av.video.frame.PictureType.NONE
            container.mux(stream.encode(frame))
        times.append((time.perf_counter() - t0) * 1e3)
        emitted_total = video_samples_in(sink.getvalue())
        held_back.append((n + 1) * BLOCK - emitted_total)
        emitted = emitted_total
    container.close()
    return {
        "encode_ms_median": round(statistics.median(times[2:]), 2),
        "held_back_frames_max": max(held_back),
        "held_back_ms": round(max(held_back) / FPS * 1e3, 1),
        "frames_in_output_before_close": emitted,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12)
    args = parser.parse_args()
    result = {
        "bench": "media",
        "encoder": open_h264_encoder_name(),
        "block_frames": BLOCK,
        "fps": FPS,
        "cpu_count": os.cpu_count(),
        "pyav": av.__version__,
    }
    for width, height in SIZES:
        inputs = [(synthetic_frames(n * BLOCK, BLOCK, width, height), synthetic_pcm(n * 36000, 36000)) for n in range(4)]
        key = f"{width}x{height}"
        result[key] = {
            "audio_off": bench_ours(width, height, False, args.blocks, inputs),
            "audio_on": bench_ours(width, height, True, args.blocks, inputs),
            "reference_ffmpeg_muxer": bench_reference_muxer(width, height, args.blocks, inputs),
        }
        result[key]["realtime_budget_ms"] = round(BLOCK / FPS * 1e3, 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
