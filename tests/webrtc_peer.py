"""A client's WebRTC peer for the tests (aiortc): what a browser's page does with `POST /v1/webrtc`."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from aiortc import RTCConfiguration, RTCPeerConnection, RTCSessionDescription


class Peer:
    """A client's peer connection: video (and audio) received, the `arstream` data channel, messages kept."""

    def __init__(self, *, video: str = "recvonly", audio: bool = True, channel: bool = True) -> None:
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        if video:
            self.pc.addTransceiver("video", direction=video)
        if audio:
            self.pc.addTransceiver("audio", direction="recvonly")
        self.channel = self.pc.createDataChannel("arstream") if channel else None
        self.messages: list[dict] = []
        self.frames: list[tuple[float, object]] = []  # (arrival, rgb)
        self.opened = asyncio.Event()
        self.tasks: list[asyncio.Task] = []
        if self.channel is not None:
            self.channel.on("open", self.opened.set)
            self.channel.on("message", lambda m: self.messages.append(json.loads(m)))
        self.pc.on("track", self._on_track)

    def _on_track(self, track) -> None:
        async def read():
            while True:
                try:
                    frame = await track.recv()
                except Exception:
                    return
                if track.kind == "video":
                    self.frames.append((time.monotonic(), frame.to_ndarray(format="rgb24")))
        self.tasks.append(asyncio.ensure_future(read()))

    async def offer(self) -> str:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        return self.pc.localDescription.sdp

    async def connect(self, base_url: str, path: str = "/v1/webrtc") -> httpx.Response:
        async with httpx.AsyncClient() as http:
            answer = await http.post(base_url + path, content=await self.offer(),
                                     headers={"content-type": "application/sdp"})
        if answer.status_code == 201:
            await self.pc.setRemoteDescription(RTCSessionDescription(sdp=answer.text, type="answer"))
            await asyncio.wait_for(self.opened.wait(), 20)
        return answer

    def send(self, **message) -> None:
        self.channel.send(json.dumps(message))

    async def wait_for(self, predicate, timeout_s: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for message in self.messages:
                if predicate(message):
                    return message
            await asyncio.sleep(0.02)
        raise AssertionError(f"no such message; got {[m['type'] for m in self.messages][-20:]}")

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await self.pc.close()
