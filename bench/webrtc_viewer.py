"""A WebRTC viewer for bench/control_to_screen.py: the same prompt-change case as its socket player, over a peer.

An aiortc peer (video and audio received, the controls on a data channel) opens a session with
``POST /v1/webrtc``. "On screen" is when aiortc hands over a decoded frame: after its own jitter buffer and
decoder, as a browser's would be before it paints (a browser adds its paint, one display frame at most). A
frame's place on the session's timeline is read from its RTP timestamp against the first frame's (the first
frame sent is the session's first, pts 0). A stall is a gap between two frames handed over of more than two
frame times after the first second (the server paces; nothing else should leave a gap).

Control to screen = the send of a `prompt` on the data channel -> the first frame handed over whose pts is at or
after the chunk that names the message (`chunk.controls`); with ``--read-pixels`` also -> the first frame that
reads as what was asked (world.measure).

Live (``--live STRENGTH``): the peer sends a camera track of marker frames (control_to_screen.marker_frame's
picture: a white square whose place moves with the frame count) at 16 frames/s; camera frame k's effect on screen
= the moment the track hands frame k to its encoder -> the first frame handed over that shows frame k's marker.
"""

from __future__ import annotations

import asyncio
import json
import time

import fractions

import av
import httpx
import numpy as np
from aiortc import MediaStreamTrack, RTCConfiguration, RTCPeerConnection, RTCSessionDescription

VIDEO_CLOCK = 90_000  # RTP's video clock rate
STALL_FRAMES = 2.0  # a gap of more than this many frame times between frames handed over is a stall
STARTUP_S = 1.0


class MarkerCamera(MediaStreamTrack):
    """A camera of marker frames at ``fps``: frame k (its white square at ``place(k)``) handed over at start + k/fps;
    ``sent[k]`` is when."""

    kind = "video"

    def __init__(self, width: int, height: int, fps: int, picture) -> None:
        super().__init__()
        self.width, self.height, self.fps, self.picture = width, height, fps, picture
        self.sent: list[float] = []
        self._start: float | None = None

    async def recv(self) -> av.VideoFrame:
        k = len(self.sent)
        if self._start is None:
            self._start = time.monotonic()
        wait = self._start + k / self.fps - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)
        frame = av.VideoFrame.from_ndarray(self.picture(k, self.width, self.height), format="rgb24")
        frame.pts, frame.time_base = k * VIDEO_CLOCK // self.fps, fractions.Fraction(1, VIDEO_CLOCK)
        self.sent.append(time.monotonic())
        return frame


class WebRTCViewer:
    def __init__(self, fps: int = 16, camera: MarkerCamera | None = None) -> None:
        self.fps = fps
        self.pc = RTCPeerConnection(RTCConfiguration(iceServers=[]))
        if camera is not None:
            self.pc.addTransceiver(camera, direction="sendrecv")  # the camera out, the session's video in
        else:
            self.pc.addTransceiver("video", direction="recvonly")
        self.pc.addTransceiver("audio", direction="recvonly")
        self.channel = self.pc.createDataChannel("arstream")
        self.opened = asyncio.Event()
        self.channel.on("open", self.opened.set)
        self.messages: list[tuple[float, dict]] = []  # (arrival, message)
        self.channel.on("message", lambda m: self.messages.append((time.monotonic(), json.loads(m))))
        self.frames: list[tuple[int, float, np.ndarray | None]] = []  # (pts, handed over at, rgb when kept)
        self.keep_pixels = False
        self._rtp_first: int | None = None
        self._tasks: list[asyncio.Task] = []
        self.pc.on("track", self._on_track)

    def _on_track(self, track) -> None:
        async def read() -> None:
            while True:
                try:
                    frame = await track.recv()
                except Exception:
                    return
                if track.kind != "video":
                    continue
                now = time.monotonic()
                if self._rtp_first is None:
                    self._rtp_first = frame.pts
                ticks = (frame.pts - self._rtp_first) % 2**32
                pts = round(ticks * self.fps / VIDEO_CLOCK)
                self.frames.append((pts, now, frame.to_ndarray(format="rgb24") if self.keep_pixels else None))

        self._tasks.append(asyncio.ensure_future(read()))

    async def connect(self, base_url: str) -> float:
        """Offer, answer, data channel open: the seconds it took."""
        started = time.monotonic()
        await self.pc.setLocalDescription(await self.pc.createOffer())
        async with httpx.AsyncClient(timeout=60) as http:
            answer = await http.post(f"{base_url}/v1/webrtc", content=self.pc.localDescription.sdp,
                                     headers={"content-type": "application/sdp"})
        if answer.status_code != 201:
            raise RuntimeError(f"POST /v1/webrtc: {answer.status_code} {answer.text[:300]}")
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=answer.text, type="answer"))
        await asyncio.wait_for(self.opened.wait(), 30)
        return time.monotonic() - started

    def send(self, message: dict) -> None:
        self.channel.send(json.dumps(message))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await self.pc.close()


async def run_webrtc_case(url: str, args, *, seconds: float, caption, colours, backgrounds, spread) -> dict:
    """The prompt case of control_to_screen.run_case over a peer; the same result keys where they apply
    (``spread``: the extra seconds of each interval between changes, control_to_screen.change_spread)."""
    fps = 16
    viewer = WebRTCViewer(fps)
    viewer.keep_pixels = bool(args.read_pixels)
    sent: dict[str, tuple[str, float, str]] = {}
    colour, background = colours[0], backgrounds[0]
    started = time.monotonic()
    connect_s = await viewer.connect(url)
    viewer.send({"type": "start", "prompt": caption(colour, background), "seed": args.seed,
                 "options": {"pace": True}, "id": "start"})
    while not viewer.frames and time.monotonic() - started < 60:
        await asyncio.sleep(0.005)
    if not viewer.frames:
        raise RuntimeError("no frame in 60 s")
    first_media = viewer.frames[0][1] - started
    first_shown = viewer.frames[0][1]
    change, next_change = 0, args.first_change
    stop = started + seconds
    ahead_at_send: list[float] = []
    while time.monotonic() < stop:
        await asyncio.sleep(0.01)
        playing = time.monotonic() - first_shown
        if playing >= next_change and change < args.changes:
            message_id = f"c{change}"
            if change % 2 == 0:
                colour = colours[(colours.index(colour) + 1) % 2]
                kind, expected = "soft", colour
            else:
                background = backgrounds[(backgrounds.index(background) + 1) % 2]
                kind, expected = "reset", background
            sent[message_id] = (kind, time.monotonic(), expected)
            newest = max((m.get("pts", 0) + m.get("frames", 0) for _, m in viewer.messages if m["type"] == "chunk"),
                         default=0)
            ahead_at_send.append(round((newest - viewer.frames[-1][0]) / fps, 3))
            viewer.send({"type": "prompt", "prompt": caption(colour, background), "policy": kind, "id": message_id})
            change += 1
            next_change += args.interval + next(spread)
    viewer.send({"type": "close"})
    await asyncio.sleep(0.2)
    await viewer.close()

    chunks = [m for _, m in viewer.messages if m["type"] == "chunk"]
    named = {cid: m["pts"] for m in chunks for cid in m.get("controls", ()) if cid in sent}
    results = []
    for control_id, (kind, at, expected) in sent.items():
        if control_id not in named:
            continue
        shown = next((t for pts, t, _ in viewer.frames if pts >= named[control_id] and t >= at), None)
        if shown is None:
            continue
        result = {"id": control_id, "kind": kind, "protocol_s": shown - at}
        if args.read_pixels:
            result.update(_pixels(viewer.frames, named[control_id], at, kind, expected))
        results.append(result)
    # How long after its chunk message a chunk's first frame was handed over (the socket player's "slack" is
    # the other way round: how long before it shows a segment came).
    shown_at = {}
    for pts, t, _ in viewer.frames:
        shown_at.setdefault(pts, t)
    arrivals = [(t, m["pts"]) for t, m in viewer.messages if m["type"] == "chunk"]
    after_message = [round(shown_at[pts] - t, 3) for t, pts in arrivals if pts in shown_at]
    gaps = [(pts / fps, t1 - t0) for (_, t0, _), (pts, t1, _) in zip(viewer.frames, viewer.frames[1:])
            if t1 - first_shown > STARTUP_S and t1 - t0 > STALL_FRAMES / fps]
    return {"transport": "webrtc", "connect_s": round(connect_s, 3), "chunks": len(chunks),
            "first_media_s": round(first_media, 3), "frames_shown": len(viewer.frames),
            "played_s": round(viewer.frames[-1][0] / fps, 1),
            "stalls": len(gaps), "stall_s": round(sum(g for _, g in gaps), 3),
            "stalls_per_min": round(60 * len(gaps) / max(seconds, 1e-9), 2),
            "stall_list": [(round(at, 2), round(g, 3)) for at, g in gaps[:20]],
            "buffered_at_send_s": ahead_at_send, "named": f"{len(named)} of {len(sent)}",
            "shown_after_chunk_message_s": _stats(after_message[8:]),
            "results": results}


def _stats(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {"n": len(values), "median_s": ordered[len(ordered) // 2], "p10_s": ordered[len(ordered) // 10],
            "p90_s": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], "max_s": ordered[-1]}


def _pixels(frames, named_pts: int, at: float, kind: str, expected: str) -> dict:
    from world.measure import background_name, colour_name, read_frame

    for pts, shown, rgb in frames:
        if pts < named_pts - 12 or shown < at or rgb is None:
            continue
        reading = read_frame(rgb)
        got = colour_name(reading) if kind == "soft" else background_name(reading)
        if got == expected:
            return {"pixels_s": shown - at}
    return {}


async def run_webrtc_live(url: str, args, *, seconds: float, prompt: str, picture, read_marker, marker_x,
                          width: int = 256, height: int = 144) -> dict:
    """The live case over a peer: camera frame k's marker -> the first frame handed over that shows it."""
    fps = 16
    camera = MarkerCamera(width, height, fps, picture)
    viewer = WebRTCViewer(fps, camera)
    viewer.keep_pixels = True
    started = time.monotonic()
    await viewer.connect(url)
    viewer.send({"type": "start", "prompt": prompt, "seed": args.seed,
                 "options": {"pace": True}, "id": "start"})
    viewer.send({"type": "live", "strength": args.live, "id": "live"})
    await asyncio.sleep(max(0.0, started + seconds - time.monotonic()))
    viewer.send({"type": "close"})
    await asyncio.sleep(0.2)
    await viewer.close()
    latencies = []
    for _, shown, rgb in viewer.frames:
        x = read_marker(rgb)
        if x is None:
            continue
        candidates = [k for k, at in enumerate(camera.sent) if at <= shown and abs(marker_x(k, width) - x) <= 3]
        if candidates:
            latencies.append(shown - camera.sent[candidates[-1]])
    live = _stats(latencies) | {"frames_read": len(latencies)}
    return {"transport": "webrtc", "frames_shown": len(viewer.frames), "camera_frames_sent": len(camera.sent),
            "first_media_s": round(viewer.frames[0][1] - started, 3) if viewer.frames else None,
            "stalls": 0, "live": live}
