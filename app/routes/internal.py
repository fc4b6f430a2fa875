"""Routes only a front end calls, present only when this service runs as one of its workers.

``GET /internal/capacity``: whether a new session would be admitted here now and how much room is
left, from the engine's own admission numbers (docs/SCALE_OUT.md). The front end places each new
session on the worker with the most headroom; reading these never admits or evicts anything.
"""

from __future__ import annotations

from fastapi import APIRouter

from app.deps import ServiceDep
from app.schemas import WorkerCapacity

router = APIRouter(prefix="/internal", tags=["internal"], include_in_schema=False)


@router.get("/capacity", response_model=WorkerCapacity)
async def capacity(service: ServiceDep) -> WorkerCapacity:
    worker = service.settings.worker
    outlook = service.registry.outlook()
    ready = service.ready
    return WorkerCapacity(
        ready=ready,
        admitting=ready and outlook is not None and outlook.admitting,
        live_sessions=outlook.live_sessions if outlook else 0,
        live_headroom=outlook.live_headroom if outlook else None,
        slots_free=outlook.slots_free if outlook else 0,
        utilisation=round(outlook.utilisation, 4) if outlook else 0.0,
        device=service.settings.engine.device,
        generation=worker.generation if worker is not None else 0,
        name=worker.name if worker is not None else service.settings.engine.device,
        open_sessions=outlook.open_sessions if outlook else 0,
        retry_after_s=round(outlook.retry_after_s, 3) if outlook else 5.0,
    )
