"""Audio through the whole service: one MP4 with both tracks, sample-exact against the video clock."""

from __future__ import annotations

import asyncio
import io

import av
import pytest

from tests.stream_client import StreamClient

BLOCKS = 40  # a sample of drift per block would show in the exact sum below after any number of blocks
SAMPLES_PER_FRAME = 3000  # 48 kHz at 16 fps
TINY_LOOKAHEAD_SAMPLES = 12 * 600  # the tiny codec's right receptive field (12 latent frames) x hop
OPUS_FRAME = 960
OPUS_ENCODER_DELAY = 312  # libopus' lookahead (the pre-skip): the last 6.5 ms fed wait inside the encoder


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


def test_audio_stays_on_the_video_clock_block_after_block_and_across_a_reset(server):
    """...across a reset in the middle too: the old content's held-back audio is flushed into the stream."""

    async def scenario():
        client = await StreamClient.open(server.ws_url + "/v1/stream")
        assert client.session["audio"] == {"codec": "opus", "sample_rate": 48000, "channels": 2}
        assert "opus" in client.session["mime"]
        await client.start("a thunderstorm", seed=4)
        chunks = await client.chunks(BLOCKS // 2)
        await client.send(type="reset", id="r")
        await client.control(lambda m: m["type"] == "ack" and m["id"] == "r")
        chunks = client.got.chunks[: BLOCKS // 2] + await client.chunks(BLOCKS - len(client.got.chunks))
        media = client.media()
        await client.close()
        return chunks, media

    chunks, media = asyncio.run(asyncio.wait_for(scenario(), 600))
    frames = sum(chunk["frames"] for chunk in chunks)
    assert frames == 9 + (BLOCKS - 1) * 12 - 3  # the block after the reset opens new content: 9 frames
    expected = frames * SAMPLES_PER_FRAME
    # the engine hands over exactly what is decodable: everything but the codec's lookahead
    assert sum(chunk["audio_samples"] for chunk in chunks) == expected - TINY_LOOKAHEAD_SAMPLES

    with av.open(io.BytesIO(media)) as container:
        assert len(container.streams.video) == 1 and len(container.streams.audio) == 1
        audio_stream = container.streams.audio[0]
        assert audio_stream.codec_context.sample_rate == 48000
        decoded = sum(frame.samples for frame in container.decode(audio_stream))
    with av.open(io.BytesIO(media)) as container:
        video_frames = sum(1 for _ in container.decode(video=0))
    assert video_frames == frames
    # what a client decodes trails the video edge by at most the lookahead plus one codec frame
    # (a partial 20 ms frame waits for the next block, and Opus' own 6.5 ms encoder delay)
    assert expected - TINY_LOOKAHEAD_SAMPLES - OPUS_FRAME - OPUS_ENCODER_DELAY <= decoded <= expected


def test_a_reconnected_stream_places_its_audio_on_the_session_timeline(server):
    """A socket attaching mid-session starts its audio where the engine's audio is, one lookahead behind the video."""

    async def scenario():
        first = await StreamClient.open(server.ws_url + "/v1/stream")
        await first.start("surf", seed=2)
        before = await first.chunks(3)
        session_id = first.session["session_id"]
        await first.drop()
        again = await StreamClient.open(server.ws_url + f"/v1/sessions/{session_id}/stream")
        await again.chunks(2)
        media = again.media()
        await again.close()
        return before, again.got.chunks, media

    before, after, media = asyncio.run(asyncio.wait_for(scenario(), 300))
    video_start = after[0]["pts"] / 16
    with av.open(io.BytesIO(media)) as container:  # one container per track: demuxing one skips the other
        first_audio = next(container.decode(audio=0))
    with av.open(io.BytesIO(media)) as container:
        first_video = next(container.decode(video=0))
    assert first_video.time == pytest.approx(video_start)
    # audio trails the video edge by the codec's lookahead: its first sample sits that much earlier
    expected_audio_start = after[0]["pts"] * SAMPLES_PER_FRAME - TINY_LOOKAHEAD_SAMPLES
    assert first_audio.time == pytest.approx(expected_audio_start / 48000, abs=0.008)  # Opus pre-skip: 6.5 ms
