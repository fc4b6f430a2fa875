"""`arstream generate`: one session through the engine into a playable MP4."""

from __future__ import annotations

import subprocess
import sys

import av


def test_generate_writes_a_playable_clip_of_the_requested_length(tmp_path):
    out = tmp_path / "clip.mp4"
    completed = subprocess.run(
        [sys.executable, "-m", "app.cli", "generate", "--prompt", "a kite", "--seconds", "1.5", "--seed", "3",
         "--height", "48", "--width", "64", "--out", str(out), "--quiet"],
        capture_output=True, text=True, timeout=300,
    )
    assert completed.returncode == 0, completed.stderr
    assert "wrote 24 frames" in completed.stdout
    with av.open(str(out)) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    assert len(frames) == 24
    assert frames[0].shape == (48, 64, 3)
    assert frames[0].std() > 1.0


def test_generate_refuses_bad_arguments(tmp_path):
    completed = subprocess.run(
        [sys.executable, "-m", "app.cli", "generate", "--prompt", "x", "--seconds", "-1", "--out", str(tmp_path / "x.mp4")],
        capture_output=True, text=True, timeout=120,
    )
    assert completed.returncode == 2 and "--seconds" in completed.stderr
