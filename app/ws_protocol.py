"""uvicorn's WebSocket protocol with bounded buffers and a hard stop for peers that stopped reading.

Why: a client that stops reading is otherwise invisible for a long time. Linux autotunes a socket's
send buffer up to megabytes (docs/BENCHMARKS.md), so the app's
sends keep "succeeding" for hundreds of chunks; and once the peer's window is zero, uvicorn's own
``transport.close()`` waits for a buffer that never drains, so neither a keepalive timeout nor a
close ever reaches the app. This protocol:

- fixes the kernel send buffer at ``send_buffer_bytes`` (Linux doubles the value given) and bounds
  asyncio's write buffer above it by the same amount, so a stalled reader blocks the app's send
  within a few chunks, where ``app.transport.websocket`` detects it;
- aborts the connection when a keepalive ping goes unanswered, or when the app closes a socket
  whose peer is not reading, so the app hears ``websocket.disconnect`` at once and the connection's
  buffers are freed.
"""

from __future__ import annotations

import logging
import socket

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

log = logging.getLogger("arstream.stream")



class BoundedWebSocketProtocol(WebSocketsSansIOProtocol):
    """Set ``send_buffer_bytes`` on a subclass (see :func:`bounded_websocket_protocol`)."""

    send_buffer_bytes = 64 * 1024

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer_bytes)
            except OSError:  # not every transport's socket takes it (e.g. a Unix socket on some systems)
                log.debug("could not bound the socket send buffer")
        # asyncio's write buffer above the kernel's: same bound (64 KiB by default, asyncio's own default).
        transport.set_write_buffer_limits(high=self.send_buffer_bytes, low=self.send_buffer_bytes // 4)

    def keepalive_timeout(self) -> None:
        """The peer answered no ping in time: fail it, and drop the connection without waiting for a
        write buffer it will never read (``close()`` alone waits for that)."""
        super().keepalive_timeout()
        if not self.disconnected:
            self.transport.abort()

    async def send(self, message) -> None:
        if message["type"] == "websocket.close" and self.handshake_complete and not self.writable.is_set():
            # Our buffers are full because the peer does not read: a close frame would queue behind
            # them forever. Abort instead; the peer sees the connection reset.
            self.close_sent = True
            self.transport.abort()
            return
        await super().send(message)


def bounded_websocket_protocol(send_buffer_bytes: int) -> type[BoundedWebSocketProtocol]:
    """The protocol class for ``uvicorn.Config(ws=...)`` with this send buffer."""
    return type("BoundedWebSocketProtocol", (BoundedWebSocketProtocol,), {"send_buffer_bytes": send_buffer_bytes})
