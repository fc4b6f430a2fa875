"""Every bad invocation of `arstream serve`, `arstream generate` and `examples/client.py` ends the same
way: a non-zero exit within 30 s, under 2 GB of memory, ONE line on stderr naming the offending flag,
path or value, and no traceback.

The table runs in this process through the programs' own ``main(argv)`` (an exception escaping it fails
the case as a traceback would). A few cases, one down each program's deepest check, also run as real
subprocesses, side by side: they prove the envelope a process shows — its exit status, its stderr
with nothing else on it, its time and its peak RSS (from ``wait4``).
"""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

import app.cli

ROOT = Path(__file__).resolve().parent.parent
CLIENT = ROOT / "examples" / "client.py"
TIME_LIMIT_S = 30.0
MEMORY_LIMIT_BYTES = 2 * 2**30
# Run also as processes: down serve's checks to its port, generate's to a model directory's parts, the client's
# to a connection refused.
PROCESS_CASES = ("serve_port_in_use", "generate_model_dir_without_weights", "client_unreachable_server")
SILENT_SERVER_TIMEOUT_S = 0.5  # in process, the client's connect timeout (10 s) is shortened for the silent server


@dataclass(frozen=True)
class Case:
    name: str
    argv: list[str]  # after the program: ["generate", ...] for arstream, client flags for the client
    names: str  # what the stderr line must contain
    program: str = "arstream"
    env: tuple[tuple[str, str], ...] = ()


@dataclass
class Outcome:
    returncode: int
    stderr: str
    wall_s: float | None = None  # a process's own
    max_rss_bytes: int | None = None


def _command(case: Case) -> list[str]:
    if case.program == "client":
        return [sys.executable, str(CLIENT), *case.argv]
    return [sys.executable, "-m", "app.cli", *case.argv]


def run_case(case: Case, tmp_path: Path) -> Outcome:
    """Run one case to its end (killed at the time limit); its peak RSS comes from wait4."""
    err_path = tmp_path / f"{case.name}.stderr"
    with open(err_path, "wb") as err:
        process = subprocess.Popen(
            _command(case), cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), **dict(case.env)},
        )
    began = time.monotonic()
    killer = threading.Timer(TIME_LIMIT_S + 5, lambda: process.kill())
    killer.start()
    try:
        _, status, usage = os.wait4(process.pid, 0)
    finally:
        killer.cancel()
    process.returncode = os.waitstatus_to_exitcode(status)  # reaped here; keep Popen from waiting again
    return Outcome(process.returncode, err_path.read_text(errors="replace"), time.monotonic() - began,
                   usage.ru_maxrss * 1024)


def _client_module():
    spec = importlib.util.spec_from_file_location("arstream_example_client", CLIENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run_in_process(case: Case, capsys, monkeypatch) -> Outcome:
    """``main(argv)`` of the case's program here, its environment set; what it wrote to stderr."""
    for name, value in case.env:
        monkeypatch.setenv(name, value)
    if case.program == "client":
        client = _client_module()
        client.CONNECT_TIMEOUT_S = SILENT_SERVER_TIMEOUT_S
        main = client.main
    else:
        main = app.cli.main
    capsys.readouterr()
    try:
        status = main(case.argv)
    except SystemExit as exit_:  # argparse's usage errors
        status = exit_.code
    return Outcome(status, capsys.readouterr().err)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def offline_cases(tmp_path: Path, silent_port: int) -> list[Case]:
    """``silent_port``: a socket that accepts connections (the kernel's backlog) and never answers; it is
    also a port in use."""
    empty_model = tmp_path / "empty-model"
    empty_model.mkdir()
    no_weights = tmp_path / "configs-only-model"  # parts that fit each other, but no weights files
    for part, config in (("transformer", '{"text_dim": 32}'), ("vae", '{"z_dim": 16}'), ("text_encoder", '{"d_model": 32}')):
        (no_weights / part).mkdir(parents=True)
        (no_weights / part / "config.json").write_text(config)
    (no_weights / "tokenizer").mkdir()
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    out = str(tmp_path / "clip.mp4")
    long_prompt = "x" * 2001
    closed_port = _free_port()
    gen = ["generate", "--out", out, "--quiet"]
    return [
        # serve
        Case("serve_bad_preset", ["serve", "--preset", "tiny-ish"], "tiny-ish"),
        Case("serve_1_3b_without_weights", ["serve", "--preset", "wan2.1-1.3b"], "--random-weights"),
        Case("serve_1_3b_without_weights_by_env", ["serve"], "wan2.1-1.3b",
             env=(("ARSTREAM_ENGINE__PRESET", "wan2.1-1.3b"),)),
        Case("serve_missing_model_dir", ["serve", "--model", str(tmp_path / "nowhere")], str(tmp_path / "nowhere")),
        Case("serve_invalid_model_dir", ["serve", "--model", str(empty_model)], str(empty_model)),
        Case("serve_cuda_on_cpu_torch", ["serve", "--device", "cuda"], "cuda"),
        Case("serve_gpu_memory_on_the_cpu", ["serve", "--gpu-memory-gib", "24"], "--gpu-memory-gib"),
        Case("serve_umt5_text_encoder_for_tiny", ["serve", "--random-weights", "--random-text-encoder", "umt5-xxl"],
             "--random-text-encoder"),
        Case("serve_bad_port", ["serve", "--port", "70000"], "--port"),
        Case("serve_port_in_use", ["serve", "--port", str(silent_port)], f"--port {silent_port}"),
        Case("serve_all_devices_on_cpu_torch", ["serve", "--devices", "all"], "--devices all"),
        Case("serve_gpu_named_twice", ["serve", "--devices", "cuda:0,cuda:0"], "cuda:0 is named twice"),
        Case("serve_bad_device_in_list", ["serve", "--devices", "cpu,gpu1"], "'gpu1'"),
        Case("serve_device_and_devices", ["serve", "--device", "cpu", "--devices", "cpu,cpu"], "--device and --devices"),
        # generate
        Case("generate_no_prompt", ["generate", "--out", out], "--prompt"),
        Case("generate_empty_prompt", [*gen, "--prompt", ""], "--prompt"),
        Case("generate_whitespace_prompt", [*gen, "--prompt", " \t\n "], "--prompt"),
        Case("generate_over_long_prompt", [*gen, "--prompt", long_prompt], "--prompt"),
        Case("generate_zero_seconds", [*gen, "--prompt", "a kite", "--seconds", "0"], "--seconds"),
        Case("generate_nan_seconds", [*gen, "--prompt", "a kite", "--seconds", "nan"], "--seconds"),
        Case("generate_word_seconds", [*gen, "--prompt", "a kite", "--seconds", "five"], "five"),
        Case("generate_unwritable_out", ["generate", "--prompt", "a kite", "--out", "/sys/clip.mp4"], "/sys/clip.mp4"),
        Case("generate_out_under_a_file", ["generate", "--prompt", "a kite", "--out", f"{a_file}/clip.mp4"],
             f"{a_file}/clip.mp4"),
        Case("generate_out_is_a_directory", ["generate", "--prompt", "a kite", "--out", str(tmp_path)], str(tmp_path)),
        Case("generate_missing_model_dir", [*gen, "--prompt", "a kite", "--model", str(tmp_path / "nowhere")],
             str(tmp_path / "nowhere")),
        Case("generate_invalid_model_dir", [*gen, "--prompt", "a kite", "--model", str(empty_model)], str(empty_model)),
        Case("generate_model_dir_without_weights", [*gen, "--prompt", "a kite", "--model", str(no_weights)],
             str(no_weights / "transformer")),
        Case("generate_missing_causal_weights",
             [*gen, "--prompt", "a kite", "--causal-weights", str(tmp_path / "w.safetensors")], "--causal-weights"),
        Case("generate_cuda_on_cpu_torch", [*gen, "--prompt", "a kite", "--device", "cuda"], "cuda"),
        Case("generate_bad_preset", [*gen, "--prompt", "a kite", "--preset", "huge"], "huge"),
        Case("generate_1_3b_without_weights", [*gen, "--prompt", "a kite", "--preset", "wan2.1-1.3b"],
             "--random-weights"),
        Case("generate_bad_height", [*gen, "--prompt", "a kite", "--height", "50"], "50"),
        # the example client
        Case("client_http_url", ["--url", "http://127.0.0.1:8000", "--prompt", "a kite", "--out", out],
             "http://127.0.0.1:8000", program="client"),
        Case("client_unreachable_server", ["--url", f"ws://127.0.0.1:{closed_port}", "--prompt", "a kite", "--out", out],
             f"127.0.0.1:{closed_port}", program="client"),
        Case("client_silent_server", ["--url", f"ws://127.0.0.1:{silent_port}", "--prompt", "a kite", "--out", out],
             "no answer within", program="client"),
        Case("client_whitespace_prompt", ["--prompt", "   ", "--out", out], "--prompt", program="client"),
        Case("client_negative_seconds", ["--prompt", "a kite", "--seconds", "-1", "--out", out], "--seconds",
             program="client"),
        Case("client_out_in_missing_directory", ["--prompt", "a kite", "--out", str(tmp_path / "no" / "c.mp4")],
             str(tmp_path / "no"), program="client"),
    ]


def assert_one_clean_line(case: Case, outcome: Outcome) -> None:
    lines = outcome.stderr.strip().splitlines()
    assert outcome.returncode not in (0, None), f"{case.name}: exit {outcome.returncode}"
    if outcome.wall_s is not None:
        assert outcome.wall_s < TIME_LIMIT_S, f"{case.name}: took {outcome.wall_s:.1f} s"
        assert outcome.max_rss_bytes < MEMORY_LIMIT_BYTES, f"{case.name}: peak RSS {outcome.max_rss_bytes / 2**20:.0f} MiB"
    assert "Traceback" not in outcome.stderr, f"{case.name}:\n{outcome.stderr}"
    assert len(lines) == 1, f"{case.name}: {len(lines)} lines on stderr:\n{outcome.stderr}"
    assert case.names in lines[0], f"{case.name}: {case.names!r} not in {lines[0]!r}"


@pytest.fixture
def silent_port():
    """A listening socket that never answers: a silent server to a client, a port in use to `serve`."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        yield silent.getsockname()[1]


def test_every_bad_invocation_exits_with_one_line_naming_the_problem(tmp_path, silent_port, capsys, monkeypatch):
    cases = offline_cases(tmp_path, silent_port)
    assert len(cases) >= 12
    for case in cases:
        with monkeypatch.context() as patched:
            assert_one_clean_line(case, run_in_process(case, capsys, patched))
    assert not (tmp_path / "clip.mp4").exists(), "a refused run left an output file"


def test_a_bad_invocation_is_one_line_from_a_small_quick_process(tmp_path, silent_port):
    cases = [case for case in offline_cases(tmp_path, silent_port) if case.name in PROCESS_CASES]
    assert len(cases) == len(PROCESS_CASES)
    with ThreadPoolExecutor(len(cases)) as pool:
        outcomes = list(pool.map(lambda case: run_case(case, tmp_path), cases))
    print("processes:", [(case.name, round(o.wall_s, 1), round(o.max_rss_bytes / 2**20)) for case, o in zip(cases, outcomes)])
    for case, outcome in zip(cases, outcomes):
        assert_one_clean_line(case, outcome)
        assert outcome.returncode == (1 if case.program == "client" else 2), (case.name, outcome.returncode)


def test_client_exits_with_the_servers_message_when_start_is_refused(tmp_path, shared_server, capsys, monkeypatch):
    out = tmp_path / "refused.mp4"
    # The server's guidance scale is fixed (1.0); asking for another is the server's `invalid_field`.
    case = Case("client_server_error_on_start",
                ["--url", shared_server.ws_url, "--prompt", "a kite", "--guidance", "3", "--out", str(out)],
                "invalid_field", program="client")
    outcome = run_in_process(case, capsys, monkeypatch)
    assert_one_clean_line(case, outcome)
    assert outcome.returncode == 1 and "guidance" in outcome.stderr
    assert not out.exists(), "no media was received: the client must not leave a file"


def test_one_session_that_does_not_fit_in_memory_is_refused_before_building():
    from engine.config import EngineConfig
    from decoders.video import WAN_2_1_VAE_STATE_BYTES_PER_PIXEL_FP32
    from decoders.video_encode import WAN_2_1_VAE_ENCODER_BYTES_PER_PIXEL_FP32
    from engine.memory import (
        InsufficientMemory,
        check_fits_in_memory,
        estimate_decoder_session_bytes,
        estimate_kv_session_bytes,
        estimate_weight_bytes,
    )

    config = EngineConfig(preset="wan2.1-1.3b", random_weights=True)
    # 1.3B geometry in float32 at 832x480, estimated on the meta device (nothing allocated):
    # 30 layers x 2 x 1560 tokens x 12 heads x 128 x 4 bytes per latent frame, 18 resident + 512 text tokens
    assert estimate_kv_session_bytes(config) == (18 * 1560 + 512) * 30 * 2 * 12 * 128 * 4
    # The decoder's cache, and the live-input encoder's (its cache + at most 3 waiting frames of 3 channels).
    encoder = round(WAN_2_1_VAE_ENCODER_BYTES_PER_PIXEL_FP32 * 832 * 480) + 3 * 3 * 832 * 480 * 4
    assert estimate_decoder_session_bytes(config) == round(WAN_2_1_VAE_STATE_BYTES_PER_PIXEL_FP32 * 832 * 480) + encoder
    without_input = EngineConfig(preset="wan2.1-1.3b", random_weights=True, video_input=False)
    assert estimate_decoder_session_bytes(without_input) == round(WAN_2_1_VAE_STATE_BYTES_PER_PIXEL_FP32 * 832 * 480)
    # TAEHV streaming a Wan model: its own encoder half encodes the session's input (TAEHV's small state is not
    # estimated); asked to, the Wan VAE's.
    assert estimate_decoder_session_bytes(EngineConfig(preset="wan2.1-1.3b", random_weights=True,
                                                       video_decoder="taehv")) == 0
    assert estimate_decoder_session_bytes(EngineConfig(preset="wan2.1-1.3b", random_weights=True,
                                                       video_decoder="taehv", video_encoder="wan")) == encoder
    assert 1.4e9 * 4 < estimate_weight_bytes(config) < 1.6e9 * 4  # ~1.42 B parameters (DiT + VAE)
    with pytest.raises(InsufficientMemory, match="not enough memory for preset wan2.1-1.3b"):
        check_fits_in_memory(config, available=8 * 2**30)
    check_fits_in_memory(EngineConfig(), available=8 * 2**30)  # tiny fits easily


def test_cpu_session_budget_keeps_a_reserve_of_available_memory():
    from engine.memory import CPU_RESERVE_MIN_BYTES, cpu_session_budget

    assert cpu_session_budget(available=16 * 2**30) == 12 * 2**30  # a quarter kept back
    assert cpu_session_budget(available=CPU_RESERVE_MIN_BYTES // 2) == 0
    # Without a figure it reads this machine's (Linux: MemAvailable), which is under MemTotal.
    meminfo = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    total = int(meminfo["MemTotal"].split()[0]) * 1024
    budget = cpu_session_budget()
    assert budget is not None and 0 <= budget <= 0.75 * total


def test_random_weights_are_asked_for_by_flag_or_by_variable(monkeypatch):
    from app.cli import _engine_config, _settings_from, build_parser
    from app.settings import Settings

    args = build_parser().parse_args(["generate", "--prompt", "x", "--preset", "wan2.1-1.3b", "--random-weights"])
    assert _engine_config(args).random_weights is True
    args = build_parser().parse_args(["serve", "--preset", "wan2.1-1.3b", "--random-weights"])
    assert _settings_from(args).engine.random_weights is True
    monkeypatch.setenv("ARSTREAM_ENGINE__PRESET", "wan2.1-1.3b")
    monkeypatch.setenv("ARSTREAM_ENGINE__RANDOM_WEIGHTS", "true")
    assert Settings().engine.random_weights is True
    args = build_parser().parse_args(["generate", "--prompt", "x"])
    assert _engine_config(args).random_weights is False and _engine_config(args).preset == "tiny"


def test_the_block_length_is_a_flag_of_both_commands_and_unset_leaves_the_weights_setting():
    from app.cli import _engine_config, _settings_from, build_parser

    args = build_parser().parse_args(["serve", "--frames-per-block", "1"])
    assert _settings_from(args).engine.frames_per_block == 1
    assert _engine_config(build_parser().parse_args(["generate", "--prompt", "x", "--frames-per-block", "1"])) \
        .frames_per_block == 1
    # The shipped tiny weights are served with blocks of 2 (their arstream settings) unless a flag says otherwise.
    assert _settings_from(build_parser().parse_args(["serve"])).engine.frames_per_block == 2


def test_every_flag_has_help_and_generate_shows_its_defaults():
    import argparse

    from app.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, command in commands.items():
        for action in command._actions:
            assert action.help, f"arstream {name} {action.option_strings}: no help text"
    shown = commands["generate"].format_help()
    for default in ("(default: 5.0)", "(default: clip.mp4)", "(default: tiny)", "(default: cpu)", "(default: 0)"):
        assert default in " ".join(shown.split()), default
    served = " ".join(commands["serve"].format_help().split())
    assert "default 8000; ARSTREAM_PORT" in served and "ARSTREAM_ENGINE__RANDOM_WEIGHTS" in served
