"""A protocol v1 client over `websockets` for tests against a real `arstream serve`: session + init,
controls, chunk/segment pairs, the stream as one MP4."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from dataclasses import dataclass, field

from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

RECEIVE_TIMEOUT_S = 60


@dataclass
class Received:
    chunks: list[dict] = field(default_factory=list)
    segments: list[bytes] = field(default_factory=list)
    received_at: list[float] = field(default_factory=list)  # epoch ms when each segment arrived
    others: list[dict] = field(default_factory=list)


class StreamClient:
    """A protocol v1 client over `websockets`: session + init, controls, chunk/segment pairs."""

    def __init__(self, ws) -> None:
        self.ws = ws
        self.session: dict = {}
        self.init = b""
        self.got = Received()

    @classmethod
    async def open(cls, url: str) -> "StreamClient":
        ws = await connect(url, subprotocols=["arstream.v1"], compression=None, max_size=2**24)
        client = cls(ws)
        client.session = json.loads(await client._recv())
        assert client.session["type"] == "session"
        client.init = await client._recv()
        assert isinstance(client.init, bytes)
        return client

    @classmethod
    async def open_best_effort(cls, base_url: str, ws_url: str) -> "StreamClient":
        """A session created over REST with pacing off, attached: realtime admission does not count it (a
        socket's own ``/v1/stream`` session is live from creation)."""
        request = urllib.request.Request(f"{base_url}/v1/sessions", data=json.dumps({"options": {"pace": False}}).encode(),
                                         headers={"Content-Type": "application/json"})
        created = await asyncio.to_thread(lambda: json.loads(urllib.request.urlopen(request, timeout=10).read()))
        return await cls.open(f"{ws_url}/v1/sessions/{created['session_id']}/stream")

    async def _recv(self):
        return await asyncio.wait_for(self.ws.recv(), RECEIVE_TIMEOUT_S)

    async def send(self, **message) -> None:
        await self.ws.send(json.dumps(message))

    async def start(self, prompt: str, seed: int, pace: bool = False) -> None:
        await self.send(type="start", prompt=prompt, seed=seed, options={"pace": pace}, id="start")
        await self.control(lambda m: m["type"] == "ack" and m["id"] == "start")

    async def control(self, matches) -> dict:
        """Receive (keeping chunks) until a non-chunk message that ``matches`` arrives."""
        while True:
            message = await self._next()
            if message is not None and matches(message):
                return message

    async def chunks(self, count: int) -> list[dict]:
        """Receive until ``count`` more chunks (each with its segment) arrived."""
        target = len(self.got.chunks) + count
        while len(self.got.chunks) < target:
            await self._next()
        return self.got.chunks[target - count : target]

    async def _next(self) -> dict | None:
        message = await self._recv()
        if isinstance(message, bytes):
            raise AssertionError("a media segment without its chunk message")
        parsed = json.loads(message)
        if parsed["type"] != "chunk":
            self.got.others.append(parsed)
            return parsed
        segment = await self._recv()
        assert isinstance(segment, bytes), "a chunk message must be followed by its segment"
        self.got.received_at.append(time.time() * 1000.0)
        self.got.chunks.append(parsed)
        self.got.segments.append(segment)
        return None

    async def until_closed(self) -> tuple[list[dict], int]:
        try:
            while True:
                await self._next()
        except ConnectionClosed:
            pass
        return self.got.others, self.ws.close_code

    def media(self) -> bytes:
        return self.init + b"".join(self.got.segments)

    async def close(self) -> None:
        """End the session (`close`, then wait for `closed`), freeing its slot at once."""
        await self.send(type="close")
        others, _ = await self.until_closed()
        assert others[-1] == {"type": "closed", "reason": "client"}

    async def drop(self) -> None:
        """Lose the connection without ending the session."""
        await self.ws.close()
