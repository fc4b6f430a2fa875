"""Control to screen, as a viewer sees it: how long a prompt change, a reset or a camera frame takes to show.

Starts `arstream serve` with the server arguments given after `--` (its first session after `/readyz` is the one
measured), then runs one paced session through an outside `websockets` client that models a player with no
buffer of its own: playback starts when the first media segment arrives, frame k shows at start + k / fps, and a
frame whose segment has not arrived by then stalls playback until it does (a stall: counted, and the clock moves
on by it). The opening chunk's block (a split first block's rest) is start-up, not a stall.

Cases:
- `prompt` (default): every `--interval` seconds of playback the client changes the prompt, alternating a `soft`
  change of the object's colour and a change with policy `reset` of the background; each message has an id.
  Control to screen = send -> the frame of the chunk that names the id (`chunk.controls`) on the player's
  screen. With `--read-pixels` (the tiny model's world) the frames are decoded and read too (world.measure):
  send -> the first frame showing the new colour.
- `live` (`--live STRENGTH`): live input on at that strength; the client sends camera frames at 16 frames/s, each
  with a bright square moving with the frame count (the marker), and reads the square's place in the frames shown:
  send of camera frame k -> the first frame on screen that shows frame k's marker (`live`); and without reading
  pixels (any model, random weights included): send of camera frame k -> the first frame of the chunk that names
  it (`chunk.input_frame`: the client counts the frames it sends from 0, as the server numbers them) on screen
  (`live_named`).

`--transport webrtc` runs the case over a WebRTC peer instead (the live case: the camera as a video track) (bench/webrtc_viewer.py: aiortc, "on screen"
when aiortc hands over the decoded frame); `--transport both` runs the socket and then WebRTC, each on its own
server, so the two are compared in one run (and the server's CPU seconds of each: the engine's work is the
same, the difference is each transport's own encoding).

`--reference` repeats the case on a second server with the lead as it was before (`playout_margin_s` = two blocks,
whole-block chunks, no cut on reset): the naive path, in the same run. Prints ONE JSON line (and writes it to
`--out`); a short table goes to stderr.

    python bench/control_to_screen.py --changes 20 --interval 3 --read-pixels --reference -- --preset tiny
    python bench/control_to_screen.py --live 0 --seconds 30 -- --preset tiny
    python bench/control_to_screen.py --transport both --changes 10 --read-pixels -- --preset tiny
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import av
import numpy as np
from websockets.asyncio.client import connect

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_service_gpu import ServerProcess, free_port, gpu_name, process_cpu_seconds  # noqa: E402

COLOURS = ("red", "yellow")
BACKGROUNDS = ("blue", "green")
REFERENCE_ENV = {  # the lead before the control-latency work: two blocks ahead, whole blocks, resets wait behind it
    "ARSTREAM_ENGINE__PLAYOUT_MARGIN_S": "1.5",
    "ARSTREAM_ENGINE__MEDIA_GRANULARITY": "block",
    "ARSTREAM_ENGINE__CUT_ON_RESET": "false",
}
STARTUP_S = 1.0  # playback time before which a late segment is start-up, not a stall
MARKER = 24  # the live marker's side, pixels


def caption(colour: str, background: str) -> str:
    return f"a {colour} circle drifting on a {background} background"


class Player:
    """A viewer's player with no buffer of its own: frame k shows at anchor + k / fps; a segment that comes
    after its first frame's time stalls playback until it arrives."""

    def __init__(self, fps: int) -> None:
        self.fps = fps
        self.anchor: float | None = None
        self.stalls: list[tuple[float, float]] = []  # (playback seconds, stall seconds)

    def playing_frame(self, now: float) -> float:
        return (now - self.anchor) * self.fps

    def arrived(self, pts: int, frames: int, now: float) -> float:
        """A segment arrived at ``now``: returns when its first frame shows."""
        if self.anchor is None:
            self.anchor = now - pts / self.fps
        due = self.anchor + pts / self.fps
        if now > due:
            if pts / self.fps > STARTUP_S:
                self.stalls.append((pts / self.fps, now - due))
            self.anchor += now - due
            due = now
        return due


def decode_segment(init: bytes, segment: bytes) -> list[np.ndarray]:
    """The RGB frames of one media segment (each starts with a keyframe, so init + it decodes alone)."""
    with av.open(io.BytesIO(init + segment), format="mp4") as container:
        return [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]


def marker_pixels(index: int, width: int, height: int) -> np.ndarray:
    """Camera frame ``index``: dark grey with a white square whose place moves with the frame count (RGB)."""
    pixels = np.full((height, width, 3), 40, np.uint8)
    x = marker_x(index, width)
    y = (height - MARKER) // 2
    pixels[y:y + MARKER, x:x + MARKER] = 255
    return pixels


def marker_frame(index: int, width: int, height: int) -> bytes:
    """Camera frame ``index`` as the socket sends it (JPEG)."""
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(marker_pixels(index, width, height)).save(out, format="JPEG", quality=90)
    return out.getvalue()


def marker_x(index: int, width: int) -> int:
    steps = (width - MARKER) // 6
    return 6 * (index % steps)


def read_marker(frame: np.ndarray) -> float | None:
    """The marker's left edge in a frame (None when there is no bright square)."""
    bright = frame.mean(axis=2) > 180
    if bright.sum() < MARKER * MARKER // 3:
        return None
    xs = np.nonzero(bright)[1]
    return float(np.percentile(xs, 2))


async def run_case(url: str, args, *, seconds: float) -> dict:
    fps = 16
    player = Player(fps)
    sent: dict[str, tuple[str, float, str]] = {}  # id -> (kind, send time, expected colour/background)
    results: list[dict] = []
    frames_seen: list[tuple[int, float, np.ndarray]] = []  # (pts, time shown, rgb) when pixels are read
    camera_sent: list[float] = []
    camera_named: list[float] = []  # camera frame k sent -> the chunk naming it (chunk.input_frame) on screen
    camera_sent_epoch: list[float] = []  # the same sends on the server's clock (same host on the device)
    # Where a named camera frame's time went: sent -> its block began, the block's making until its chunk was
    # sent (server timings), sent -> arrived, arrived -> shown (the player's slack).
    camera_parts: dict[str, list[float]] = {"to_block_start": [], "block_to_sent": [], "sent_to_arrived": [],
                                            "arrived_to_shown": [], "queued": [], "denoise": [], "decode": []}
    segments: list[tuple[int, float, bytes]] = []  # (pts, the player's clock anchor then, media segment)
    ahead_at_send: list[float] = []  # seconds of media the player held beyond the frame showing, at each control
    received_frames = 0
    slack: list[tuple[int, float, int, float]] = []  # (pts, seconds the segment came before its frame showed, ...)
    named: dict[str, int] = {}
    chunks = 0
    first_media = None
    async with connect(f"{url.replace('http', 'ws', 1)}/v1/stream", compression=None, max_size=2**26,
                       open_timeout=60) as ws:
        colour, background = COLOURS[0], BACKGROUNDS[0]
        started = time.monotonic()
        await ws.send(json.dumps({"type": "start", "prompt": caption(colour, background), "seed": args.seed,
                                  "options": {"pace": True}, "id": "start"}))
        session = json.loads(await ws.recv())
        assert session["type"] == "session", session
        width, height = session["video"]["width"], session["video"]["height"]
        init = await ws.recv()
        if args.live is not None:
            await ws.send(json.dumps({"type": "live", "strength": args.live, "id": "live"}))
        pending = None
        change = 0
        next_change = args.first_change
        spread = change_spread(args)
        stop = started + seconds
        camera_next = time.monotonic()
        while time.monotonic() < stop:
            now = time.monotonic()
            if args.live is not None and now >= camera_next and player.anchor is not None:
                camera_sent.append(now)
                camera_sent_epoch.append(time.time())
                await ws.send(marker_frame(len(camera_sent) - 1, width, height))
                camera_next += 1 / fps
            if args.live is None and player.anchor is not None and (now - player.anchor) >= next_change \
                    and change < args.changes:
                message_id = f"c{change}"
                if change % 2 == 0:
                    colour = COLOURS[(COLOURS.index(colour) + 1) % 2]
                    kind, policy, expected = "soft", "soft", colour
                else:
                    background = BACKGROUNDS[(BACKGROUNDS.index(background) + 1) % 2]
                    kind, policy, expected = "reset", "reset", background
                sent[message_id] = (kind, time.monotonic(), expected)
                ahead_at_send.append(round((received_frames - player.playing_frame(time.monotonic())) / fps, 3))
                await ws.send(json.dumps({"type": "prompt", "prompt": caption(colour, background), "policy": policy,
                                          "id": message_id}))
                change += 1
                next_change += args.interval + next(spread)
            try:
                message = await asyncio.wait_for(ws.recv(), 0.005 if args.live is not None else 0.05)
            except TimeoutError:
                continue
            if isinstance(message, bytes):
                if pending is None:
                    continue
                arrived = time.monotonic()
                shows = player.arrived(pending["pts"], pending["frames"], arrived)
                received_frames = pending["pts"] + pending["frames"]
                slack.append((pending["pts"], round(shows - arrived, 3), pending["frames"],
                              round(pending["timings"]["encode_ms"], 1)))
                chunks += 1
                if first_media is None:
                    first_media = arrived - started
                number = pending.get("input_frame")
                if number is not None and number < len(camera_sent):
                    camera_named.append(shows - camera_sent[number])
                    timings = pending["timings"]
                    camera_parts["to_block_start"].append(timings["started_at"] / 1000 - camera_sent_epoch[number])
                    camera_parts["block_to_sent"].append((timings["sent_at"] - timings["started_at"]) / 1000)
                    camera_parts["sent_to_arrived"].append(time.time() - timings["sent_at"] / 1000)
                    camera_parts["arrived_to_shown"].append(shows - arrived)
                    for part in ("queued", "denoise", "decode"):
                        camera_parts[part].append(timings[f"{part}_ms"] / 1000)
                for control_id in pending.get("controls", ()):
                    if control_id in sent:
                        named[control_id] = pending["pts"]
                        kind, at, _ = sent[control_id]
                        results.append({"id": control_id, "kind": kind, "protocol_s": shows - at})
                if args.read_pixels or args.live is not None:
                    # Decoded and read after the session: reading here would hold up the next chunk's arrival.
                    segments.append((pending["pts"], player.anchor, message))
                pending = None
            else:
                parsed = json.loads(message)
                if parsed["type"] == "chunk":
                    pending = parsed
                elif parsed["type"] in ("error", "closed"):
                    print(f"server: {parsed}", file=sys.stderr)
                    if parsed["type"] == "closed":
                        break
        await ws.send(json.dumps({"type": "close"}))
    for pts, anchor, segment in segments:
        for offset, rgb in enumerate(decode_segment(init, segment)):
            frames_seen.append((pts + offset, anchor + (pts + offset) / fps, rgb))
    if args.read_pixels:
        _pixel_latencies(results, sent, named, frames_seen)
    out = {"chunks": chunks, "first_media_s": round(first_media, 3) if first_media else None,
           "played_s": round(frames_seen[-1][0] / fps, 1) if frames_seen else None,
           "stalls": len(player.stalls), "stall_s": round(sum(s for _, s in player.stalls), 3),
           "stalls_per_min": round(60 * len(player.stalls) / max(seconds, 1e-9), 2),
           "stall_list": [(round(at, 2), round(s, 3)) for at, s in player.stalls[:20]],
           "buffered_at_send_s": ahead_at_send,
           "slack_s": _stats([s for _, s, _, _ in slack[8:]]) | {"all_s": None},
           "tightest": sorted(slack, key=lambda item: item[1])[:8],
           "changes_at": [round(at - player.anchor, 2) for _, at, _ in sent.values()] if player.anchor else []}
    if args.live is not None:
        out["live"] = _camera_latencies(camera_sent, frames_seen, width)
        out["live_named"] = _stats(camera_named)
        out["live_parts"] = {part: {k: v for k, v in _stats(values).items() if k != "all_s"}
                             for part, values in camera_parts.items()}
    else:
        out["controls"] = _summaries(results)
        out["named"] = f"{len(named)} of {len(sent)}"
    return out


def _pixel_latencies(results, sent, named, frames_seen) -> None:
    """For each control, the first frame at or after its named chunk that reads as what was asked (world.measure)."""
    from world.measure import background_name, colour_name, read_frame

    for result in results:
        kind, at, expected = sent[result["id"]]
        start = named[result["id"]]
        for pts, shows, rgb in frames_seen:
            if pts < start - 12:
                continue
            reading = read_frame(rgb)
            got = colour_name(reading) if kind == "soft" else background_name(reading)
            if got == expected and shows >= at:
                result["pixels_s"] = shows - at
                break


def _camera_latencies(camera_sent: list[float], frames_seen, width: int) -> dict:
    """Camera frame k's marker on screen: the first frame shown whose marker sits where frame k put it."""
    latencies = []
    for pts, shows, rgb in frames_seen:
        x = read_marker(rgb)
        if x is None:
            continue
        # The newest camera frame sent before this frame showed whose marker is at x (within 3 px).
        candidates = [k for k, at in enumerate(camera_sent) if at <= shows and abs(marker_x(k, width) - x) <= 3]
        if candidates:
            latencies.append(shows - camera_sent[candidates[-1]])
    return _stats(latencies) | {"frames_read": len(latencies)}


def _stats(values: list[float]) -> dict:
    if not values:
        return {"n": 0}
    ordered = sorted(values)
    return {"n": len(values), "median_s": round(statistics.median(values), 3),
            "p90_s": round(ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))], 3),
            "max_s": round(ordered[-1], 3), "all_s": [round(v, 3) for v in values]}


def _summaries(results: list[dict]) -> dict:
    out = {}
    for kind in ("soft", "reset"):
        mine = [r for r in results if r["kind"] == kind]
        out[kind] = {"protocol": _stats([r["protocol_s"] for r in mine])}
        pixels = [r["pixels_s"] for r in mine if "pixels_s" in r]
        if pixels:
            out[kind]["pixels"] = _stats(pixels) | {"read": f"{len(pixels)} of {len(mine)}"}
    return out


def _cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds the server process has used so far, to 0.01 s (None elsewhere than Linux)."""
    seconds = process_cpu_seconds(pid)
    return None if seconds is None else round(seconds, 2)


def serve_and_run(server_args: list[str], args, env: dict[str, str], label: str, transport: str = "websocket") -> dict:
    port = free_port()
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    server = ServerProcess([*server_args, "--port", str(port)], port,
                           Path(args.log_dir) / f"{args.tag}{label}.log" if args.log_dir else None)
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        server.start()
        ready = server.wait_ready(args.ready_timeout)
        cpu_before = _cpu_seconds(server.process.pid)
        if transport == "webrtc" and args.live is not None:
            from webrtc_viewer import run_webrtc_live

            result = asyncio.run(run_webrtc_live(server.url, args, seconds=args.seconds,
                                                 prompt=caption(COLOURS[0], BACKGROUNDS[0]), picture=marker_pixels,
                                                 read_marker=read_marker, marker_x=marker_x))
        elif transport == "webrtc":
            from webrtc_viewer import run_webrtc_case

            result = asyncio.run(run_webrtc_case(server.url, args, seconds=args.seconds, caption=caption,
                                                 colours=COLOURS, backgrounds=BACKGROUNDS, spread=change_spread(args)))
            result["controls"] = _summaries(result.pop("results"))
        else:
            result = asyncio.run(run_case(server.url, args, seconds=args.seconds))
        cpu_after = _cpu_seconds(server.process.pid)
        session_cpu = round(cpu_after - cpu_before, 2) if cpu_before is not None and cpu_after is not None else None
        return {"label": label, "transport": transport, **ready, **result, "server_cpu_s": cpu_after,
                "session_cpu_s": session_cpu,
                "server_problems": list(server.problems)[-3:]}
    finally:
        server.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def change_spread(args):
    """The extra seconds of each interval between changes (``--spread``), the same sequence for a given seed."""
    rng = random.Random(args.seed)
    while True:
        yield rng.uniform(0.0, args.spread) if args.spread > 0 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--changes", type=int, default=20, help="prompt changes (alternating soft and reset)")
    parser.add_argument("--interval", type=float, default=3.0, help="seconds of playback between changes")
    parser.add_argument("--spread", type=float, default=0.0,
                        help="each interval is longer by a seeded uniform draw in [0, SPREAD) s, so the changes fall "
                             "at every phase of a block (an interval that is a multiple of the block's playback "
                             "would time the same phase each time)")
    parser.add_argument("--first-change", type=float, default=3.0, help="playback seconds before the first change")
    parser.add_argument("--seconds", type=float, default=None, help="session length (default: room for the changes)")
    parser.add_argument("--seed", type=int, default=5)
    parser.add_argument("--read-pixels", action="store_true", help="decode and read the frames (the tiny world)")
    parser.add_argument("--live", type=float, default=None, help="live input at this strength instead of prompts")
    parser.add_argument("--reference", action="store_true", help="also run the lead as it was before")
    parser.add_argument("--transport", choices=("websocket", "webrtc", "both"), default="websocket",
                        help="how the viewer reaches the session (both: the socket, then WebRTC, same case)")
    parser.add_argument("--ready-timeout", type=float, default=900.0)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--tag", default="", help="prefix of the server logs' names")
    parser.add_argument("--out", default=None)
    parser.add_argument("server_args", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    server_args = [a for a in args.server_args if a != "--"]
    if args.seconds is None:
        args.seconds = args.first_change + args.changes * (args.interval + args.spread) + 4.0 if args.live is None else 30.0
    result = {"bench": "control_to_screen", "date": time.strftime("%Y-%m-%d"), "gpu": gpu_name(),
              "server_args": server_args, "case": "live" if args.live is not None else "prompt",
              "live_strength": args.live, "runs": []}
    transports = ("websocket", "webrtc") if args.transport == "both" else (args.transport,)
    runs = [(transport, "lead_on_server" if transport == "websocket" else "lead_on_server_webrtc", {})
            for transport in transports]
    if args.reference:
        runs.append(("websocket", "reference_lead_two_blocks", REFERENCE_ENV))
    for transport, label, env in runs:
        result["runs"].append(serve_and_run(server_args, args, env, label, transport))
        if args.out:  # after each run: a later one cut short by a time limit keeps the ones before it
            Path(args.out).write_text(json.dumps(result) + "\n")
    print(json.dumps(result))
    for run in result["runs"]:
        controls = run.get("controls") or {"live": {"protocol": run.get("live_named", {}), "pixels": run.get("live", {})}}
        for kind, figures in controls.items():
            protocol = figures.get("protocol", {})
            print(f"{run['label']:28s} {kind:6s} median {protocol.get('median_s')} p90 {protocol.get('p90_s')} "
                  f"max {protocol.get('max_s')} pixels {figures.get('pixels', {}).get('median_s')} "
                  f"stalls {run['stalls']}", file=sys.stderr)


if __name__ == "__main__":
    main()
