"""Prometheus metrics (text exposition format 0.0.4)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from app.deps import ServiceDep

router = APIRouter(tags=["metrics"])

PROMETHEUS_TEXT = "text/plain; version=0.0.4; charset=utf-8"


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(service: ServiceDep) -> PlainTextResponse:
    """Sessions by state, ticks, blocks, KV use, queue depths, fps, chunk latency, time to first chunk,
    encode time. No session ids: an id is a capability."""
    text = service.metrics.render(service.engine.counters(), draining=service.draining)
    return PlainTextResponse(text, media_type=PROMETHEUS_TEXT)
