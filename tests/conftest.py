"""Shared test fixtures: a small engine config, the app under TestClient, a real `arstream serve`, MP4 decoding.

Everything runs the real engine (tiny preset at 64x64, one torch thread) and the real encoder; nothing
under test is mocked. Kept generic so other test modules can use them too.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from engine.cpu_threads import limit_spinning

limit_spinning()  # as the command line does, before torch loads: tests that use two threads do not spin them

import av  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from tests import background, background_pytest  # noqa: E402
from tests.server_zygote import ForkedServer, start_forkserver  # noqa: E402


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``background`` go to child pytests on the idle core (tests/background_pytest.py). Modules
    that wait on a background job (tests/background.py) run after the others, so their jobs, which share the
    idle core, have finished by then: run early, a module's fixture left this process waiting on its job."""
    kept = background_pytest.split(items)
    if background_pytest.in_child():
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
    else:  # sorted() is stable: the files keep their order within each group, and the marked ones stay last
        kept = sorted(kept, key=_run_group)
    items[:] = kept


def _run_group(item: pytest.Item) -> int:
    """0: most tests; 1: a module that waits on a background job; 2: the child pytests' (split() put them last)."""
    if background_pytest.is_marked(item):
        return 2
    return 1 if getattr(getattr(item, "module", None), "BACKGROUND_JOBS", ()) else 0


def pytest_collection_finish(session: pytest.Session) -> None:
    """Once the selected tests are known: their modules' background jobs start (tests/background.py), then the
    background pytests after them, and the forkserver the test servers fork from begins importing
    (tests/server_zygote.py), all beside the first tests."""
    modules = {item.module for item in session.items if getattr(item, "module", None) is not None}
    if not background_pytest.in_child():  # a child's tests need none of them (their module's others use them)
        background.start_for(modules)
    background_pytest.start()
    if any(_uses_servers(item) for item in session.items):
        start_forkserver()


def _uses_servers(item: pytest.Item) -> bool:
    """Whether a test forks `arstream serve` (start_server, shared_server, ForkedServer); else the forkserver's
    imports would only take CPU from the tests that run (a server forked anyway starts it then)."""
    module = getattr(item, "module", None)
    return "shared_server" in getattr(item, "fixturenames", ()) or any(
        hasattr(module, name) for name in ("start_server", "ForkedServer"))


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> bool | None:
    return background_pytest.run_protocol(item)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    background_pytest.record(report)


def pytest_terminal_summary(terminalreporter) -> None:
    background_pytest.summary(terminalreporter)


def pytest_sessionfinish(session: pytest.Session) -> None:
    background_pytest.finish()
    background.stop_all()


SMALL_ENGINE = {
    "preset": "tiny",
    "random_weights": True,  # service tests pin the seeded random model (the shipped weights have their own tests)
    "height": 64,
    "width": 64,
    "cpu_threads": 1,
    "warmup_blocks": 0,
    "sink_frames": 1,
    "window_frames": 3,
}
SERVER_START_TIMEOUT_S = 180  # imports torch + diffusers; slow on a busy 2-core machine


def wait_ready(get: Callable, timeout: float = SERVER_START_TIMEOUT_S) -> None:
    """Poll ``get("/readyz")`` until 200: the engine warms up in the background after the server starts."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if get("/readyz").status_code == 200:
                return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError("the engine did not become ready in time")
        time.sleep(0.05)


def small_engine(**overrides) -> dict:
    """Engine config fields for fast CPU tests (merge overrides, e.g. ``max_sessions=1``)."""
    return {**SMALL_ENGINE, **overrides}


@pytest.fixture
def make_client() -> Iterator[Callable]:
    """``with make_client(engine={...}, **settings) as client:`` — the app under TestClient, lifespan run."""
    from fastapi.testclient import TestClient

    from app.main import create_app
    from app.settings import Settings

    @contextmanager
    def factory(engine: dict | None = None, **settings):
        app = create_app(Settings(engine=small_engine(**(engine or {})), **settings))
        with TestClient(app) as client:
            wait_ready(client.get)
            yield client

    yield factory


@dataclass
class RunningServer:
    """An `arstream serve` process (a fresh one, or forked: tests/server_zygote.py); ``base_url`` is
    http://127.0.0.1:PORT."""

    process: subprocess.Popen | ForkedServer
    base_url: str
    log_lines: list[str] = field(default_factory=list)

    @property
    def ws_url(self) -> str:
        return "ws" + self.base_url[len("http") :]

    @property
    def port(self) -> int:
        return int(self.base_url.rsplit(":", 1)[1])

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM (drain) and wait; returns the exit status (-15 when uvicorn re-raised SIGTERM)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def follow_serving_url(
    process: subprocess.Popen, lines: list[str], timeout_s: float, pattern: str = r"arstream serving on (http://\S+)"
) -> str | None:
    """Drain ``process``'s output into ``lines`` for its whole life (a full pipe would stall it); return the URL
    it says it serves on (``pattern``'s group), or None if it exits or ``timeout_s`` passes first."""
    found = threading.Event()
    url: list[str] = []

    def read_output() -> None:
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            match = re.search(pattern, line)
            if match and not found.is_set():
                url.append(match.group(1))
                found.set()
        found.set()

    threading.Thread(target=read_output, daemon=True).start()
    found.wait(timeout_s)
    return url[0] if url else None


def _arstream_command() -> list[str]:
    script = Path(sys.executable).parent / "arstream"
    return [str(script)] if script.exists() else [sys.executable, "-m", "app.cli"]


def start_server(*extra_args: str, env: dict | None = None, small: bool = True, cold: bool = False) -> RunningServer:
    """Start `arstream serve` on a free port (``--port 0``) with the small engine (``small=False``: the tiny preset
    as shipped, its trained weights at their own size, for tests that read what the frames show); wait until it
    serves. It is forked from a warm interpreter (tests/server_zygote.py) unless ``cold``: then the installed
    command starts as a fresh process, as a user starts it."""
    args = ["serve", "--host", "127.0.0.1", "--port", "0", "--log-format", "json",
            "--preset", "tiny", "--cpu-threads", "1"]
    if small:
        args += ["--height", str(SMALL_ENGINE["height"]), "--width", str(SMALL_ENGINE["width"]), "--warmup-blocks", "0",
                 "--sink-frames", str(SMALL_ENGINE["sink_frames"]), "--window-frames", str(SMALL_ENGINE["window_frames"])]
    # The small engine is the seeded random model, as SMALL_ENGINE: these tests pin its output.
    weights = {"ARSTREAM_ENGINE__RANDOM_WEIGHTS": "true"} if small else {}
    environment = {**os.environ, "PYTHONUNBUFFERED": "1", **weights, **(env or {})}
    if cold:
        process = subprocess.Popen([*_arstream_command(), *args, *extra_args], stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, text=True, env=environment)
    else:
        process = ForkedServer([*args, *extra_args], environment)
    server = RunningServer(process=process, base_url="")
    server.base_url = follow_serving_url(process, server.log_lines, SERVER_START_TIMEOUT_S) or ""
    if not server.base_url:
        server.stop(timeout=5)
        tail = "\n".join(server.log_lines[-40:])
        raise RuntimeError(f"arstream serve did not start (exit {process.returncode}):\n{tail}")
    wait_ready(lambda path: _http_status(server.base_url + path))
    return server


@pytest.fixture(scope="session")
def shared_server() -> Iterator[RunningServer]:
    """One default `arstream serve` (the small engine, 4 slots) for every test that needs nothing else of it.

    Each test's sessions are its own and end with the test (a closed session holds no slot), so tests that
    share it do not see each other; one that needs other settings, its log, or to stop it starts its own.
    """
    server = start_server()
    try:
        yield server
    finally:
        server.stop()


@dataclass
class _Status:
    status_code: int


def _http_status(url: str) -> _Status:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return _Status(response.status)
    except urllib.error.HTTPError as error:
        return _Status(error.code)


def decode_mp4(data: bytes) -> tuple[np.ndarray, list[float]]:
    """Decode an MP4 (init + segments) with PyAV: RGB frames ``[N, H, W, 3]`` and their times in seconds."""
    frames, times = [], []
    with av.open(io.BytesIO(data)) as container:
        for frame in container.decode(container.streams.video[0]):
            frames.append(frame.to_ndarray(format="rgb24"))
            times.append(float(frame.time))
    return np.stack(frames) if frames else np.zeros((0, 0, 0, 3), np.uint8), times


def decoded_audio_samples(data: bytes) -> int | None:
    """Samples per channel the MP4's audio track decodes to (None without an audio track)."""
    with av.open(io.BytesIO(data)) as container:
        if not container.streams.audio:
            return None
        return sum(frame.samples for frame in container.decode(container.streams.audio[0]))
