"""Why a caller gets no session, decided once and worded by each transport.

A :class:`Refusal` names the refusal in no transport's terms; each transport renders it its own way:

    REST      ``ApiError``: the status of ``code`` (503, 429), ``{"error": {code, message}}``, ``Retry-After``
              (``app/transport/rest.py``)
    socket    ``error`` (unless ``closed`` says it all), ``closed`` ``reason`` (+ ``retry_after_s``) and the
              reason's close code (``app/transport/websocket.py`` ``refuse_socket``)

A single server and a front end build refusals here, so a client is refused alike by either:

    refusal                           reason    code           retry_after_s
    engine warming up                 capacity  unavailable    5
    draining                          draining  unavailable    5 (a socket's ``closed``: ``drain_timeout_s``)
    engine dead or failed to start    failed    unavailable    5 (a socket's ``closed``: none)
    no session slot or device time    capacity  capacity       the engine's estimate
    too many sessions for a client    capacity  rate_limited   1
    too many WebRTC peers for one     capacity  rate_limited   1
    a front end's table full          capacity  capacity       1
    no engine worker ready            capacity  unavailable    5
    every ready worker refused        capacity  the worker's   the soonest any worker said (at least 1)
    the session's worker silent       capacity  capacity       1

A socket hears ``error`` first unless ``closed`` says it all (``draining``, or the code ``capacity``); to a
socket, ``unavailable`` is ``internal`` (docs/PROTOCOL.md has no ``unavailable`` on the socket).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from engine.errors import CapacityFull
from engine.status import NotReady

UNAVAILABLE_RETRY_AFTER_S = 5  # warming up, draining, no worker answering
PER_CLIENT_RETRY_AFTER_S = 1.0  # too many sessions for one client, a full front-end table


@dataclass(frozen=True)
class Refusal:
    """A caller refused a session. ``reason``: the ``closed`` reason a socket is told (``capacity``,
    ``draining``, ``failed``); ``code``: the protocol error code (REST answers with it and its status);
    ``retry_after_s``: when trying again may succeed (None: the transport's own rule)."""

    reason: str
    code: str
    message: str
    retry_after_s: float | None = None


def not_ready(reason: NotReady) -> Refusal:
    """The engine (a front end: the front end itself) serves no new session now."""
    if reason is NotReady.DRAINING:
        return Refusal("draining", "unavailable", "the server is draining", UNAVAILABLE_RETRY_AFTER_S)
    if reason.final:  # the engine's own reason goes to the log only
        return Refusal("failed", "unavailable", "the engine is not available", UNAVAILABLE_RETRY_AFTER_S)
    return Refusal("capacity", "unavailable", "the engine is warming up; try again later", UNAVAILABLE_RETRY_AFTER_S)


def capacity_full(refusal: CapacityFull) -> Refusal:
    """The engine's admission refused: every slot, or the device's time for live sessions, is taken."""
    return Refusal("capacity", "capacity", refusal.message, refusal.retry_after_s)


def too_many_sessions(message: str) -> Refusal:
    """The caller's address holds ``max_sessions_per_client`` open sessions already."""
    return Refusal("capacity", "rate_limited", message, PER_CLIENT_RETRY_AFTER_S)


def too_many_peers(held: int, limit: int) -> Refusal:
    """The caller's address holds (or is negotiating) ``max_peers_per_client`` WebRTC peer connections."""
    return Refusal("capacity", "rate_limited", f"this client already holds {held} peer connections (limit {limit})",
                   PER_CLIENT_RETRY_AFTER_S)


def table_full() -> Refusal:
    """A front end routes as many sessions as its table may hold."""
    return Refusal("capacity", "capacity", "the front end routes as many sessions as it may; try again later",
                   PER_CLIENT_RETRY_AFTER_S)


def no_worker_ready() -> Refusal:
    """A front end has no engine worker ready to ask."""
    return Refusal("capacity", "unavailable", "no engine worker is ready; try again later", UNAVAILABLE_RETRY_AFTER_S)


def worker_silent() -> Refusal:
    """The worker a session lives on did not answer a socket attaching to it (it may again soon)."""
    return Refusal("capacity", "capacity", "the session's engine worker did not answer; try again later",
                   PER_CLIENT_RETRY_AFTER_S)


def worker_full(code: object = "capacity", message: object = None, retry_after_s: float | None = None) -> Refusal:
    """One engine worker refused a new session for room, as a front end read its answer (``code``: ``capacity``,
    or ``unavailable`` from a worker that stopped being ready since it was last asked)."""
    return Refusal("capacity", code if code in ("capacity", "unavailable") else "capacity",
                   message if isinstance(message, str) else "the engine worker has no room; try again later",
                   retry_after_s)


def every_worker_refused(refusals: Sequence[Refusal]) -> Refusal:
    """Every ready worker refused a new session: the refusal of the one that expects room soonest, retried no
    sooner than 1 s; when none said when, the first one's, retried after ``UNAVAILABLE_RETRY_AFTER_S``."""
    known = [r for r in refusals if r.retry_after_s is not None and math.isfinite(r.retry_after_s)]
    if not known:
        return replace(refusals[0], retry_after_s=UNAVAILABLE_RETRY_AFTER_S)
    soonest = min(known, key=lambda r: r.retry_after_s)
    return replace(soonest, retry_after_s=max(1.0, soonest.retry_after_s))
