"""Time to first media: counted from the arrival of `start`, and nothing left for the first socket to open.

The first session after `/readyz` once waited ~0.5 s between `session created` and `session started` on an H200
(the first socket detected the H.264 encoder, whose first candidate, NVENC, fails there only after FFmpeg made a
CUDA context), while the service's own metric, counted from when the engine applied `start`, did not see it.
These tests pin the three things that close that: readiness waits for the encoders' warm-up, the socket stamps
`start` when it arrives (even while its opening is still held up), and the engine counts from the request.
"""

from __future__ import annotations

import asyncio
import threading
import time

from engine.api import Engine, NotReady
from engine.controls import Start
from tests.engine_helpers import run_async as run
from tests.engine_helpers import small_config, stepped_core
from tests.testclient_ws import hello, next_chunk


class SteppedClock:
    """A clock that stands still until the test moves it, and counts its readings."""

    def __init__(self, now: float) -> None:
        self.now = now
        self.readings = 0

    def __call__(self) -> float:
        self.readings += 1
        return self.now


def metric_samples(client) -> dict[str, float]:
    text = client.get("/metrics").text
    return {name: float(value) for name, value in
            (line.split() for line in text.splitlines() if line and not line.startswith("#"))}


def test_time_to_first_media_counts_from_the_arrival_of_start_while_the_stream_opening_is_held(make_client):
    with make_client(encode_threads=1) as client:
        service = client.app.state.service
        clock = SteppedClock(10.0)
        service.clock = clock
        gate = threading.Event()
        service.encoder_pool.submit(gate.wait)  # the one encoder thread is busy: the stream cannot open yet
        try:
            with client.websocket_connect("/v1/stream") as ws:
                # Sent before `session` (the protocol allows it): the socket must stamp it now, at 10 s.
                ws.send_json({"type": "start", "prompt": "a red fox", "options": {"pace": False}})
                deadline = time.monotonic() + 30
                while clock.readings < 2:  # the socket's acceptance, then the arrival of `start`
                    assert time.monotonic() < deadline, "start was not read while the stream's opening was held"
                    time.sleep(0.01)
                clock.now = 20.0  # ten seconds pass before the opening goes on
                gate.set()
                hello(ws)
                next_chunk(ws)
            samples = metric_samples(client)
        finally:
            gate.set()
    assert samples["arstream_time_to_first_chunk_seconds_count"] == 1.0
    assert samples["arstream_time_to_first_chunk_seconds_sum"] == 10.0
    assert samples["arstream_stream_open_seconds_sum"] == 10.0


def test_readiness_comes_after_the_media_encoders_were_opened_at_the_service_size(make_client):
    with make_client() as client:  # returns once /readyz answers 200
        service = client.app.state.service
        warmup = service.media_warmup
        assert warmup is not None
        assert warmup.video_encoder in ("libx264", "libopenh264", "h264_nvenc")
        assert warmup.audio_encoder in ("libopus", "aac")  # the tiny preset streams audio
        assert warmup.probe_s >= 0 and warmup.stream_s > 0


def test_engine_is_not_ready_until_its_owners_warm_up_finished_and_a_failed_one_fails_the_start():
    async def scenario():
        entered, release = asyncio.Event(), asyncio.Event()
        seen = []

        async def owners_warm_up(geometry):
            seen.append((geometry.width, geometry.height))
            entered.set()
            await release.wait()

        engine = Engine(small_config())
        starting = asyncio.create_task(engine.start(before_ready=owners_warm_up))
        await entered.wait()
        while_warming = engine.not_ready()
        release.set()
        await starting
        after = engine.not_ready()
        await engine.shutdown()

        async def broken(geometry):
            raise RuntimeError("no H.264 encoder")

        failing = Engine(small_config())
        try:
            await failing.start(before_ready=broken)
        except RuntimeError:
            pass
        failed = failing.not_ready()
        await failing.shutdown()
        return seen, while_warming, after, failed

    seen, while_warming, after, failed = run(scenario())
    assert seen == [(64, 48)]
    assert while_warming is NotReady.WARMING_UP
    assert after is None
    assert failed is NotReady.FAILED_TO_START


def test_the_engines_time_to_first_chunk_counts_from_the_start_request_not_the_tick_that_applied_it():
    held_s = 0.3

    async def scenario():
        async with stepped_core(small_config()) as core:
            record = core.admit(seed=1, pace=False, negative_prompt="", prompt=None, start_on_attach=False)
            core.submit(record.session_id, Start(prompt="a lighthouse"))
            await asyncio.sleep(held_s)  # no tick yet: the engine was busy, say
            assert await core.step()
            await core.delivered()
            chunk = await record.queue.get()
            return record.time_to_first_chunk_ms, chunk.timings

    ttfc_ms, timings = run(scenario())
    # The wait for the tick, then at least the block's own denoise and decode.
    assert ttfc_ms >= held_s * 1000.0 + timings.denoise_ms + timings.decode_ms
