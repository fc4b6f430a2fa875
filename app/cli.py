"""The ``arstream`` command line: ``generate`` (offline clip through the engine) and ``serve``."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import sys
import time
from pathlib import Path

import uvicorn
from tqdm import tqdm

from app.media import Mp4FileWriter
from engine.api import Engine
from engine.config import EngineConfig
from engine.errors import CapacityFull

MAX_GENERATE_SECONDS = 24 * 3600


def _engine_arguments(parser: argparse.ArgumentParser, *, with_defaults: bool = True) -> None:
    """Engine flags. Without defaults (``serve``) a flag left out is absent from the namespace, so
    ``ARSTREAM_ENGINE__*`` variables and the settings' defaults decide it."""

    def default(value):
        return value if with_defaults else argparse.SUPPRESS

    parser.add_argument("--preset", default=default("tiny"), choices=["tiny", "wan2.1-1.3b"])
    parser.add_argument("--model", type=Path, default=default(None), help="local model directory (nothing is downloaded)")
    parser.add_argument("--causal-weights", type=Path, default=default(None),
                        help="original-format causal DiT weights (.safetensors/.pt) for --model; see docs/MODELS.md")
    parser.add_argument("--device", default=default("cpu"))
    parser.add_argument("--dtype", default=default("float32"), choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--height", type=int, default=default(None))
    parser.add_argument("--width", type=int, default=default(None))
    # None: the model directory's arstream.json, else 3 / 15 (explicit flags win over arstream.json)
    parser.add_argument("--sink-frames", type=int, default=default(None))
    parser.add_argument("--window-frames", type=int, default=default(None))
    parser.add_argument("--guidance", type=float, default=default(1.0))
    parser.add_argument("--cpu-threads", type=int, default=default(None))


def _engine_config(args: argparse.Namespace, **overrides) -> EngineConfig:
    windows = {name: getattr(args, name) for name in ("sink_frames", "window_frames") if getattr(args, name) is not None}
    return EngineConfig(
        preset=args.preset,
        model_dir=args.model,
        causal_weights=args.causal_weights,
        device=args.device,
        dtype=args.dtype,
        height=args.height,
        width=args.width,
        guidance_scale=args.guidance,
        cpu_threads=args.cpu_threads,
        **windows,
        **overrides,
    )


async def generate(args: argparse.Namespace) -> int:
    """One session through the same engine the service runs, written as a plain MP4."""
    config = _engine_config(args, max_sessions=1, warmup_blocks=0)
    engine = Engine(config)
    await engine.start()
    try:
        geometry = engine.geometry
        total_frames = max(1, math.ceil(args.seconds * geometry.fps))
        session = engine.create_session(seed=args.seed, pace=False)
        if isinstance(session, CapacityFull):  # cannot happen with a fresh engine; keep the type honest
            raise RuntimeError(session.message)
        engine.start_session(session.session_id, args.prompt, negative_prompt=args.negative_prompt)
        written = 0
        with Mp4FileWriter(args.out, geometry.width, geometry.height, fps=geometry.fps) as writer, tqdm(
            total=total_frames, unit="frame", disable=args.quiet
        ) as progress:
            async for chunk in engine.chunks(session.session_id):
                frames = chunk.frames[: total_frames - written]
                writer.write(frames)
                written += len(frames)
                progress.update(len(frames))
                if written >= total_frames:
                    break
        status = engine.status(session.session_id)
        if status.close_reason == "failed":
            print(f"generation failed: {status.error}", file=sys.stderr)
            return 1
        print(f"wrote {written} frames ({written / geometry.fps:.2f} s) to {args.out}")
        return 0
    finally:
        await engine.shutdown("client")


# --- serve ------------------------------------------------------------------------------------------

# flag dest -> EngineConfig field, for the flags `serve` passes through
_ENGINE_FLAGS = {
    "preset": "preset",
    "model": "model_dir",
    "causal_weights": "causal_weights",
    "device": "device",
    "dtype": "dtype",
    "height": "height",
    "width": "width",
    "sink_frames": "sink_frames",
    "window_frames": "window_frames",
    "guidance": "guidance_scale",
    "cpu_threads": "cpu_threads",
    "max_sessions": "max_sessions",
    "lead_chunks": "lead_chunks",
    "warmup_blocks": "warmup_blocks",
    "detach_grace_s": "detach_grace_s",
}
_SERVICE_FLAGS = ("host", "port", "environment", "allowed_origins", "log_format", "max_sessions_per_client")


def _settings_from(args: argparse.Namespace):
    """Flags given on the command line win over ``ARSTREAM_*`` variables, which win over defaults."""
    from app.settings import Settings

    given = vars(args)
    engine = {field: given[flag] for flag, field in _ENGINE_FLAGS.items() if flag in given}
    service = {flag: given[flag] for flag in _SERVICE_FLAGS if flag in given}
    return Settings(engine=engine, **service)


def serve(args: argparse.Namespace) -> int:
    """Run the web service until SIGINT/SIGTERM (exit 0) or until the engine dies (exit 1)."""
    from pydantic import ValidationError

    from app.main import create_app

    try:
        settings = _settings_from(args)
    except ValidationError as error:
        # Without the input values: they may hold the token.
        for problem in error.errors(include_input=False, include_url=False):
            where = ".".join(str(part) for part in problem["loc"]) or "settings"
            print(f"arstream serve: {where}: {problem['msg']}", file=sys.stderr)
        return 2
    configure_logging(settings.log_format)
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        ws=_websocket_implementation(settings.send_buffer_bytes),
        ws_ping_interval=settings.ping_interval_s,  # a client that answers no ping is dropped (detached)
        ws_ping_timeout=settings.ping_timeout_s,
        ws_per_message_deflate=False,  # media does not compress; deflate only costs CPU and latency
        ws_max_size=settings.max_message_bytes,  # larger client frames are closed 1009 by the protocol layer
        lifespan="on",
        log_config=None,  # our structured logging, configured above
        timeout_graceful_shutdown=max(1, int(settings.drain_timeout_s)),
    )
    server = _DrainingServer(config)
    app.state.on_engine_dead = server.request_exit
    server.run()
    if not server.started:
        return 3  # start-up failed (engine build, port in use); the reason is in the log
    return app.state.service.exit_code if hasattr(app.state, "service") else 0


def _websocket_implementation(send_buffer_bytes: int):
    """uvicorn's non-deprecated WebSocket protocol: the Sans-I/O websockets one where this uvicorn has it,
    with bounded buffers and a hard stop for clients that stopped reading (app.ws_protocol)."""
    from uvicorn.config import WS_PROTOCOLS

    if "websockets-sansio" not in WS_PROTOCOLS:
        return "websockets"
    from app.ws_protocol import bounded_websocket_protocol

    return bounded_websocket_protocol(send_buffer_bytes)


class _DrainingServer(uvicorn.Server):
    """uvicorn closes every socket with 1012 *before* the lifespan shutdown runs; drain first, so each
    client gets ``closed`` (``draining``) and 1001 instead, then let uvicorn finish."""

    def request_exit(self) -> None:
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            print(f"arstream serving on http://{shown}:{port} (demo page /, API docs /docs)", flush=True)

    async def shutdown(self, sockets=None) -> None:
        app = self.config.app
        service = getattr(app.state, "service", None) if hasattr(app, "state") else None
        if service is not None:
            await service.drain()
        await super().shutdown(sockets)


# --- logging -----------------------------------------------------------------------------------------

# uvicorn adds `color_message` (the same text with terminal colours) to its records: not a field.
_RECORD_FIELDS = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName", "color_message",
}


class StructuredFormatter(logging.Formatter):
    """One line per event: the message plus the ``extra={...}`` fields (session ids, reasons, numbers).
    Callers never put prompt text or media in either."""

    def __init__(self, style: str = "json") -> None:
        super().__init__()
        self.json_style = style == "json"

    def format(self, record: logging.LogRecord) -> str:
        fields = {key: value for key, value in vars(record).items() if key not in _RECORD_FIELDS}
        timestamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        if self.json_style:
            line = {"ts": timestamp, "level": record.levelname.lower(), "logger": record.name,
                    "event": record.getMessage(), **fields}
            if record.exc_info:
                line["exception"] = self.formatException(record.exc_info)
            return json.dumps(line, default=str, ensure_ascii=False)
        extras = " ".join(f"{key}={value}" for key, value in fields.items())
        text = f"{timestamp} {record.levelname} {record.name} {record.getMessage()}" + (f" {extras}" if extras else "")
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def configure_logging(style: str = "text", level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(StructuredFormatter(style))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="arstream", description="realtime autoregressive video diffusion")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate one clip offline through the engine")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--negative-prompt", default="")
    gen.add_argument("--seconds", type=float, default=5.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--out", type=Path, default=Path("clip.mp4"))
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    _engine_arguments(gen)

    srv = commands.add_parser("serve", help="run the web service (WebSocket stream, REST, demo page)")
    srv.add_argument("--host", default=argparse.SUPPRESS, help="default 127.0.0.1 (ARSTREAM_HOST)")
    srv.add_argument("--port", type=int, default=argparse.SUPPRESS, help="default 8000; 0 picks a free port")
    srv.add_argument("--environment", choices=["development", "production"], default=argparse.SUPPRESS)
    srv.add_argument("--allowed-origin", dest="allowed_origins", action="append", default=argparse.SUPPRESS,
                     help="extra browser origin allowed to connect (repeatable); the token comes from ARSTREAM_TOKEN")
    srv.add_argument("--log-format", choices=["json", "text"], default=argparse.SUPPRESS)
    srv.add_argument("--max-sessions", type=int, default=argparse.SUPPRESS, help="engine session slots")
    srv.add_argument("--max-sessions-per-client", type=int, default=argparse.SUPPRESS)
    srv.add_argument("--lead-chunks", type=int, default=argparse.SUPPRESS, help="paced sessions run this far ahead")
    srv.add_argument("--warmup-blocks", type=int, default=argparse.SUPPRESS)
    srv.add_argument("--detach-grace-s", type=float, default=argparse.SUPPRESS)
    _engine_arguments(srv, with_defaults=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    configure_logging("text")
    if args.command == "generate":
        if not 0 < args.seconds <= MAX_GENERATE_SECONDS:
            parser.error(f"--seconds must be in (0, {MAX_GENERATE_SECONDS}]")
        if args.seed < 0:
            parser.error("--seed must be >= 0")
        return asyncio.run(generate(args))
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
