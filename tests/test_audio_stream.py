"""Audio through the whole service: one MP4 with both tracks, sample-exact against the video clock."""

from __future__ import annotations

import asyncio
import io

import av
import pytest

from tests.conftest import start_server
from tests.test_service_e2e import StreamClient

BLOCKS = 200
SAMPLES_PER_FRAME = 3000  # 48 kHz at 16 fps
TINY_LOOKAHEAD_SAMPLES = 12 * 600  # the tiny codec's right receptive field (12 latent frames) x hop
OPUS_FRAME = 960


@pytest.fixture(scope="module")
def server():
    running = start_server("--max-sessions", "2")
    try:
        yield running
    finally:
        running.stop()


def test_two_hundred_blocks_of_audio_stay_on_the_video_clock(server):
    async def scenario():
        client = await StreamClient.open(server.ws_url + "/v1/stream")
        assert client.session["audio"] == {"codec": "opus", "sample_rate": 48000, "channels": 2}
        assert "opus" in client.session["mime"]
        await client.start("a thunderstorm", seed=4)
        chunks = await client.chunks(BLOCKS)
        media = client.media()
        await client.close()
        return chunks, media

    chunks, media = asyncio.run(asyncio.wait_for(scenario(), 600))
    frames = sum(chunk["frames"] for chunk in chunks)
    assert frames == 9 + (BLOCKS - 1) * 12
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
    assert expected - TINY_LOOKAHEAD_SAMPLES - OPUS_FRAME <= decoded <= expected
