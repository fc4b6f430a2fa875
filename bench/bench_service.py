"""Benchmark the web service as a real client sees it; prints ONE JSON line.

Starts `arstream serve` (tiny preset on CPU by default) and, over WebSockets:
- time to first chunk: `start` sent (as soon as the socket is open, before `session` arrives) -> first media
  segment received (client clock), median of N sessions, each on an idle engine (the previous session's last
  block finished);
- steady frames/s with pacing off: frames received per second after the first chunk;
- encode ms per chunk (the server's `timings.encode_ms`);
- decode end -> segment on the wire: the block's decode end (`started_at + denoise_ms + decode_ms`) to
  `sent_at` (server clock) and to the client's receive time (same machine, same clock).
The same number of blocks also runs through the engine alone in this process (the reference path:
no service, no encoding, no socket), so the service's cost is a ratio as well as a time.

    python bench/bench_service.py [--chunks 40] [--ttfc-sessions 3] [--height 144 --width 256]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from websockets.asyncio.client import connect

START_TIMEOUT_S = 300


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    script = Path(sys.executable).parent / "arstream"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "app.cli"]
    command += ["serve", "--host", "127.0.0.1", "--port", "0", "--preset", args.preset, "--log-format", "json",
                "--max-sessions", "2"]
    if args.random_weights:
        command.append("--random-weights")
    for flag in ("height", "width", "cpu_threads", "device"):
        value = getattr(args, flag)
        if value is not None:
            command += [f"--{flag.replace('_', '-')}", str(value)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    found: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in process.stdout:
            match = re.search(r"arstream serving on (http://\S+)", line)
            if match and not found:
                found.append(match.group(1))
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(START_TIMEOUT_S) or not found:
        process.kill()
        raise SystemExit("arstream serve did not start")
    # The port is bound before the engine is built and warmed: /readyz answers 200 once sessions are taken.
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            if urllib.request.urlopen(found[0] + "/readyz", timeout=5).status == 200:
                break
        except OSError:
            pass
        if time.monotonic() > deadline or process.poll() is not None:
            process.kill()
            raise SystemExit("arstream serve did not become ready")
        time.sleep(0.1)
    return process, "ws" + found[0][len("http"):]


async def engine_idle(url: str, timeout_s: float = 30.0) -> None:
    """Wait until no session holds KV blocks: a closed session's block still in flight is finished."""
    metrics_url = "http" + url[len("ws"):] + "/metrics"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = await asyncio.to_thread(lambda: urllib.request.urlopen(metrics_url, timeout=5).read().decode())
        if re.search(r"^arstream_kv_blocks_in_use 0(\.0)?$", text, re.MULTILINE):
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("the engine did not go idle")


async def one_session(url: str, chunks: int, seed: int) -> dict:
    """Start a session with pacing off and receive ``chunks`` chunks; return raw observations."""
    async with connect(f"{url}/v1/stream", compression=None, max_size=2**26) as ws:
        # `start` as soon as the socket is open, before `session`: whatever the server does to open the stream
        # counts in the time to first chunk, as it does for a viewer.
        sent = time.time() * 1000.0
        await ws.send(json.dumps({"type": "start", "prompt": "benchmark", "seed": seed, "options": {"pace": False}}))
        json.loads(await ws.recv())
        await ws.recv()  # init segment
        observed, pending = [], None
        while len(observed) < chunks:
            message = await ws.recv()
            now = time.time() * 1000.0
            if isinstance(message, bytes):
                observed.append((pending, now, len(message)))
                continue
            parsed = json.loads(message)
            if parsed["type"] == "chunk":
                pending = parsed
        # Close and wait for `closed`, so no block of this session is still running when the next starts.
        await ws.send(json.dumps({"type": "close"}))
        async for message in ws:
            if isinstance(message, str) and json.loads(message)["type"] == "closed":
                break
        return {"start_sent": sent, "chunks": observed}


def engine_only_fps(args: argparse.Namespace, chunks: int) -> float:
    """The reference path: the same engine config, same block count, no service in between."""
    from engine.api import Engine
    from engine.config import EngineConfig

    async def run() -> float:
        config = EngineConfig(preset=args.preset, device=args.device or "cpu", height=args.height, width=args.width,
                              cpu_threads=args.cpu_threads, max_sessions=1, warmup_blocks=1,
                              random_weights=args.random_weights)
        engine = Engine(config)
        await engine.start()
        session = engine.create_session(seed=1, pace=False)
        engine.start_session(session.session_id, "benchmark")
        frames, first_at, count = 0, None, 0
        async for chunk in engine.chunks(session.session_id):
            count += 1
            if first_at is None:
                first_at = time.perf_counter()
            else:
                frames += chunk.frames.shape[0]
            if count >= chunks:
                break
        elapsed = time.perf_counter() - first_at
        await engine.shutdown("client")
        return frames / elapsed

    return asyncio.run(run())


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--device", default=None)
    parser.add_argument("--height", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--cpu-threads", type=int, default=None)
    parser.add_argument("--chunks", type=int, default=40, help="chunks in the steady-state run")
    parser.add_argument("--ttfc-sessions", type=int, default=3)
    parser.add_argument("--random-weights", action="store_true",
                        help="the preset's seeded random model (default: its shipped weights, what `arstream serve` runs)")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    process, url = start_server(args)
    try:
        async def measure():
            ttfc = []
            for seed in range(args.ttfc_sessions):
                await engine_idle(url)  # time to first chunk on an idle engine
                run = await one_session(url, 1, seed)
                ttfc.append(run["chunks"][0][1] - run["start_sent"])
            await engine_idle(url)
            return ttfc, await one_session(url, args.chunks, 100)

        ttfc, steady = asyncio.run(measure())
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)

    observed = steady["chunks"]
    frames_after_first = sum(chunk["frames"] for chunk, _, _ in observed[1:])
    fps = frames_after_first / ((observed[-1][1] - observed[0][1]) / 1000.0)
    encode_ms = [chunk["timings"]["encode_ms"] for chunk, _, _ in observed]

    def decode_end(chunk: dict) -> float:
        timings = chunk["timings"]
        return timings["started_at"] + timings["denoise_ms"] + timings["decode_ms"]

    to_sent = [chunk["timings"]["sent_at"] - decode_end(chunk) for chunk, _, _ in observed]
    to_received = [received - decode_end(chunk) for chunk, received, _ in observed]
    reference_fps = engine_only_fps(args, args.chunks)
    first = observed[0][0]
    result = {
        "bench": "service",
        "preset": args.preset,
        "device": args.device or "cpu",
        "frames_per_chunk": observed[1][0]["frames"] if len(observed) > 1 else first["frames"],
        "chunks": len(observed),
        "time_to_first_chunk_ms_median": round(statistics.median(ttfc), 1),
        "time_to_first_chunk_ms_all": [round(v, 1) for v in ttfc],
        "steady_fps_pace_off": round(fps, 2),
        "engine_only_fps": round(reference_fps, 2),
        "service_over_engine_fps_ratio": round(fps / reference_fps, 3),
        "denoise_ms_median": round(statistics.median(c["timings"]["denoise_ms"] for c, _, _ in observed), 1),
        "decode_ms_median": round(statistics.median(c["timings"]["decode_ms"] for c, _, _ in observed), 1),
        "encode_ms_median": round(statistics.median(encode_ms), 2),
        "encode_ms_p95": round(percentile(encode_ms, 0.95), 2),
        "decode_end_to_sent_ms_median": round(statistics.median(to_sent), 2),
        "decode_end_to_received_ms_median": round(statistics.median(to_received), 2),
        "decode_end_to_received_ms_p95": round(percentile(to_received, 0.95), 2),
        "segment_kib_median": round(statistics.median(size for _, _, size in observed) / 1024, 1),
        "cpu_count": os.cpu_count(),
        # A shared machine: other work running at the same time shows here (1-minute load averages).
        "loadavg_1m_before": round(load_before, 2),
        "loadavg_1m_after": round(os.getloadavg()[0], 2),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
