"""Prometheus metrics (text exposition format 0.0.4, written by ``prometheus-client``)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from app.deps import ServerDep

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response)
async def metrics(server: ServerDep) -> Response:
    """Sessions by state, ticks, blocks, KV and decoder memory, realtime admission (live capacity,
    utilisation, deadline misses), frame rates, chunk latency, time to first chunk, encode time.
    No session ids: an id is a capability."""
    return Response(server.render_metrics(), media_type=CONTENT_TYPE_PLAIN_0_0_4)
