"""``arstream generate``: one session through the same engine the service runs, written as an MP4.

The file carries what a stream would: H.264 video and, when the model makes audio, the same audio
(Opus, else AAC) on the same clock. Ctrl-C (SIGINT) or SIGTERM stops generating and finishes the
file with what was written — a playable, shorter clip — or removes it when no frame was written.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from app.media import AudioSpec, Mp4FileWriter
from engine.api import Engine
from engine.config import EngineConfig
from engine.errors import CapacityFull

EXIT_INTERRUPTED = {signal.SIGINT: 130, signal.SIGTERM: 143}


@dataclass(frozen=True)
class GenerateRequest:
    prompt: str
    negative_prompt: str
    seconds: float
    seed: int
    out: Path
    quiet: bool


async def generate(config: EngineConfig, request: GenerateRequest, say) -> int:
    """Run the clip; ``say(text)`` prints the one-line outcome on stderr. Returns the exit status.

    SIGINT / SIGTERM cancel this task wherever it is (building, generating); the file is finished
    with what was written by then.
    """
    engine = Engine(config)
    clip = _Clip(request)
    stopped_by = _stop_on_signals(asyncio.current_task())
    try:
        try:
            await engine.start()
        except ValueError as error:  # ModelLoadError and friends: the message names the file
            say(f"cannot start the engine: {error}")
            return 3
        return await clip.run(engine, say)
    except asyncio.CancelledError:
        if stopped_by[0] is None:
            raise
        asyncio.current_task().uncancel()  # the signal was handled here; let shutdown run to the end
        return clip.interrupted(stopped_by[0], say)
    finally:
        _restore_signals()
        await engine.shutdown("client")


class _Clip:
    """The file being written and how far it got."""

    def __init__(self, request: GenerateRequest) -> None:
        self.request = request
        self.written = 0
        self.fps = 16

    @property
    def duration(self) -> str:
        return f"{self.written} frames ({self.written / self.fps:.2f} s)"

    async def run(self, engine: Engine, say) -> int:
        request, geometry = self.request, engine.geometry
        self.fps = geometry.fps
        total_frames = max(1, math.ceil(request.seconds * geometry.fps))
        session = engine.create_session(seed=request.seed, pace=False)
        if isinstance(session, CapacityFull):  # cannot happen with a fresh engine; keep the type honest
            say(session.message)
            return 1
        engine.start_session(session.session_id, request.prompt, negative_prompt=request.negative_prompt)

        audio = None
        if geometry.audio_sample_rate:
            audio = AudioSpec(sample_rate=geometry.audio_sample_rate, channels=geometry.audio_channels or 2)
        # The audio trails the video by the decoder's lookahead; none is kept past the clip's end.
        audio_end = total_frames * (geometry.audio_sample_rate or 0) // geometry.fps
        progress = tqdm(total=total_frames, unit="frame", disable=request.quiet, file=sys.stderr)
        writer = Mp4FileWriter(request.out, geometry.width, geometry.height, fps=geometry.fps, audio=audio)
        try:
            async for chunk in engine.chunks(session.session_id):
                frames = chunk.frames[: total_frames - self.written]
                pcm = None
                if audio is not None and chunk.audio is not None:
                    pcm = chunk.audio[:, : max(0, audio_end - chunk.audio_start)]
                writer.write(frames, pcm)
                self.written += len(frames)
                progress.update(len(frames))
                if self.written >= total_frames:
                    break
        finally:
            progress.close()
            writer.close()  # always finish the file: what was written plays

        status = engine.status(session.session_id)
        if status.close_reason == "failed":
            self._remove_if_empty()
            say(f"generation failed after {self.duration}: {status.error}")
            return 1
        tracks = "video and audio" if audio is not None else "video"
        print(f"wrote {self.duration} of {tracks} to {request.out}")
        return 0

    def interrupted(self, signum: int, say) -> int:
        name = signal.Signals(signum).name
        if self.written:
            say(f"interrupted by {name}: wrote {self.duration} to {self.request.out} (playable)")
        else:
            self._remove_if_empty()
            say(f"interrupted by {name} before any frame was written; no file written")
        return EXIT_INTERRUPTED.get(signum, 1)

    def _remove_if_empty(self) -> None:
        if not self.written:
            try:
                os.unlink(self.request.out)
            except OSError:
                pass


def _stop_on_signals(task: asyncio.Task) -> list:
    """SIGINT / SIGTERM cancel ``task``; returns a one-item list that then holds the signal number."""
    loop = asyncio.get_running_loop()
    received: list = [None]

    def stop(signum: int) -> None:
        if received[0] is None:  # a second Ctrl-C while finishing the file does not cut it short
            received[0] = signum
            task.cancel()

    for signum in EXIT_INTERRUPTED:
        loop.add_signal_handler(signum, stop, signum)
    return received


def _restore_signals() -> None:
    loop = asyncio.get_running_loop()
    for signum in EXIT_INTERRUPTED:
        loop.remove_signal_handler(signum)
