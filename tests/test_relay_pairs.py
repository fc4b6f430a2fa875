"""The front end relays a worker's `chunk` message only with its segment (``app/cluster/relay.py``).

A worker killed between the two left its client with a `chunk` followed by an `error` where the protocol promises
the segment (test_scale_out's killed-worker test failed about once in ten). A real worker-side socket here, a
worker that sends two pairs and an `ack`, then a `chunk` and dies; the client's side records what it is sent.
"""

from __future__ import annotations

import asyncio
import json

from websockets.asyncio.client import connect
from websockets.asyncio.server import serve

from app.cluster.relay import StreamRelay
from tests.engine_helpers import run_async


class RecordingClient:
    """The client's socket as the relay uses it: what it was sent, in order."""

    def __init__(self) -> None:
        self.sent: list[str | bytes] = []

    async def send_text(self, text: str) -> None:
        self.sent.append(text)

    async def send_bytes(self, data: bytes) -> None:
        self.sent.append(data)


def _chunk(index: int) -> str:
    return json.dumps({"type": "chunk", "index": index, "pts": 4 * index})


def test_a_chunk_whose_segment_never_comes_is_never_relayed():
    async def scenario():
        async def dying_worker(ws):
            for index in range(2):
                await ws.send(_chunk(index))
                await ws.send(bytes([index]) * 8)
            await ws.send(json.dumps({"type": "ack", "id": "p1"}))
            await ws.send(_chunk(2))
            await asyncio.sleep(0.05)  # (the frames leave before the socket dies)
            ws.transport.abort()  # killed before its segment

        async with serve(dying_worker, "127.0.0.1", 0, close_timeout=0.2) as server:
            port = server.sockets[0].getsockname()[1]
            async with connect(f"ws://127.0.0.1:{port}", close_timeout=0.2) as upstream:
                client = RecordingClient()
                relay = StreamRelay(client, upstream, None, "s", on_ended=lambda _: None, on_unknown=lambda _: None,
                                    on_bytes=lambda _: None, is_current=lambda: True, on_failed=lambda: None)
                ended_by_worker, _, _ = await relay._downstream()
                return ended_by_worker, client.sent

    ended_by_worker, sent = run_async(scenario(), timeout_s=30)
    assert ended_by_worker
    assert sent == [_chunk(0), bytes([0]) * 8, _chunk(1), bytes([1]) * 8, json.dumps({"type": "ack", "id": "p1"})]
