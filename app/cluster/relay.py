"""Bytes between clients and workers: the WebSocket relay and the REST calls, both bounded.

Workers encode their own media; the front end only moves it (a raw 480p block is ~14 MB, its segment a
small fraction of that). A relayed socket is two sockets joined:

    client ──text──▶ front end ──text──▶ worker       (controls, passed through untouched)
    client ◀─text/binary── front end ◀─text/binary── worker  (session, init, chunk + segment, acks, closed)

Every frame is passed through as it came, text as text and binary as binary; the front end looks inside
text frames only to learn that a session ended (``closed``). Backpressure: the front end reads the next
frame from the worker only once the client's send of the previous one returned, and reads ahead at most
``relay_queue_messages`` frames into a socket whose kernel receive buffer is fixed small, so a client
that reads slowly makes its worker's own send block within a few chunks: the worker's stall detection
and pings then treat it exactly as a slow client of a single server (docs/SERVICE.md), and the client
holds back its own session and nothing else.

Closes propagate with their codes: the worker's close code and reason go to the client as they are
(1000, 1001 draining, 1011, 1013 capacity, 4404 ...); a client that goes away (any code, 1007 and 1009
included) closes the worker's socket normally, so the worker detaches the session as it would for a
direct client. When the worker is lost, the client gets ``error`` ``internal`` and ``closed`` ``failed``
and close 1011, as for a failed session of a single server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from starlette.requests import HTTPConnection
from starlette.websockets import WebSocket
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from app.cluster.pool import WorkerEndpoint
from app.schemas import ClosedMessage, ErrorMessage, to_text
from app.security import (
    INTERNAL_HEADER,
    PROTOCOL_SUBPROTOCOL,
    bearer_from_header,
    bearer_from_subprotocols,
    client_address,
)
from app.transport.websocket import CLOSE_FAILED, CLOSE_NORMAL, FAREWELL_TIMEOUT_S

log = logging.getLogger("arstream.cluster")

ABNORMAL_CLOSE_CODES = (None, 1005, 1006)  # no close frame from the worker: it died, or dropped the socket
LOSS_VERDICT_S = 2.0  # a worker socket that dropped: how long to wait for the pool to say the worker died
# Response headers a worker's answer keeps on its way through the front end (a WebRTC answer's resource too).
KEPT_RESPONSE_HEADERS = ("content-type", "retry-after", "www-authenticate", "location", "x-session-id", "link")


class WorkerUnreachable(Exception):
    """The worker did not answer (connection refused or reset, timeout, an answer over the size bound)."""


# --- REST ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Proxied:
    """A worker's answer, as the front end passes it on."""

    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> dict:
        try:
            value = json.loads(self.body)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}

    @property
    def retry_after_s(self) -> float | None:
        value = self.headers.get("retry-after", "")
        return float(value) if value.isdigit() else None

    @property
    def error(self) -> dict:
        """An error answer's ``{"code", "message"}`` (empty when it has none)."""
        error = self.json().get("error")
        return error if isinstance(error, dict) else {}


def forwarded_headers(connection: HTTPConnection) -> dict[str, str]:
    """What a worker must see of the client: its credentials (a browser's ``bearer.<token>`` subprotocol
    becomes a header), its address and scheme (the worker trusts these from loopback only) and the host it
    asked for (a ``201`` body's ``stream_url`` names the front end, not the worker)."""
    headers = {"x-forwarded-for": client_address(connection.scope)}
    token = bearer_from_header(connection.headers)
    if token is None and connection.scope["type"] == "websocket":
        token = bearer_from_subprotocols(list(connection.scope.get("subprotocols") or []))
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    headers["x-forwarded-proto"] = "https" if connection.url.scheme in ("https", "wss") else "http"
    if connection.scope["type"] == "http":
        if "host" in connection.headers:
            headers["host"] = connection.headers["host"]
        if "content-type" in connection.headers:
            headers["content-type"] = connection.headers["content-type"]
    return headers


class WorkerHttp:
    """HTTP to the workers: one pooled client, the front end's secret on every call, bounded in time and size."""

    def __init__(self, secret: str, timeout_s: float, max_body_bytes: int) -> None:
        self._secret = secret
        self.max_body_bytes = max_body_bytes
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s),
            limits=httpx.Limits(max_connections=256, max_keepalive_connections=32),
            trust_env=False,  # workers are on loopback: never through a proxy from the environment
        )

    async def call(self, endpoint: WorkerEndpoint, method: str, path: str, *, headers: dict[str, str] | None = None,
                   body: bytes | None = None, timeout_s: float | None = None) -> Proxied:
        sent = {**(headers or {}), INTERNAL_HEADER: self._secret}
        extra = {"timeout": timeout_s} if timeout_s is not None else {}
        try:
            async with self._client.stream(method, endpoint.base_url + path, headers=sent, content=body,
                                           **extra) as response:
                chunks, size = [], 0
                async for chunk in response.aiter_bytes():
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        raise WorkerUnreachable(f"worker {endpoint.name}: answer over {self.max_body_bytes} bytes")
                    chunks.append(chunk)
                kept = {k: v for k, v in response.headers.items() if k.lower() in KEPT_RESPONSE_HEADERS}
                return Proxied(response.status_code, kept, b"".join(chunks))
        except httpx.HTTPError as error:
            raise WorkerUnreachable(f"worker {endpoint.name}: {type(error).__name__}") from None

    async def aclose(self) -> None:
        await self._client.aclose()


# --- WebSocket ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SocketLimits:
    open_timeout_s: float
    max_message_bytes: int
    queue_messages: int
    receive_buffer_bytes: int


async def open_upstream(endpoint: WorkerEndpoint, path: str, client: WebSocket, *, secret: str,
                        limits: SocketLimits) -> ClientConnection:
    """The worker's socket for ``path`` on behalf of ``client``; :class:`WorkerUnreachable` if it cannot be had."""
    parts = urlsplit(endpoint.base_url)
    url = ("wss" if parts.scheme == "https" else "ws") + "://" + parts.netloc + path
    headers = {**forwarded_headers(client), INTERNAL_HEADER: secret}
    try:
        sock = await asyncio.wait_for(
            _bounded_socket(parts.hostname or "127.0.0.1", parts.port or 80, limits.receive_buffer_bytes),
            limits.open_timeout_s,
        )
        return await connect(
            url, sock=sock, additional_headers=headers, subprotocols=[PROTOCOL_SUBPROTOCOL], compression=None,
            proxy=None, open_timeout=limits.open_timeout_s, ping_interval=None, close_timeout=FAREWELL_TIMEOUT_S,
            max_size=limits.max_message_bytes, max_queue=limits.queue_messages, user_agent_header=None,
        )
    except (TimeoutError, OSError, InvalidHandshake) as error:
        raise WorkerUnreachable(f"worker {endpoint.name}: {type(error).__name__}") from None


async def _bounded_socket(host: str, port: int, receive_buffer_bytes: int) -> socket.socket:
    """A connected socket whose receive buffer is fixed small (set before connect, so the window starts small):
    bytes a slow client leaves unread back up into its worker within a few chunks, not megabytes later."""
    loop = asyncio.get_running_loop()
    family, kind, proto, _, address = (await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM))[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer_bytes)
        sock.setblocking(False)
        await loop.sock_connect(sock, address)
    except BaseException:
        sock.close()
        raise
    return sock


@dataclass(frozen=True)
class Opening:
    """How a worker answered a new stream: its ``session`` message (as sent, and parsed), or the refusal."""

    session_text: str | None
    session: dict | None
    refusal: list[dict]  # the error/closed messages of a refusal (the worker closes right after)

    @property
    def session_id(self) -> str | None:
        session_id = self.session.get("session_id") if self.session is not None else None
        return session_id if isinstance(session_id, str) else None

    @property
    def retry_after_s(self) -> float | None:
        closed = [m for m in self.refusal if m.get("type") == "closed"]
        value = closed[0].get("retry_after_s") if closed else None
        return value if isinstance(value, (int, float)) else None


async def first_answer(upstream: ClientConnection, timeout_s: float) -> Opening:
    """Read a new stream's opening, up to its ``session`` message or the refusal's ``closed``."""
    said: list[dict] = []
    try:
        while len(said) < 4:
            message = await asyncio.wait_for(upstream.recv(), timeout_s)
            payload = json.loads(message) if isinstance(message, str) else None
            if not isinstance(payload, dict):
                break
            if payload.get("type") == "session":
                return Opening(message, payload, [])
            said.append(payload)
            if payload.get("type") == "closed":
                break
    except (ConnectionClosed, TimeoutError, ValueError):
        pass
    return Opening(None, None, said)


class StreamRelay:
    """One client socket joined to one worker socket, until either ends or the worker is lost."""

    def __init__(self, client: WebSocket, upstream: ClientConnection, endpoint: WorkerEndpoint, session_id: str,
                 *, on_ended: Callable[[str], None], on_unknown: Callable[[str], None],
                 on_bytes: Callable[[int], None], is_current: Callable[[], bool],
                 on_failed: Callable[[], None]) -> None:
        self.client = client
        self.upstream = upstream
        self.endpoint = endpoint
        self.session_id = session_id
        self.finished = asyncio.Event()
        self._lost = asyncio.Event()
        self._on_ended = on_ended
        self._on_unknown = on_unknown
        self._on_bytes = on_bytes
        self._is_current = is_current  # the worker generation serving this session is still the pool's
        self._on_failed = on_failed  # the client is ended `failed` because its worker was lost

    def lose(self) -> None:
        """The worker is gone (the pool said so): end the client with ``closed`` ``failed``."""
        self._lost.set()

    async def run(self, first: str | None = None) -> None:
        """Relay until one side ends. ``first``: the ``session`` message already read from the worker."""
        tasks: set[asyncio.Task] = set()
        try:
            if first is not None:
                await self.client.send_text(first)
            down = asyncio.ensure_future(self._downstream())
            up = asyncio.ensure_future(self._upstream())
            lost = asyncio.ensure_future(self._lost.wait())
            tasks = {down, up, lost}
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            if down in done and not self._lost.is_set():
                ended_by_worker, code, reason = down.result()
                if not ended_by_worker:  # the client cannot take more: treat as gone
                    await self._close_upstream()
                    return
                if code in ABNORMAL_CLOSE_CODES:
                    await self._await_verdict()
                if not self._lost.is_set():
                    if code == 4404:
                        self._on_unknown(self.session_id)
                    await self._close_client(CLOSE_FAILED if code in ABNORMAL_CLOSE_CODES else code,
                                             "worker connection lost" if code in ABNORMAL_CLOSE_CODES else reason)
                    return
            if self._lost.is_set():
                for task in (down, up):
                    task.cancel()
                self._on_failed()
                await self._farewell_failed()
                if self.upstream.transport is not None:
                    self.upstream.transport.abort()  # a dead worker sends no close frame: do not wait for one
                return
            await self._close_upstream()  # the client went away: the worker detaches the session
        except Exception:  # the client vanished mid-send, or the worker socket broke: end both quietly
            log.debug("relay ended", extra={"session_id": self.session_id}, exc_info=True)
            await self._close_upstream()
        finally:
            for task in tasks:
                task.cancel()
            self.finished.set()

    async def _await_verdict(self) -> None:
        """The worker's socket dropped without a close: did the worker die (the pool says so, or has already
        replaced that generation), or did it drop just this socket (a client too slow to keep)?"""
        deadline = asyncio.get_running_loop().time() + LOSS_VERDICT_S
        while not self._lost.is_set() and asyncio.get_running_loop().time() < deadline:
            if not self._is_current():
                self._lost.set()
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._lost.wait(), 0.1)

    async def _downstream(self) -> tuple[bool, int | None, str]:
        """Worker → client. Returns (the worker ended it, its close code, reason)."""
        held: str | None = None  # a chunk message waits for its segment: a worker that dies between them sent neither
        try:
            async for message in self.upstream:
                if held is not None:  # its segment (or, from a worker off the protocol, whatever came instead)
                    await self.client.send_text(held)
                    held = None
                if isinstance(message, str):
                    self._watch(message)
                    if _is_type(message, "chunk"):
                        held = message
                    else:
                        await self.client.send_text(message)
                else:
                    await self.client.send_bytes(message)
                    self._on_bytes(len(message))
        except ConnectionClosed:
            pass
        except Exception:  # the client's side failed
            return False, None, ""
        return True, self.upstream.close_code, self.upstream.close_reason or ""

    async def _upstream(self) -> None:
        """Client → worker, every text and binary frame as it came (the worker answers binary with ``bad_json``)."""
        while True:
            message = await self.client.receive()
            if message["type"] == "websocket.disconnect":
                return
            text, data = message.get("text"), message.get("bytes")
            try:
                await self.upstream.send(text if text is not None else data or b"")
            except ConnectionClosed:
                await asyncio.Event().wait()  # the downstream side reports how the worker ended it

    def _watch(self, text: str) -> None:
        if _is_type(text, "closed"):
            self._on_ended(self.session_id)

    async def _farewell_failed(self) -> None:
        self._on_ended(self.session_id)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(FAREWELL_TIMEOUT_S):
                await self.client.send_text(to_text(ErrorMessage(code="internal", message="the engine worker failed")))
                await self.client.send_text(to_text(ClosedMessage(reason="failed")))
        await self._close_client(CLOSE_FAILED, "failed")

    async def _close_client(self, code: int, reason: str) -> None:
        with contextlib.suppress(Exception):
            async with asyncio.timeout(FAREWELL_TIMEOUT_S):
                await self.client.close(code, reason[:120])

    async def _close_upstream(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.upstream.close(CLOSE_NORMAL), FAREWELL_TIMEOUT_S)


def _is_type(text: str, kind: str) -> bool:
    """A worker's text message of type ``kind`` (parsed only when the word is in it: most frames are not)."""
    if f'"{kind}"' not in text:
        return False
    with contextlib.suppress(ValueError):
        payload = json.loads(text)
        return isinstance(payload, dict) and payload.get("type") == kind
    return False
