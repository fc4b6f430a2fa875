"""``create_frontend_app``: the FastAPI app of a front end (``arstream serve --devices``; docs/SCALE_OUT.md)."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

from app.cluster.frontend import FrontEnd
from app.cluster.pool import WorkerPool
from app.log_redaction import install_log_redaction
from app.main import API_DESCRIPTION, add_demo_page
from app.routes import health, metrics, sessions, stream, webrtc
from app.security import BodySizeLimit, StrictRequestTarget
from app.settings import Settings
from app.transport.rest import install_error_handlers


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    frontend: FrontEnd = app.state.service
    await frontend.start()
    try:
        yield
    finally:
        await frontend.drain()


def create_frontend_app(settings: Settings, pool: WorkerPool, secret: str) -> FastAPI:
    """The front end's app: the single server's routes and bounds, backed by ``pool``'s workers.

    The :class:`FrontEnd` is both ``app.state.service`` (the shared request checks read its ``settings`` and
    count into its ``metrics``; ``arstream serve`` drains it before uvicorn closes the sockets) and
    ``app.state.sessions``: the routes are the single server's own (``app/backend.py``)."""
    app: FastAPI = FastAPIOffline(title="arstream", version="1", description=API_DESCRIPTION, lifespan=_lifespan)
    app.state.settings = settings
    app.state.service = app.state.sessions = FrontEnd(settings, pool, secret)
    app.state.on_engine_dead = None
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_message_bytes)
    app.add_middleware(StrictRequestTarget)
    token = settings.token.get_secret_value() if settings.token is not None else None
    install_log_redaction([s for s in (token, secret) if s])
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per poll of every worker, otherwise
    install_error_handlers(app)
    app.include_router(health.router)
    app.include_router(metrics.router)
    app.include_router(sessions.router)
    app.include_router(stream.router)
    app.include_router(webrtc.router)
    add_demo_page(app)
    return app
