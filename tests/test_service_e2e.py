"""End to end: a real `arstream serve` (uvicorn, tiny preset, CPU) and real WebSocket clients.

Media checks decode what the client received with PyAV; effect checks compare decoded pixels between
runs (H.264 is lossy but deterministic: identical input through an identical encoder history gives
identical output, and the same content at another point of a stream decodes within a small error).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from websockets.sync.client import connect

from tests.conftest import decode_mp4, decoded_audio_samples, start_server
from tests.stream_client import RECEIVE_TIMEOUT_S, StreamClient

FPS = 16
FIRST_BLOCK_FRAMES = 9
BLOCK_FRAMES = 12
LEAD_CHUNKS = 2
# Same content encoded at a different point of a stream: x264's rate control differs a little.
SAME_CONTENT_MAX_MEAN_ABS_ERROR = 3.0
DIFFERENT_CONTENT_MIN_MEAN_ABS_ERROR = 10.0


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server  # its defaults are these tests': 4 slots, a pacing lead of LEAD_CHUNKS


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, RECEIVE_TIMEOUT_S * 2))


# --- the stream as a file, and block ordering --------------------------------------------------------


def _released_chunks(server, session_id: str) -> int:
    """The chunks the engine has released to the session's socket so far (REST counters)."""
    with urllib.request.urlopen(f"{server.base_url}/v1/sessions/{session_id}", timeout=10) as answer:
        return json.loads(answer.read())["counters"]["chunks"]


def test_stream_is_one_playable_file_and_no_segment_waits_for_the_next_block(server):
    """The chunks make one playable file, and a block's media never waits for the block after it: once the
    session is paused no further block is made, yet every chunk the engine released arrives with its segment
    (one held back until the next block would never come: the socket's receive times out). No clock is
    compared, so a slow or busy machine cannot fail it."""
    client = connect(f"{server.ws_url}/v1/stream", max_size=2**24, proxy=None, open_timeout=RECEIVE_TIMEOUT_S)
    chunks, segments = [], []
    paused = False

    def receive() -> str | bytes:
        return client.recv(timeout=RECEIVE_TIMEOUT_S)

    def next_message() -> None:
        nonlocal paused
        parsed = json.loads(receive())
        if parsed["type"] == "chunk":
            segment = receive()
            assert isinstance(segment, bytes)
            chunks.append(parsed)
            segments.append(segment)
        elif parsed["type"] == "state" and parsed["state"] == "paused":
            paused = True

    try:
        session = json.loads(receive())
        init = receive()
        client.send(json.dumps({"type": "start", "prompt": "waves on a shore", "seed": 11, "options": {"pace": False}}))
        while len(chunks) < 3:
            next_message()
        client.send(json.dumps({"type": "pause"}))
        while not paused:
            next_message()
        while len(chunks) < _released_chunks(server, session["session_id"]):
            next_message()
        client.send(json.dumps({"type": "close"}))  # free the shared server's slot now, not after the grace
    finally:
        client.close()

    count = len(chunks)
    assert [c["index"] for c in chunks] == list(range(count))
    media = init + b"".join(segments)
    frames, times = decode_mp4(media)
    total = sum(c["frames"] for c in chunks)
    assert total == FIRST_BLOCK_FRAMES + (count - 1) * BLOCK_FRAMES
    assert frames.shape == (total, session["video"]["height"], session["video"]["width"], 3) == (total, 64, 64, 3)
    assert all(b > a for a, b in zip(times, times[1:])), "timestamps strictly increase"
    assert times == pytest.approx([i / FPS for i in range(total)])
    if session["audio"] is not None:
        # Every sample announced decodes, less what the Opus encoder still holds (under one 20 ms frame)
        # and its priming, which the decoder drops.
        announced = sum(c["audio_samples"] for c in chunks)
        assert announced - 2 * 960 <= decoded_audio_samples(media) <= announced


# --- effects -----------------------------------------------------------------------------------------


def _frames(client: StreamClient) -> np.ndarray:
    return decode_mp4(client.media())[0]


def _mean_abs_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.int16) - b.astype(np.int16)).mean())


LONE_CHUNKS = 8


def _frames_of(chunks: int) -> int:
    return FIRST_BLOCK_FRAMES + (chunks - 1) * BLOCK_FRAMES


@pytest.fixture(scope="module")
def lone_run(server):
    """Seed 21, one prompt, eight chunks, alone on the server: the reference the other runs compare with."""

    async def go():
        client = await StreamClient.open(f"{server.ws_url}/v1/stream")
        await client.start("a forest at night", seed=21)
        await client.chunks(LONE_CHUNKS)
        await client.close()
        return client

    client = run(go())
    return _frames(client)[: _frames_of(LONE_CHUNKS)]


def test_prompt_change_changes_the_frames_that_follow(server, lone_run):
    async def go():
        client = await StreamClient.open(f"{server.ws_url}/v1/stream")
        await client.start("a forest at night", seed=21)
        await client.chunks(2)
        await client.send(type="prompt", prompt="a desert at noon", id="change")
        await client.control(lambda m: m["type"] == "ack" and m["id"] == "change")
        acked_after = len(client.got.chunks)
        await client.chunks(max(0, LONE_CHUNKS - acked_after))
        await client.close()
        return client, acked_after

    client, acked_after = run(go())
    # At least two blocks after the ack: the first may have been in flight (old prompt), the next is new.
    assert acked_after <= LONE_CHUNKS - 2, f"the ack came only after {acked_after} chunks"
    frames = _frames(client)[: len(lone_run)]
    before = FIRST_BLOCK_FRAMES + BLOCK_FRAMES  # the first two chunks: generated before the change
    assert np.array_equal(frames[:before], lone_run[:before]), "same seed and prompt: same frames"
    # A block already in flight when the message arrived still used the old prompt; the one after differs.
    changed_from = FIRST_BLOCK_FRAMES + BLOCK_FRAMES * acked_after
    assert _mean_abs_error(frames[changed_from:], lone_run[changed_from:]) > 0.5
    assert not np.array_equal(frames[changed_from:], lone_run[changed_from:])


def test_reset_restarts_the_content_on_a_continuing_timeline(server):
    async def go():
        client = await StreamClient.open(f"{server.ws_url}/v1/stream")
        await client.start("a city in rain", seed=33)
        await client.chunks(3)
        await client.send(type="reset", id="reset")
        await client.control(lambda m: m["type"] == "ack" and m["id"] == "reset")
        while client.got.chunks[-1]["frames"] != FIRST_BLOCK_FRAMES or len(client.got.chunks) == 1:
            await client.chunks(1)
        await client.chunks(1)  # and one block after the restarted first one
        await client.close()
        return client

    client = run(go())
    chunks = client.got.chunks
    restart = next(i for i, c in enumerate(chunks) if i > 0 and c["frames"] == FIRST_BLOCK_FRAMES)
    assert [c["index"] for c in chunks] == list(range(len(chunks)))  # the index continues
    frames, times = decode_mp4(client.media())
    assert times == pytest.approx([i / FPS for i in range(len(frames))])  # so does the timeline
    first = frames[: FIRST_BLOCK_FRAMES + BLOCK_FRAMES]
    start = chunks[restart]["pts"]
    again = frames[start : start + FIRST_BLOCK_FRAMES + BLOCK_FRAMES]
    assert _mean_abs_error(again, first) < SAME_CONTENT_MAX_MEAN_ABS_ERROR
    before_reset = frames[start - len(first) : start]
    # ... and that bound means something: other content of the same session is far from it.
    assert _mean_abs_error(before_reset, first) > DIFFERENT_CONTENT_MIN_MEAN_ABS_ERROR


def test_rest_delete_closes_the_socket_and_forgets_the_session(server):
    async def go():
        client = await StreamClient.open(f"{server.ws_url}/v1/stream")
        session_id = client.session["session_id"]
        await client.start("a quiet room", seed=1, pace=True)
        await client.chunks(1)
        request = urllib.request.Request(f"{server.base_url}/v1/sessions/{session_id}", method="DELETE")
        status = await asyncio.to_thread(lambda: urllib.request.urlopen(request, timeout=10).status)
        others, code = await client.until_closed()
        return session_id, status, others, code

    session_id, status, others, code = run(go())
    assert status == 204
    assert others[-1] == {"type": "closed", "reason": "client"} and code == 1000
    with pytest.raises(urllib.error.HTTPError) as missing:
        urllib.request.urlopen(f"{server.base_url}/v1/sessions/{session_id}", timeout=10)
    assert missing.value.code == 404


def test_reconnect_within_grace_resumes_at_the_next_chunk(server):
    async def go():
        first = await StreamClient.open(f"{server.ws_url}/v1/stream")
        session_id = first.session["session_id"]
        await first.start("a train crossing a bridge", seed=4, pace=True)
        await first.chunks(2)
        await first.drop()  # the session waits the grace period for a reconnect
        await asyncio.sleep(0.3)
        second = await StreamClient.open(f"{server.ws_url}/v1/sessions/{session_id}/stream")
        await second.chunks(2)
        await second.close()
        return first, second

    first, second = run(go())
    assert second.session["session_id"] == first.session["session_id"]
    assert second.session["state"] == "active"
    last = first.got.chunks[-1]
    resumed = second.got.chunks[0]
    # Paced: nothing new was released while away beyond the chunk waiting to be sent, which the fresh attach drops.
    assert last["index"] + 1 <= resumed["index"] <= last["index"] + 2
    skipped = resumed["pts"] - sum(c["frames"] for c in first.got.chunks)
    assert (skipped == 0) == (resumed["index"] == last["index"] + 1) and 0 <= skipped <= BLOCK_FRAMES
    frames, times = decode_mp4(second.media())  # a fresh init segment whose timeline starts at the resumed pts
    assert len(frames) == sum(c["frames"] for c in second.got.chunks)
    assert times[0] == pytest.approx(resumed["pts"] / FPS)


def test_paced_session_stays_within_lead_chunks_of_its_playback_clock(server):
    async def go():
        client = await StreamClient.open(f"{server.ws_url}/v1/stream")
        await client.start("clouds", seed=8, pace=True)
        await client.chunks(6)
        await client.close()
        return client

    client = run(go())
    chunks, received = client.got.chunks, client.got.received_at
    first = chunks[0]["timings"]
    # The client's playback clock starts when chunk 0 arrives; the engine's when chunk 0 left the
    # decoder. The difference (encode + send of chunk 0) is known exactly from the timings.
    playback_start = received[0]
    clock_offset_ms = received[0] - (first["started_at"] + first["denoise_ms"] + first["decode_ms"])
    lead_ms = LEAD_CHUNKS * BLOCK_FRAMES / FPS * 1000.0
    slack_ms = 5.0
    for chunk in chunks[1:]:
        media_ahead_ms = chunk["pts"] / FPS * 1000.0 - (chunk["timings"]["started_at"] - playback_start)
        assert media_ahead_ms < lead_ms + clock_offset_ms + slack_ms, (chunk["index"], media_ahead_ms)
    # ... and pacing really held it back: the last chunk (3.6 s of media) came no earlier than its media
    # time minus the lead allows, about 2 s in; unpaced, six chunks take under a second here.
    last = chunks[-1]
    assert received[-1] - playback_start >= last["pts"] / FPS * 1000.0 - lead_ms - slack_ms


def test_concurrent_clients_seeds_decide_the_frames(server, lone_run):
    async def one(seed: int) -> StreamClient:
        # Best effort from creation (REST, pace off): three live sessions need not fit this machine's device time.
        client = await StreamClient.open_best_effort(server.base_url, server.ws_url)
        await client.start("a forest at night", seed=seed)
        await client.chunks(6)
        await client.close()
        return client

    async def go():
        return await asyncio.gather(one(21), one(22), one(21))

    frames = _frames_of(6)
    same_a, other, same_b = (_frames(c)[:frames] for c in run(go()))
    assert len(same_a) == len(other) == len(same_b) == frames
    assert np.array_equal(same_a, lone_run[:frames]) and np.array_equal(same_b, lone_run[:frames])
    assert _mean_abs_error(other, lone_run[:frames]) > DIFFERENT_CONTENT_MIN_MEAN_ABS_ERROR


def test_example_client_saves_a_playable_file(server, tmp_path):
    out = tmp_path / "example.mp4"
    example = Path(__file__).resolve().parents[1] / "examples" / "client.py"
    result = subprocess.run(
        [sys.executable, str(example), "--url", server.ws_url, "--prompt", "a boat", "--then", "a storm",
         "--seconds", "3", "--no-pace", "--seed", "5", "--out", str(out)],
        capture_output=True, text=True, timeout=RECEIVE_TIMEOUT_S * 2,
    )
    assert result.returncode == 0, result.stderr
    assert '"of": "prompt"' in result.stdout and "closed: client" in result.stdout
    frames, times = decode_mp4(out.read_bytes())
    assert len(frames) >= 3 * FPS and times == pytest.approx([i / FPS for i in range(len(frames))])


# --- shutdown ------------------------------------------------------------------------------------------


def test_sigterm_drains_clients_with_closed_and_1001():
    server = start_server(cold=True)  # the installed command, started and stopped as a user's would be
    try:
        async def go():
            client = await StreamClient.open(f"{server.ws_url}/v1/stream")
            await client.start("last light", seed=2, pace=True)
            await client.chunks(1)
            await asyncio.to_thread(server.process.terminate)
            return await client.until_closed()

        others, code = run(go())
    finally:
        status = server.stop()
    assert others[-1] == {"type": "closed", "reason": "draining", "retry_after_s": 10.0} and code == 1001
    assert status in (0, -15)  # uvicorn re-raises SIGTERM after a graceful shutdown
    assert any('"event": "drained"' in line for line in server.log_lines)
