"""One host, N devices: one ``arstream serve`` worker process per device, supervised by the front end.

A process per device, so a device fault (or anything else that kills an engine) stays in its process: the
worker exits, its sessions end, and only it is restarted. Each worker:

- listens on 127.0.0.1, on a port it picks itself (``--port 0``; its ``arstream serving on`` line says
  which), and answers only requests carrying the front end's secret (``X-Arstream-Internal``, passed in
  ``ARSTREAM_WORKER__SECRET``: an environment variable, not a flag that ``ps`` would show);
- sees only its own GPU (``CUDA_VISIBLE_DEVICES`` narrowed to it, ``--device cuda:0`` inside), so a
  fault cannot touch another worker's device;
- runs in its own session, so a Ctrl-C on the terminal reaches only the front end, which stops the
  workers in order (drain first); and dies with the front end (``PR_SET_PDEATHSIG``) should the front
  end itself be killed;
- writes its log lines to the front end's stderr, tagged ``worker=NAME`` (a ``"worker"`` field in JSON).

Restarts back off (0.5 s, doubling while a worker keeps dying within a minute of its start, up to 30 s)
and are bounded per minute; every start has a new generation, so sessions of a lost generation can never
be confused with the new one's.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import os
import re
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from app.cluster.pool import WorkerEndpoint
from app.security import INTERNAL_HEADER

log = logging.getLogger("arstream.cluster")

CODE_ROOT = Path(__file__).resolve().parents[2]  # the tree this front end runs from: its workers run the same code
SERVING_LINE = re.compile(r"arstream serving on (http://\S+)")
# Environment a worker must not inherit: the front end's own address, its device list, and the per-client
# limit (the front end counts that over all workers; a worker would count only its share).
FRONT_END_ONLY_VARIABLES = ("ARSTREAM_HOST", "ARSTREAM_PORT", "ARSTREAM_DEVICES", "ARSTREAM_MAX_SESSIONS_PER_CLIENT")
PR_SET_PDEATHSIG = 1
HEALTHY_RUN_S = 60.0  # a worker that ran this long before dying starts over at the shortest backoff
RATE_WINDOW_S = 60.0
MAX_LOG_LINE_CHARS = 64 * 1024  # a worker line longer than this is cut (asyncio's reader limit is raised to it)


@dataclass(frozen=True)
class PoolLimits:
    restart_backoff_s: float = 0.5  # first restart; doubles while the worker keeps dying young
    restart_backoff_max_s: float = 30.0
    max_starts_per_minute: int = 5  # per worker; further restarts wait for the window
    start_timeout_s: float = 180.0  # launch to its "serving on" line (imports torch; not the warm-up)
    stop_timeout_s: float = 15.0  # SIGTERM (the worker drains) to SIGKILL
    probe_interval_s: float = 1.0
    hang_timeout_s: float = 30.0  # no /healthz answer for this long: the worker is killed and restarted


@dataclass(eq=False)
class _Worker:
    name: str
    device: str  # as the user named it: cpu, cuda:1
    generation: int = 0
    process: asyncio.subprocess.Process | None = None
    endpoint: WorkerEndpoint | None = None  # published once its port is known, withdrawn when it exits
    starts: deque[float] = field(default_factory=deque)  # monotonic start times inside the rate window
    launched: asyncio.Event = field(default_factory=asyncio.Event)
    supervisor: asyncio.Task | None = None


def worker_names(devices: list[str]) -> list[str]:
    """Stable names for the workers' places: ``cuda:N`` as given, CPU workers ``cpu-0``, ``cpu-1``, ..."""
    names, cpu_index = [], 0
    for device in devices:
        if device == "cpu":
            names.append(f"cpu-{cpu_index}")
            cpu_index += 1
        else:
            names.append(device)
    return names


class LocalPool:
    """:class:`~app.cluster.pool.WorkerPool` of ``arstream serve`` subprocesses on this host."""

    def __init__(
        self,
        devices: list[str],
        worker_args: list[str],
        *,
        secret: str,
        limits: PoolLimits | None = None,
        log_format: str = "json",
    ) -> None:
        self.limits = limits or PoolLimits()
        self.worker_args = list(worker_args)
        self.log_format = log_format
        self._secret = secret
        names = worker_names(devices)
        self._workers = [_Worker(name, device) for name, device in zip(names, devices, strict=True)]
        self._callbacks: list[Callable[[WorkerEndpoint], None]] = []
        self._stopping = False
        self._http: httpx.AsyncClient | None = None

    # --- WorkerPool -------------------------------------------------------------------------------
    async def start(self) -> None:
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(self.limits.probe_interval_s * 2), trust_env=False)
        for worker in self._workers:
            worker.supervisor = asyncio.get_running_loop().create_task(
                self._supervise(worker), name=f"arstream-worker-{worker.name}"
            )
        await asyncio.gather(*(worker.launched.wait() for worker in self._workers))

    async def stop(self) -> None:
        """SIGTERM every worker (each drains its sockets), SIGKILL what is left after ``stop_timeout_s``."""
        self._stopping = True
        running = [w.process for w in self._workers if w.process is not None and w.process.returncode is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        if running:
            _, pending = await asyncio.wait(
                [asyncio.ensure_future(p.wait()) for p in running], timeout=self.limits.stop_timeout_s
            )
            for process in running:
                if process.returncode is None:
                    log.warning("worker did not stop in time; killed", extra={"pid": process.pid})
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
            if pending:
                await asyncio.wait(pending, timeout=5.0)
        supervisors = [w.supervisor for w in self._workers if w.supervisor is not None]
        if supervisors:  # each logs its worker's exit; one still waiting to restart is cancelled
            _, waiting = await asyncio.wait(supervisors, timeout=5.0)
            for supervisor in waiting:
                supervisor.cancel()
            await asyncio.gather(*supervisors, return_exceptions=True)
        if self._http is not None:
            await self._http.aclose()

    def endpoints(self) -> list[WorkerEndpoint]:
        return [worker.endpoint for worker in self._workers if worker.endpoint is not None]

    def on_worker_lost(self, callback: Callable[[WorkerEndpoint], None]) -> None:
        self._callbacks.append(callback)

    # --- one worker's life --------------------------------------------------------------------------
    async def _supervise(self, worker: _Worker) -> None:
        backoff = self.limits.restart_backoff_s
        while not self._stopping:
            await self._wait_for_rate_window(worker)
            started = time.monotonic()
            try:
                await self._run_once(worker)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("worker supervision failed", extra={"worker": worker.name})
            finally:
                worker.launched.set()  # even a launch that failed: start() must return
            if self._stopping:
                return
            backoff = self.limits.restart_backoff_s if time.monotonic() - started >= HEALTHY_RUN_S else backoff
            log.info("worker restarting", extra={"worker": worker.name, "in_s": round(backoff, 2)})
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.limits.restart_backoff_max_s)

    async def _wait_for_rate_window(self, worker: _Worker) -> None:
        now = time.monotonic()
        while worker.starts and now - worker.starts[0] >= RATE_WINDOW_S:
            worker.starts.popleft()
        if len(worker.starts) >= self.limits.max_starts_per_minute:
            wait_s = RATE_WINDOW_S - (now - worker.starts[0])
            log.warning("worker restarts rate-limited", extra={"worker": worker.name, "wait_s": round(wait_s, 1)})
            await asyncio.sleep(wait_s)
            worker.starts.popleft()
        worker.starts.append(time.monotonic())

    async def _run_once(self, worker: _Worker) -> None:
        """Launch one generation, publish its endpoint once it listens, watch it until it exits."""
        worker.generation += 1
        generation = worker.generation
        process = await asyncio.create_subprocess_exec(
            *self._command(worker),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self._environment(worker),
            cwd=str(CODE_ROOT),
            start_new_session=True,  # terminal signals reach the front end only; it stops workers in order
            preexec_fn=_die_with_parent,
            limit=MAX_LOG_LINE_CHARS,
        )
        worker.process = process
        worker.launched.set()
        log.info("worker started", extra={"worker": worker.name, "generation": generation, "pid": process.pid,
                                          "device": worker.device})
        listening: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        readers = [
            asyncio.ensure_future(self._read_stdout(worker, process.stdout, listening)),
            asyncio.ensure_future(self._copy_stderr(worker, process.stderr)),
        ]
        probe: asyncio.Task | None = None
        try:
            exited = asyncio.ensure_future(process.wait())
            done, _ = await asyncio.wait({exited, listening}, timeout=self.limits.start_timeout_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                log.error("worker did not listen in time; killed", extra={"worker": worker.name,
                                                                           "generation": generation})
                _kill(process)
            elif listening in done and not exited.done():
                worker.endpoint = WorkerEndpoint(worker.name, listening.result(), generation)
                log.info("worker listening", extra={"worker": worker.name, "generation": generation,
                                                    "url": worker.endpoint.base_url})
                probe = asyncio.ensure_future(self._probe(worker, process))
            returncode = await exited
        finally:
            lost, worker.endpoint, worker.process = worker.endpoint, None, None
            if probe is not None:
                probe.cancel()
            if process.returncode is None:  # cancelled (the pool stops): do not leave it behind
                _kill(process)
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(process.wait(), 5.0)
            await asyncio.wait(readers, timeout=2.0)
            for reader in readers:
                reader.cancel()
        log_level = logging.INFO if self._stopping else logging.WARNING
        log.log(log_level, "worker exited", extra={"worker": worker.name, "generation": generation,
                                                   "returncode": returncode})
        if lost is not None and not self._stopping:
            for callback in list(self._callbacks):
                try:
                    callback(lost)
                except Exception:
                    log.exception("worker-lost callback failed", extra={"worker": worker.name})

    async def _probe(self, worker: _Worker, process: asyncio.subprocess.Process) -> None:
        """Kill a worker whose event loop stopped answering: it would hold its sessions forever."""
        assert self._http is not None and worker.endpoint is not None
        url = worker.endpoint.base_url + "/healthz"
        last_answer = time.monotonic()
        while process.returncode is None:
            await asyncio.sleep(self.limits.probe_interval_s)
            try:
                response = await self._http.get(url, headers={INTERNAL_HEADER: self._secret})
                if response.status_code == 200:
                    last_answer = time.monotonic()
            except httpx.HTTPError:
                pass
            if time.monotonic() - last_answer > self.limits.hang_timeout_s:
                log.error("worker stopped answering; killed", extra={"worker": worker.name})
                _kill(process)
                return

    def _command(self, worker: _Worker) -> list[str]:
        device = "cuda:0" if worker.device.startswith("cuda") else worker.device  # it sees only its own GPU
        return [sys.executable, "-m", "app.cli", "serve", *self.worker_args,
                "--device", device, "--host", "127.0.0.1", "--port", "0", "--log-format", self.log_format]

    def _environment(self, worker: _Worker) -> dict[str, str]:
        env = {key: value for key, value in os.environ.items() if key not in FRONT_END_ONLY_VARIABLES}
        env.update({
            "ARSTREAM_WORKER__NAME": worker.name,
            "ARSTREAM_WORKER__GENERATION": str(worker.generation),
            "ARSTREAM_WORKER__SECRET": self._secret,
            "PYTHONPATH": os.pathsep.join(p for p in (str(CODE_ROOT), os.environ.get("PYTHONPATH", "")) if p),
            "PYTHONUNBUFFERED": "1",
            "FORWARDED_ALLOW_IPS": "127.0.0.1",  # the worker trusts X-Forwarded-For/-Proto from its front end only
        })
        if worker.device.startswith("cuda"):
            index = int(worker.device.partition(":")[2] or 0)
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index].strip() if visible else str(index)
        return env

    # --- output ---------------------------------------------------------------------------------------
    async def _read_stdout(self, worker: _Worker, stream: asyncio.StreamReader, listening: asyncio.Future) -> None:
        async for raw in _lines(stream):
            match = SERVING_LINE.search(raw)
            if match and not listening.done():
                listening.set_result(match.group(1))
                continue  # not echoed: the front end's own "serving on" line is the one that counts
            self._echo(worker, raw)

    async def _copy_stderr(self, worker: _Worker, stream: asyncio.StreamReader) -> None:
        async for raw in _lines(stream):
            self._echo(worker, raw)

    def _echo(self, worker: _Worker, line: str) -> None:
        """One worker line on the front end's stderr: JSON gets a ``worker`` field, text a ``worker=`` prefix."""
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict):
                    line = json.dumps({"worker": worker.name, **record}, ensure_ascii=False)
                    sys.stderr.write(line + "\n")
                    return
        sys.stderr.write(f"worker={worker.name} {line}\n")


async def _lines(stream: asyncio.StreamReader):
    while True:
        try:
            raw = await stream.readline()
        except ValueError:  # a line over the limit: the reader dropped it
            continue
        if not raw:
            return
        yield raw.decode("utf-8", "replace").rstrip("\n")


def _kill(process: asyncio.subprocess.Process) -> None:
    with contextlib.suppress(ProcessLookupError):
        process.kill()


def _die_with_parent() -> None:
    """In the child, before exec: SIGTERM it when the front end dies, however it dies (Linux only)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
