"""The front end: the FastAPI app in front of several engine workers (``arstream serve --devices``).

Same routes, status codes and wire protocol as a single server (docs/PROTOCOL.md, docs/SERVICE.md);
what changes is where a session lives. Each new session is placed on the worker with the most headroom
(``app/cluster/placement.py``) and pinned there for its life; REST and re-attach for its id go to that
worker (``app/cluster/table.py``); its media is encoded on the worker and relayed as bytes
(``app/cluster/relay.py``). When a worker is lost, only its sessions end — each relayed client gets
``closed`` ``failed`` — and the pool starts it again.

The front end checks origin and token itself (before accept, as a single server does) and passes the
client's credentials on, so sessions keep their owners; a worker answers only requests that carry the
front end's secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any

from fastapi import Request, Response, WebSocket

from app.cluster.metrics import FrontEndMetrics, FrontEndView, WorkerView
from app.cluster.placement import WorkerLoad, placement_order
from app.cluster.pool import WorkerEndpoint, WorkerPool
from app.cluster.relay import (
    Proxied,
    SocketLimits,
    StreamRelay,
    WorkerHttp,
    WorkerUnreachable,
    first_answer,
    forwarded_headers,
    open_upstream,
)
from app.cluster.table import SessionTable
from app.schemas import CreateSessionRequest, PromptRequest, SessionList
from app.security import Caller
from app.settings import Settings
from app.transport.refusal import (
    UNAVAILABLE_RETRY_AFTER_S,
    Refusal,
    every_worker_refused,
    no_worker_ready,
    not_ready,
    table_full,
    too_many_sessions,
    worker_full,
    worker_silent,
)
from app.transport.rest import ApiError
from app.transport.websocket import admit_socket, refuse_socket, refuse_unknown_session, socket_pace
from engine.status import NotReady

log = logging.getLogger("arstream.cluster")

CAPACITY_TIMEOUT_S = 2.0
UNANSWERED_POLLS = 3


class FrontEnd:
    """The running front end: its pool, the workers' last capacity answers, the session table, the relays."""

    def __init__(self, settings: Settings, pool: WorkerPool, secret: str) -> None:
        self.settings = settings
        self.cluster = settings.cluster
        self.pool = pool
        self.secret = secret
        self.metrics = FrontEndMetrics()
        self.table = SessionTable(self.cluster.max_tracked_sessions, settings.closed_retention_s)
        self.http = WorkerHttp(secret, self.cluster.proxy_timeout_s, self.cluster.max_proxied_body_bytes)
        self.socket_limits = SocketLimits(
            open_timeout_s=self.cluster.proxy_timeout_s,
            max_message_bytes=self.cluster.max_relay_message_bytes,
            queue_messages=self.cluster.relay_queue_messages,
            receive_buffer_bytes=settings.send_buffer_bytes,
        )
        self.loads: dict[str, WorkerLoad] = {}
        self.relays: set[StreamRelay] = set()
        self.draining = False
        self.exit_code = 0
        self._seen: dict[str, tuple[int, int]] = {}  # worker name -> (first generation seen, latest)
        self._lost: dict[str, int] = {}
        self._placed: dict[str, int] = {}
        self._unanswered: dict[str, int] = {}  # worker name -> capacity polls in a row it did not answer
        self._tasks: set[asyncio.Task] = set()
        self._drain: asyncio.Task | None = None

    # --- lifetime -------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.pool.on_worker_lost(self._worker_lost)
        await self.pool.start()
        self._note_generations(self.endpoints())
        self._spawn(self._poll_capacity(), "arstream-capacity")
        self._spawn(self._reconcile_sessions(), "arstream-reconcile")
        log.info("front end started")

    async def drain(self) -> None:
        """Shut down once: refuse new work, stop the workers (each drains its own sockets: relayed clients get
        ``closed`` ``draining`` and 1001 from them), wait for the relays, close."""
        if self._drain is None:
            self._drain = asyncio.get_running_loop().create_task(self._drain_once(), name="arstream-drain")
        await asyncio.shield(self._drain)

    async def _drain_once(self) -> None:
        self.draining = True
        log.info("draining", extra={"sockets": len(self.relays), "sessions": len(self.table)})
        for task in list(self._tasks):
            task.cancel()
        await self.pool.stop()
        waiting = [asyncio.ensure_future(relay.finished.wait()) for relay in list(self.relays)]
        if waiting:
            _, pending = await asyncio.wait(waiting, timeout=self.settings.drain_timeout_s)
            for task in pending:
                task.cancel()
        await self.http.aclose()
        log.info("drained")

    def _spawn(self, coroutine: Coroutine, name: str | None = None) -> None:
        if self.draining:  # the workers are stopping and the HTTP client closes: nothing more to ask them
            coroutine.close()
            return
        task = asyncio.get_running_loop().create_task(coroutine, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --- workers --------------------------------------------------------------------------------------
    def endpoints(self) -> dict[str, WorkerEndpoint]:
        """The workers running now, by name."""
        return {endpoint.name: endpoint for endpoint in self.pool.endpoints()}

    def _note_generations(self, endpoints: dict[str, WorkerEndpoint]) -> None:
        """Remember each worker's first and latest generation (its restarts, for /metrics)."""
        for name, endpoint in endpoints.items():
            first, _ = self._seen.get(name, (endpoint.generation, endpoint.generation))
            self._seen[name] = (first, endpoint.generation)

    def endpoint_of(self, worker: str, generation: int) -> WorkerEndpoint | None:
        endpoint = self.endpoints().get(worker)
        return endpoint if endpoint is not None and endpoint.generation == generation else None

    def owner_of(self, session_id: str) -> WorkerEndpoint | None:
        """The running worker a session lives on (None: unknown id, or its worker's generation is gone)."""
        entry = self.table.lookup(session_id)
        return self.endpoint_of(entry.worker, entry.generation) if entry is not None else None

    def current_loads(self) -> list[WorkerLoad]:
        endpoints = self.endpoints()
        return [load for name, load in self.loads.items()
                if name in endpoints and endpoints[name].generation == load.generation]

    @property
    def ready(self) -> bool:
        return self.not_ready_reason() is None

    def not_ready_reason(self) -> str | None:
        if self.draining:
            return "draining"
        if not any(load.ready for load in self.current_loads()):
            return "no engine worker is ready"
        return None

    async def refresh(self, endpoint: WorkerEndpoint) -> None:
        """Read one worker's capacity now (placement and /metrics use the last answer). A worker that does not
        answer keeps its last answer for ``UNANSWERED_POLLS`` polls (one slow answer on a busy machine must not
        flip readiness; a dead worker is noticed by its exit, not here), then counts as not ready."""
        try:
            answer = await self.http.call(endpoint, "GET", "/internal/capacity", timeout_s=CAPACITY_TIMEOUT_S)
            load = WorkerLoad.from_answer(endpoint.name, endpoint.generation, answer.json())
            if answer.status != 200:
                load = replace(load, ready=False, admitting=False)
            self._unanswered.pop(endpoint.name, None)
        except WorkerUnreachable:
            unanswered = self._unanswered[endpoint.name] = self._unanswered.get(endpoint.name, 0) + 1
            previous = self.loads.get(endpoint.name)
            if previous is not None and previous.generation == endpoint.generation and unanswered < UNANSWERED_POLLS:
                return  # keep the last answer a little longer
            load = WorkerLoad(endpoint.name, endpoint.generation, ready=False, admitting=False, live_sessions=0,
                              live_headroom=None, slots_free=0, utilisation=0.0, open_sessions=0)
        if self.endpoint_of(endpoint.name, endpoint.generation) is not None:
            self.loads[endpoint.name] = load

    async def _poll_capacity(self) -> None:
        while True:
            endpoints = self.endpoints()
            self._note_generations(endpoints)
            await asyncio.gather(*(self.refresh(e) for e in endpoints.values()), return_exceptions=True)
            await asyncio.sleep(self.cluster.capacity_poll_s)

    async def _reconcile_sessions(self) -> None:
        """Forget ids whose worker forgot them while no socket was relayed (grace periods, idle timeouts)."""
        headers = {}
        if self.settings.token is not None:  # with one configured token, its holder sees every session
            headers["authorization"] = f"Bearer {self.settings.token.get_secret_value()}"
        while True:
            await asyncio.sleep(self.cluster.reconcile_s)
            try:
                await self._reconcile_once(headers)
            except Exception:
                log.exception("session reconcile failed")

    async def _reconcile_once(self, headers: dict[str, str]) -> None:
        self.table.sweep()
        current = self.endpoints()
        self.table.retain_generations({name: e.generation for name, e in current.items()})
        for endpoint in list(current.values()):
            since = time.monotonic()
            try:
                answer = await self.http.call(endpoint, "GET", "/v1/sessions", headers=headers)
            except WorkerUnreachable:
                continue
            if answer.status == 200:
                listed = answer.json().get("sessions") or []
                states = {s.get("session_id"): s.get("state") for s in listed if isinstance(s, dict)}
                self.table.reconcile(endpoint.name, endpoint.generation, states, since)

    def _worker_lost(self, endpoint: WorkerEndpoint) -> None:
        """Only that worker's sessions end: its relayed clients get ``closed`` ``failed``, its ids are forgotten."""
        self.loads.pop(endpoint.name, None)
        forgotten = self.table.forget_worker(endpoint.name, endpoint.generation)
        relays = [relay for relay in self.relays if relay.endpoint == endpoint]
        for relay in relays:
            relay.lose()
        self._lost[endpoint.name] = self._lost.get(endpoint.name, 0) + 1
        log.warning("worker lost", extra={"worker": endpoint.name, "generation": endpoint.generation,
                                          "session_ids": len(forgotten), "sockets": len(relays)})

    def _placed_on(self, endpoint: WorkerEndpoint, session_id: str, address: str, via: str) -> None:
        if self.endpoint_of(endpoint.name, endpoint.generation) is None:
            self.table.cancel()  # the worker was lost while it answered: the session is gone with it
            return
        self.table.add(session_id, endpoint.name, endpoint.generation, address)
        self._placed[endpoint.name] = self._placed.get(endpoint.name, 0) + 1
        load = self.loads.get(endpoint.name)
        if load is not None and load.generation == endpoint.generation:
            self.loads[endpoint.name] = load.after_placement()  # until its next answer: spread what comes next
        log.info("session placed", extra={"session_id": session_id, "worker": endpoint.name,
                                          "generation": endpoint.generation, "via": via})
        self._spawn(self.refresh(endpoint))

    def _placement(self) -> list[WorkerEndpoint]:
        endpoints = self.endpoints()
        return [endpoints[load.name] for load in placement_order(self.current_loads())]

    def _check_client_limit(self, caller: Caller) -> str | None:
        limit = self.settings.max_sessions_per_client
        if limit is None:
            return None
        held = self.table.open_sessions_of(caller.address)
        return f"this client already holds {held} open sessions (limit {limit})" if held >= limit else None

    # --- placing a new session: one flow for REST and the socket -----------------------------------------
    async def _place(self, caller: Caller, via: str,
                     ask: Callable[[WorkerEndpoint], Awaitable[Attempt | None]]) -> Placement:
        """Reserve a table entry, ask the ready workers in placement order until one admits (``ask``: one
        worker's answer, None when it did not answer), and give the reservation back unless one did. The
        session is refused exactly when every ready worker refuses it; a refusal is decided here, once, and
        each transport words it (``app/transport/refusal.py``)."""
        too_many = self._check_client_limit(caller)
        if too_many is not None:
            return Placement(refusal=too_many_sessions(too_many))
        if not self.table.reserve():
            return Placement(refusal=table_full())
        placed = False
        try:
            refusals: list[Refusal] = []
            for endpoint in self._placement():
                attempt = await ask(endpoint)
                if attempt is None:
                    continue
                if attempt.session_id is not None:
                    self._placed_on(endpoint, attempt.session_id, caller.address, via)
                    placed = True
                    return Placement(endpoint=endpoint, attempt=attempt)
                if attempt.final:
                    return Placement(endpoint=endpoint, attempt=attempt)
                refusals.append(attempt.refusal)
                self._spawn(self.refresh(endpoint))
            if not refusals:
                return Placement(refusal=no_worker_ready())
            self.metrics.placement_refusals += 1
            return Placement(refusal=every_worker_refused(refusals))
        finally:
            if not placed:
                self.table.cancel()

    # --- REST -----------------------------------------------------------------------------------------
    async def create_session(self, request: Request, caller: Caller, body: CreateSessionRequest) -> Response:
        """On the first worker in placement order that admits it; the worker's own answer comes back."""
        if self.draining:
            raise ApiError.refused(not_ready(NotReady.DRAINING))
        raw = await request.body()  # validated as ``body`` already; passed on byte for byte

        async def ask(endpoint: WorkerEndpoint) -> Attempt | None:
            try:
                answer = await self.http.call(endpoint, "POST", "/v1/sessions", headers=forwarded_headers(request),
                                              body=raw)
            except WorkerUnreachable:
                return None
            return _rest_attempt(answer, answer.json().get("session_id") if answer.status == 201 else None)

        placement = await self._place(caller, "rest", ask)
        if placement.attempt is not None:
            return proxied_response(placement.attempt.answer)
        raise ApiError.refused(placement.refusal)

    # --- WebRTC: the worker that admits the session answers the offer (its host candidates: one host) -----
    async def create_peer(self, request: Request, caller: Caller, pace: bool) -> Response:
        """As ``create_session``: the first worker that admits it answers the offer (its host candidates)."""
        if self.draining:
            raise ApiError.refused(not_ready(NotReady.DRAINING))
        raw = await request.body()
        path = "/v1/webrtc" if pace else "/v1/webrtc?pace=false"

        async def ask(endpoint: WorkerEndpoint) -> Attempt | None:
            try:
                answer = await self.http.call(endpoint, "POST", path, headers=forwarded_headers(request), body=raw)
            except WorkerUnreachable:
                return None
            return _rest_attempt(answer, answer.headers.get("x-session-id") if answer.status == 201 else None)

        placement = await self._place(caller, "webrtc", ask)
        if placement.attempt is not None:
            return proxied_response(placement.attempt.answer)
        raise ApiError.refused(placement.refusal)

    async def attach_peer(self, request: Request, caller: Caller, session_id: str) -> Response:
        return await self._forward(request, session_id, "POST", "/webrtc", await request.body())

    async def list_sessions(self, request: Request, caller: Caller) -> SessionList:
        """Every worker's list (each shows only the caller's sessions when a token is configured)."""
        headers = forwarded_headers(request)
        calls = [self.http.call(e, "GET", "/v1/sessions", headers=headers) for e in self.endpoints().values()]
        sessions: list[dict] = []
        for answer in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(answer, Proxied) and answer.status == 200:
                sessions.extend(s for s in answer.json().get("sessions") or [] if isinstance(s, dict))
        return SessionList.model_validate({"sessions": sessions})

    async def session_detail(self, request: Request, caller: Caller, session_id: str) -> Response:
        return await self._forward(request, session_id, "GET")

    async def control(self, request: Request, caller: Caller, session_id: str, control: str,
                      body: PromptRequest | None = None) -> Response:
        raw = await request.body() if body is not None else None
        return await self._forward(request, session_id, "POST", f"/{control}", raw)

    async def delete_session(self, request: Request, caller: Caller, session_id: str) -> Response:
        return await self._forward(request, session_id, "DELETE")

    async def _forward(self, request: Request, session_id: str, method: str, suffix: str = "",
                       body: bytes | None = None) -> Response:
        """A REST call for one session, to the worker it lives on."""
        endpoint = self.owner_of(session_id)
        if endpoint is None:
            raise ApiError(404, "unknown_session", "unknown session")
        try:
            answer = await self.http.call(endpoint, method, f"/v1/sessions/{session_id}{suffix}",
                                          headers=forwarded_headers(request), body=body)
        except WorkerUnreachable:
            if self.endpoint_of(endpoint.name, endpoint.generation) is None:
                raise ApiError(404, "unknown_session", "unknown session") from None
            raise ApiError.from_code("unavailable", "the session's engine worker did not answer",
                                     UNAVAILABLE_RETRY_AFTER_S) from None
        if answer.status == 404 or (method == "DELETE" and answer.status == 204):
            self.table.forget(session_id)
        return proxied_response(answer)

    # --- sockets --------------------------------------------------------------------------------------
    async def _admitted(self, websocket: WebSocket) -> Caller | None:
        """The socket's caller once origin and token pass and the front end is not draining (else refused)."""
        caller = await admit_socket(websocket, self)
        if caller is not None and self.draining:
            await refuse_socket(websocket, self, not_ready(NotReady.DRAINING))
            return None
        return caller

    async def create_stream(self, websocket: WebSocket) -> None:
        """``WS /v1/stream``: the worker that admits it creates the session; every socket byte is relayed."""
        caller = await self._admitted(websocket)
        if caller is None:
            return
        pace = await socket_pace(websocket, self)
        if pace is None:
            return
        path = "/v1/stream" if pace else "/v1/stream?pace=false"

        async def ask(endpoint: WorkerEndpoint) -> Attempt | None:
            try:
                upstream = await open_upstream(endpoint, path, websocket, secret=self.secret,
                                               limits=self.socket_limits)
            except WorkerUnreachable:
                return None
            opening = await first_answer(upstream, self.cluster.proxy_timeout_s)
            if opening.session_id is None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(upstream.close(), 2.0)
                return Attempt(refusal=worker_full(retry_after_s=opening.retry_after_s))
            return Attempt(session_id=opening.session_id, answer=(upstream, opening.session_text))

        placement = await self._place(caller, "websocket", ask)
        if placement.attempt is not None:
            upstream, first = placement.attempt.answer
            await self._relay(websocket, upstream, placement.endpoint, placement.attempt.session_id, first)
        else:
            await refuse_socket(websocket, self, placement.refusal)

    async def attach_stream(self, websocket: WebSocket, session_id: str) -> None:
        """``WS /v1/sessions/{id}/stream``: to the worker the session lives on (4404 when none has it)."""
        if await self._admitted(websocket) is None:
            return
        endpoint = self.owner_of(session_id)
        upstream = None
        if endpoint is not None:
            try:
                upstream = await open_upstream(endpoint, f"/v1/sessions/{session_id}/stream", websocket,
                                               secret=self.secret, limits=self.socket_limits)
            except WorkerUnreachable:
                if self.endpoint_of(endpoint.name, endpoint.generation) is not None:
                    await refuse_socket(websocket, self, worker_silent())
                    return
        if endpoint is None or upstream is None:
            await refuse_unknown_session(websocket, self)
            return
        await self._relay(websocket, upstream, endpoint, session_id, None)

    async def _relay(self, websocket: WebSocket, upstream, endpoint: WorkerEndpoint, session_id: str,
                     first: str | None) -> None:
        relay = StreamRelay(
            websocket, upstream, endpoint, session_id,
            on_ended=self.table.ended, on_unknown=self.table.forget, on_bytes=self._count_media,
            is_current=lambda: self.endpoint_of(endpoint.name, endpoint.generation) is not None,
            on_failed=self._count_failed_by_loss,
        )
        self.relays.add(relay)
        self.metrics.connections_open += 1
        self.metrics.connections_total += 1
        try:
            await relay.run(first)
        finally:
            self.relays.discard(relay)
            self.metrics.connections_open -= 1
            if self.endpoint_of(endpoint.name, endpoint.generation) is not None:
                self._spawn(self.refresh(endpoint))

    def _count_failed_by_loss(self) -> None:
        # Counted by the relay that ends its client, not when the pool reports the loss: a relay may find
        # its worker's generation gone (and finish) before the pool's callback runs.
        self.metrics.failed_by_worker_loss += 1

    def _count_media(self, size: int) -> None:
        self.metrics.media_bytes_relayed += size

    # --- metrics --------------------------------------------------------------------------------------
    def render_metrics(self) -> bytes:
        """The front end's counts and each worker's capacity (``worker`` label); no session ids."""
        return self.metrics.render(self.view())

    def view(self) -> FrontEndView:
        endpoints = self.endpoints()
        loads = {load.name: load for load in self.current_loads()}
        workers = []
        for name in sorted(self._seen):
            load = loads.get(name)
            first, latest = self._seen[name]
            workers.append(WorkerView(
                name=name,
                up=name in endpoints,
                ready=load is not None and load.ready,
                admitting=load is not None and load.admitting,
                generation=latest,
                restarts=latest - first,
                lost=self._lost.get(name, 0),
                live_sessions=load.live_sessions if load else 0,
                open_sessions=load.open_sessions if load else 0,
                live_headroom=load.live_headroom if load else None,
                slots_free=load.slots_free if load else 0,
                utilisation=load.utilisation if load else 0.0,
                placed=self._placed.get(name, 0),
            ))
        return FrontEndView(ready=self.ready, draining=self.draining, tracked_sessions=len(self.table),
                            workers=workers)


@dataclass(frozen=True)
class Attempt:
    """One worker's answer to placing a new session."""

    session_id: str | None = None  # admitted: the id it created
    refusal: Refusal | None = None  # refused for room (with when it expects some)
    final: bool = False  # refused for what was asked: the same on any worker
    answer: Any = None  # what the caller passes on (the worker's HTTP answer, the upstream socket)


def _rest_attempt(answer, session_id: object) -> Attempt:
    """A worker's REST answer to a new session (``session_id``: the id it created, read from its answer)."""
    if isinstance(session_id, str):
        return Attempt(session_id=session_id, answer=answer)
    if answer.status != 503:  # refused for what it asked (400, 409, 413, ...): the same on any worker
        return Attempt(final=True, answer=answer)
    error = answer.error
    return Attempt(refusal=worker_full(error.get("code"), error.get("message"), answer.retry_after_s))


@dataclass(frozen=True)
class Placement:
    """Where a new session went: admitted (or finally refused) by ``endpoint``, or refused (``refusal``)."""

    endpoint: WorkerEndpoint | None = None
    attempt: Attempt | None = None
    refusal: Refusal | None = None


def proxied_response(answer: Proxied) -> Response:
    return Response(answer.body, status_code=answer.status, headers=answer.headers)


def new_internal_secret() -> str:
    return secrets.token_urlsafe(32)
