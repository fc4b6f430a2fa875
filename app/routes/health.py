"""Liveness and readiness, for probes and load balancers."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from app.deps import ServiceDep
from app.routes import UNAVAILABLE_RETRY_AFTER_S
from app.schemas import Health

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process is up and its event loop answers."""
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses={503: {"model": Health}})
async def readyz(service: ServiceDep):
    """200 only while the engine is warm, alive and not draining: send traffic here."""
    reason = service.not_ready_reason()
    if reason is None:
        return Health(status="ok")
    return JSONResponse(
        Health(status="unavailable", detail=reason).model_dump(),
        status_code=503,
        headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
    )
