"""One engine worker as a Ray Serve replica: the unchanged arstream service, on the node Ray placed it.

A worker deployment has exactly one replica (one per GPU: ``ray_actor_options={"num_gpus": 1}``; Ray
narrows ``CUDA_VISIBLE_DEVICES`` to that GPU, so ``device = "cuda"`` inside is it). The replica runs the
same app and uvicorn server as ``arstream serve`` (``app.main.create_app``,
``app.server_process.build_server``) on its own event loop, bound to its node's address on a free port: the
front end relays sockets and REST calls to that ``base_url`` directly, so media never goes through Ray's
object store, and nothing depends on which replica Ray's request router would pick (a worker is addressed
by its deployment: one per place).

Ray sees the worker through two methods:

- ``info()``: where it listens and which incarnation it is (the Serve replica id: a restarted replica has
  a new one, which is how :class:`app.cluster.ray_pool.RayWorkerPool` tells a restart from a slow answer);
- ``check_health()``: fails once the engine is dead (a device-fatal error, a failed start) or the server
  stopped, so Ray Serve replaces the replica; ``arstream serve`` exits 1 in the same cases.

It runs in-process rather than as an ``arstream serve`` child: a replica that dies takes its engine with it
(no orphan holding the GPU), and the health check reads the engine itself rather than a pid.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import dataclass

import ray
from ray import serve

log = logging.getLogger("arstream.cluster")

LISTEN_TIMEOUT_S = 120.0  # create_app + bind; the engine builds and warms in the background after it


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker replica tells the pool about itself."""

    name: str
    base_url: str
    incarnation: str  # the Serve replica id: new on every (re)start
    node_id: str
    pid: int
    engine_alive: bool  # False once the engine died or failed to start: this incarnation is lost
    ready: bool


class ArstreamWorker:
    """The body of a worker deployment (``app.cluster.ray_app`` wraps it in ``serve.deployment``)."""

    async def __init__(self, name: str, settings_fields: dict, secret: str) -> None:
        from app.server_process import build_server
        from app.main import create_app
        from app.settings import Settings, WorkerSettings
        from engine.preflight import check_before_build

        self.name = name
        self.incarnation = serve.get_replica_context().replica_id.unique_id
        host = ray.util.get_node_ip_address()
        settings = Settings(
            **{**settings_fields, "host": host, "port": 0, "max_sessions_per_client": None},
            worker=WorkerSettings(name=name, secret=secret),
        )
        log_to_stderr(settings.log_format, worker=name)
        check_before_build(settings.engine)  # a bad model directory fails the replica with that one line
        self.app = create_app(settings)
        self.server = build_server(self.app, settings)
        self.server.capture_signals = contextlib.nullcontext  # Ray owns this process's signals
        # The front end is on another node: take the client's address and scheme from its X-Forwarded-*
        # headers whoever sends them, since nothing without the front end's secret gets past the app.
        self.server.config.forwarded_allow_ips = "*"
        self.app.state.on_engine_dead = self._engine_died
        self._engine_dead = False
        self._serving = asyncio.get_running_loop().create_task(self.server.serve(), name=f"arstream-{name}")
        deadline = time.monotonic() + LISTEN_TIMEOUT_S
        while not self.server.started:
            if self._serving.done() or time.monotonic() > deadline:
                self.server.should_exit = True
                raise RuntimeError(f"worker {name}: the service did not start listening on {host}")
            await asyncio.sleep(0.05)
        sockets = [sock for server in self.server.servers for sock in server.sockets]
        if not sockets:  # stopped as it started (Serve is stopping this replica)
            raise RuntimeError(f"worker {name}: the service stopped while starting")
        bound_host, port = sockets[0].getsockname()[:2]
        self.base_url = f"http://{bound_host}:{port}"
        log.info("worker listening", extra={"worker": name, "base_url": self.base_url, "incarnation": self.incarnation})

    def _engine_died(self) -> None:
        # As `arstream serve` would exit 1: stop the server (the service drains), fail the health check.
        self._engine_dead = True
        self.server.should_exit = True

    def _service(self):
        return getattr(self.app.state, "service", None)  # set by the lifespan, once uvicorn started it

    async def info(self) -> WorkerInfo:
        service = self._service()
        reason = service.not_ready() if service is not None else None
        alive = not self._engine_dead and not self._serving.done() and service is not None and not (reason and reason.final)
        return WorkerInfo(
            name=self.name,
            base_url=self.base_url,
            incarnation=self.incarnation,
            node_id=ray.get_runtime_context().get_node_id(),
            pid=os.getpid(),
            engine_alive=alive,
            ready=alive and service.ready,
        )

    async def check_health(self) -> None:
        """Raise (Ray Serve then replaces this replica) once this incarnation cannot serve again."""
        service = self._service()
        if self._serving.done():
            raise RuntimeError(f"worker {self.name}: its server stopped")
        reason = service.not_ready() if service is not None else None
        if self._engine_dead or (reason is not None and reason.final):
            raise RuntimeError(f"worker {self.name}: the engine is dead")

    async def __del__(self) -> None:
        # Serve stops the replica (redeploy, shutdown): drain as on SIGTERM, within the graceful timeout.
        self.server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._serving), timeout=self.server.config.timeout_graceful_shutdown + 5)


class _WorkerField(logging.Filter):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.worker = name

    def filter(self, record: logging.LogRecord) -> bool:
        record.worker = self.worker
        return True


def log_to_stderr(style: str, worker: str | None = None) -> None:
    """The service's structured lines on this replica's stderr (Ray keeps them in its worker logs), tagged
    ``worker=NAME`` in a worker as the local pool tags its workers'. Ray's own loggers stay as Ray set them."""
    from app.log_format import StructuredFormatter

    handler = logging.StreamHandler()
    handler.setFormatter(StructuredFormatter(style))
    if worker is not None:
        handler.addFilter(_WorkerField(worker))
    for logger_name in ("arstream", "uvicorn"):
        logger = logging.getLogger(logger_name)
        logger.handlers[:] = [handler]
        logger.setLevel(logging.INFO)
        logger.propagate = False
