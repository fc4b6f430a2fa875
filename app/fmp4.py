"""Fragmented MP4 (ISO BMFF / CMAF) boxes, written in plain Python.

Why we write the boxes ourselves instead of using FFmpeg's mp4 muxer: the muxer holds a fragment until
the next keyframe (or an explicit ``av_write_frame(ctx, NULL)``, which PyAV does not expose), and its
interleaver holds video packets while it waits for audio. Writing ``moof``/``mdat`` here makes every
media segment exactly the packets we hand in, returned the moment they are encoded.

This module knows nothing of codecs beyond the bytes of their configuration records: it takes
encoded samples and returns bytes. Big-endian everywhere, as ISO/IEC 14496-12 requires.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Iterator

# Sample flags (ISO/IEC 14496-12 §8.8.3.1): a sync sample "depends on no other";
# a non-sync sample "depends on others" and has is_non_sync_sample set.
SYNC_SAMPLE_FLAGS = 0x02000000
NON_SYNC_SAMPLE_FLAGS = 0x01010000

_UNITY_MATRIX = struct.pack(">9I", 0x00010000, 0, 0, 0, 0x00010000, 0, 0, 0, 0x40000000)
_LANGUAGE_UND = 0x55C4  # ISO-639-2 "und", packed 5 bits per letter


def box(kind: bytes, *payload: bytes) -> bytes:
    """One box: 32-bit size + 4-character type + payload."""
    body = b"".join(payload)
    return struct.pack(">I4s", 8 + len(body), kind) + body


def full_box(kind: bytes, version: int, flags: int, *payload: bytes) -> bytes:
    """A box with the version byte and 24-bit flags of a FullBox."""
    return box(kind, struct.pack(">I", (version << 24) | flags), *payload)


def iter_boxes(data: bytes, offset: int = 0, end: int | None = None) -> Iterator[tuple[bytes, int, int]]:
    """Yield ``(type, payload_start, box_end)`` for each top-level box in ``data[offset:end]``."""
    end = len(data) if end is None else end
    while offset + 8 <= end:
        size, kind = struct.unpack_from(">I4s", data, offset)
        header = 8
        if size == 1:
            (size,) = struct.unpack_from(">Q", data, offset + 8)
            header = 16
        elif size == 0:
            size = end - offset
        if size < header or offset + size > end:
            raise ValueError(f"truncated or corrupt box {kind!r} at {offset}")
        yield kind, offset + header, offset + size
        offset += size


# --- H.264 bitstream helpers -------------------------------------------------------------------


def annexb_nal_units(data: bytes) -> list[bytes]:
    """Split an Annex B byte stream (start codes) into NAL units.

    Emulation prevention guarantees 00 00 01 never occurs inside a NAL, so splitting on it is exact;
    trailing zero bytes belong to the next start code (or are discardable cabac_zero_words).
    """
    units = []
    for chunk in bytes(data).split(b"\x00\x00\x01"):
        chunk = chunk.rstrip(b"\x00")
        if chunk:
            units.append(chunk)
    return units


def avcc_sample(annexb: bytes) -> bytes:
    """Annex B access unit -> MP4 sample (each NAL prefixed by its 4-byte length)."""
    return b"".join(struct.pack(">I", len(nal)) + nal for nal in annexb_nal_units(annexb))


def parameter_sets(extradata: bytes) -> tuple[list[bytes], list[bytes]]:
    """SPS and PPS NAL units from an encoder's global header (Annex B, as libx264/NVENC emit it)."""
    nals = annexb_nal_units(extradata)
    sps = [n for n in nals if n[0] & 0x1F == 7]
    pps = [n for n in nals if n[0] & 0x1F == 8]
    if not sps or not pps:
        raise ValueError("encoder extradata holds no SPS/PPS (was AV_CODEC_FLAG_GLOBAL_HEADER set?)")
    return sps, pps


def avc_decoder_configuration(sps: list[bytes], pps: list[bytes]) -> bytes:
    """The AVCDecoderConfigurationRecord (payload of ``avcC``), ISO/IEC 14496-15 §5.3.3.1."""
    first = sps[0]
    record = struct.pack(">5B", 1, first[1], first[2], first[3], 0xFF)  # 0xFF: 4-byte NAL lengths
    record += struct.pack(">B", 0xE0 | len(sps)) + b"".join(struct.pack(">H", len(s)) + s for s in sps)
    record += struct.pack(">B", len(pps)) + b"".join(struct.pack(">H", len(p)) + p for p in pps)
    if first[1] in (100, 110, 122, 144):
        # High profiles carry chroma format and bit depths; we only ever encode 8-bit 4:2:0.
        record += bytes((0xFC | 1, 0xF8 | 0, 0xF8 | 0, 0))
    return record


def avc_codec_string(avc_config: bytes) -> str:
    """RFC 6381 string (``avc1.PPCCLL``) from the profile, constraint and level bytes of the record."""
    return "avc1.%02x%02x%02x" % (avc_config[1], avc_config[2], avc_config[3])


# --- track descriptions --------------------------------------------------------------------------


@dataclass(frozen=True)
class VideoTrack:
    track_id: int
    timescale: int
    width: int
    height: int
    avc_config: bytes  # AVCDecoderConfigurationRecord

    def sample_entry(self) -> bytes:
        visual = struct.pack(
            ">6xH16xHHIIIH32sHh",
            1,  # data_reference_index
            self.width, self.height,
            0x00480000, 0x00480000, 0,  # 72 dpi, reserved
            1,  # frame_count
            b"",  # compressorname
            0x0018, -1,  # depth, pre_defined
        )
        return box(b"avc1", visual, box(b"avcC", self.avc_config))


@dataclass(frozen=True)
class AudioTrack:
    track_id: int
    sample_rate: int  # also the track timescale
    channels: int
    codec_box: bytes  # ``dOps`` or ``esds``, complete
    entry_type: bytes  # b"Opus" or b"mp4a"

    @property
    def timescale(self) -> int:
        return self.sample_rate

    def sample_entry(self) -> bytes:
        audio = struct.pack(">6xH8xHHHHI", 1, self.channels, 16, 0, 0, self.sample_rate << 16)
        return box(self.entry_type, audio, self.codec_box)


def opus_specific_box(opus_head: bytes) -> bytes:
    """``dOps`` from an Ogg ``OpusHead`` (the libopus extradata): same fields, but big-endian."""
    if opus_head[:8] != b"OpusHead" or len(opus_head) < 19:
        raise ValueError("not an OpusHead")
    channels = opus_head[9]
    pre_skip, rate, gain = struct.unpack_from("<HIh", opus_head, 10)
    mapping_family = opus_head[18]
    payload = struct.pack(">BBHIhB", 0, channels, pre_skip, rate, gain, mapping_family)
    if mapping_family != 0:
        payload += opus_head[19:]  # stream count, coupled count, channel mapping: bytes, no endianness
    return box(b"dOps", payload)


def _descriptor(tag: int, payload: bytes) -> bytes:
    if len(payload) > 0x0FFFFFFF:
        raise ValueError("descriptor too large")
    size = len(payload)
    # 4-byte expandable size encoding (what FFmpeg writes; every parser accepts it).
    size_bytes = bytes(((size >> 21) & 0x7F | 0x80, (size >> 14) & 0x7F | 0x80, (size >> 7) & 0x7F | 0x80, size & 0x7F))
    return bytes((tag,)) + size_bytes + payload


def aac_esds_box(audio_specific_config: bytes, track_id: int, bitrate: int) -> bytes:
    """``esds`` for AAC: ES_Descriptor > DecoderConfigDescriptor(AudioSpecificConfig) + SLConfig."""
    decoder_specific = _descriptor(0x05, audio_specific_config)
    decoder_config = _descriptor(0x04, struct.pack(">BB3sII", 0x40, 0x15, b"\x00\x00\x00", bitrate, bitrate) + decoder_specific)
    es = _descriptor(0x03, struct.pack(">HB", track_id, 0) + decoder_config + _descriptor(0x06, b"\x02"))
    return full_box(b"esds", 0, 0, es)


def aac_codec_string(audio_specific_config: bytes) -> str:
    """RFC 6381 ``mp4a.40.<audio object type>``."""
    return "mp4a.40.%d" % (audio_specific_config[0] >> 3)


# --- init segment ---------------------------------------------------------------------------------


def _trak(track: VideoTrack | AudioTrack) -> bytes:
    is_video = isinstance(track, VideoTrack)
    width, height = (track.width, track.height) if is_video else (0, 0)
    tkhd = full_box(
        b"tkhd", 0, 0x3,  # enabled | in_movie
        # creation, modification, track_ID, reserved, duration (0: fragmented), reserved, layer,
        # alternate_group, volume, reserved
        struct.pack(">IIIII8xhhhH", 0, 0, track.track_id, 0, 0, 0, 0, 0 if is_video else 0x0100, 0),
        _UNITY_MATRIX, struct.pack(">II", width << 16, height << 16),
    )
    mdhd = full_box(b"mdhd", 0, 0, struct.pack(">IIIIHH", 0, 0, track.timescale, 0, _LANGUAGE_UND, 0))
    handler, name = (b"vide", b"VideoHandler\x00") if is_video else (b"soun", b"SoundHandler\x00")
    hdlr = full_box(b"hdlr", 0, 0, struct.pack(">I4s12x", 0, handler), name)
    media_header = full_box(b"vmhd", 0, 1, bytes(8)) if is_video else full_box(b"smhd", 0, 0, bytes(4))
    dinf = box(b"dinf", full_box(b"dref", 0, 0, struct.pack(">I", 1), full_box(b"url ", 0, 1)))
    empty_table = struct.pack(">I", 0)
    stbl = box(
        b"stbl",
        full_box(b"stsd", 0, 0, struct.pack(">I", 1), track.sample_entry()),
        full_box(b"stts", 0, 0, empty_table),
        full_box(b"stsc", 0, 0, empty_table),
        full_box(b"stsz", 0, 0, struct.pack(">II", 0, 0)),
        full_box(b"stco", 0, 0, empty_table),
    )
    return box(b"trak", tkhd, box(b"mdia", mdhd, hdlr, box(b"minf", media_header, dinf, stbl)))


def init_segment(tracks: list[VideoTrack | AudioTrack]) -> bytes:
    """``ftyp`` + ``moov`` with empty sample tables and an ``mvex`` announcing fragments."""
    # iso5: the brand that allows default-base-is-moof (what FFmpeg writes for the same layout).
    ftyp = box(b"ftyp", b"iso5", struct.pack(">I", 0x200), b"iso5", b"iso6", b"mp41", b"avc1")
    next_track_id = max(t.track_id for t in tracks) + 1
    mvhd = full_box(
        b"mvhd", 0, 0,
        struct.pack(">IIIIIH10x", 0, 0, 1000, 0, 0x00010000, 0x0100),
        _UNITY_MATRIX, bytes(24), struct.pack(">I", next_track_id),
    )
    trex = [full_box(b"trex", 0, 0, struct.pack(">5I", t.track_id, 1, 0, 0, 0)) for t in tracks]
    return ftyp + box(b"moov", mvhd, *[_trak(t) for t in tracks], box(b"mvex", *trex))


# --- media segments -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    data: bytes
    duration: int  # in the track's timescale
    is_sync: bool = True


@dataclass
class TrackRun:
    """The samples of one track in one fragment, starting at ``base_decode_time`` (track timescale)."""

    track_id: int
    base_decode_time: int
    samples: list[Sample] = field(default_factory=list)


_TFHD_DEFAULT_BASE_IS_MOOF = 0x020000
_TRUN_DATA_OFFSET = 0x000001
_TRUN_DURATION = 0x000100
_TRUN_SIZE = 0x000200
_TRUN_FLAGS = 0x000400


def _traf(run: TrackRun, data_offset: int) -> bytes:
    trun_flags = _TRUN_DATA_OFFSET | _TRUN_DURATION | _TRUN_SIZE | _TRUN_FLAGS
    entries = b"".join(
        struct.pack(">III", s.duration, len(s.data), SYNC_SAMPLE_FLAGS if s.is_sync else NON_SYNC_SAMPLE_FLAGS)
        for s in run.samples
    )
    return box(
        b"traf",
        full_box(b"tfhd", 0, _TFHD_DEFAULT_BASE_IS_MOOF, struct.pack(">I", run.track_id)),
        full_box(b"tfdt", 1, 0, struct.pack(">Q", run.base_decode_time)),
        full_box(b"trun", 0, trun_flags, struct.pack(">Ii", len(run.samples), data_offset), entries),
    )


def media_segment(sequence_number: int, runs: list[TrackRun]) -> bytes:
    """One fragment: ``moof`` (one ``traf`` per non-empty run) + ``mdat`` holding the runs back to back.

    Data offsets are relative to the start of the ``moof`` (default-base-is-moof), so a segment is
    position-independent: it can be appended after any init segment and earlier segments.
    """
    runs = [r for r in runs if r.samples]
    if not runs:
        return b""
    # The moof size does not depend on the offsets' values, so build once with zeros to measure it.
    moof_size = len(box(b"moof", full_box(b"mfhd", 0, 0, bytes(4)), *[_traf(r, 0) for r in runs]))
    trafs, offset = [], moof_size + 8  # + mdat header
    for run in runs:
        trafs.append(_traf(run, offset))
        offset += sum(len(s.data) for s in run.samples)
    moof = box(b"moof", full_box(b"mfhd", 0, 0, struct.pack(">I", sequence_number)), *trafs)
    mdat = box(b"mdat", *[s.data for r in runs for s in r.samples])
    return moof + mdat
