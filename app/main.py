"""The app factory: ``create_app(settings)`` builds the FastAPI app; its lifespan runs the engine.

Start-up builds and warms the engine in the background: ``/healthz`` answers at once, ``/readyz`` is
503 until the engine is warm, and streams or sessions asked for meanwhile are refused as "try later". Shutdown drains: readiness 503, every client gets ``closed`` (``draining``) and
close code 1001, then the engine releases its sessions. ``arstream serve`` drains *before* uvicorn
closes the sockets itself (see ``app.server_process``); the lifespan drain covers every other host.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from fastapi.staticfiles import StaticFiles
from fastapi_offline import FastAPIOffline

from app.routes import health, internal, metrics, sessions, stream, webrtc
from app.log_redaction import install_log_redaction, quiet_polls
from app.security import BodySizeLimit, InternalCallerOnly, StrictRequestTarget
from app.local_sessions import LocalSessions
from app.service import Service
from app.settings import Settings
from app.transport.rest import ApiError, install_error_handlers

STATIC_DIR = Path(__file__).parent / "static"
API_DESCRIPTION = """Realtime streaming for autoregressive video diffusion.

The stream itself is a WebSocket (`/v1/stream`, `/v1/sessions/{id}/stream`): see docs/PROTOCOL.md.
These REST routes create sessions and control them for callers that do not hold the stream."""


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    service = Service(app.state.settings)
    service.on_engine_dead = lambda: app.state.on_engine_dead and app.state.on_engine_dead()
    app.state.service = service
    app.state.sessions = LocalSessions(service)
    service.begin_start()
    try:
        yield
    finally:
        await service.drain()


def create_app(settings: Settings) -> FastAPI:
    # FastAPIOffline: FastAPI whose /docs and /redoc load Swagger UI / ReDoc from files in the
    # fastapi-offline package (served under /static-offline-docs), not from a CDN, so the API docs
    # render on a machine without internet.
    app: FastAPI = FastAPIOffline(title="arstream", version="1", description=API_DESCRIPTION, lifespan=_lifespan)
    app.state.settings = settings
    app.state.on_engine_dead = None  # set by the server runner: how to stop the process when the engine dies
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_message_bytes)
    app.add_middleware(StrictRequestTarget)  # a target that is not valid UTF-8 goes no further
    worker_secret = None
    if settings.worker is not None and settings.worker.secret is not None:
        worker_secret = settings.worker.secret.get_secret_value()
        app.add_middleware(InternalCallerOnly, secret=worker_secret)  # outermost: only the front end gets in
    token = settings.token.get_secret_value() if settings.token is not None else None
    install_log_redaction([s for s in (token, worker_secret) if s])  # query strings, secrets: never in a log line
    install_error_handlers(app)
    app.include_router(health.router)
    if settings.worker is not None:  # a worker behind a front end (app/cluster): its placement numbers
        app.include_router(internal.router)
        quiet_polls()
    app.include_router(metrics.router)
    app.include_router(sessions.router)
    app.include_router(stream.router)
    app.include_router(webrtc.router)
    add_demo_page(app)
    return app


def add_demo_page(app: FastAPI) -> None:
    app.mount("/static", StaticFiles(directory=STATIC_DIR, check_dir=False), name="static")

    @app.get("/", include_in_schema=False)
    async def demo_page() -> FileResponse:
        index = STATIC_DIR / "index.html"
        if not index.is_file():
            raise ApiError(404, "not_found", "the demo page is not installed")
        return FileResponse(index, headers={"Cache-Control": "no-cache"})
