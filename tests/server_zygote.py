"""Test servers forked from one warm interpreter instead of started cold.

A cold `arstream serve` spends most of its start importing torch, diffusers and the app (3.9 of 4.4 s to
/readyz on the 2-core CI machine class), and the suite starts a dozen servers. A multiprocessing forkserver
imports them once; each server is then a fork of it that runs the command line's own ``main(["serve", ...])``
with the same arguments and environment a cold start would get, its stdout and stderr going to a log file
that :class:`ForkedServer` reads like a pipe. Tests of the command itself (``tests/test_cli*.py``, the SIGTERM
drain in ``tests/test_service_e2e.py``) still start it as a fresh process.

The forkserver only imports: it never runs a torch op, so no OpenMP pool or other thread exists to be forked.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import wait as ready

# What `arstream serve` imports on its way to serving (its engine, decoders and app).
PRELOAD = ["app.cli", "app.main", "engine.startup", "engine.api", "decoders.video", "decoders.audio"]
POLL_S = 0.02

_context: multiprocessing.context.BaseContext | None = None


def _forkserver() -> multiprocessing.context.BaseContext:
    global _context
    if _context is None:
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        _context = context
    return _context


def start_forkserver() -> None:
    """Start the forkserver now (it imports while the session goes on); the first server would otherwise wait."""
    from multiprocessing import forkserver

    _forkserver()
    forkserver.ensure_running()


def _serve(argv: list[str], env: dict[str, str], log_path: str) -> None:
    """In the fork: the environment and output a cold `arstream serve` would have, then its main()."""
    os.environ.clear()
    os.environ.update(env)
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # line-buffered, as PYTHONUNBUFFERED=1 gives
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    from app.cli import main

    sys.exit(main(argv))


class ForkedServer:
    """The part of ``subprocess.Popen`` the tests use, for a server forked from the forkserver."""

    def __init__(self, argv: list[str], env: dict[str, str]) -> None:
        log = tempfile.NamedTemporaryFile(prefix="arstream-serve-", suffix=".log", delete=False)
        log.close()
        self._log_path = log.name
        # Daemonic: one a failed test left running is terminated when the session exits (a non-daemonic child
        # would be joined, and pytest would hang on it). Its own children are subprocesses, which it may have.
        self._process = _forkserver().Process(target=_serve, args=(argv, env, self._log_path), daemon=True)
        self._status = threading.Lock()  # the exit status is read from a pipe once: one reader at a time
        self._process.start()
        self.pid = self._process.pid
        self.stdout = self._lines()

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def poll(self) -> int | None:
        with self._status:
            return self._process.exitcode

    def _exited(self) -> bool:
        """Without reading the status: the forkserver writes it to the sentinel when the fork exits."""
        return bool(ready([self._process.sentinel], 0))  # and readable (at its end) ever after

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (status := self.poll()) is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired("arstream serve (forked)", timeout)
            time.sleep(POLL_S)
        return status

    def _lines(self) -> Iterator[str]:
        """The server's output line by line as it is written, until it has exited and all was read."""
        with open(self._log_path) as log:
            pending = ""
            while True:
                chunk = log.readline()
                if chunk:
                    pending += chunk
                    if pending.endswith("\n"):
                        yield pending
                        pending = ""
                    continue
                if self._exited():
                    rest = log.read()
                    if pending or rest:
                        yield from (pending + rest).splitlines(keepends=True)
                    os.unlink(self._log_path)
                    return
                time.sleep(POLL_S)
