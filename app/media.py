"""Media encoding for arstream: uint8 RGB frames + float PCM -> H.264 (+ Opus/AAC) in MP4.

Two consumers, one module:
- the web service: one :class:`FragmentedMp4Stream` per attached client, one media segment (moof + mdat)
  per AR block, returned the moment the block is encoded (see ``app/fmp4.py`` for why we write the
  boxes ourselves);
- ``arstream generate``: :class:`Mp4FileWriter` / :func:`write_mp4`, a normal (non-fragmented) MP4.

Inputs are plain numpy: video ``uint8 [T, H, W, 3]`` RGB, audio ``float32 [channels, samples]`` in
[-1, 1]. This module knows nothing of torch, asyncio or sockets. Everything here is synchronous and
CPU-bound: call it from a worker thread, never from an event loop. Objects are not thread-safe: one
thread at a time per object.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Iterable, Sequence

import av
import numpy as np
from av.codec.context import Flags
from av.video.frame import PictureType
from av.video.reformatter import ColorRange, Colorspace, VideoReformatter

from app import fmp4

VIDEO_ENCODER_PREFERENCE = ("h264_nvenc", "libx264", "libopenh264")
AUDIO_ENCODER_PREFERENCE = ("libopus", "aac")

# Low-latency settings per encoder: no B-frames, no lookahead, keyframes only where we force them.
_VIDEO_ENCODER_OPTIONS = {
    "libx264": {"preset": "ultrafast", "tune": "zerolatency", "forced-idr": "1", "x264-params": "scenecut=0"},
    "h264_nvenc": {"preset": "p1", "tune": "ull", "zerolatency": "1", "forced-idr": "1", "delay": "0"},
}
_PROBE_SIZE = (256, 144)  # small, but above NVENC's minimum frame size
MAX_FRAMES_PER_BLOCK = 256
MAX_AUDIO_SECONDS_PER_BLOCK = 30.0


# --- encoder detection ----------------------------------------------------------------------------


def _new_video_context(name: str, width: int, height: int, fps: int, global_header: bool) -> av.CodecContext:
    ctx = av.CodecContext.create(name, "w")
    ctx.width, ctx.height, ctx.pix_fmt = width, height, "yuv420p"
    ctx.time_base = Fraction(1, fps)
    ctx.framerate = Fraction(fps)
    ctx.max_b_frames = 0
    ctx.gop_size = 10 * fps  # we force an IDR at every block start; this only caps very long blocks
    # Signal what we convert with (BT.709, limited range) so every player converts back the same way.
    ctx.colorspace, ctx.color_primaries, ctx.color_trc, ctx.color_range = 1, 1, 1, ColorRange.MPEG
    if global_header:
        ctx.flags |= Flags.global_header  # SPS/PPS go to extradata -> avcC, not in-band
    ctx.options = dict(_VIDEO_ENCODER_OPTIONS.get(name, {}))
    return ctx


def _rgb_to_encoder_frame(rgb: np.ndarray, pts: int, reformatter: VideoReformatter) -> av.VideoFrame:
    """RGB -> yuv420p BT.709 limited range. Pass one reformatter per stream: it caches the swscale
    context, which costs more to build than converting a frame."""
    frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
    frame = reformatter.reformat(
        frame, format="yuv420p", dst_colorspace=Colorspace.ITU709, dst_color_range=ColorRange.MPEG
    )
    frame.pts = pts
    return frame


def open_h264_encoder_name(preferred: Sequence[str] = VIDEO_ENCODER_PREFERENCE) -> str:
    """Name of the first H.264 encoder in ``preferred`` that actually opens and encodes a frame.

    Detection is by opening, never by ``av.codecs_available``: PyAV lists ``h264_nvenc`` on machines
    without NVENC hardware (H100/H200). Cached per preference list. Raises RuntimeError if none works.
    """
    return _first_working_h264_encoder(tuple(preferred))


@functools.lru_cache(maxsize=None)
def _first_working_h264_encoder(preferred: tuple[str, ...]) -> str:
    failures = []
    for name in preferred:
        try:
            ctx = _new_video_context(name, *_PROBE_SIZE, fps=16, global_header=True)
            ctx.open()
            rgb = np.zeros((_PROBE_SIZE[1], _PROBE_SIZE[0], 3), np.uint8)
            packets = ctx.encode(_rgb_to_encoder_frame(rgb, 0, VideoReformatter())) + ctx.encode(None)
            if packets:
                return name
            failures.append(f"{name}: produced no packet")
        except Exception as exc:  # noqa: BLE001 - any failure means "not usable here"
            failures.append(f"{name}: {exc}")
    raise RuntimeError("no usable H.264 encoder; tried " + "; ".join(failures))


def _open_video_encoder(names: Sequence[str], width: int, height: int, fps: int) -> tuple[str, av.CodecContext]:
    """Open the detected encoder for a stream, falling back along ``names`` if this open fails
    (e.g. NVENC's per-GPU session limit is reached while the probe had succeeded)."""
    names = list(names)
    detected = open_h264_encoder_name(names)
    errors = []
    for name in names[names.index(detected):]:
        try:
            ctx = _new_video_context(name, width, height, fps, global_header=True)
            ctx.open()
            return name, ctx
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{name}: {exc}")
    raise RuntimeError(f"cannot open an H.264 encoder at {width}x{height}: " + "; ".join(errors))


def _new_audio_context(name: str, sample_rate: int, channels: int, global_header: bool) -> av.CodecContext:
    ctx = av.CodecContext.create(name, "w")
    ctx.sample_rate = sample_rate
    ctx.layout = "mono" if channels == 1 else "stereo"
    formats = [f.name for f in ctx.codec.audio_formats or ()]
    ctx.format = next((f for f in ("flt", "fltp", "s16") if f in formats), formats[0] if formats else "fltp")
    ctx.time_base = Fraction(1, sample_rate)
    if global_header:
        ctx.flags |= Flags.global_header
    return ctx


def open_audio_encoder_name(
    preferred: Sequence[str] = AUDIO_ENCODER_PREFERENCE, sample_rate: int = 48000, channels: int = 2
) -> str:
    """Name of the first audio encoder in ``preferred`` that opens at this rate/layout (Opus, else AAC).
    Detected by opening, cached. Raises RuntimeError if none opens."""
    return _first_working_audio_encoder(tuple(preferred), sample_rate, channels)


@functools.lru_cache(maxsize=None)
def _first_working_audio_encoder(preferred: tuple[str, ...], sample_rate: int, channels: int) -> str:
    failures = []
    for name in preferred:
        try:
            _new_audio_context(name, sample_rate, channels, global_header=True).open()
            return name
        except Exception as exc:  # noqa: BLE001
            failures.append(f"{name}: {exc}")
    raise RuntimeError("no usable audio encoder; tried " + "; ".join(failures))


@dataclass(frozen=True)
class EncoderWarmup:
    """What :func:`warm_up_encoders` did, and how long each part took (for the start-up log)."""

    video_encoder: str
    audio_encoder: str | None
    probe_s: float  # finding the encoders by opening them (the first socket paid this before the warm-up)
    stream_s: float  # opening one stream at the service's size and encoding one block through it


def warm_up_encoders(width: int, height: int, fps: int, frames: int, audio: AudioSpec | None = None) -> EncoderWarmup:
    """Detect the encoders and push one block of ``frames`` through a stream at the service's size, so the
    first socket finds everything opened once before.

    Why: detection opens each preferred encoder in turn, and the first of them, ``h264_nvenc``, fails on a
    GPU without NVENC (H100/H200) only after FFmpeg has loaded the driver's encode library and made a CUDA
    context for it. Cached after the first call, that cost otherwise falls on the first socket, between its
    session being created and its ``session`` message. Synchronous: run it in a worker thread.
    """
    started = time.perf_counter()
    video = open_h264_encoder_name()
    audio_name = open_audio_encoder_name(audio.encoders, audio.sample_rate, audio.channels) if audio else None
    probed = time.perf_counter()
    stream = FragmentedMp4Stream(width, height, fps, audio=audio)
    rgb = np.random.default_rng(0).integers(0, 256, (frames, height, width, 3), dtype=np.uint8)
    stream.encode_block(rgb)
    stream.close()
    return EncoderWarmup(video, audio_name, probed - started, time.perf_counter() - probed)


# --- validation -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class AudioSpec:
    """Audio of a stream: PCM arrives as float32 [channels, samples] at ``sample_rate``."""

    sample_rate: int = 48000
    channels: int = 2
    encoders: tuple[str, ...] = AUDIO_ENCODER_PREFERENCE  # tried in order, by opening

    def __post_init__(self) -> None:
        if self.channels not in (1, 2):
            raise ValueError(f"audio channels must be 1 or 2, got {self.channels}")
        if not 8000 <= self.sample_rate <= 192000:
            raise ValueError(f"audio sample_rate out of range: {self.sample_rate}")


def _check_geometry(width: int, height: int, fps: int) -> None:
    if width <= 0 or height <= 0 or width % 2 or height % 2:
        raise ValueError(f"width and height must be positive and even (yuv420p), got {width}x{height}")
    if not (isinstance(fps, int) and 1 <= fps <= 240):
        raise ValueError(f"fps must be an integer in 1..240, got {fps!r}")


def _check_frames(frames: np.ndarray, width: int, height: int) -> np.ndarray:
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8:
        raise ValueError(f"frames must be a numpy uint8 array, got {getattr(frames, 'dtype', type(frames))}")
    if frames.ndim != 4 or frames.shape[1:] != (height, width, 3):
        raise ValueError(f"frames must have shape [T, {height}, {width}, 3], got {list(frames.shape)}")
    if not 1 <= frames.shape[0] <= MAX_FRAMES_PER_BLOCK:
        raise ValueError(f"a block holds 1..{MAX_FRAMES_PER_BLOCK} frames, got {frames.shape[0]}")
    return np.ascontiguousarray(frames)


def _check_pcm(pcm: np.ndarray, spec: AudioSpec) -> np.ndarray:
    if not isinstance(pcm, np.ndarray) or pcm.dtype != np.float32:
        raise ValueError(f"audio must be a numpy float32 array, got {getattr(pcm, 'dtype', type(pcm))}")
    if pcm.ndim != 2 or pcm.shape[0] != spec.channels:
        raise ValueError(f"audio must have shape [{spec.channels}, samples], got {list(pcm.shape)}")
    if pcm.shape[1] > MAX_AUDIO_SECONDS_PER_BLOCK * spec.sample_rate:
        raise ValueError(f"audio block longer than {MAX_AUDIO_SECONDS_PER_BLOCK} s")
    # NaN/inf would reach the codec as garbage; out-of-range values would wrap in s16 paths.
    return np.clip(np.nan_to_num(pcm, nan=0.0, posinf=1.0, neginf=-1.0), -1.0, 1.0)


# --- audio framing --------------------------------------------------------------------------------


class _PcmFramer:
    """Cuts a PCM stream into encoder-sized AudioFrames, keeping the remainder for the next push."""

    def __init__(self, ctx: av.CodecContext, channels: int):
        self.frame_size = ctx.frame_size or 1024
        self.format = ctx.format.name
        self.layout = "mono" if channels == 1 else "stereo"
        self.sample_rate = ctx.sample_rate
        self.pending = np.zeros((channels, 0), np.float32)
        self.samples_framed = 0  # pts of the next frame

    def _frame(self, pcm: np.ndarray) -> av.AudioFrame:
        if self.format == "flt":
            data = pcm.T.reshape(1, -1)  # packed: interleave channels
        elif self.format == "s16":
            data = (pcm.T.reshape(1, -1) * 32767.0).round().astype(np.int16)
        else:
            data = pcm
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(data), format=self.format, layout=self.layout)
        frame.sample_rate = self.sample_rate
        frame.pts = self.samples_framed
        self.samples_framed += pcm.shape[1]
        return frame

    def push(self, pcm: np.ndarray) -> list[av.AudioFrame]:
        buf = np.concatenate([self.pending, pcm], axis=1) if self.pending.shape[1] else pcm
        whole = buf.shape[1] // self.frame_size * self.frame_size
        frames = [self._frame(buf[:, i : i + self.frame_size]) for i in range(0, whole, self.frame_size)]
        self.pending = buf[:, whole:].copy()
        return frames

    def drain(self) -> list[av.AudioFrame]:
        """The short last frame (encoders we use accept one), then nothing is pending."""
        frames = [self._frame(self.pending)] if self.pending.shape[1] else []
        self.pending = self.pending[:, :0]
        return frames


# --- the streaming encoder ------------------------------------------------------------------------


class FragmentedMp4Stream:
    """H.264 (+ Opus/AAC) fragmented MP4 for one attached client: an init segment, then one media
    segment per block.

    Contract:
    - :meth:`init_segment` (ftyp + moov) is ready as soon as the object exists, before any frame.
    - :meth:`encode_block` returns exactly one fragment (moof + mdat) holding exactly the given frames:
      nothing of the block is held back for a later call. Its video starts on an IDR frame (GOP = block),
      so init + any one segment decodes on its own.
    - Frame ``i`` of the stream has presentation = decode time = ``(start_pts + i) / fps`` seconds.
    - Audio comes from one continuous encoder; each segment carries every whole codec frame fed so far
      (the remainder waits for the next block). Audio decode time of sample ``k`` of this stream is
      ``start_pts / fps + k / sample_rate`` plus the codec's priming (Opus pre-skip, which the decoder
      drops: about 6.5 ms of constant offset; no drift).
    - Not thread-safe: one thread at a time. Synchronous and CPU-bound: never call it on an event loop.
    """

    VIDEO_TRACK_ID = 1
    AUDIO_TRACK_ID = 2

    def __init__(
        self,
        width: int,
        height: int,
        fps: int = 16,
        audio: AudioSpec | None = None,
        start_pts: int = 0,
        video_encoders: Sequence[str] = VIDEO_ENCODER_PREFERENCE,
        audio_start_sample: int | None = None,
    ):
        """``audio_start_sample``: where the first audio sample fed lies on the session timeline (default:
        at the first video frame); a stream attached mid-session passes it because audio trails the
        video edge by the audio decoder's lookahead."""
        _check_geometry(width, height, fps)
        if start_pts < 0:
            raise ValueError(f"start_pts must be >= 0, got {start_pts}")
        if audio_start_sample is not None and audio_start_sample < 0:
            raise ValueError(f"audio_start_sample must be >= 0, got {audio_start_sample}")
        self.audio_start_sample = audio_start_sample
        self.width, self.height, self.fps, self.audio = width, height, fps, audio
        self.start_pts = start_pts
        self.frames_encoded = 0
        self._sequence = 0
        self._failed = False
        self._audio_flushed = False
        self._video_timescale = fps * 1000  # finer than 1/fps, as players expect, and exact

        self.video_encoder_name, self._video = _open_video_encoder(video_encoders, width, height, fps)
        self._reformatter = VideoReformatter()
        avc_config = fmp4.avc_decoder_configuration(*fmp4.parameter_sets(bytes(self._video.extradata)))
        self.video_codec = fmp4.avc_codec_string(avc_config)
        tracks: list = [fmp4.VideoTrack(self.VIDEO_TRACK_ID, self._video_timescale, width, height, avc_config)]

        self.audio_codec: str | None = None
        self.audio_encoder_name: str | None = None
        self._audio = None
        if audio is not None:
            self.audio_encoder_name = open_audio_encoder_name(audio.encoders, audio.sample_rate, audio.channels)
            self._audio = _new_audio_context(self.audio_encoder_name, audio.sample_rate, audio.channels, True)
            self._audio.open()
            self._framer = _PcmFramer(self._audio, audio.channels)
            self._audio_origin: int | None = None  # media time = origin + packet pts; set by the 1st packet
            self.audio_samples_fed = 0
            tracks.append(self._audio_track(audio))
        self._init = fmp4.init_segment(tracks)

    def _audio_track(self, spec: AudioSpec) -> fmp4.AudioTrack:
        extradata = bytes(self._audio.extradata or b"")
        if extradata.startswith(b"OpusHead"):
            self.audio_codec = "opus"
            codec_box, entry = fmp4.opus_specific_box(extradata), b"Opus"
        elif self._audio.codec.name == "aac":
            self.audio_codec = fmp4.aac_codec_string(extradata)
            codec_box, entry = fmp4.aac_esds_box(extradata, self.AUDIO_TRACK_ID, self._audio.bit_rate or 0), b"mp4a"
        else:
            raise RuntimeError(f"no MP4 mapping for audio encoder {self._audio.codec.name}")
        return fmp4.AudioTrack(self.AUDIO_TRACK_ID, spec.sample_rate, spec.channels, codec_box, entry)

    # --- description ---

    @property
    def mime(self) -> str:
        """MSE type string, e.g. ``video/mp4; codecs="avc1.42c01e, opus"``."""
        codecs = self.video_codec + (f", {self.audio_codec}" if self.audio_codec else "")
        return f'video/mp4; codecs="{codecs}"'

    @property
    def next_pts(self) -> int:
        """Session frame index of the next frame to be encoded."""
        return self.start_pts + self.frames_encoded

    def init_segment(self) -> bytes:
        """ftyp + moov; the same bytes every call."""
        return self._init

    # --- encoding ---

    def encode_block(self, frames: np.ndarray, audio_pcm: np.ndarray | None = None) -> bytes:
        """Encode one block; return its media segment (one moof + mdat).

        ``frames``: uint8 [T, H, W, 3] RGB with the configured H, W. ``audio_pcm``: float32
        [channels, n], any n (the remainder of a codec frame waits for the next block); if audio is
        configured and this is None, the block gets silence of its own duration so audio never drifts.
        Raises ValueError on a wrong shape/dtype, or on audio for a stream configured without it.
        """
        self._check_usable()
        frames = _check_frames(frames, self.width, self.height)
        if audio_pcm is not None and (self._audio is None or self._audio_flushed):
            raise ValueError("this stream takes no audio (configured without it, or already flushed)")
        if self._audio is not None and not self._audio_flushed and audio_pcm is None:
            silence = frames.shape[0] * self.audio.sample_rate // self.fps
            audio_pcm = np.zeros((self.audio.channels, silence), np.float32)
        pcm = _check_pcm(audio_pcm, self.audio) if audio_pcm is not None else None

        self._failed = True  # until the block is through: a half-encoded block breaks the timeline
        runs = [self._encode_video(frames)]
        if pcm is not None:
            runs.append(self._encode_audio(pcm))
        segment = self._segment(runs)
        self._failed = False
        return segment

    def _check_usable(self) -> None:
        if self._video is None:
            raise RuntimeError("stream is closed")
        if self._failed:
            raise RuntimeError("an earlier encode failed; this stream's timeline is broken, open a new one")

    def _encode_video(self, frames: np.ndarray) -> fmp4.TrackRun:
        first = self.frames_encoded
        packets = []
        for i, rgb in enumerate(frames):
            frame = _rgb_to_encoder_frame(rgb, first + i, self._reformatter)
            if i == 0:
                frame.pict_type = PictureType.I  # with forced-idr: an IDR, so the segment stands alone
            packets.extend(self._video.encode(frame))
        if len(packets) != len(frames):
            # A zero-latency encoder emits one packet per frame; anything else would leak frames
            # into the next segment and break "one block = one self-contained segment".
            raise RuntimeError(f"{self.video_encoder_name} returned {len(packets)} packets for {len(frames)} frames")
        if not packets[0].is_keyframe:
            raise RuntimeError(f"{self.video_encoder_name} ignored the forced keyframe")
        self.frames_encoded += len(frames)
        step = self._video_timescale // self.fps
        samples = [fmp4.Sample(fmp4.avcc_sample(bytes(p)), step, p.is_keyframe) for p in packets]
        return fmp4.TrackRun(self.VIDEO_TRACK_ID, (self.start_pts + first) * step, samples)

    def _encode_audio(self, pcm: np.ndarray) -> fmp4.TrackRun:
        self.audio_samples_fed += pcm.shape[1]
        packets = [p for f in self._framer.push(pcm) for p in self._audio.encode(f)]
        return self._audio_run(packets)

    def _audio_run(self, packets: list) -> fmp4.TrackRun:
        if not packets:
            return fmp4.TrackRun(self.AUDIO_TRACK_ID, 0)
        if self._audio_origin is None:
            # The first packet starts at -priming (Opus pre-skip, AAC's 1024); put it at the stream's
            # first video time so media times stay non-negative and continue sample-exactly.
            start_sample = self.audio_start_sample
            if start_sample is None:
                start_sample = self.start_pts * self.audio.sample_rate // self.fps
            self._audio_origin = start_sample - packets[0].pts
        samples = [fmp4.Sample(bytes(p), p.duration) for p in packets]
        return fmp4.TrackRun(self.AUDIO_TRACK_ID, self._audio_origin + packets[0].pts, samples)

    def flush_audio(self) -> bytes:
        """Encode the buffered remainder and drain the audio encoder; returns an audio-only segment
        (b"" if nothing was left). Idempotent; later blocks are video-only and must carry no audio."""
        if self._audio is None or self._audio_flushed or self._video is None:
            return b""
        self._audio_flushed = True
        packets = [p for f in self._framer.drain() for p in self._audio.encode(f)]
        packets += self._audio.encode(None)
        return self._segment([self._audio_run(packets)])

    def close(self) -> bytes:
        """Flush the audio tail (returned as a last segment, possibly b"") and release the encoders.
        Idempotent; encode_block afterwards raises RuntimeError."""
        tail = b"" if self._failed else self.flush_audio()
        self._video = self._audio = None
        return tail

    def _segment(self, runs: list[fmp4.TrackRun]) -> bytes:
        if not any(r.samples for r in runs):
            return b""
        self._sequence += 1
        return fmp4.media_segment(self._sequence, runs)


# --- the offline file writer ----------------------------------------------------------------------


class Mp4FileWriter:
    """A normal, seekable MP4 file (moov at the front) written block by block, for ``arstream generate``.

    Usage: ``with Mp4FileWriter(path, w, h, fps, audio) as out: out.write(frames, pcm)``.
    Same input contracts as :meth:`FragmentedMp4Stream.encode_block`. One thread at a time.
    """

    def __init__(self, path, width: int, height: int, fps: int = 16, audio: AudioSpec | None = None,
                 video_encoders: Sequence[str] = VIDEO_ENCODER_PREFERENCE):
        _check_geometry(width, height, fps)
        self.width, self.height, self.fps, self.audio = width, height, fps, audio
        self.frames_written = 0
        self._container = av.open(str(path), mode="w", format="mp4", options={"movflags": "+faststart"})
        name = open_h264_encoder_name(video_encoders)
        self._video = self._container.add_stream(name, rate=fps)
        ctx = self._video.codec_context
        ctx.width, ctx.height, ctx.pix_fmt, ctx.max_b_frames = width, height, "yuv420p", 0
        ctx.colorspace, ctx.color_primaries, ctx.color_trc, ctx.color_range = 1, 1, 1, ColorRange.MPEG
        ctx.options = dict(_VIDEO_ENCODER_OPTIONS.get(name, {}))
        self._reformatter = VideoReformatter()
        self._audio = None
        if audio is not None:
            audio_name = open_audio_encoder_name(audio.encoders, audio.sample_rate, audio.channels)
            self._audio = self._container.add_stream(
                audio_name, rate=audio.sample_rate, layout="mono" if audio.channels == 1 else "stereo"
            )
            probe = _new_audio_context(audio_name, audio.sample_rate, audio.channels, global_header=False)
            self._audio.codec_context.format = probe.format
            self._framer: _PcmFramer | None = None  # frame size is known once the container opens it

    def write(self, frames: np.ndarray, audio_pcm: np.ndarray | None = None) -> None:
        """Append one block of frames (and its audio, if the file has an audio track)."""
        frames = _check_frames(frames, self.width, self.height)
        if audio_pcm is not None and self._audio is None:
            raise ValueError("this file was configured without audio")
        for rgb in frames:
            self._container.mux(self._video.encode(_rgb_to_encoder_frame(rgb, self.frames_written, self._reformatter)))
            self.frames_written += 1
        if audio_pcm is not None:
            pcm = _check_pcm(audio_pcm, self.audio)
            if self._framer is None:
                self._container.start_encoding()  # opens the codec, which fixes its frame size
                self._framer = _PcmFramer(self._audio.codec_context, self.audio.channels)
            for frame in self._framer.push(pcm):
                self._container.mux(self._audio.encode(frame))

    def close(self) -> None:
        """Drain the encoders and finish the file. Idempotent."""
        if self._container is None:
            return
        if self._audio is not None and self._framer is not None:
            for frame in self._framer.drain():
                self._container.mux(self._audio.encode(frame))
            self._container.mux(self._audio.encode(None))
        self._container.mux(self._video.encode(None))
        self._container.close()
        self._container = None

    def __enter__(self) -> "Mp4FileWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def write_mp4(path, blocks: Iterable, fps: int = 16, audio: AudioSpec | None = None) -> int:
    """Write ``blocks`` to an MP4 file; each block is frames ``[T, H, W, 3]`` or ``(frames, pcm)``.

    The frame size comes from the first block. Returns the number of frames written.
    """
    writer = None
    try:
        for block in blocks:
            frames, pcm = block if isinstance(block, tuple) else (block, None)
            if writer is None:
                writer = Mp4FileWriter(path, frames.shape[2], frames.shape[1], fps, audio)
            writer.write(frames, pcm)
    finally:
        if writer is not None:
            writer.close()
    return writer.frames_written if writer is not None else 0
