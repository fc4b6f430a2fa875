"""Who may be served: the checks every transport runs before it serves a caller.

:func:`identify` reads the browser origin, then the bearer token, and names the :class:`Caller` or raises
:class:`AccessDenied`; each transport words a denial its own way: REST answers 403 / 401
(``app/transport/rest.py``), a socket handshake is closed unaccepted (``app/transport/websocket.py``
``admit_socket``). The per-address limits stay with what they count: the session registry (a single server)
and the session table (a front end).
"""

from __future__ import annotations

from starlette.requests import HTTPConnection

from app.security import (
    Caller,
    Unauthorized,
    authenticate,
    bearer_from_header,
    bearer_from_subprotocols,
    client_address,
    origin_allowed,
)
from app.settings import Settings


class AccessDenied(Exception):
    """The caller may not be served: ``reason`` is ``origin`` (a foreign browser page) or ``token``."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def identify(connection: HTTPConnection, settings: Settings) -> Caller:
    """The caller of a request or socket handshake, once its origin is allowed and its token is right.

    Browsers cannot set headers on a WebSocket, so a socket may present its token as a ``bearer.<token>``
    subprotocol instead (a plain HTTP request offers none)."""
    if not origin_allowed(connection.headers.get("origin"), connection.headers.get("host"), settings):
        raise AccessDenied("origin", "this origin may not use the API")
    offered = list(connection.scope.get("subprotocols") or [])
    presented = bearer_from_header(connection.headers) or bearer_from_subprotocols(offered)
    try:
        principal = authenticate(presented, settings)
    except Unauthorized as error:
        raise AccessDenied("token", str(error)) from None
    return Caller(principal=principal, address=client_address(connection.scope))
