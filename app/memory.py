"""Give memory freed by ended sockets back to the operating system (glibc's ``malloc_trim``).

Why: each socket's encoders, segments and frames are freed when it ends, but glibc keeps freed
memory in its per-thread arenas, and holes in the middle of an arena are never returned on their
own. With the device thread, the encoder threads and the server's threads allocating in turn, RSS
then wanders by tens of MiB and ratchets up at each new peak — indistinguishable from a leak for
whoever watches the process. ``malloc_trim(0)`` returns every whole free page of every arena. It
runs off the event loop, at most once per ``min_interval_s``, and once more after the last request
of a busy spell so an idle server ends up trimmed. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time
from concurrent.futures import Executor

log = logging.getLogger("arstream.service")

DEFAULT_MIN_INTERVAL_S = 5.0


def _glibc_malloc_trim():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        trim = ctypes.CDLL(name).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


class FreedMemoryReleaser:
    """``request()`` after something big was freed; the trim happens soon, in ``executor``."""

    def __init__(self, executor: Executor | None = None, min_interval_s: float = DEFAULT_MIN_INTERVAL_S) -> None:
        self._trim = _glibc_malloc_trim()
        self._executor = executor
        self.min_interval_s = min_interval_s
        self._last = -float("inf")
        self._scheduled: asyncio.TimerHandle | None = None
        self.trims = 0

    @property
    def available(self) -> bool:
        return self._trim is not None

    def request(self) -> None:
        if self._trim is None or self._scheduled is not None:
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, self._last + self.min_interval_s - time.monotonic())
        self._scheduled = loop.call_later(delay, self._run, loop)

    def _run(self, loop: asyncio.AbstractEventLoop) -> None:
        self._scheduled = None
        self._last = time.monotonic()
        self.trims += 1
        try:
            loop.run_in_executor(self._executor, self._trim, 0)
        except RuntimeError:  # the executor shut down (drain): nothing left to trim for
            pass

    def cancel(self) -> None:
        if self._scheduled is not None:
            self._scheduled.cancel()
            self._scheduled = None
