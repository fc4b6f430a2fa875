"""A connection storm: 36 times as many sockets as slots, all at once. Every one is answered — a session
or ``closed`` ``capacity`` with ``retry_after_s`` and close 1013 — quickly, and the admitted sessions
stream on. Slow: ``ARSTREAM_SLOW_TESTS=1`` runs it (figures in docs/RELIABILITY.md);
``ARSTREAM_STORM_FACTOR`` scales it."""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from tests.conftest import start_server

SLOTS = 4
FACTOR = int(os.environ.get("ARSTREAM_STORM_FACTOR", "36"))


async def one(url: str) -> tuple[str, float, int | None, dict | None]:
    started = time.monotonic()
    async with connect(url, compression=None, max_size=2**24, open_timeout=60) as ws:
        first = json.loads(await asyncio.wait_for(ws.recv(), 60))
        elapsed = time.monotonic() - started
        if first["type"] == "session":
            await ws.recv()
            await ws.send(json.dumps({"type": "start", "prompt": "storm", "options": {"pace": False}}))
            chunks = 0
            while chunks < 3:
                message = json.loads(await asyncio.wait_for(ws.recv(), 60))
                if message["type"] == "chunk":
                    await ws.recv()
                    chunks += 1
            await ws.send(json.dumps({"type": "close"}))
            return "admitted", elapsed, None, first
        try:
            await asyncio.wait_for(ws.recv(), 10)
        except ConnectionClosed:
            pass
        return "refused", elapsed, ws.close_code, first


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("ARSTREAM_SLOW_TESTS"), reason="a 144-socket storm (ARSTREAM_SLOW_TESTS=1 runs it)")
def test_connection_storm_is_answered_quickly_and_admitted_sessions_stream():
    server = start_server("--max-sessions", str(SLOTS))
    try:
        async def go():
            return await asyncio.gather(*(one(f"{server.ws_url}/v1/stream") for _ in range(SLOTS * FACTOR)))

        results = asyncio.run(asyncio.wait_for(go(), 300))
    finally:
        server.stop()
    admitted = [r for r in results if r[0] == "admitted"]
    refused = [r for r in results if r[0] == "refused"]
    latencies = sorted(r[1] for r in refused)
    print(f"storm: {len(results)} sockets for {SLOTS} slots: {len(admitted)} admitted, {len(refused)} refused; "
          f"refusal median {statistics.median(latencies) * 1000:.0f} ms, "
          f"p95 {latencies[int(len(latencies) * 0.95)] * 1000:.0f} ms, max {latencies[-1] * 1000:.0f} ms")
    assert len(admitted) >= 1 and len(admitted) + len(refused) == SLOTS * FACTOR
    for _, _, code, closed in refused:
        assert code == 1013 and closed["type"] == "closed" and closed["reason"] == "capacity"
        assert closed["retry_after_s"] >= 1
