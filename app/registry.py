"""The service's session table: who owns each session, which socket is attached, and the controls.

The engine owns sessions; the service keeps only what only it knows: the caller that created a session
(for listing and per-client limits), its REST rate bucket, and the one socket attached to it (a second
one replaces the first). Sessions are read as the engine's immutable snapshots. Socket and REST
controls both go through here, so they behave the same.

An ended session stays listed for ``closed_retention_s`` from the moment it ended — whatever ended it
and whether or not a socket was attached then — and is then forgotten by both the table and the engine.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from app.schemas import SessionOptions
from app.security import Caller, TokenBucket
from app.settings import Settings
from engine.api import Engine, SessionStatus
from engine.session import Chunk
from engine.status import AdmissionOutlook
from engine.errors import CapacityFull, EngineError, InvalidRequest, SessionClosed, UnknownSession
from engine.plan import InputContext

log = logging.getLogger("arstream.sessions")


class TooManySessions(EngineError):
    """The caller's address already holds ``max_sessions_per_client`` open sessions."""

    code = "rate_limited"


class AttachedSocket(Protocol):
    """What the table needs of an attached socket (``app.transport.websocket.StreamConnection``) or peer."""

    # How long before it plays the consumer needs each paced piece (None: the engine's playout_margin_s).
    playout_margin_s: float | None

    async def replace(self) -> None: ...

    def post_state(self, state: str, reason: str | None = None) -> None: ...


@dataclass(eq=False)
class RegisteredSession:
    """A session as the service knows it: whose it is, its REST rate bucket, the socket attached to it."""

    session_id: str
    owner: str | None
    address: str
    rest_bucket: TokenBucket
    engine: Engine = field(repr=False)
    connection: AttachedSocket | None = None
    _last: SessionStatus | None = field(default=None, repr=False)

    @property
    def session(self) -> SessionStatus:
        """The session's latest snapshot; once the engine forgot it, the last one taken (a socket still
        attached to a deleted session reads why it ended from here)."""
        try:
            self._last = self.engine.status(self.session_id)
        except UnknownSession:
            if self._last is None:
                raise
        return self._last

    def remember(self) -> None:
        """Take a last snapshot before the engine forgets the session."""
        self._last = self.engine.status(self.session_id)


@dataclass(frozen=True, eq=False)
class Attachment:
    record: RegisteredSession
    start_pts: int  # the next chunk's first frame: where this socket's media timeline begins
    audio_start: int = 0  # the next chunk's first audio sample on the session timeline

    @property
    def session(self) -> SessionStatus:
        return self.record.session


@dataclass
class SessionRegistry:
    engine: Engine
    settings: Settings
    registered: dict[str, RegisteredSession] = field(default_factory=dict)

    # --- lifetime ---------------------------------------------------------------------------------
    def create(
        self, caller: Caller, *, prompt: str | None = None, seed: int | None = None,
        options: SessionOptions | None = None, via: str,
    ) -> RegisteredSession | CapacityFull:
        """A new session in ``created``; with a prompt, it starts when a socket attaches."""
        options = options or SessionOptions()
        self._check_options(options)
        limit = self.settings.max_sessions_per_client
        if limit is not None:
            held = sum(1 for r in self.registered.values() if r.address == caller.address and r.session.is_open)
            if held >= limit:
                raise TooManySessions(f"this client already holds {held} open sessions (limit {limit})")
        status = self.engine.create_session(
            seed=seed,
            prompt=prompt,
            negative_prompt=options.negative_prompt or "",
            pace=options.pace,
            start_on_attach=True,
        )
        if isinstance(status, CapacityFull):
            log.info(
                "session refused",
                extra={"reason": "capacity", "via": via, "pace": options.pace, "live_capacity": status.live_capacity,
                       "retry_after_s": status.retry_after_s},
            )
            return status
        record = RegisteredSession(
            session_id=status.session_id,
            owner=caller.principal,
            address=caller.address,
            rest_bucket=TokenBucket(self.settings.control_rate_per_s, self.settings.control_burst),
            engine=self.engine,
        )
        self.registered[status.session_id] = record
        log.info("session created", extra={"session_id": status.session_id, "via": via, "pace": options.pace})
        return record

    def get(self, session_id: str) -> RegisteredSession:
        record = self.registered.get(session_id)
        if record is None:
            raise UnknownSession("unknown session")
        return record

    def knows(self, session_id: str) -> bool:
        return session_id in self.registered

    def status(self, session_id: str) -> SessionStatus:
        return self.get(session_id).session

    def chunks(self, session_id: str) -> AsyncIterator[Chunk]:
        """The session's chunks as the engine makes them, for the one socket attached to it."""
        return self.engine.chunks(session_id)

    def outlook(self) -> AdmissionOutlook | None:
        """Whether a live newcomer would be admitted now, and the room left (None until the engine is built)."""
        return self.engine.outlook()

    def visible(self, caller: Caller) -> list[RegisteredSession]:
        """With auth on, only the caller's sessions; without it, all of them."""
        return [r for r in self.registered.values() if caller.principal is None or r.owner == caller.principal]

    async def attach(self, session_id: str, connection: AttachedSocket) -> Attachment:
        """Attach ``connection``; a socket already attached is replaced (it is told ``replaced``) first."""
        record = self.get(session_id)
        while record.connection is not None and record.connection is not connection:
            previous = record.connection
            await previous.replace()  # returns once it no longer consumes chunks
            if record.connection is previous:
                record.connection = None
        status = record.session
        if not status.is_open:
            raise SessionClosed(f"session is closed ({status.close_reason})")
        # From here to the return nothing awaits: the engine's attach and the timeline start agree.
        status = self.engine.attach(session_id, connection.playout_margin_s)
        record.connection = connection
        return Attachment(record=record, start_pts=status.counters.frames, audio_start=status.counters.audio_samples)

    def detach(self, session_id: str, connection: AttachedSocket) -> None:
        """The socket went away: the session waits the engine's grace period for a reconnect."""
        record = self.registered.get(session_id)
        if record is None or record.connection is not connection:
            return
        record.connection = None
        self.engine.detach(session_id)

    def delete(self, session_id: str) -> None:
        """Close now and forget at once (GET answers 404); an attached socket is still told ``closed``."""
        record = self.get(session_id)
        self.engine.end(session_id, "client")
        self._forget(record)
        log.info("session deleted", extra={"session_id": session_id})

    def sweep(self, now: float | None = None) -> None:
        """Forget sessions that ended at least ``closed_retention_s`` ago, however they ended."""
        now = time.monotonic() if now is None else now
        retention = self.settings.closed_retention_s
        for record in list(self.registered.values()):
            try:
                status = record.session
            except UnknownSession:  # the engine forgot it on its own: so do we
                del self.registered[record.session_id]
                continue
            if not status.is_open and status.ended_at is not None and now - status.ended_at >= retention:
                self._forget(record)

    def _forget(self, record: RegisteredSession) -> None:
        # The socket, if one is still finishing, keeps its record and reads the last snapshot from it.
        record.remember()
        record.connection = None
        self.engine.forget(record.session_id)
        self.registered.pop(record.session_id, None)

    # --- controls: each returns the new state when it changed, for the caller to announce ------------
    def start(self, session_id: str, prompt: str, seed: int | None, options: SessionOptions | None,
              context: np.ndarray | None = None) -> str:
        """``context``: decoded frames of an image or clip to start from."""
        record = self.get(session_id)
        if options is not None:
            self._check_options(options)
        state = self.engine.start_session(
            session_id,
            prompt,
            seed=seed,
            negative_prompt=options.negative_prompt if options is not None else None,
            pace=options.pace if options is not None else None,
            context=context,
        )
        log.info(
            "session started",
            extra={"session_id": session_id, "prompt_length": len(prompt), "pace": record.session.pace,
                   "context_frames": 0 if context is None else int(context.shape[0])},
        )
        return state

    def unknown_words(self, prompt: str) -> tuple[str, ...] | None:
        """The prompt's words the model cannot read (None: it reads any text)."""
        return self.engine.unknown_words(prompt)

    def set_prompt(self, session_id: str, prompt: str, policy: str, *, control_id: str | None = None,
                   arrived_at: float | None = None) -> None:
        """``control_id``, ``arrived_at``: the client's id for the change and its arrival (monotonic), followed
        to the first frames that show it."""
        self.get(session_id)
        self.engine.set_prompt(session_id, prompt, policy, control_id=control_id, arrived_at=arrived_at)
        log.info("prompt changed", extra={"session_id": session_id, "prompt_length": len(prompt), "policy": policy})

    def pause(self, session_id: str) -> str | None:
        was = self.get(session_id).session.state
        self.engine.pause(session_id)
        return "paused" if was != "paused" else None

    def resume(self, session_id: str) -> str | None:
        was = self.get(session_id).session.state
        self.engine.resume(session_id)
        return "active" if was == "paused" else None

    def reset(self, session_id: str, context: InputContext | None = None, *, control_id: str | None = None,
              arrived_at: float | None = None) -> None:
        self.get(session_id)
        self.engine.reset(session_id, context, control_id=control_id, arrived_at=arrived_at)
        log.info("session reset", extra={"session_id": session_id, "context": _described(context)})

    # --- pictures and video in -----------------------------------------------------------------------
    def set_live(self, session_id: str, strength: float | None, *, control_id: str | None = None,
                 arrived_at: float | None = None) -> tuple[float, int] | None:
        self.get(session_id)
        used = self.engine.set_live(session_id, strength, control_id=control_id, arrived_at=arrived_at)
        log.info("live input", extra={"session_id": session_id, "strength": None if used is None else used[0]})
        return used

    def admit_frame(self, session_id: str) -> int | None:
        return self.engine.admit_input_frame(session_id)

    def push_frame(self, session_id: str, frame: np.ndarray, number: int | None = None) -> None:
        self.engine.push_input_frame(session_id, frame, number)

    def count_invalid_frame(self, session_id: str) -> None:
        self.engine.count_invalid_input(session_id)

    def close(self, session_id: str, reason: str = "client") -> None:
        self.get(session_id)
        self.engine.close(session_id, reason)

    def announce(self, session_id: str, state: str | None, reason: str | None = None) -> None:
        """Tell the attached socket (if any) about a state change made elsewhere (REST)."""
        record = self.registered.get(session_id)
        if state is not None and record is not None and record.connection is not None:
            record.connection.post_state(state, reason)

    def _check_options(self, options: SessionOptions) -> None:
        configured = self.engine.config.guidance_scale
        if options.guidance is not None and abs(options.guidance - configured) > 1e-9:
            # CFG branches are fixed when the engine builds its KV pools; per-session guidance is not offered.
            raise InvalidRequest(f"options.guidance: this server runs guidance {configured:g} for every session")


def _described(context: InputContext | None) -> str:
    """For a log line: what a reset restarts from, never its pixels."""
    if context is None:
        return "as before"
    return "prompt" if context.frames is None else f"{context.frames.shape[0]} frames"
