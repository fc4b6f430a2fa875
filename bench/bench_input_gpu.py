"""Pictures and video in through the service, as a client sees them; ONE JSON line (docs/BENCHMARKS.md).

Starts `arstream serve` with the server arguments after `--` (default: the 1.3B preset, random bf16 weights,
CUDA, 832x480) and, over real WebSockets, each case on an idle engine:
- `image_ttfm`: `start` with an announced PNG (a synthetic 832x480 picture) sent -> the first media segment
  received (the picture as the codec reproduces it), and -> the first *generated* block's segment; the same for a
  text-only `start` as the reference (`text_ttfm`); median of `--sessions` sessions each;
- `live_{strength}`: live input at each `--strengths` value, pacing off, a feeder sending synthetic JPEG frames
  (a square sweeping across, 832x480) at the session's input rate so input never runs out: output frames/s after
  the first chunk, the server's per-block denoise (which includes the input's encode) and decode ms, and what
  the session's status counted (frames used, dropped); `text_pace_off` is the same session without input;
  "added latency per block" is the live block's denoise + decode minus the text block's.
After the server stops, the streaming encoders run alone in this process (bench/bench_video_encode.py): the Wan2.1
VAE encoder's cost per 12-frame block and its state bytes at the server's size.

    python bench/bench_input_gpu.py --out $OUT/input.json --server-log $OUT/server.log \\
        -- --preset wan2.1-1.3b --random-weights --device cuda --dtype bfloat16
    python bench/bench_input_gpu.py --sessions 1 --duration 4 -- --preset tiny   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import signal
import statistics
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
from PIL import Image
from websockets.asyncio.client import connect

from bench_service_gpu import ServerProcess, engine_idle, free_port, gpu_name

REPO = Path(__file__).resolve().parents[1]
PROMPT = "a red fox running through fresh snow, golden hour, cinematic"
INPUT_FPS = 30  # the engine's default live_input_fps: the feeder sends at the rate it takes
RECV_TIMEOUT_S = 60.0


def picture(width: int, height: int, step: int = 0) -> np.ndarray:
    """A synthetic frame: a gradient background and a bright square that sweeps across with ``step``."""
    y, x = np.mgrid[0:height, 0:width]
    frame = np.stack([x * 255 // max(width - 1, 1), y * 255 // max(height - 1, 1), np.full_like(x, 96)], -1)
    side = height // 4
    left = (step * width // 48) % (width - side)
    frame[height // 2 - side // 2 : height // 2 + side // 2, left : left + side] = (250, 240, 60)
    return frame.astype(np.uint8)


def encoded(frame: np.ndarray, fmt: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format=fmt, **({"quality": 85} if fmt == "JPEG" else {}))
    return buffer.getvalue()


async def _hello(ws) -> dict:
    session = json.loads(await asyncio.wait_for(ws.recv(), RECV_TIMEOUT_S))
    await asyncio.wait_for(ws.recv(), RECV_TIMEOUT_S)  # init segment
    return session


async def _next_chunk(ws) -> tuple[dict, float]:
    """The next `chunk` and the time its segment arrived (monotonic); other messages are skipped."""
    while True:
        message = await asyncio.wait_for(ws.recv(), RECV_TIMEOUT_S)
        if isinstance(message, bytes):
            continue
        parsed = json.loads(message)
        if parsed["type"] == "error":
            raise RuntimeError(f"server error: {parsed}")
        if parsed["type"] == "chunk":
            await asyncio.wait_for(ws.recv(), RECV_TIMEOUT_S)
            return parsed, time.monotonic()


async def _close(ws) -> None:
    await ws.send(json.dumps({"type": "close"}))
    try:
        async for message in ws:
            if isinstance(message, str) and json.loads(message)["type"] == "closed":
                return
    except Exception:  # noqa: BLE001 - the socket may go first
        return


async def ttfm(url: str, image: bytes | None, seed: int) -> dict:
    """`start` sent -> first segment, and -> first generated block's segment (ms)."""
    async with connect(f"{url}/v1/stream", compression=None, max_size=2**26) as ws:
        await _hello(ws)
        start = {"type": "start", "prompt": PROMPT, "seed": seed, "options": {"pace": False}}
        if image is not None:
            start["input"] = {"kind": "image", "bytes": len(image)}
        sent = time.monotonic()
        await ws.send(json.dumps(start))
        if image is not None:
            await ws.send(image)
        first, first_at = await _next_chunk(ws)
        generated, generated_at = (first, first_at) if image is None else await _next_chunk(ws)
        await _close(ws)
    return {"first_ms": (first_at - sent) * 1000, "first_frames": first["frames"],
            "first_generated_ms": (generated_at - sent) * 1000, "first_generated_frames": generated["frames"]}


async def stream(base_url: str, url: str, *, strength: float | None, seconds: float, width: int, height: int) -> dict:
    """One pacing-off session for ``seconds``, with live input at ``strength`` (None: text only)."""
    frames = [encoded(picture(width, height, k), "JPEG") for k in range(48)] if strength is not None else []
    async with connect(f"{url}/v1/stream", compression=None, max_size=2**26) as ws:
        session = await _hello(ws)
        ack = None
        if strength is not None:
            await ws.send(json.dumps({"type": "live", "strength": strength, "id": "live"}))
            for data in frames[:9]:
                await ws.send(data)
        await ws.send(json.dumps({"type": "start", "prompt": PROMPT, "seed": 5, "options": {"pace": False}}))

        async def feed() -> None:
            sent = 9
            while True:
                await asyncio.sleep(1 / INPUT_FPS)
                await ws.send(frames[sent % len(frames)])
                sent += 1

        feeder = asyncio.create_task(feed()) if frames else None
        seen, started = [], time.monotonic()
        try:
            while time.monotonic() - started < seconds:
                message = await asyncio.wait_for(ws.recv(), RECV_TIMEOUT_S)
                if isinstance(message, bytes):
                    continue
                parsed = json.loads(message)
                if parsed["type"] == "ack" and parsed.get("id") == "live":
                    ack = parsed
                elif parsed["type"] == "chunk":
                    await asyncio.wait_for(ws.recv(), RECV_TIMEOUT_S)
                    seen.append((parsed, time.monotonic()))
                elif parsed["type"] == "error":
                    raise RuntimeError(f"server error: {parsed}")
        finally:
            if feeder is not None:
                feeder.cancel()
        status = json.loads(urllib.request.urlopen(f"{base_url}/v1/sessions/{session['session_id']}", timeout=10).read())
        await _close(ws)
    steady = seen[1:]
    frames_after_first = sum(chunk["frames"] for chunk, _ in steady)
    span = seen[-1][1] - seen[0][1] if len(seen) > 1 else float("nan")
    timings = [chunk["timings"] for chunk, _ in steady if chunk["frames"] >= 12] or [c["timings"] for c, _ in seen]
    return {
        "strength_asked": strength,
        "strength_used": ack.get("strength") if ack else None,
        "steps": ack.get("steps") if ack else None,
        "chunks": len(seen),
        "fps": round(frames_after_first / span, 2) if span == span and span > 0 else None,
        "denoise_ms_median": round(statistics.median(t["denoise_ms"] for t in timings), 1),
        "decode_ms_median": round(statistics.median(t["decode_ms"] for t in timings), 1),
        "encode_ms_median": round(statistics.median(t["encode_ms"] for t in timings), 1),
        "input": status.get("input"),
        "encoder_state_bytes": status["counters"].get("encoder_state_bytes"),
    }


def run(args: argparse.Namespace, server_args: list[str]) -> dict:
    started = time.monotonic()
    result: dict = {"bench": "input_gpu", "server_args": server_args, "gpu": gpu_name(), "complete": False, "cases": {}}
    port = free_port()
    server = ServerProcess([*server_args, "--host", "127.0.0.1", "--port", str(port)], port,
                           Path(args.server_log) if args.server_log else None)
    server.start()
    try:
        result["startup"] = server.wait_ready(args.start_timeout_s)
        ws_url = "ws" + server.url[len("http"):]
        result["frame_size"] = asyncio.run(_frame_size(ws_url))  # from a socket's `session` message
        width, height = result["frame_size"]
        image = encoded(picture(width, height), "PNG")
        result["image_png_bytes"] = len(image)

        async def cases() -> None:
            for name, payload in (("text_ttfm", None), ("image_ttfm", image)):
                runs = []
                for seed in range(args.sessions):
                    await engine_idle(server)
                    runs.append(await ttfm(ws_url, payload, seed))
                result["cases"][name] = {
                    "first_ms_median": round(statistics.median(r["first_ms"] for r in runs), 1),
                    "first_generated_ms_median": round(statistics.median(r["first_generated_ms"] for r in runs), 1),
                    "runs": [{k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()} for r in runs],
                }
                write(result, args.out)
            for strength in [None, *args.strengths]:
                if time.monotonic() - started > args.budget_s - args.duration - 60:
                    result.setdefault("skipped", []).append(f"live {strength}")
                    continue
                await engine_idle(server)
                name = "text_pace_off" if strength is None else f"live_{strength}"
                result["cases"][name] = await stream(server.url, ws_url, strength=strength, seconds=args.duration,
                                                     width=width, height=height)
                write(result, args.out)

        asyncio.run(cases())
        text = result["cases"].get("text_pace_off")
        for name, case in result["cases"].items():
            if name.startswith("live_") and text:
                case["added_ms_per_block"] = round(case["denoise_ms_median"] + case["decode_ms_median"]
                                                   - text["denoise_ms_median"] - text["decode_ms_median"], 1)
        result["server_problems"] = list(server.problems)
    finally:
        result["stop"] = server.stop()
    if time.monotonic() - started < args.budget_s - 40 and "frame_size" in result:
        width, height = result["frame_size"]
        import subprocess

        encode = subprocess.run([sys.executable, str(REPO / "bench" / "bench_video_encode.py"), "--height", str(height),
                                 "--width", str(width), "--encoders", args.encoders],
                                capture_output=True, text=True, timeout=max(30, args.budget_s - (time.monotonic() - started) - 10))
        result["encoders"] = json.loads(encode.stdout.strip().splitlines()[-1]) if encode.returncode == 0 else encode.stderr[-2000:]
    result["complete"] = True
    result["elapsed_s"] = round(time.monotonic() - started, 1)
    write(result, args.out)
    return result


async def _frame_size(ws_url: str) -> tuple[int, int]:
    async with connect(f"{ws_url}/v1/stream", compression=None, max_size=2**26) as ws:
        video = (await _hello(ws))["video"]
        await _close(ws)
    return video["width"], video["height"]


def write(result: dict, path: Path | None) -> None:
    if path is not None:
        path.write_text(json.dumps(result))


def main() -> None:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a `timeout` around us: unwind, stop the server
    argv = sys.argv[1:]
    ours, server_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=3, help="sessions per time-to-first-media case")
    parser.add_argument("--strengths", type=lambda s: [float(x) for x in s.split(",")], default=[0.7, 0.95])
    parser.add_argument("--duration", type=float, default=12.0, help="seconds per streaming case")
    parser.add_argument("--budget-s", type=float, default=480.0)
    parser.add_argument("--start-timeout-s", type=float, default=300.0)
    parser.add_argument("--encoders", default="wan2.1,tiny-codec", help="bench_video_encode.py's, after the server")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--server-log", default=None)
    args = parser.parse_args(ours)
    server_args = server_args or ["--preset", "wan2.1-1.3b", "--random-weights", "--device", "cuda", "--dtype", "bfloat16"]
    print(json.dumps(run(args, server_args)))


if __name__ == "__main__":
    main()
