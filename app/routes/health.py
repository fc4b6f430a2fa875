"""Liveness and readiness, for probes and load balancers."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from app.deps import ServerDep
from app.schemas import Health
from app.transport.refusal import UNAVAILABLE_RETRY_AFTER_S

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process is up and its event loop answers."""
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses={503: {"model": Health}})
async def readyz(server: ServerDep):
    """200 only while new sessions are admitted — the engine warm, alive and not draining (a front end: at
    least one such worker; a full one counts, it refuses sessions one by one): send traffic here."""
    reason = server.not_ready_reason()
    if reason is None:
        return Health(status="ok")
    return JSONResponse(
        Health(status="unavailable", detail=reason).model_dump(),
        status_code=503,
        headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
    )
