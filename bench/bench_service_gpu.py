"""The service as its viewers see it, N concurrent sessions, pacing on and off; prints ONE JSON line.

Starts `arstream serve` as a subprocess with the server arguments given after `--` (passed through unchanged),
records the start-up time to `/readyz`, then runs cases, each on an idle engine (no KV block in use):
- `first_after_ready`: the very first session after `/readyz`, pacing off (stalls from a shape seen for the first
  time after readiness, or from anything the first socket opens, show here and nowhere else; every client sends
  `start` as soon as its socket is open, so time to first media counts the stream's opening too);
- `transitions`: one paced session that gets `reset`, then a `recache` prompt change, then a second paced session
  joins; the chunk gaps after each event are reported (warm-up must have covered those shapes);
- `n{N}_pace_{on,off}` for each N of `--concurrency`: N `websockets` clients start together and stream for
  `--duration` seconds.
Per session: frames/s, time to first media, worst chunk gap, gaps over 1.5x the chunk duration, deadline misses,
refusals, and the server's chunk timings (see service_session.py). Cases that no longer fit `--budget-s` are
listed as skipped, never cut short. After the server stops, the engine alone runs one session with pacing off in
a child process with the same configuration (the reference path: no encoding, no socket), so the service's
frames/s is also a ratio. The JSON goes to stdout and to `--out` (rewritten after every case, `complete` false
until the end); a short table goes to stderr.

    python bench/bench_service_gpu.py --concurrency 1,2 --duration 8 --out /tmp/service.json -- --preset tiny
    python bench/bench_service_gpu.py --duration 20 --budget-s 420 --out $OUT/service.json \\
        -- --preset wan2.1-1.3b --random-weights --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from pathlib import Path

from service_session import case_summary, media_check, run_session, session_stats

REPO = Path(__file__).resolve().parents[1]
CASE_OVERHEAD_S = 5.0  # connect, close, waiting for the engine to go idle
IDLE_TIMEOUT_S = 60.0
WARM_CHUNKS = 3  # the engine reference's throwaway session
# Server gauges worth keeping with each case, where this server version has them.
GAUGES = ("arstream_session_capacity", "arstream_live_session_capacity", "arstream_realtime_admission",
          "arstream_block_cost_seconds", "arstream_realtime_utilisation", "arstream_kv_blocks_total",
          "arstream_session_deadline_misses_max", "arstream_live_sessions_below_realtime",
          "arstream_device_memory_peak_bytes", "arstream_device_memory_limit_bytes")
PROMPT = "a red fox running through fresh snow, golden hour, cinematic"
OTHER_PROMPT = "a lighthouse on a cliff at night, waves crashing, moonlight"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ServerProcess:
    """`arstream serve` as a child on a port chosen here: its output goes to a log file (and a short tail in
    memory); readiness is read from `/healthz` and `/readyz`, not from its log."""

    def __init__(self, server_args: list[str], port: int, log_path: Path | None) -> None:
        self.command = [sys.executable, "-m", "app.cli", "serve", *server_args]
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.tail: deque[str] = deque(maxlen=40)
        self.problems: deque[str] = deque(maxlen=10)  # log lines at warning level or worse
        self.process: subprocess.Popen | None = None
        self.started = 0.0

    def start(self) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
        self.started = time.monotonic()
        self.process = subprocess.Popen(self.command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, errors="replace")
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        log = open(self.log_path, "w") if self.log_path else None
        try:
            for line in self.process.stdout:
                if log:
                    log.write(line)
                    log.flush()
                self.tail.append(line.rstrip()[:500])
                if re.search(r'"level": "(warning|error|critical)"|Traceback', line):
                    self.problems.append(line.rstrip()[:500])
        finally:
            if log:
                log.close()

    def _answers(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}{path}", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):  # refused while starting, 503 while warming up
            return False

    def wait_ready(self, timeout_s: float) -> dict:
        """Seconds from spawn to `/healthz` 200 (listening) and to `/readyz` 200 (warm); raises on failure."""
        deadline = self.started + timeout_s
        listening_s = None
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"arstream serve exited with {self.process.returncode} before ready")
            if listening_s is None and self._answers("/healthz"):
                listening_s = time.monotonic() - self.started
            if listening_s is not None and self._answers("/readyz"):
                return {"listening_s": round(listening_s, 2), "ready_s": round(time.monotonic() - self.started, 2)}
            time.sleep(0.1)
        raise RuntimeError(f"/readyz not 200 within {timeout_s:.0f} s (listening: {listening_s is not None})")

    def metrics(self) -> dict[str, float]:
        """Every unlabelled `arstream_*` sample of `/metrics` (Prometheus text)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as response:
            text = response.read().decode()
        samples = {}
        for name, value in re.findall(r"^(arstream_[a-z0-9_]+) (\S+)$", text, re.MULTILINE):
            if not name.endswith("_created"):
                try:
                    samples[name] = float(value)
                except ValueError:
                    pass
        return samples

    def metric(self, name: str) -> float | None:
        return self.metrics().get(name)

    def stop(self) -> dict:
        if self.process is None or self.process.poll() is not None:
            return {"exit_code": None if self.process is None else self.process.returncode}
        started = time.monotonic()
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=10)
        return {"exit_code": self.process.returncode, "stop_s": round(time.monotonic() - started, 2)}


class GpuSampler:
    """nvidia-smi every 500 ms while a case runs: is the GPU busy, how much memory is in use."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._process: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "GpuSampler":
        try:
            self._process = subprocess.Popen(
                ["nvidia-smi", "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits",
                 "-lms", "500"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            return self
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        for line in self._process.stdout:
            try:
                utilization, memory = (float(part) for part in line.split(",")[:2])
            except ValueError:
                continue
            self.samples.append((utilization, memory))

    def __exit__(self, *exc) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait(timeout=5)

    def summary(self) -> dict | None:
        if not self.samples:
            return None
        return {"util_pct_mean": round(statistics.mean(u for u, _ in self.samples), 1),
                "memory_mib_max": max(m for _, m in self.samples), "samples": len(self.samples)}


def gpu_name() -> str | None:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


# --- cases ------------------------------------------------------------------------------------------


def plan_cases(args: argparse.Namespace) -> list[dict]:
    cases = [{"name": "first_after_ready", "sessions": 1, "pace": False, "duration": args.first_duration}]
    if args.transitions:
        cases.append({"name": "transitions", "sessions": 2, "pace": True, "duration": args.transitions_duration})
    for n in args.concurrency:
        for pace in args.pacing:
            cases.append({"name": f"n{n}_pace_{'on' if pace else 'off'}", "sessions": n, "pace": pace,
                          "duration": args.duration})
    return cases


async def run_case(url: str, case: dict, prompt: str) -> list:
    duration, pace = case["duration"], case["pace"]
    stop_at = time.monotonic() + duration
    if case["name"] == "transitions":
        # Session A meets reset, then a recache prompt change; session B joins for the last quarter.
        actions = [(duration * 0.25, {"type": "reset"}),
                   (duration * 0.5, {"type": "prompt", "prompt": OTHER_PROMPT, "policy": "recache"})]
        a = run_session(url, label="a", pace=pace, seed=11, prompt=prompt, stop_at=stop_at, actions=actions,
                        keep_media=True)

        async def joiner():
            await asyncio.sleep(duration * 0.75)
            return await run_session(url, label="b_joins", pace=pace, seed=12, prompt=prompt, stop_at=stop_at)

        return list(await asyncio.gather(a, joiner()))
    # The first session of each case keeps its bytes: its stream is decoded afterwards (media_check).
    return list(await asyncio.gather(*(
        run_session(url, label=f"s{i}", pace=pace, seed=100 + i, prompt=prompt, stop_at=stop_at, keep_media=i == 0)
        for i in range(case["sessions"])
    )))


def safe_metrics(server: ServerProcess) -> dict[str, float]:
    try:
        return server.metrics()
    except OSError:
        return {}


async def engine_idle(server: ServerProcess, timeout_s: float = IDLE_TIMEOUT_S) -> bool:
    """No session holds KV blocks: the previous case's last block is finished."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if await asyncio.to_thread(server.metric, "arstream_kv_blocks_in_use") == 0:
                return True
        except OSError:  # URLError too: a server that died shows in the case that follows
            pass
        await asyncio.sleep(0.1)
    return False


# --- the engine-only reference -----------------------------------------------------------------------


async def one_session(engine, prompt: str, *, seed: int, chunks: int | None = None, seconds: float | None = None):
    """One pacing-off session through the engine API until ``chunks`` or ``seconds``; then closed and idle."""
    session = engine.create_session(seed=seed, pace=False)
    engine.start_session(session.session_id, prompt)
    sent, seen = time.monotonic(), []
    async for chunk in engine.chunks(session.session_id):
        seen.append((time.monotonic(), int(chunk.frames.shape[0]), chunk.timings))
        if (chunks is not None and len(seen) >= chunks) or (seconds is not None and time.monotonic() - sent >= seconds):
            break
    engine.close(session.session_id, "client")
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while engine.counters().kv_blocks_in_use and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    return sent, seen


def engine_reference(server_args: list[str], duration: float, prompt: str) -> dict:
    """The same engine config as the server's, one session, pacing off, no service in between."""
    sys.path.insert(0, str(REPO))
    import torch

    from app.cli import _settings_from, build_parser
    from engine.api import Engine

    config = _settings_from(build_parser().parse_args(["serve", *server_args])).engine

    async def run() -> dict:
        began = time.monotonic()
        engine = Engine(config)
        await engine.start()
        start_s = time.monotonic() - began
        try:
            # A short session first, as the service's measured N = 1 cases come after others: the reference
            # is the engine's steady speed, not its first session's.
            await one_session(engine, prompt, seed=0, chunks=WARM_CHUNKS)
            sent, seen = await one_session(engine, prompt, seed=1, seconds=duration)
        finally:
            await engine.shutdown("client")
        span = seen[-1][0] - seen[0][0]
        return {
            "engine_start_s": round(start_s, 2),
            "warm_up_chunks": WARM_CHUNKS,
            "chunks": len(seen),
            "fps_steady": round(sum(frames for _, frames, _ in seen[1:]) / span, 2) if span > 0 else None,
            "time_to_first_chunk_ms": round((seen[0][0] - sent) * 1000.0, 1),
            "denoise_ms_median": round(statistics.median(t.denoise_ms for *_, t in seen), 2),
            "decode_ms_median": round(statistics.median(t.decode_ms for *_, t in seen), 2),
            "torch": torch.__version__,
            "device_name": torch.cuda.get_device_name() if config.device.startswith("cuda") else config.device,
        }

    return asyncio.run(run())


def run_engine_reference(args: argparse.Namespace, server_args: list[str], timeout_s: float) -> dict:
    command = [sys.executable, str(Path(__file__).resolve()), "--engine-only", "--engine-duration",
               str(args.engine_duration), "--prompt", args.prompt, "--", *server_args]
    try:
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        return {"error": f"exit {done.returncode}", "stderr_tail": done.stderr[-1500:]}
    return json.loads(lines[-1])


# --- the run -----------------------------------------------------------------------------------------


def headline(result: dict) -> dict:
    """The figures the issue's targets are stated in."""
    cases = result["cases"]
    out: dict = {"ready_s": (result.get("startup") or {}).get("ready_s")}
    first = cases.get("first_after_ready")
    if first:
        out["first_session"] = {k: first["summary"].get(k) for k in (
            "time_to_first_media_ms_max", "connect_to_first_media_ms_max", "fps_steady_min", "worst_gap_ms",
            "gaps_over_1_5x")}
    realtime = [case["sessions_asked"] for name, case in cases.items()
                if name.endswith("_pace_on") and case["summary"]["refused"] == 0 and case["summary"]["served"]
                and case["summary"]["deadline_misses"] == 0 and case["summary"]["gaps_over_1_5x"] == 0]
    out["max_paced_sessions_without_misses_or_stalls"] = max(realtime) if realtime else 0
    for name in ("n1_pace_on", "n1_pace_off"):
        if name in cases:
            summary = cases[name]["summary"]
            out[name] = {k: summary[k] for k in ("fps_steady_min", "time_to_first_media_ms_max", "deadline_misses",
                                                 "gaps_over_1_5x")}
    reference = result.get("engine_only") or {}
    service_fps = (cases.get("n1_pace_off") or cases.get("first_after_ready") or {}).get("summary", {})
    if reference.get("fps_steady") and service_fps.get("fps_steady_min"):
        out["service_over_engine_fps"] = round(service_fps["fps_steady_min"] / reference["fps_steady"], 3)
    encode = result.get("text_encode_ms_median")
    if encode is not None and "n1_pace_on" in out and out["n1_pace_on"]["time_to_first_media_ms_max"] is not None:
        out["n1_time_to_first_media_plus_umt5_encode_ms"] = round(
            out["n1_pace_on"]["time_to_first_media_ms_max"] + encode, 1)
    return out


def print_table(result: dict) -> None:
    rows = [("case", "N", "pace", "fps min/sum", "ttfm max", "worst gap", ">1.5x", "misses", "refused",
             "denoise/decode/encode ms", "gpu %")]
    for name, case in result["cases"].items():
        s, sessions = case["summary"], [x for x in case["sessions"] if "refused" not in x and x.get("chunks")]
        timing = "/".join(str(sessions[0].get(f"server_{k}_ms_median")) for k in ("denoise", "decode", "encode")) \
            if sessions else "-"
        gpu = (case.get("gpu") or {}).get("util_pct_mean", "-")
        rows.append((name, str(s["sessions"]), "on" if case["pace"] else "off",
                     f"{s['fps_steady_min']}/{s['fps_steady_sum']}", str(s["time_to_first_media_ms_max"]),
                     str(s["worst_gap_ms"]), str(s["gaps_over_1_5x"]), str(s["deadline_misses"]), str(s["refused"]),
                     timing, str(gpu)))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)), file=sys.stderr)
    startup, reference = result.get("startup") or {}, result.get("engine_only") or {}
    print(f"ready after {startup.get('ready_s')} s; engine alone {reference.get('fps_steady')} frames/s; "
          f"skipped: {result['skipped'] or 'none'}", file=sys.stderr)


def on_fresh_server(server_args: list[str], ready_timeout_s: float, measure, log_path: Path | None = None) -> dict:
    """`arstream serve` with ``server_args`` on a free port: its readiness figures and ``measure(server)``'s, then
    it is stopped."""
    port = free_port()
    server = ServerProcess([*server_args, "--port", str(port)], port, log_path)
    try:
        server.start()
        ready = server.wait_ready(ready_timeout_s)
        return {**ready, **measure(server)}
    finally:
        server.stop()


def process_cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds a process has used so far (Linux /proc; None once it is gone, or elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (stat's 14th, 15th)
    except (OSError, ValueError, IndexError):
        return None


def write(result: dict, path: Path | None) -> None:
    if path is not None:
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(json.dumps(result) + "\n")
        tmp.replace(path)


def run(args: argparse.Namespace, server_args: list[str]) -> dict:
    began = time.monotonic()

    def left() -> float:
        return args.budget_s - (time.monotonic() - began)

    given = {arg.split("=")[0] for arg in server_args}
    port = free_port()
    extra = ["--host", "127.0.0.1", "--port", str(port), "--log-format", "json"]
    if "--max-sessions" not in given:
        extra += ["--max-sessions", str(max(args.concurrency + [2]))]
    full_args = [*server_args, *extra]
    result: dict = {"bench": "service_gpu", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                    "complete": False, "gpu": gpu_name(), "server_args": full_args, "prompt_chars": len(args.prompt),
                    "startup": None, "capacity": None, "cases": {}, "skipped": [], "engine_only": None,
                    "cpu_count": os.cpu_count(), "loadavg_1m_before": round(os.getloadavg()[0], 2)}
    if args.text_encode_json and Path(args.text_encode_json).is_file():
        try:  # a failed or cut-short text-encode run leaves nothing usable: then there is no sum
            line = Path(args.text_encode_json).read_text().strip().splitlines()[-1]
            result["text_encode_ms_median"] = json.loads(line).get("encode_ms_median")
        except (IndexError, ValueError):
            result["text_encode_ms_median"] = None
    server = ServerProcess(full_args, port, Path(args.server_log) if args.server_log else None)
    server.start()
    try:
        try:
            result["startup"] = server.wait_ready(min(args.start_timeout_s, max(1.0, left() - args.engine_reserve_s)))
            gauges = server.metrics()
            result["capacity"] = gauges.get("arstream_session_capacity")
            result["server_gauges_at_ready"] = {name: value for name, value in gauges.items() if name in GAUGES}
            # The reference starts the engine once more: keep what the server's start took, unless that would
            # leave the cases too little of the budget (then the reference is the part that goes).
            reserve = 1.2 * result["startup"]["ready_s"] + args.engine_duration + 20
            args.engine_reserve_s = reserve if reserve <= 0.4 * left() and args.engine_reference else 0.0
        except RuntimeError as error:
            result["startup_error"] = str(error)
            result["server_log_tail"] = list(server.tail)[-20:]
        write(result, args.out)
        if result["startup"] is not None:
            ws_url = "ws" + server.url[len("http"):]
            for case in plan_cases(args):
                if server.process.poll() is not None:
                    result["server_died"] = {"exit_code": server.process.returncode, "log_tail": list(server.tail)[-20:]}
                    result["skipped"].append(case["name"])
                    continue
                if case["duration"] + CASE_OVERHEAD_S > left() - args.engine_reserve_s:
                    result["skipped"].append(case["name"])
                    continue
                idle = asyncio.run(engine_idle(server))
                before = safe_metrics(server)
                with GpuSampler() as sampler:
                    records = asyncio.run(run_case(ws_url, case, args.prompt))
                after = safe_metrics(server)
                sessions = [session_stats(record) for record in records]
                for record, stats in zip(records, sessions):
                    if record.media is not None:
                        stats["media_check"] = media_check(record)
                        record.media = None
                result["cases"][case["name"]] = {
                    "sessions_asked": case["sessions"], "pace": case["pace"], "duration_s": case["duration"],
                    "idle_before": idle, "summary": case_summary(sessions), "sessions": sessions,
                    "gpu": sampler.summary(),
                    # The server's own view: its counters over the case, and its gauges at the end.
                    # (with the histograms' sums and counts: the server's own time to first media and stream
                    # opening over the case, beside the client's)
                    "server_counters": {name: round(after[name] - before.get(name, 0.0), 3) for name in after
                                        if name.endswith(("_total", "_seconds_sum", "_seconds_count"))
                                        and after[name] != before.get(name, 0.0)},
                    "server_gauges": {name: value for name, value in after.items() if name in GAUGES},
                }
                print(f"{case['name']}: {json.dumps(result['cases'][case['name']]['summary'])}", file=sys.stderr)
                write(result, args.out)
    finally:
        result["server_stop"] = server.stop()
        result["server_log_problems"] = list(server.problems)
        write(result, args.out)
    if args.engine_reserve_s > 0 and left() > 20:
        result["engine_only"] = run_engine_reference(args, full_args, left() - 5)
    else:
        result["engine_only"] = {"error": "skipped: not enough of the budget left for a second engine start"}
    result["headline"] = headline(result)
    result["loadavg_1m_after"] = round(os.getloadavg()[0], 2)
    result["wall_s"] = round(time.monotonic() - began, 1)
    result["complete"] = True
    write(result, args.out)
    return result


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    ours, server_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 3, 4])
    parser.add_argument("--pacing", type=lambda s: [{"on": True, "off": False}[x] for x in s.split(",")],
                        default=[True, False], help="on,off (order kept)")
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of streaming per case")
    parser.add_argument("--first-duration", type=float, default=None, help="first session's seconds (--duration)")
    parser.add_argument("--transitions", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--transitions-duration", type=float, default=None, help="default: --duration")
    parser.add_argument("--engine-duration", type=float, default=None, help="engine-only seconds (--duration)")
    parser.add_argument("--engine-reference", action=argparse.BooleanOptionalAction, default=True,
                        help="run the engine alone after the server (--no-engine-reference: the engine-only "
                        "figures come from another benchmark in the same call)")
    parser.add_argument("--engine-reserve-s", type=float, default=90.0,
                        help="budget kept for the engine reference until the server's start time is known")
    parser.add_argument("--budget-s", type=float, default=600.0, help="whole run; cases that would overrun are skipped")
    parser.add_argument("--start-timeout-s", type=float, default=300.0)
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--server-log", default=None)
    parser.add_argument("--text-encode-json", default=None, help="text_encode_gpu.py's output, added to TTFM")
    parser.add_argument("--engine-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(ours)
    if not args.engine_reference:
        args.engine_reserve_s = 0.0
    for name in ("first_duration", "transitions_duration", "engine_duration"):
        if getattr(args, name) is None:
            setattr(args, name, args.duration)
    return args, server_args or ["--preset", "tiny"]


def main() -> None:
    # A `timeout` around this script sends SIGTERM: unwind, so the server is stopped and the JSON written.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args, server_args = parse(sys.argv[1:])
    if args.engine_only:
        print(json.dumps(engine_reference(server_args, args.engine_duration, args.prompt)))
        return
    result = run(args, server_args)
    print_table(result)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
