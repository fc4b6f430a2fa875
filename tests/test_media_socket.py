"""Pictures and video in over a real socket (`arstream serve`, the small seeded random model): an image start,
live input that stops or floods, and every kind of bad input answered with a clear error that harms no session."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request

import numpy as np
import pytest

from app.media_input import FrameSize, decode_image
from engine.bundle import build_models
from engine.config import EngineConfig
from tests.conftest import SMALL_ENGINE, decode_mp4, start_server
from tests.input_helpers import (
    clip_bytes, jpeg_bytes, mean_abs_step, png_bytes, png_header_claiming, psnr, round_trip,
)
from tests.stream_client import RECEIVE_TIMEOUT_S, StreamClient

SIZE = FrameSize(SMALL_ENGINE["width"], SMALL_ENGINE["height"])
SAMPLES_PER_FRAME = 3000  # 48 kHz at 16 fps
TINY_LOOKAHEAD_SAMPLES = 12 * 600  # the tiny audio codec's right receptive field x hop (tests/test_audio_stream.py)
# The first frame after H.264: the codec's round trip within the encoder's loss (measured 43 dB; bound 35 dB).
MIN_PSNR_DB = 35.0


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


@pytest.fixture(scope="module")
def bundle():
    return build_models(EngineConfig(**SMALL_ENGINE))  # the server's model: the same seeded codec


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, RECEIVE_TIMEOUT_S * 3))


def _status(server, session_id: str) -> dict:
    with urllib.request.urlopen(f"{server.base_url}/v1/sessions/{session_id}", timeout=10) as response:
        return json.loads(response.read())


def _picture(seed: int) -> np.ndarray:
    """A 64 x 48 picture: a flat colour with a bright square somewhere (seeded)."""
    rng = np.random.default_rng(seed)
    frame = np.empty((48, 64, 3), dtype=np.uint8)
    frame[:] = rng.integers(20, 120, 3, dtype=np.uint8)
    x, y = rng.integers(0, 40), rng.integers(0, 24)
    frame[y : y + 20, x : x + 20] = 230
    return frame


async def _answer(client: StreamClient, message_id: str) -> dict:
    """The ack or error answering ``message_id`` (chunks keep arriving meanwhile)."""
    return await client.control(lambda m: m.get("id") == message_id and m["type"] in ("ack", "error"))


async def _announce(client: StreamClient, data: bytes, kind: str = "image", *, type_: str = "start",
                    declared: int | None = None, **fields) -> dict:
    message_id = f"{type_}-{kind}-{len(data)}"
    await client.send(type=type_, id=message_id, input={"kind": kind, "bytes": declared or len(data) or 1}, **fields)
    await client.ws.send(data)
    return await _answer(client, message_id)


def test_an_image_start_streams_the_image_first_then_its_continuation(server, bundle):
    async def scenario():
        pictures = [_picture(1), _picture(2)]
        streams = []
        for picture in pictures:
            client = await StreamClient.open(f"{server.ws_url}/v1/stream")
            answer = await _announce(client, png_bytes(picture), prompt="a picture", seed=3, options={"pace": False})
            assert answer["type"] == "ack" and answer["of"] == "start", answer
            chunks = await client.chunks(2)
            assert [c["frames"] for c in chunks] == [1, 12]  # the picture, alone, then the generated block
            assert chunks[0]["audio_samples"] == 0 and chunks[1]["audio_samples"] > 0
            status = _status(server, client.session["session_id"])
            assert status["input"]["context_frames"] == 1 and not status["input"]["live"]
            frames, _ = decode_mp4(client.media())
            streams.append(frames)
            if len(streams) == 1:
                # Sound stays on the video clock through the picture's silent frame, and through a reset that
                # restarts from another picture: exactly what is decodable, less the audio codec's lookahead.
                await client.chunks(2)
                answer = await _announce(client, png_bytes(pictures[1]), type_="reset")
                assert answer["type"] == "ack", answer
                got = client.got.chunks
                while not any(c["frames"] == 1 for c in got[4:-1]):  # a block queued before the reset may come first
                    await client.chunks(1)
                lone = [i for i, c in enumerate(got) if c["frames"] == 1]
                assert lone[0] == 0 and len(lone) == 2 and got[lone[1] + 1]["frames"] == 12, [c["frames"] for c in got]
                frames_sent = sum(c["frames"] for c in got)
                assert sum(c["audio_samples"] for c in got) == frames_sent * SAMPLES_PER_FRAME - TINY_LOOKAHEAD_SAMPLES
            await client.close()
        for picture, frames in zip(pictures, streams):
            expected = round_trip(bundle, decode_image(png_bytes(picture), SIZE, max_bytes=1 << 20, max_pixels=1 << 20)[None])
            assert psnr(frames[0], expected[0]) >= MIN_PSNR_DB
        assert mean_abs_step(streams[0][0], streams[1][0]) > 10.0  # another picture, another first chunk

    run(scenario())


def test_bad_input_gets_a_clear_error_and_harms_no_session(server):
    async def scenario():
        witness = await StreamClient.open(f"{server.ws_url}/v1/stream")
        await witness.start("a witness", seed=1, pace=False)
        client = await StreamClient.open(f"{server.ws_url}/v1/stream")
        await client.start("bad input", seed=2, pace=False)
        codes = {}
        codes["not a picture"] = (await _announce(client, b"certainly not a PNG", type_="reset"))["code"]
        codes["truncated PNG"] = (await _announce(client, png_bytes(_picture(3))[:60], type_="reset"))["code"]
        codes["20000 x 20000"] = (await _announce(client, png_header_claiming(20_000, 20_000), type_="reset"))["code"]
        long_clip = clip_bytes(np.zeros((23, 48, 64, 3), np.uint8), fps=2)  # 11.5 s: over the 10 s bound
        codes["clip over the limit"] = (await _announce(client, long_clip, "clip", type_="reset"))["code"]
        codes["size mismatch"] = (await _announce(client, png_bytes(_picture(4)), type_="reset", declared=10))["code"]
        # A frame without live input on: the unexpected-binary answer of every v1 server.
        await client.ws.send(jpeg_bytes(_picture(5)))
        codes["frame without live"] = (await client.control(lambda m: m["type"] == "error"))["code"]
        await client.send(type="live", strength=0.5, id="live")
        assert (await _answer(client, "live"))["type"] == "ack"
        await client.ws.send(b"")
        codes["0-byte frame"] = (await client.control(lambda m: m["type"] == "error"))["code"]
        await client.ws.send(b"\xff\xd8\xff" + b"\0" * 50)  # JPEG magic, nothing else
        codes["broken frame"] = (await client.control(lambda m: m["type"] == "error"))["code"]
        assert codes == {
            "not a picture": "invalid_media", "truncated PNG": "invalid_media", "20000 x 20000": "media_too_large",
            "clip over the limit": "media_too_large", "size mismatch": "invalid_media",
            "frame without live": "bad_json", "0-byte frame": "invalid_media", "broken frame": "invalid_media",
        }, codes
        # A start refused before it was read whole (a seed out of bounds) that announced a picture: its bytes are
        # taken off all the same, answered once (no extra `bad_json` for them).
        await client.send(type="start", id="bad-start", prompt="again", seed=-1,
                          input={"kind": "image", "bytes": len(png_bytes(_picture(6)))})
        await client.ws.send(png_bytes(_picture(6)))
        await client.send(type="pause", id="after")
        answers = [await client.control(lambda m: m["type"] in ("ack", "error")) for _ in range(2)]
        assert [(a["type"], a.get("code"), a["id"]) for a in answers] == [
            ("error", "invalid_field", "bad-start"), ("ack", None, "after")], answers
        await client.send(type="resume", id="after-resume")
        assert (await _answer(client, "after-resume"))["type"] == "ack"
        # A text message where announced bytes were due: refused, then handled as itself.
        await client.send(type="reset", id="r", input={"kind": "image", "bytes": 100})
        await client.send(type="pause", id="p")
        assert (await _answer(client, "r"))["code"] == "invalid_media"
        assert (await _answer(client, "p"))["type"] == "ack"
        await client.send(type="resume", id="q")
        assert (await _answer(client, "q"))["type"] == "ack"
        # Both sessions go on: more chunks, no error, nothing closed.
        before = len(client.got.chunks)
        await client.chunks(2)
        assert len(client.got.chunks) >= before + 2
        await witness.chunks(2)
        assert not [m for m in witness.got.others if m["type"] in ("error", "closed")]
        status = _status(server, client.session["session_id"])
        assert status["state"] == "active" and status["input"]["frames_invalid"] == 2
        await client.close()
        await witness.close()

    run(scenario())


def test_live_input_that_stops_or_floods_never_stalls_its_session_or_costs_another(server):
    rate, burst = 30.0, 8  # the engine's default live_input_fps / live_input_burst

    async def scenario():
        other = await StreamClient.open(f"{server.ws_url}/v1/stream")
        await other.start("another session", seed=1, pace=False)
        client = await StreamClient.open(f"{server.ws_url}/v1/stream")
        await client.send(type="live", strength=0.7, id="live")
        ack = await _answer(client, "live")
        assert (ack["strength"], ack["steps"]) == (0.625, 1)  # the model's schedule point nearest to 0.7
        frames = [jpeg_bytes(_picture(k)) for k in range(4)]
        for data in frames:  # a few frames, then the input stops
            await client.ws.send(data)
        await client.start("live", seed=2, pace=False)
        await client.chunks(4)  # it keeps streaming on the last frame it had
        # 10x the rate for a second: 10 frames every 1/30 s, dropped unread beyond the rate, counted.
        sent, started = 0, time.monotonic()
        for tick in range(int(rate)):
            for _ in range(10):
                await client.ws.send(frames[sent % 4])
                sent += 1
            await asyncio.sleep(max(0.0, started + (tick + 1) / rate - time.monotonic()))
        elapsed = time.monotonic() - started
        others_before = len(other.got.chunks)
        await client.send(type="pause", id="after")  # answered after every frame before it was handled
        await _answer(client, "after")
        status = _status(server, client.session["session_id"])["input"]
        assert status["frames_received"] == 4 + sent
        # At most the rate's worth was taken, however long sending took (about 1 s: 38 of 300 frames).
        assert status["frames_dropped"] >= sent - (burst + rate * elapsed) - 4 > 0, (status, sent, elapsed)
        assert status["frames_invalid"] == 0
        # The other session: streaming all along, no input of its own, nothing dropped, no error.
        await other.chunks(2)
        assert len(other.got.chunks) >= others_before + 2
        assert _status(server, other.session["session_id"])["input"]["frames_received"] == 0
        assert not [m for m in other.got.others if m["type"] in ("error", "closed")]
        await client.send(type="live", strength=None, id="off")
        assert "strength" not in await _answer(client, "off")
        await client.close()
        await other.close()

    run(scenario())


def test_a_live_chunk_names_the_input_frame_its_first_frame_shows(bundle):
    """At strength 0 a live session shows its camera frames frame for frame (the codec's round trip of them as one
    stream): each chunk made from live input names the frame its first frame shows, by the number the client
    counts as it sends. The frames are all waiting before the session begins (a buffer, burst and jitter allowance
    that hold them: none is stale), so its blocks take exactly the stream's frames whatever the machine's speed."""
    count = 33  # three blocks' input: 9 + 12 + 12
    frames = np.stack([_picture(100 + k) for k in range(count)])
    sent = [png_bytes(frame) for frame in frames]
    seen = np.stack([decode_image(data, SIZE, max_bytes=1 << 20, max_pixels=1 << 20) for data in sent])
    expected = round_trip(bundle, seen)
    server = start_server(env={"ARSTREAM_ENGINE__LIVE_INPUT_BUFFER_FRAMES": "48",
                               "ARSTREAM_ENGINE__LIVE_INPUT_BURST": "48",
                               "ARSTREAM_ENGINE__LIVE_INPUT_JITTER_FRAMES": "48"})

    async def scenario():
        client = await StreamClient.open(f"{server.ws_url}/v1/stream")
        await client.send(type="live", strength=0.0, id="live")
        assert (await _answer(client, "live"))["type"] == "ack"
        for data in sent:
            await client.ws.send(data)
        await client.send(type="pause", id="sent")  # answered after every frame before it was taken in
        await _answer(client, "sent")
        await client.start("live", seed=4, pace=True)
        while sum(c["frames"] for c in client.got.chunks) < count + 4:
            await client.chunks(1)
        await client.close()
        return client

    try:
        client = run(scenario())
    finally:
        server.stop()
    shown, _ = decode_mp4(client.media())
    named = [(c["pts"], c["input_frame"]) for c in client.got.chunks if "input_frame" in c]
    # Paced: one chunk per latent frame (1, 4, 4 frames, then 4 each), each naming the frame it begins with.
    assert [number for _, number in named if number < count] == [0, 1, 5, 9, 13, 17, 21, 25, 29], named
    for pts, number in named:
        if number < count:
            scores = [psnr(shown[pts], candidate) for candidate in expected]
            assert int(np.argmax(scores)) == number and scores[number] >= MIN_PSNR_DB, (number, np.argmax(scores))


@pytest.mark.parametrize("text", ["[" * 5000, '{"type": "start", "input": ' * 3000])
def test_text_nested_deeper_than_python_recurses_is_bad_json_for_every_reader(text):
    """Found by the fuzz: a refused message is read a second time to see whether it announced a picture; that
    reading met Python's recursion limit and the client got ``internal``. Both readings answer it as JSON that
    is not valid, and such text announces nothing."""
    from app.schemas import ProtocolError, parse_client_message
    from app.transport.socket_input import SocketInput

    with pytest.raises(ProtocolError) as refused:
        parse_client_message(text)
    assert refused.value.code == "bad_json"
    assert SocketInput.announces_bytes(text) is False
