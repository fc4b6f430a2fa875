"""The ``arstream`` command line: ``serve`` (the web service) and ``generate`` (one clip, offline).

Every mistake a user can make on the command line ends in one line on stderr that names the flag,
path or value, and exit status 2 — before anything heavy is built: flags and ``ARSTREAM_*`` values
are validated as the engine's config, then :func:`engine.preflight.check_before_build` checks the
model directory and the memory, all before the first tensor is allocated.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import re
import sys
import warnings
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from pydantic import ValidationError

from app.log_format import configure_logging
from app.server_process import bind_listening_socket, run_server
from engine.cpu_threads import limit_spinning

# Nothing here imports torch at module level: usage mistakes are answered in a fraction of a second.

MAX_GENERATE_SECONDS = 24 * 3600
EXIT_USAGE = 2

# flag dest -> EngineConfig field
_ENGINE_FLAGS = {
    "preset": "preset",
    "model": "model_dir",
    "causal_weights": "causal_weights",
    "random_weights": "random_weights",
    "device": "device",
    "dtype": "dtype",
    "fp8": "fp8",
    "height": "height",
    "width": "width",
    "sink_frames": "sink_frames",
    "window_frames": "window_frames",
    "frames_per_block": "frames_per_block",
    "guidance": "guidance_scale",
    "cpu_threads": "cpu_threads",
    "audio": "audio",
    "max_sessions": "max_sessions",
    "lead_chunks": "lead_chunks",
    "blocks_in_flight": "blocks_in_flight",
    "warmup_blocks": "warmup_blocks",
    "detach_grace_s": "detach_grace_s",
    "gpu_memory_gib": "gpu_memory_gib",
    "text_encoder": "text_encoder_device",
    "random_text_encoder": "random_text_encoder",
}
_SERVICE_FLAGS = ("host", "port", "environment", "allowed_origins", "log_format", "max_sessions_per_client")
_FLAG_OF_FIELD = {field: "--" + flag.replace("_", "-") for flag, field in _ENGINE_FLAGS.items()}
_FLAG_OF_FIELD.update({"audio": "--no-audio", "allowed_origins": "--allowed-origin"})
_FLAG_OF_FIELD.update({flag: "--" + flag.replace("_", "-") for flag in _SERVICE_FLAGS if flag != "allowed_origins"})

# Field names in cross-field messages ("causal_weights needs model_dir", "height=50 ..."): the
# snake_case ones anywhere, the others only right before "=".
_FIELD_NAMES = re.compile(
    r"\b(?:" + "|".join(name for name in _FLAG_OF_FIELD if "_" in name) + r")\b"
    r"|\b(?:" + "|".join(_FLAG_OF_FIELD) + r")(?==)"
)


def package_version() -> str:
    try:
        return version("arstream")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a usage error as ONE line (the usage block would bury it) and exits 2."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see {self.prog} --help)\n")


class ShownDefaults(argparse.HelpFormatter):
    """Help that ends with the default wherever it does not say it already (flags, values, not False)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if "default" in text or default in (None, "", argparse.SUPPRESS) or isinstance(default, bool):
            return text
        return f"{text} (default: %(default)s)"


def fail(command: str, message: str, status: int = EXIT_USAGE) -> int:
    """Print ``arstream COMMAND: MESSAGE`` as one line on stderr; return ``status``."""
    print(f"arstream {command}: {' '.join(str(message).split())}", file=sys.stderr)
    return status


def describe_validation_error(error: ValidationError, *, variables: bool = False) -> str:
    """One line for a settings/config validation error: each problem with its flag (and, for the
    service, its ``ARSTREAM_*`` variable), never the input value (it may be the token)."""
    problems = []
    for problem in error.errors(include_input=False, include_url=False):
        parts = [str(part) for part in problem["loc"]]
        location = [part for part in parts if part != "engine"]
        field = location[-1] if location else ""
        where = _FLAG_OF_FIELD.get(field) or ".".join(location)
        if variables and location and parts[-1].isidentifier():
            variable = "ARSTREAM_" + "__".join(parts).upper()
            where = f"{where} ({variable})" if where != field else variable
        message = problem["msg"].removeprefix("Value error, ")
        if not where:  # a rule across fields: name them as the flags the user typed
            message = _FIELD_NAMES.sub(lambda match: _FLAG_OF_FIELD[match.group(0)], message)
        problems.append(f"{where}: {message}" if where else message)
    return "; ".join(problems)


# --- flags ------------------------------------------------------------------------------------------


def _engine_arguments(parser: argparse.ArgumentParser, *, with_defaults: bool = True) -> None:
    """Engine flags. Without defaults (``serve``) a flag left out is absent from the namespace, so
    ``ARSTREAM_ENGINE__*`` variables and the config's defaults decide it; the help says which."""

    def option(*names, default, help, env=None, **kwargs):
        if with_defaults:
            parser.add_argument(*names, default=default, help=help, **kwargs)
        else:
            shown = "" if default is None or kwargs.get("action") else f"default {default}; "
            variable = env or "ARSTREAM_ENGINE__" + names[0].lstrip("-").replace("-", "_").upper()
            parser.add_argument(*names, default=argparse.SUPPRESS, help=f"{help} ({shown}{variable})", **kwargs)

    option("--preset", default="tiny", choices=["tiny", "wan2.1-1.3b"],
           help="model preset: tiny runs live on a CPU; wan2.1-1.3b needs --model DIR (or --random-weights)")
    option("--model", type=Path, default=None, metavar="DIR", env="ARSTREAM_ENGINE__MODEL_DIR",
           help="local diffusers-layout model directory (nothing is downloaded; docs/MODELS.md)")
    option("--causal-weights", type=Path, default=None, metavar="FILE",
           help="original-format causal DiT weights (.safetensors/.pt) for --model")
    option("--random-weights", action="store_true", default=False,
           help="seeded random weights for a preset without --model: benchmarks only, the output is noise")
    option("--device", default="cpu", help="torch device: cpu or cuda[:N]")
    option("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
           help="weights and activations; float16 needs cuda (bfloat16 runs on cpu too, slowly)")
    option("--fp8", default="off", choices=["off", "linear", "attention", "all"],
           help="FP8 for a bfloat16 DiT (docs/FP8.md): linear = e4m3 weights and activations in every block's "
                "per-forward matrix products (GPU 8.9+); attention = self-attention through a Triton FP8 kernel, "
                "history quantized once per block (Hopper 9.0+); all = both")
    option("--height", type=int, default=None, help="frame height in pixels, a multiple of 16 (default: the preset's)")
    option("--width", type=int, default=None, help="frame width in pixels, a multiple of 16 (default: the preset's)")
    option("--sink-frames", type=int, default=None,
           help="first latent frames kept forever (default: the model's arstream.json, else 3)")
    option("--window-frames", type=int, default=None,
           help="recent latent frames kept besides the sink (default: the model's arstream.json, else 15)")
    option("--frames-per-block", type=int, default=None,
           help="latent frames per AR block, 4 video frames each (default: the model's arstream.json or the shipped "
                "weights' setting, else 3); 1 puts a live camera frame on screen soonest (docs/ENGINE.md)")
    option("--guidance", type=float, default=1.0, env="ARSTREAM_ENGINE__GUIDANCE_SCALE",
           help="classifier-free guidance scale; > 1 runs a second, unconditional branch")
    option("--cpu-threads", type=int, default=None,
           help="torch intra-op threads (default on cpu: every core up to 2, three quarters of them beyond)")
    option("--gpu-memory-gib", type=float, default=None, metavar="GIB",
           help="device memory the engine may use, as on a card of this size (e.g. 24): the allocator is capped, the "
                "text encoder runs on the CPU, and a setup where not even one session fits is refused (docs/MODELS.md)")
    option("--text-encoder", default="auto", choices=["auto", "device", "cpu"], env="ARSTREAM_ENGINE__TEXT_ENCODER_DEVICE",
           help="where the text encoder runs: cpu keeps its weights off the GPU (prompts encoded off the device "
                "thread, each cached); auto = cpu with --gpu-memory-gib, else the engine's device")
    option("--random-text-encoder", default="tiny", choices=["tiny", "umt5-xxl"],
           help="with --random-weights: umt5-xxl builds Wan's 5.7 B-parameter text encoder with random weights "
                "(a real model's memory and encode time, for benchmarks)")
    option("--no-audio", dest="audio", action="store_false", default=True, env="ARSTREAM_ENGINE__AUDIO=false",
           help="no audio track, even when the preset makes audio")


def _engine_config(args: argparse.Namespace, **overrides):
    """The ``EngineConfig`` of the flags given (absent or None ones take the config's defaults)."""
    from engine.config import EngineConfig

    given = vars(args)
    fields = {field: given[flag] for flag, field in _ENGINE_FLAGS.items() if given.get(flag) is not None}
    return EngineConfig(**{**fields, **overrides})


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="arstream", description="realtime autoregressive video diffusion")
    parser.add_argument("--version", action="version", version=f"arstream {package_version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{serve,generate}")

    gen = commands.add_parser(
        "generate", help="generate one clip offline through the engine, as an MP4 with its audio",
        description="Generate one clip through the same engine the service runs and write it as an MP4 "
                    "(H.264, and Opus/AAC audio when the model makes it). Ctrl-C stops and keeps what was written.",
        formatter_class=ShownDefaults,
    )
    gen.add_argument("--prompt", required=True, help="what to generate: 1-2000 characters, not only whitespace")
    gen.add_argument("--negative-prompt", default="", help="what to steer away from (used with --guidance > 1; default: none)")
    gen.add_argument("--seconds", type=float, default=5.0, help=f"clip length, in (0, {MAX_GENERATE_SECONDS}]")
    gen.add_argument("--seed", type=int, default=0, help="noise seed (same seed and prompt: same clip)")
    gen.add_argument("--out", type=Path, default=Path("clip.mp4"), metavar="FILE", help="MP4 file to write")
    gen.add_argument("--quiet", action="store_true", help="no progress bar")
    _engine_arguments(gen)

    srv = commands.add_parser(
        "serve", formatter_class=ShownDefaults, help="run the web service (WebSocket stream, REST, demo page); keeps the terminal",
        description="Run the web service until Ctrl-C / SIGTERM. Flags win over ARSTREAM_* variables, "
                    "which win over the defaults; the token is read only from ARSTREAM_TOKEN.",
    )
    srv.add_argument("--host", default=argparse.SUPPRESS, help="address to listen on (default 127.0.0.1; ARSTREAM_HOST)")
    srv.add_argument("--port", type=int, default=argparse.SUPPRESS,
                     help="port; 0 picks a free one (default 8000; ARSTREAM_PORT)")
    srv.add_argument("--environment", choices=["development", "production"], default=argparse.SUPPRESS,
                     help="production refuses to run without a token (default development; ARSTREAM_ENVIRONMENT)")
    srv.add_argument("--allowed-origin", dest="allowed_origins", action="append", default=argparse.SUPPRESS,
                     metavar="ORIGIN", help="extra browser origin allowed to connect, repeatable (ARSTREAM_ALLOWED_ORIGINS)")
    srv.add_argument("--log-format", choices=["json", "text"], default=argparse.SUPPRESS,
                     help="log lines (default json; ARSTREAM_LOG_FORMAT)")
    srv.add_argument("--max-sessions", type=int, default=argparse.SUPPRESS,
                     help="engine session slots; memory may allow fewer (default 4; ARSTREAM_ENGINE__MAX_SESSIONS)")
    srv.add_argument("--max-sessions-per-client", type=int, default=argparse.SUPPRESS,
                     help="open sessions per client address (default off; ARSTREAM_MAX_SESSIONS_PER_CLIENT)")
    srv.add_argument("--lead-chunks", type=int, default=argparse.SUPPRESS,
                     help="paced sessions run this many blocks ahead (default 2; ARSTREAM_ENGINE__LEAD_CHUNKS)")
    srv.add_argument("--blocks-in-flight", type=int, default=argparse.SUPPRESS, choices=(1, 2),
                     help="blocks a session may have queued on the device ahead of its delivered chunks; 2 keeps "
                     "the GPU busy between blocks (default 2 on CUDA, 1 elsewhere; ARSTREAM_ENGINE__BLOCKS_IN_FLIGHT)")
    srv.add_argument("--warmup-blocks", type=int, default=argparse.SUPPRESS,
                     help="blocks run before ready (default 1; ARSTREAM_ENGINE__WARMUP_BLOCKS)")
    srv.add_argument("--detach-grace-s", type=float, default=argparse.SUPPRESS,
                     help="a session without a socket lives this long (default 30; ARSTREAM_ENGINE__DETACH_GRACE_S)")
    srv.add_argument("--devices", default=argparse.SUPPRESS, metavar="LIST",
                     help="one engine worker process per device behind this server: cuda:0,cuda:1 or all (every "
                          "visible GPU); cpu,cpu runs CPU workers (tests). One device: a single process, as "
                          "--device. docs/SCALE_OUT.md (default off; ARSTREAM_DEVICES)")
    _engine_arguments(srv, with_defaults=False)
    return parser


# --- generate ---------------------------------------------------------------------------------------


def check_output_path(out: Path) -> str | None:
    """Why ``out`` cannot be written (one phrase), or None. Probes by opening: permissions alone lie
    to root, and read-only mounts show only then. A file the probe created is removed again."""
    if out.is_dir():
        return "is a directory"
    existed = out.exists()
    try:
        with open(out, "ab"):
            pass
    except OSError as error:
        return f"cannot be written ({error.strerror or error})"
    if not existed:
        out.unlink(missing_ok=True)
    return None


def run_generate(args: argparse.Namespace) -> int:
    """Check every flag (cheapest first), then write the clip."""
    from engine.errors import EngineError
    from engine.prompts import check_prompt

    try:
        check_prompt(args.prompt, field="--prompt")
        check_prompt(args.negative_prompt, field="--negative-prompt", allow_empty=True)
    except EngineError as error:
        return fail("generate", error.message)
    if not (math.isfinite(args.seconds) and 0 < args.seconds <= MAX_GENERATE_SECONDS):
        return fail("generate", f"--seconds {args.seconds}: must be a number in (0, {MAX_GENERATE_SECONDS}]")
    if not 0 <= args.seed <= 2**63 - 1:
        return fail("generate", f"--seed {args.seed}: must be an integer in [0, 2**63 - 1]")
    problem = check_output_path(args.out)
    if problem is not None:
        return fail("generate", f"--out {args.out}: {problem}")
    try:
        # One session, unpaced, no warm-up: the clip is all there is.
        config = _engine_config(args, max_sessions=1, warmup_blocks=0, max_session_s=7 * 86400.0)
    except ValidationError as error:
        return fail("generate", describe_validation_error(error))
    from engine.preflight import check_before_build

    try:
        check_before_build(config)
    except ValueError as error:
        return fail("generate", error)
    from app.generate import GenerateRequest, generate  # the engine and the encoders: only once the checks passed

    configure_logging("text", logging.WARNING)  # progress is the bar; info lines would only interleave
    # diffusers' audio VAE calls torch's deprecated weight_norm: nothing a user of this command can act on.
    warnings.filterwarnings("ignore", message=r".*weight_norm.* is deprecated", category=FutureWarning)
    request = GenerateRequest(args.prompt, args.negative_prompt, args.seconds, args.seed, args.out, args.quiet)
    return asyncio.run(generate(config, request, lambda text: fail("generate", text)))


# --- serve ------------------------------------------------------------------------------------------


def _settings_from(args: argparse.Namespace):
    """Flags given on the command line win over ``ARSTREAM_*`` variables, which win over defaults."""
    from app.settings import Settings

    given = vars(args)
    engine = {field: given[flag] for flag, field in _ENGINE_FLAGS.items() if flag in given}
    service = {flag: given[flag] for flag in _SERVICE_FLAGS if flag in given}
    return Settings(engine=engine, **service)


MAX_WORKER_DEVICES = 64
_DEVICE_ITEM = re.compile(r"^(cpu|cuda(?::(\d{1,3}))?)$")
# serve flags a front end keeps for itself; its workers get every other flag it was given
_FRONT_END_ONLY_DESTS = frozenset({"host", "port", "devices", "device", "max_sessions_per_client", "log_format"})


def parse_devices(value: str) -> list[str]:
    """``--devices``: ``all`` (every visible CUDA device) or a comma-separated list of ``cuda:N`` / ``cpu``.

    ``cpu`` may repeat (several CPU workers: tests and demos); a GPU may not (one worker per GPU); CPU and
    CUDA workers are not mixed. A ``ValueError`` says what is wrong, in a phrase."""
    value = value.strip()
    if value == "all":
        import torch

        if torch.version.cuda is None:
            raise ValueError(f"this torch {torch.__version__} is a CPU-only build: there are no CUDA devices")
        if torch.cuda.device_count() == 0:
            raise ValueError("no CUDA device is visible to this process")
        return [f"cuda:{index}" for index in range(torch.cuda.device_count())]
    items = [item.strip() for item in value.split(",")]
    if not value or any(not item for item in items):
        raise ValueError("give all, or a comma-separated list such as cuda:0,cuda:1")
    devices = []
    for item in items:
        match = _DEVICE_ITEM.match(item)
        if match is None:
            raise ValueError(f"{item!r} is not a device: use cuda:N or cpu")
        device = "cpu" if item == "cpu" else f"cuda:{int(match.group(2) or 0)}"
        if device != "cpu" and device in devices:
            raise ValueError(f"{device} is named twice (one worker per GPU)")
        devices.append(device)
    if len(devices) > MAX_WORKER_DEVICES:
        raise ValueError(f"{len(devices)} devices: at most {MAX_WORKER_DEVICES} workers")
    if len({device.partition(":")[0] for device in devices}) > 1:
        raise ValueError("cpu and cuda workers cannot be mixed")
    from engine.config import EngineConfig

    for device in dict.fromkeys(devices):
        try:
            EngineConfig(device=device)
        except ValidationError as error:
            raise ValueError(error.errors()[0]["msg"].removeprefix("Value error, ")) from None
    return devices


def worker_argv(args: argparse.Namespace) -> list[str]:
    """The ``serve`` flags a front end passes to each worker: every flag it was given, except its own
    address, device list, per-client limit and log format (the pool sets those per worker)."""
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    given = vars(args)
    argv: list[str] = []
    for action in commands.choices["serve"]._actions:
        if not action.option_strings or action.dest not in given or action.dest in _FRONT_END_ONLY_DESTS:
            continue
        value, flag = given[action.dest], action.option_strings[0]
        if action.nargs == 0:  # store_true / store_false: the flag alone, when it was given its way
            if value == action.const:
                argv.append(flag)
        elif isinstance(value, list):  # repeatable
            for item in value:
                argv += [flag, str(item)]
        else:
            argv += [flag, str(value)]
    return argv


def serve(args: argparse.Namespace) -> int:
    """Run the web service until SIGINT/SIGTERM (exit 0) or until the engine dies (exit 1).

    With ``--devices`` naming several devices, this process is a front end and runs one worker process per
    device (docs/SCALE_OUT.md); with one device, it is the single server on that device."""
    from engine.preflight import check_before_build

    devices = None
    devices_value = vars(args).get("devices", os.environ.get("ARSTREAM_DEVICES"))
    if devices_value is not None:
        try:
            devices = parse_devices(devices_value)
        except ValueError as error:
            return fail("serve", f"--devices {devices_value} (ARSTREAM_DEVICES): {error}")
        if "device" in vars(args):
            return fail("serve", "--device and --devices: give one of them")
        args.device = devices[0]
    try:
        settings = _settings_from(args)
    except ValidationError as error:
        return fail("serve", describe_validation_error(error, variables=True))
    try:
        check_before_build(settings.engine)  # on the CPU: the memory of one worker
    except ValueError as error:
        return fail("serve", error)
    try:
        listening = bind_listening_socket(settings.host, settings.port)  # before anything is built
    except OSError as error:
        return fail("serve", f"--port {settings.port} (ARSTREAM_PORT): cannot listen on {settings.host}:"
                             f"{settings.port}: {error.strerror or error}")
    configure_logging(settings.log_format)
    if devices is not None and len(devices) > 1:
        app = _front_end_app(args, settings, devices)
    else:
        from app.main import create_app  # the service and the model code: only once the checks passed

        app = create_app(settings)
    return run_server(app, settings, listening)


def _front_end_app(args: argparse.Namespace, settings, devices: list[str]):
    from app.cluster.frontend import new_internal_secret
    from app.cluster.local_pool import LocalPool, PoolLimits
    from app.cluster.server import create_frontend_app

    cluster = settings.cluster
    limits = PoolLimits(
        restart_backoff_s=cluster.restart_backoff_s,
        restart_backoff_max_s=cluster.restart_backoff_max_s,
        max_starts_per_minute=cluster.max_restarts_per_minute,
        start_timeout_s=cluster.worker_start_timeout_s,
        stop_timeout_s=settings.drain_timeout_s + 5.0,  # a worker drains its sockets within drain_timeout_s
        hang_timeout_s=cluster.worker_hang_timeout_s,
    )
    secret = new_internal_secret()
    pool = LocalPool(devices, worker_argv(args), secret=secret, limits=limits, log_format=settings.log_format)
    return create_frontend_app(settings, pool, secret)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    limit_spinning()  # before torch is imported (engine/cpu_threads.py)
    try:
        if args.command == "serve":
            return serve(args)
        return run_generate(args)
    except KeyboardInterrupt:  # Ctrl-C before the command's own handling began (e.g. while importing torch)
        return fail(args.command, "interrupted by SIGINT", 130)


if __name__ == "__main__":
    sys.exit(main())
