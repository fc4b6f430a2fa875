"""Who may talk to the service, and how much: origin allow-list, bearer token, rate and size bounds.

WebSockets are not covered by the browser's same-origin policy, so any page a user visits could open
one to a service on their machine; the ``Origin`` check (before ``accept``) is what stops that. Clients
that are not browsers send no ``Origin`` and are let through: they could forge one anyway, and the
token is what protects a service that must not be open.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes, urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from app.settings import WILDCARD_ORIGIN, Settings

LOCAL_HOSTNAMES = frozenset({"localhost", "127.0.0.1", "::1"})
BEARER_SUBPROTOCOL_PREFIX = "bearer."
PROTOCOL_SUBPROTOCOL = "arstream.v1"
INTERNAL_HEADER = "x-arstream-internal"  # a front end's secret, on every request it makes to its workers


@dataclass(frozen=True)
class Caller:
    """Who is calling: ``principal`` owns sessions when auth is on; ``address`` counts per-client limits."""

    principal: str | None
    address: str


def _hostname(netloc: str) -> str:
    return (urlsplit(f"//{netloc}").hostname or "").lower()


def origin_allowed(origin: str | None, host: str | None, settings: Settings) -> bool:
    """Allowed: no Origin (not a browser), an origin in ``allowed_origins`` (or '*'), the same host as
    the request's ``Host`` (any scheme), or localhost / 127.0.0.1 / [::1] on any port."""
    if origin is None:
        return True
    origin = origin.strip().lower().rstrip("/")
    if WILDCARD_ORIGIN in settings.allowed_origins or origin in settings.allowed_origins:
        return True
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        return False  # includes the opaque origin "null" (sandboxed frames, file://)
    if parts.hostname in LOCAL_HOSTNAMES:
        return True
    return host is not None and parts.netloc == host.strip().lower()


def bearer_from_header(headers: Headers) -> str | None:
    value = headers.get("authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def bearer_from_subprotocols(subprotocols: list[str]) -> str | None:
    """Browsers cannot set headers on a WebSocket: they offer ``bearer.<token>`` as a subprotocol."""
    for offered in subprotocols:
        if offered.startswith(BEARER_SUBPROTOCOL_PREFIX):
            return offered[len(BEARER_SUBPROTOCOL_PREFIX) :]
    return None


def principal_of(token: str) -> str:
    """A stable, non-secret name for a token holder (the token itself is never stored or logged)."""
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:16]


class Unauthorized(Exception):
    """The token is missing or wrong."""


def authenticate(presented: str | None, settings: Settings) -> str | None:
    """The caller's principal (None when auth is off); :class:`Unauthorized` for a missing or wrong token."""
    if settings.token is None:
        return None
    expected = settings.token.get_secret_value()
    if presented is None or not hmac.compare_digest(presented.encode(), expected.encode()):
        raise Unauthorized("a valid bearer token is required")
    return principal_of(expected)


def client_address(scope: Scope) -> str:
    client = scope.get("client")
    return client[0] if client else "unknown"


class TokenBucket:
    """``rate`` events per second on average, bursts of up to ``burst``."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.tokens = float(burst)
        self.updated = time.monotonic()

    def allow(self) -> bool:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False

    def seconds_until_allowed(self) -> float:
        return max(0.0, (1.0 - self.tokens) / self.rate)


class StrictRequestTarget:
    """Refuse a request whose path or query string does not decode to valid Unicode.

    Servers decode percent-escapes leniently (``%ED%A0%80``, a UTF-8-encoded surrogate, or a stray
    ``%FF`` become U+FFFD), so a route would otherwise see a different string than the client sent.
    HTTP gets 400 ``invalid_field``; a WebSocket handshake is refused before accept, as for a bad token.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or _target_is_unicode(scope):
            await self.app(scope, receive, send)
            return
        _count_rejected(scope, "invalid_field")
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "path is not valid UTF-8"})
            return
        await _send_json_error(send, 400, "invalid_field", "the path or query string is not valid UTF-8")


def _count_rejected(scope: Scope, code: str) -> None:
    app = scope.get("app")
    service = getattr(app.state, "service", None) if app is not None else None
    if service is not None:
        service.metrics.message_rejected("rest" if scope["type"] == "http" else "socket", code)


def _target_is_unicode(scope: Scope) -> bool:
    raw_path = scope.get("raw_path") or scope.get("path", "").encode("utf-8", "surrogateescape")
    query = scope.get("query_string", b"")
    try:
        unquote_to_bytes(raw_path).decode("utf-8")
        unquote_to_bytes(query.replace(b"+", b" ")).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


class InternalCallerOnly:
    """A worker behind a front end answers only that front end: every request and socket handshake must
    carry the secret the front end started it with (``X-Arstream-Internal``). Workers listen on loopback;
    this also keeps other local processes (and pages a browser on this machine visits) out of them.
    HTTP without it gets 403 ``forbidden``; a WebSocket handshake is refused before accept."""

    def __init__(self, app: ASGIApp, secret: str) -> None:
        self.app = app
        self.secret = secret.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        presented = Headers(scope=scope).get(INTERNAL_HEADER)
        if presented is not None and hmac.compare_digest(presented.encode(), self.secret):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008, "reason": "front end only"})
            return
        await _send_json_error(send, 403, "forbidden", "this worker answers only its front end")


class BodySizeLimit:
    """Refuse HTTP bodies over ``max_bytes`` with 413 before the app reads them into memory."""

    def __init__(self, app: ASGIApp, max_bytes: int, *, sdp_bytes: int = 64 * 1024) -> None:
        """``sdp_bytes``: the bound of a WebRTC offer (``POST …/webrtc``): SDP is larger than a control."""
        self.app = app
        self.max_bytes = max_bytes
        self.sdp_bytes = sdp_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        max_bytes = self.sdp_bytes if scope.get("path", "").endswith("/webrtc") else self.max_bytes
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > max_bytes:
            _count_rejected(scope, "body_too_large")
            await _send_too_large(send, max_bytes)
            return
        received = 0
        too_large = False

        async def bounded_receive() -> Message:
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > max_bytes:
                    too_large = True
                    # The app sees a truncated, invalid body; we answer 413 instead of its reply.
                    return {"type": "http.request", "body": b"", "more_body": False}
            return message

        response_started = False

        async def guarded_send(message: Message) -> None:
            nonlocal response_started
            if too_large:
                if not response_started:
                    response_started = True
                    _count_rejected(scope, "body_too_large")
                    await _send_too_large(send, max_bytes)
                return
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, bounded_receive, guarded_send)


async def _send_too_large(send: Send, max_bytes: int) -> None:
    await _send_json_error(send, 413, "invalid_field", f"request body larger than {max_bytes} bytes")


async def _send_json_error(send: Send, status: int, code: str, message: str) -> None:
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
