"""`arstream generate`: one session through the engine into a playable MP4 with the stream's audio;
Ctrl-C keeps what was written; `arstream --version`."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import av

from tests import background
from tests.background import Job

ROOT = Path(__file__).resolve().parent.parent
TINY_LOOKAHEAD_SAMPLES = 12 * 600  # the tiny audio codec's right receptive field (12 latent frames) x hop
OPUS_FRAME = 960
SAMPLES_PER_FRAME = 48000 // 16
ENV_OVER = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
ENV = {**os.environ, **ENV_OVER}


def _generate(*args: str) -> list[str]:
    return [sys.executable, "-m", "app.cli", "generate", "--height", "48", "--width", "64", "--cpu-threads", "1", *args]


def _tracks(path: Path) -> tuple[int, int | None, list[str]]:
    """Decoded video frames, audio samples per channel (None without audio), codec names."""
    with av.open(str(path)) as container:
        codecs = [stream.codec_context.name for stream in container.streams]
        frames = sum(1 for _ in container.decode(video=0))
    with av.open(str(path)) as container:
        samples = sum(f.samples for f in container.decode(audio=0)) if container.streams.audio else None
    return frames, samples, codecs


# Two `arstream generate` runs whose files the tests read, started with the session on the otherwise idle core
# (tests/background.py); the SIGINT one is interrupted by its test, so it runs from there.
WITH_AUDIO = Job((*_generate("--prompt", "a kite", "--seconds", "1.5", "--seed", "3", "--quiet"),
                  "--out", "{scratch}/clip.mp4"), env=tuple(ENV_OVER.items()))
NO_AUDIO = Job((*_generate("--prompt", "a kite", "--seconds", "0.5", "--no-audio", "--quiet"),
                "--out", "{scratch}/silent.mp4"), env=tuple(ENV_OVER.items()))
BACKGROUND_JOBS = (WITH_AUDIO, NO_AUDIO)
JOB_TIMEOUT_S = 300


def test_generate_writes_video_and_the_streams_audio_of_the_requested_length():
    completed = background.result(WITH_AUDIO, JOB_TIMEOUT_S)
    out = completed.scratch / "clip.mp4"
    assert completed.returncode == 0, completed.stderr
    assert "wrote 24 frames" in completed.stdout and "video and audio" in completed.stdout
    frames, samples, codecs = _tracks(out)
    assert frames == 24
    assert codecs[0] == "h264" and codecs[1] in ("opus", "aac")
    # The audio trails the video edge by the codec's lookahead; the encoder rounds up to whole frames.
    assert abs(samples - frames * SAMPLES_PER_FRAME) <= OPUS_FRAME + TINY_LOOKAHEAD_SAMPLES, samples
    with av.open(str(out)) as container:
        first = next(container.decode(video=0)).to_ndarray(format="rgb24")
    assert first.shape == (48, 64, 3) and first.std() > 1.0


def test_generate_without_audio_writes_one_track():
    completed = background.result(NO_AUDIO, JOB_TIMEOUT_S)
    out = completed.scratch / "silent.mp4"
    assert completed.returncode == 0, completed.stderr
    frames, samples, codecs = _tracks(out)
    assert frames == 8 and samples is None and codecs == ["h264"]


def test_sigint_during_generate_leaves_a_playable_file_and_one_line(tmp_path):
    out = tmp_path / "long.mp4"
    process = subprocess.Popen(_generate("--prompt", "a kite", "--seconds", "600", "--quiet", "--out", str(out)),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and out.stat().st_size > 20_000):  # a few blocks are in the file
            assert process.poll() is None, process.communicate()
            assert time.monotonic() < deadline, "generate wrote nothing in 120 s"
            time.sleep(0.2)
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 130, stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    written = int(re.search(r"interrupted by SIGINT: wrote (\d+) frames", lines[0]).group(1))
    frames, samples, _ = _tracks(out)
    assert frames == written > 0
    assert samples is not None and samples > 0


def test_version_prints_the_package_version():
    completed = subprocess.run([sys.executable, "-m", "app.cli", "--version"], capture_output=True, text=True,
                               timeout=60, env=ENV)
    assert completed.returncode == 0
    assert completed.stdout.strip() == f"arstream {version('arstream')}"
