"""Where a front end finds its engine workers: the one interface its placement and relay code use."""
from __future__ import annotations
from dataclasses import dataclass
from typing import Protocol
from collections.abc import Callable

@dataclass(frozen=True)
class WorkerEndpoint:
    name: str        # stable for the worker's place: "cuda:0", "cpu-1", "ray-gpu-0"
    base_url: str    # http://host:port of that worker's own arstream service (the unchanged v1 HTTP/WS API)
    generation: int  # +1 on every (re)start: sessions placed on an older generation are gone

class WorkerPool(Protocol):
    async def start(self) -> None: ...          # launch every worker (returns once launched, not necessarily ready)
    async def stop(self) -> None: ...           # stop every worker, bounded in time
    def endpoints(self) -> list[WorkerEndpoint]: ...  # the workers running now; one being restarted is absent
    def on_worker_lost(self, callback: Callable[[WorkerEndpoint], None]) -> None: ...
        # called (on the event loop) once per lost generation: the front end ends that worker's sessions
