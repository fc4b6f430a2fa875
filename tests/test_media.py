"""app.media: fragmented MP4 streaming segments, audio continuity, encoder detection, file writer."""

from __future__ import annotations

import io
import struct

import av
import numpy as np
import pytest

from app import fmp4
from app.media import (
    AudioSpec,
    FragmentedMp4Stream,
    Mp4FileWriter,
    open_audio_encoder_name,
    open_h264_encoder_name,
    write_mp4,
)

pytestmark = pytest.mark.background  # computes only: runs on the idle core (tests/background_pytest.py)

W, H, FPS, BLOCK = 128, 96, 16, 12
SR = 48000
SAMPLES_PER_FRAME = SR // FPS  # 3000


def moving_gradient(first_frame: int, count: int, width: int = W, height: int = H) -> np.ndarray:
    """Smooth RGB frames that move per frame, so each one is distinct but codec-friendly."""
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    out = np.empty((count, height, width, 3), np.uint8)
    for i in range(count):
        t = first_frame + i
        out[i, ..., 0] = 128 + 100 * np.sin((x + 3 * t) / 23)
        out[i, ..., 1] = 128 + 100 * np.cos((y + 2 * t) / 17)
        out[i, ..., 2] = 128 + 80 * np.sin((x + y - 4 * t) / 31)
    return out


def sine(first_sample: int, count: int, channels: int = 2) -> np.ndarray:
    t = np.arange(first_sample, first_sample + count) / SR
    return np.stack([0.5 * np.sin(2 * np.pi * 440 * t)] * channels).astype(np.float32)


def top_level_boxes(data: bytes) -> list[bytes]:
    return [kind for kind, _, _ in fmp4.iter_boxes(data)]


def decode_video(data: bytes) -> list[av.VideoFrame]:
    with av.open(io.BytesIO(data)) as container:
        return list(container.decode(container.streams.video[0]))


def sample_flags_of_first_video_sample(segment: bytes) -> int:
    """Walk moof > traf(track 1) > trun and return the first sample's flags."""
    for kind, start, end in fmp4.iter_boxes(segment):
        if kind != b"moof":
            continue
        for traf_kind, traf_start, traf_end in fmp4.iter_boxes(segment, start, end):
            if traf_kind != b"traf":
                continue
            children = {k: (s, e) for k, s, e in fmp4.iter_boxes(segment, traf_start, traf_end)}
            (track_id,) = struct.unpack_from(">I", segment, children[b"tfhd"][0] + 4)
            if track_id != FragmentedMp4Stream.VIDEO_TRACK_ID:
                continue
            trun = children[b"trun"][0]
            flags = struct.unpack_from(">I", segment, trun)[0] & 0xFFFFFF
            assert flags & 0x400, "per-sample flags expected"
            # fullbox header(4) + sample_count(4) + data_offset(4) + duration(4) + size(4) -> flags
            return struct.unpack_from(">I", segment, trun + 20)[0]
    raise AssertionError("no video traf")


@pytest.fixture(scope="module")
def video_stream_output():
    stream = FragmentedMp4Stream(W, H, fps=FPS)
    init = stream.init_segment()  # before any frame
    inputs, segments = [], []
    for block in range(6):
        frames = moving_gradient(block * BLOCK, BLOCK)
        inputs.append(frames)
        segments.append(stream.encode_block(frames))
    return stream, init, np.concatenate(inputs), segments


def test_init_segment_before_any_frame_has_ftyp_moov_and_no_media():
    stream = FragmentedMp4Stream(W, H)
    init = stream.init_segment()
    assert top_level_boxes(init) == [b"ftyp", b"moov"]
    assert b"mdat" not in init and b"moof" not in init
    assert b"avcC" in init and b"mvex" in init
    assert stream.frames_encoded == 0


def test_concatenation_is_one_playable_file_with_every_frame(video_stream_output):
    _, init, inputs, segments = video_stream_output
    frames = decode_video(init + b"".join(segments))
    assert len(frames) == len(inputs) == 72
    assert {(f.width, f.height) for f in frames} == {(W, H)}
    times = [f.time for f in frames]
    assert all(b > a for a, b in zip(times, times[1:]))
    assert times == pytest.approx([i / FPS for i in range(72)])
    decoded = np.stack([f.to_ndarray(format="rgb24") for f in frames]).astype(np.int16)
    mean_abs_error = np.abs(decoded - inputs.astype(np.int16)).mean()
    assert mean_abs_error < 10, mean_abs_error


def test_each_segment_is_one_fragment_starting_on_an_idr_and_decodes_alone(video_stream_output):
    _, init, inputs, segments = video_stream_output
    for n, segment in enumerate(segments):
        assert top_level_boxes(segment) == [b"moof", b"mdat"]
        assert sample_flags_of_first_video_sample(segment) == fmp4.SYNC_SAMPLE_FLAGS
        # init + this segment alone: every frame of the block is in it, nothing held back.
        frames = decode_video(init + segment)
        assert len(frames) == BLOCK
        assert frames[0].key_frame
        assert frames[0].time == pytest.approx(n * BLOCK / FPS)


def test_mime_and_codec_string_come_from_the_sps(video_stream_output):
    stream, init, _, _ = video_stream_output
    avcc = init[init.index(b"avcC") + 4 :]
    assert stream.video_codec == "avc1.%02x%02x%02x" % (avcc[1], avcc[2], avcc[3])
    assert stream.mime == f'video/mp4; codecs="{stream.video_codec}"'
    with av.open(io.BytesIO(init + video_stream_output[3][0])) as container:
        assert container.streams.video[0].codec_context.profile in ("Constrained Baseline", "Baseline", "Main", "High")


def test_start_pts_places_the_first_frame_on_the_session_timeline():
    stream = FragmentedMp4Stream(W, H, start_pts=120)
    data = stream.init_segment() + stream.encode_block(moving_gradient(120, BLOCK)) + stream.encode_block(
        moving_gradient(132, BLOCK)
    )
    times = [f.time for f in decode_video(data)]
    assert times[0] == pytest.approx(120 / 16)
    assert times == pytest.approx([(120 + i) / 16 for i in range(2 * BLOCK)])
    assert stream.next_pts == 144


def test_audio_is_continuous_and_muxed_with_video():
    stream = FragmentedMp4Stream(W, H, audio=AudioSpec(sample_rate=SR, channels=2))
    assert stream.audio_encoder_name == "libopus"
    assert stream.mime == f'video/mp4; codecs="{stream.video_codec}, opus"'
    data, fed = stream.init_segment(), 0
    for block in range(6):
        samples = BLOCK * SAMPLES_PER_FRAME
        segment = stream.encode_block(moving_gradient(block * BLOCK, BLOCK), sine(fed, samples))
        fed += samples
        assert top_level_boxes(segment) == [b"moof", b"mdat"]
        assert segment.count(b"traf") == 2  # video and the audio encoded so far, in one fragment
        data += segment
    data += stream.close()

    with av.open(io.BytesIO(data)) as container:
        assert {s.type for s in container.streams} == {"video", "audio"}
        audio = list(container.decode(container.streams.audio[0]))
    with av.open(io.BytesIO(data)) as container:
        assert len(list(container.decode(container.streams.video[0]))) == 6 * BLOCK
    decoded = sum(f.samples for f in audio)
    # The decoder drops the Opus pre-skip; the flushed tail adds at most one codec frame of padding.
    assert fed - 960 <= decoded <= fed + 960, (decoded, fed)
    # Sample-exact continuity: each decoded frame starts where the previous one ended.
    starts = [round(f.time * SR) for f in audio]
    assert all(b - a == f.samples for a, b, f in zip(starts, starts[1:], audio))
    # The first packet sits at the first video frame's time; the decoder drops the pre-skip after it.
    pre_skip = struct.unpack_from(">H", data, data.index(b"dOps") + 6)[0]
    assert 0 < pre_skip < 960 and starts[0] == pre_skip
    pcm = np.concatenate([f.to_ndarray().reshape(2, -1) if f.format.is_planar else f.to_ndarray().reshape(-1, 2).T for f in audio], axis=1)
    reference = sine(0, pcm.shape[1])
    assert np.abs(pcm[:, 2000:40000] - reference[:, 2000:40000]).mean() < 0.05  # roughly the same tone


def test_audio_remainder_waits_for_the_next_block():
    stream = FragmentedMp4Stream(W, H, audio=AudioSpec(sample_rate=SR, channels=1))
    first = stream.encode_block(moving_gradient(0, 1), sine(0, 1500, channels=1))  # 1 Opus frame + 540
    second = stream.encode_block(moving_gradient(1, 1), sine(1500, 500, channels=1))  # completes frame 2
    assert first.count(b"traf") == 2 and second.count(b"traf") == 2
    assert stream._framer.pending.shape[1] == 2000 - 2 * 960


def test_aac_fallback_when_opus_is_not_preferred():
    stream = FragmentedMp4Stream(W, H, audio=AudioSpec(channels=2, encoders=("bogus_opus", "aac")))
    assert stream.audio_codec == "mp4a.40.2"
    data = stream.init_segment()
    for block in range(3):
        data += stream.encode_block(moving_gradient(block * 4, 4), sine(block * 12000, 12000))
    data += stream.close()
    with av.open(io.BytesIO(data)) as container:
        assert container.streams.audio[0].codec_context.name == "aac"
        decoded = sum(f.samples for f in container.decode(container.streams.audio[0]))
    assert 36000 <= decoded <= 36000 + 2 * 1024  # + priming + padded last frame


def test_encoder_detection_skips_names_that_cannot_open():
    name = open_h264_encoder_name(("definitely_not_an_encoder", "h264_nvenc", "libx264"))
    assert name in ("h264_nvenc", "libx264")  # nvenc only where the hardware really exists
    assert open_h264_encoder_name(("definitely_not_an_encoder", "libx264")) == "libx264"
    with pytest.raises(RuntimeError):
        open_h264_encoder_name(("definitely_not_an_encoder",))
    assert open_audio_encoder_name(("nope", "libopus")) == "libopus"
    stream = FragmentedMp4Stream(W, H, video_encoders=["definitely_not_an_encoder", "libx264"])
    assert stream.video_encoder_name == "libx264"
    assert len(decode_video(stream.init_segment() + stream.encode_block(moving_gradient(0, 3)))) == 3


@pytest.mark.parametrize(
    "bad",
    [
        np.zeros((BLOCK, H, W, 3), np.float32),
        np.zeros((BLOCK, H + 2, W, 3), np.uint8),
        np.zeros((BLOCK, H, W, 4), np.uint8),
        np.zeros((H, W, 3), np.uint8),
        np.zeros((0, H, W, 3), np.uint8),
    ],
)
def test_wrong_frames_are_refused(bad):
    stream = FragmentedMp4Stream(W, H)
    with pytest.raises(ValueError):
        stream.encode_block(bad)
    assert stream.frames_encoded == 0


def test_wrong_geometry_and_audio_are_refused():
    with pytest.raises(ValueError, match="even"):
        FragmentedMp4Stream(W + 1, H)
    with pytest.raises(ValueError):
        AudioSpec(channels=3)
    video_only = FragmentedMp4Stream(W, H)
    with pytest.raises(ValueError, match="no audio"):
        video_only.encode_block(moving_gradient(0, 2), sine(0, 6000))
    with_audio = FragmentedMp4Stream(W, H, audio=AudioSpec(channels=2))
    with pytest.raises(ValueError):
        with_audio.encode_block(moving_gradient(0, 2), sine(0, 6000, channels=1))
    with pytest.raises(ValueError):
        with_audio.encode_block(moving_gradient(0, 2), sine(0, 6000).astype(np.float64))


def test_missing_audio_becomes_silence_so_tracks_stay_aligned():
    stream = FragmentedMp4Stream(W, H, audio=AudioSpec(channels=1))
    stream.encode_block(moving_gradient(0, BLOCK))
    assert stream.audio_samples_fed == BLOCK * SAMPLES_PER_FRAME


def test_after_flush_blocks_are_video_only_and_after_close_encoding_is_refused():
    stream = FragmentedMp4Stream(W, H, audio=AudioSpec(channels=1))
    stream.encode_block(moving_gradient(0, 2), sine(0, 2000, channels=1))
    tail = stream.flush_audio()
    assert top_level_boxes(tail) == [b"moof", b"mdat"] and tail.count(b"traf") == 1
    assert stream.flush_audio() == b""
    assert stream.encode_block(moving_gradient(2, 2)).count(b"traf") == 1
    with pytest.raises(ValueError):
        stream.encode_block(moving_gradient(4, 2), sine(0, 100, channels=1))
    assert stream.close() == b""
    with pytest.raises(RuntimeError, match="closed"):
        stream.encode_block(moving_gradient(4, 2))


def test_write_mp4_plays_back_with_every_frame(tmp_path):
    path = tmp_path / "out.mp4"
    blocks = [(moving_gradient(b * BLOCK, BLOCK), sine(b * 36000, 36000)) for b in range(3)]
    assert write_mp4(path, iter(blocks), fps=FPS, audio=AudioSpec(channels=2)) == 36
    with av.open(str(path)) as container:
        assert container.format.name.startswith("mov")
        frames = list(container.decode(container.streams.video[0]))
    assert len(frames) == 36 and (frames[0].width, frames[0].height) == (W, H)
    assert [f.time for f in frames] == pytest.approx([i / FPS for i in range(36)])
    with av.open(str(path)) as container:
        assert abs(sum(f.samples for f in container.decode(container.streams.audio[0])) - 108000) <= 960


def test_file_writer_video_only(tmp_path):
    path = tmp_path / "video.mp4"
    with Mp4FileWriter(path, W, H, fps=FPS) as out:
        for b in range(2):
            out.write(moving_gradient(b * 5, 5))
    assert len(decode_video(path.read_bytes())) == 10


def test_annexb_to_avcc_roundtrip():
    nal_a, nal_b = b"\x67\x42\x00\x1e\x01", b"\x65\x88\x00\x00\x03\x01\x02"
    annexb = b"\x00\x00\x00\x01" + nal_a + b"\x00\x00\x01" + nal_b
    assert fmp4.annexb_nal_units(annexb) == [nal_a, nal_b]
    assert fmp4.avcc_sample(annexb) == struct.pack(">I", 5) + nal_a + struct.pack(">I", 7) + nal_b
