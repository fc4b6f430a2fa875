"""``RayWorkerPool``: the :class:`~app.cluster.pool.WorkerPool` of a Ray Serve application's worker deployments.

Ray Serve starts, places and restarts the workers (one deployment per GPU, one replica each:
``app/cluster/ray_worker.py``); this pool only watches them for the front end, from the ingress replica:

    every poll_interval_s, for each worker deployment:
        TCP connect to the listed base_url refused ─▶ that generation is lost (its process is gone)
        handle.info() answers:  same incarnation ─▶ still listed, same generation
                                new incarnation  ─▶ the old generation is lost; the new one listed (+1)
                                engine dead      ─▶ that generation is lost (Ray replaces the replica)
        no answer within info_timeout_s ─▶ nothing changes

The connect probe is what makes a loss quick: a killed replica's port refuses at once, while ``info()``
through the handle waits until Ray has a replacement to route to. ``info()`` is the control plane only:
a worker whose answers are late (Ray's controller busy, the replica loaded) still serves its sessions over
its ``base_url``, so it stays listed, and the front end's own capacity reads keep new sessions off it
while it does not answer those. A hung replica fails Ray's health check, is replaced, and is lost then.

Generations are this pool's count of the incarnations it saw per worker name (1 for the first): a Serve
replica does not know how many came before it. Placement is deterministic because the front end's table
maps each session id to the endpoint (name and generation) that admitted it; nothing relies on Ray Serve's
best-effort multiplexed routing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from app.cluster.pool import WorkerEndpoint

log = logging.getLogger("arstream.cluster")


@dataclass(frozen=True)
class RayPoolLimits:
    poll_interval_s: float = 0.5
    info_timeout_s: float = 5.0  # an answer through the handle; a replica being replaced gives none
    probe_timeout_s: float = 1.0  # TCP connect to a worker's port
    stop_timeout_s: float = 5.0


@dataclass(frozen=True)
class _Watched:
    endpoint: WorkerEndpoint
    incarnation: str


class RayWorkerPool:
    """Watches Ray Serve worker deployments (``name -> DeploymentHandle``) for a front end."""

    def __init__(self, workers: Mapping[str, object], limits: RayPoolLimits | None = None) -> None:
        self.limits = limits or RayPoolLimits()
        self._handles = dict(workers)
        self._watched: dict[str, _Watched] = {}
        self._generations: dict[str, int] = {name: 0 for name in self._handles}
        self._lost_incarnations: set[str] = set()  # never listed again, even if one still answers
        self._callbacks: list[Callable[[WorkerEndpoint], None]] = []
        self._watchers: list[asyncio.Task] = []
        self._stopping = False

    # --- WorkerPool -------------------------------------------------------------------------------
    async def start(self) -> None:
        """Serve launched the workers already; ask each once (bounded), then keep watching."""
        await asyncio.gather(*(self._ask(name) for name in self._handles))
        loop = asyncio.get_running_loop()
        for name in self._handles:
            # Two loops per worker, so that an info() call left waiting on a dead replica never delays the probe.
            self._watchers.append(loop.create_task(self._every_poll(self._probe, name), name=f"arstream-probe-{name}"))
            self._watchers.append(loop.create_task(self._every_poll(self._ask, name), name=f"arstream-info-{name}"))

    async def stop(self) -> None:
        """Stop watching. The workers belong to the Serve application (``serve shutdown`` / ``serve delete``
        stops them, each draining its sockets); an ingress replica that stops must not take them along."""
        self._stopping = True  # the loops end at their next turn even if a cancellation is lost (below)
        for watcher in self._watchers:
            watcher.cancel()
        if self._watchers:
            await asyncio.wait(self._watchers, timeout=self.limits.stop_timeout_s)
        self._watchers.clear()

    def endpoints(self) -> list[WorkerEndpoint]:
        return [watched.endpoint for watched in self._watched.values()]

    def on_worker_lost(self, callback: Callable[[WorkerEndpoint], None]) -> None:
        self._callbacks.append(callback)

    # --- watching ---------------------------------------------------------------------------------
    async def _every_poll(self, check: Callable[[str], Awaitable[None]], name: str) -> None:
        # Not `while True`: on Python 3.11 asyncio.wait_for can swallow a cancellation that arrives as its inner
        # call completes, and a loop that never ends then hung the event loop's shutdown (a CI run waited on
        # it for good).
        while not self._stopping:
            await asyncio.sleep(self.limits.poll_interval_s)
            try:
                await check(name)
            except Exception:
                log.exception("worker watch failed", extra={"worker": name})

    async def _probe(self, name: str) -> None:
        watched = self._watched.get(name)
        refused = watched is not None and await self._refused(watched.endpoint.base_url)
        if refused and self._watched.get(name) is watched:  # and not replaced meanwhile
            self._lose(name, "its port refuses connections")

    async def _ask(self, name: str) -> None:
        try:
            info = await asyncio.wait_for(_ask_info(self._handles[name]), self.limits.info_timeout_s)
        except Exception as error:  # a timeout while Ray replaces it, or the replica died under the call
            log.debug("worker info unanswered", extra={"worker": name, "error": type(error).__name__})
            return
        watched = self._watched.get(name)
        if watched is not None and info.incarnation != watched.incarnation:
            self._lose(name, "a new replica answers")
            watched = None
        if not info.engine_alive:
            if watched is not None:
                self._lose(name, "its engine is dead")
            self._lost_incarnations.add(info.incarnation)
            return
        if watched is None and info.incarnation not in self._lost_incarnations:
            self._generations[name] += 1
            endpoint = WorkerEndpoint(name=name, base_url=info.base_url, generation=self._generations[name])
            self._watched[name] = _Watched(endpoint, info.incarnation)
            log.info("worker replica up", extra={"worker": name, "generation": endpoint.generation,
                                         "base_url": info.base_url, "node_id": info.node_id})

    def _lose(self, name: str, why: str) -> None:
        watched = self._watched.pop(name)
        self._lost_incarnations.add(watched.incarnation)
        log.warning("worker replica lost", extra={"worker": name, "generation": watched.endpoint.generation, "why": why})
        for callback in list(self._callbacks):
            try:
                callback(watched.endpoint)
            except Exception:
                log.exception("worker-lost callback failed", extra={"worker": name})

    async def _refused(self, base_url: str) -> bool:
        """Whether the worker's port refuses a TCP connection now (a timeout is not a refusal)."""
        address = urlsplit(base_url)
        try:
            _, writer = await asyncio.wait_for(
                asyncio.open_connection(address.hostname, address.port), self.limits.probe_timeout_s
            )
        except (ConnectionRefusedError, ConnectionResetError):
            return True
        except (OSError, TimeoutError):
            return False
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
        return False


async def _ask_info(handle):
    return await handle.info.remote()
