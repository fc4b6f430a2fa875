"""The server process: its listening socket, the uvicorn server that runs an app on it, and its exit status.

``arstream serve`` binds first (a taken port is a usage mistake, answered before anything is built), then runs
a single server's app or a front end's with :func:`run_server`. A Ray Serve worker replica runs the same
uvicorn server (:func:`build_server`) on its own event loop (``app/cluster/ray_worker.py``), so both serve the
protocol with the same bounds. Signals: uvicorn's own handlers; on SIGINT/SIGTERM the service drains before
uvicorn closes the sockets (:class:`DrainingServer`).
"""

from __future__ import annotations

import socket

import uvicorn

EXIT_START_FAILED = 3  # the engine's build failed after every check passed (the reason is in the log)


def bind_listening_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound as uvicorn binds its own: a port in use (or an address this host does not
    have) is then a usage mistake answered in one line, not a failure after the engine was built."""
    sock = socket.socket(family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def run_server(app, settings, listening: socket.socket) -> int:
    """Serve ``app`` on ``listening`` until SIGINT/SIGTERM or its engine dies; the process's exit status (a single
    server's own, 1 once its engine died; ``EXIT_START_FAILED`` when it never started)."""
    server = build_server(app, settings)
    app.state.on_engine_dead = server.request_exit
    server.run(sockets=[listening])
    if not server.started:
        return EXIT_START_FAILED
    return app.state.service.exit_code if hasattr(app.state, "service") else 0


def build_server(app, settings) -> DrainingServer:
    """The uvicorn server ``serve`` runs ``app`` with. A Ray Serve worker replica runs the same one on its own
    event loop (``app/cluster/ray_worker.py``), so both serve the protocol with the same bounds."""
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        ws=_websocket_implementation(settings.send_buffer_bytes),
        ws_ping_interval=settings.ping_interval_s,  # a client that answers no ping is dropped (detached)
        ws_ping_timeout=settings.ping_timeout_s,
        ws_per_message_deflate=False,  # media does not compress; deflate only costs CPU and latency
        ws_max_size=settings.max_socket_message_bytes,  # larger client frames are closed 1009 by the protocol layer
        lifespan="on",
        log_config=None,  # our structured logging, configured above
        timeout_graceful_shutdown=max(1, int(settings.drain_timeout_s)),
    )
    return DrainingServer(config)


def _websocket_implementation(send_buffer_bytes: int):
    """uvicorn's non-deprecated WebSocket protocol: the Sans-I/O websockets one where this uvicorn has it,
    with bounded buffers and a hard stop for clients that stopped reading (app.ws_protocol)."""
    from uvicorn.config import WS_PROTOCOLS

    if "websockets-sansio" not in WS_PROTOCOLS:
        return "websockets"
    from app.ws_protocol import bounded_websocket_protocol

    return bounded_websocket_protocol(send_buffer_bytes)


class DrainingServer(uvicorn.Server):
    """uvicorn closes every socket with 1012 *before* the lifespan shutdown runs; drain first, so each
    client gets ``closed`` (``draining``) and 1001 instead, then let uvicorn finish."""

    def request_exit(self) -> None:
        self.should_exit = True

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started and self.servers:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            shown = f"[{host}]" if ":" in host else host
            print(f"arstream serving on http://{shown}:{port} (demo page /, API docs /docs)", flush=True)

    async def shutdown(self, sockets=None) -> None:
        app = self.config.app
        service = getattr(app.state, "service", None) if hasattr(app, "state") else None
        if service is not None:
            await service.drain()
        await super().shutdown(sockets)
