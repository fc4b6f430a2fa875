"""A client that stops reading costs only its own session, and only for the grace period.

A real `arstream serve` and real sockets: the stalled reader is a raw socket with a tiny receive
buffer that stops calling recv(); the healthy readers are ordinary clients. Everything is asserted on
the server's own counters (GET /v1/sessions/{id}, /metrics), never on wall-clock rates.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
import urllib.error
import urllib.request

import pytest
from websockets.asyncio.client import connect

from tests.conftest import start_server
from tests.raw_ws import RawWebSocket

CHUNK_S = 12 / 16  # a block: 12 frames at 16 fps
STALL_CHUNKS = 2.0
GRACE_S = 2.0
SLACK_S = 1.0  # polling interval, the encode of the blocked chunk, a busy 2-core machine


def get_json(base_url: str, path: str) -> dict:
    with urllib.request.urlopen(base_url + path, timeout=10) as response:
        return json.loads(response.read())


def metric(base_url: str, name: str) -> float:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    match = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    if match is None:
        raise AssertionError(f"{name} not in /metrics")
    return float(match.group(1))


async def healthy_reader(url: str, seed: int, stop: asyncio.Event, received: list[int]) -> str:
    async with connect(url + "?pace=false", compression=None, max_size=2**24) as ws:
        first = json.loads(await ws.recv())
        assert "session_id" in first, f"a healthy viewer was not given a session: {first}"
        session_id = first["session_id"]
        await ws.recv()  # init segment
        await ws.send(json.dumps({"type": "start", "prompt": "a healthy viewer", "seed": seed,
                                  "options": {"pace": False}}))
        received.append(-1)  # marks "started"; chunk indexes follow
        while not stop.is_set():
            message = json.loads(await asyncio.wait_for(ws.recv(), 60))
            if message["type"] == "chunk":
                await ws.recv()
                received.append(message["index"])
        await ws.send(json.dumps({"type": "close"}))
        return session_id


@pytest.fixture(scope="module")
def server():
    running = start_server(
        "--max-sessions", "3", "--detach-grace-s", str(GRACE_S),
        # Pings far apart: this module proves the send-side detection on its own.
        env={"ARSTREAM_PING_INTERVAL_S": "60", "ARSTREAM_PING_TIMEOUT_S": "60",
             "ARSTREAM_STALL_CHUNKS": str(STALL_CHUNKS), "ARSTREAM_SEND_BUFFER_BYTES": "4096"},
    )
    try:
        yield running
    finally:
        running.stop()


def test_stalled_reader_is_detached_and_its_slot_freed_while_others_stream_on(server):
    base = server.base_url
    stalled = RawWebSocket(f"{server.ws_url}/v1/stream", receive_buffer_bytes=4096)
    session_id = json.loads(stalled.receive())["session_id"]
    stalled.receive()  # init
    stalled.send_json({"type": "start", "prompt": "a viewer who walks away", "seed": 3, "options": {"pace": False}})
    while True:  # read a few chunks, then stop reading for good
        message = stalled.receive()
        if isinstance(message, str) and json.loads(message)["type"] == "chunk" and json.loads(message)["index"] >= 2:
            break

    async def go():
        stop = asyncio.Event()
        received: list[list[int]] = [[], []]
        readers = [asyncio.create_task(healthy_reader(f"{server.ws_url}/v1/stream", seed, stop, got))
                   for seed, got in zip((1, 2), received)]
        # 1. Delivery to the stalled reader blocks: its chunk counter stops; then it is detached.
        last_count, last_change = -1, time.monotonic()
        detached_at = None
        deadline = time.monotonic() + 60
        while detached_at is None and time.monotonic() < deadline:
            detail = await asyncio.to_thread(get_json, base, f"/v1/sessions/{session_id}")
            now = time.monotonic()
            if detail["counters"]["chunks"] != last_count:
                last_count, last_change = detail["counters"]["chunks"], now
            if not detail["attached"]:
                detached_at = now
                assert detail["state"] == "detached"
            await asyncio.sleep(0.05)
        assert detached_at is not None, "the stalled reader was never detached"
        blocked_for = detached_at - last_change
        # 2. From detach to the end of the grace period: the engine makes no block for the stalled
        # session, while each healthy one keeps getting blocks tick after tick.
        ticks_0 = metric(base, "arstream_engine_ticks_total")
        blocks_0 = metric(base, "arstream_engine_blocks_total")
        healthy_0 = [len(got) for got in received]
        # The grace is enforced at the engine's ticks: the detach applies at the tick after it was asked for, the
        # close at the first tick after the grace (each up to a tick of two blocks late on a busy 2-core machine).
        await asyncio.sleep(GRACE_S + SLACK_S)
        ticks_1 = metric(base, "arstream_engine_ticks_total")
        blocks_1 = metric(base, "arstream_engine_blocks_total")
        healthy_1 = [len(got) for got in received]
        after = await asyncio.to_thread(get_json, base, f"/v1/sessions/{session_id}")
        # 3. Its slot is free: a newcomer is admitted without evicting anyone.
        request = urllib.request.Request(base + "/v1/sessions", method="POST")
        created = await asyncio.to_thread(lambda: urllib.request.urlopen(request, timeout=10).status)
        stop.set()
        healthy_ids = await asyncio.gather(*readers)
        return (blocked_for, last_count, after, ticks_1 - ticks_0, blocks_1 - blocks_0,
                [b - a for a, b in zip(healthy_0, healthy_1)], created, healthy_ids, received)

    try:
        blocked_for, last_count, after, ticks, blocks, healthy_blocks, created, healthy_ids, received = (
            asyncio.run(asyncio.wait_for(go(), 120))
        )
    finally:
        stalled.close()

    assert blocked_for <= STALL_CHUNKS * CHUNK_S + SLACK_S, f"detached {blocked_for:.2f} s after its last chunk"
    assert after["counters"]["chunks"] == last_count, "no block was made for the stalled session once it blocked"
    assert after["state"] == "closed" and after["close_reason"] == "idle_timeout"
    assert created == 201
    assert ticks > 0
    # The engine never waited on the stalled reader: (nearly) every tick of the window made a block —
    # the exceptions are the tick that closed the stalled session and one in flight at a sample — and
    # every block went to a healthy session, each of them getting blocks all along (a tick may start
    # while one reader is still receiving its previous chunk, so the two share the ticks).
    assert blocks >= ticks - 2
    assert blocks == pytest.approx(sum(healthy_blocks), abs=2)
    for got in healthy_blocks:
        assert got >= ticks * 0.4, (got, ticks)
    for indexes in received:  # and the healthy streams themselves are whole
        chunks = [i for i in indexes if i >= 0]
        assert chunks == list(range(len(chunks)))
    assert metric(base, "arstream_websockets_stalled_total") >= 1
    assert all(get_json(base, f"/v1/sessions/{i}")["state"] == "closed" for i in healthy_ids)


def test_client_that_answers_no_ping_is_detached():
    server = start_server(
        "--detach-grace-s", "30",
        env={"ARSTREAM_PING_INTERVAL_S": "0.5", "ARSTREAM_PING_TIMEOUT_S": "1.0"},
    )
    try:
        silent = RawWebSocket(f"{server.ws_url}/v1/stream", answer_pings=False)
        session_id = json.loads(silent.receive())["session_id"]
        silent.receive()  # init; then nothing flows (never started), only the server's pings
        opened = time.monotonic()
        while get_json(server.base_url, f"/v1/sessions/{session_id}")["attached"]:
            assert time.monotonic() - opened < 30, "a client that answers no ping stays attached"
            time.sleep(0.05)
        detached_after = time.monotonic() - opened
        detail = get_json(server.base_url, f"/v1/sessions/{session_id}")
        silent.close()
    finally:
        server.stop()
    assert detail["state"] == "detached"  # it may come back within the grace period
    assert detached_after <= 0.5 + 1.0 + SLACK_S
