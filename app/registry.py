"""The service's session table: who owns each session, which socket is attached, and the controls.

The engine knows sessions; the service adds what only it knows: the caller that created a session
(for listing and per-client limits), the one socket attached to it (a second one replaces the first),
a start deferred until a socket attaches (REST create with a prompt), and how long a closed session
stays visible. Socket and REST controls both go through here, so they behave the same.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from app.schemas import SessionOptions
from app.security import Caller, TokenBucket
from app.settings import Settings
from engine.api import Engine, SessionStatus
from engine.errors import CapacityFull, EngineError, InvalidRequest, SessionClosed, UnknownSession
from engine.session import Session, SessionState

if TYPE_CHECKING:
    from app.streaming import StreamConnection

log = logging.getLogger("arstream.sessions")


class TooManySessions(EngineError):
    """The caller's address already holds ``max_sessions_per_client`` open sessions."""

    code = "rate_limited"


@dataclass(frozen=True)
class DeferredStart:
    """A REST create with a prompt: generation starts when a socket attaches, not before."""

    prompt: str
    seed: int | None
    options: SessionOptions


@dataclass
class SessionRecord:
    session: Session  # the engine's record; kept here so a socket can read why it ended after forget()
    owner: str | None
    address: str
    rest_bucket: TokenBucket
    deferred_start: DeferredStart | None = None
    connection: StreamConnection | None = None
    closed_seen_at: float | None = None

    @property
    def session_id(self) -> str:
        return self.session.session_id


@dataclass(frozen=True)
class Attachment:
    session: Session
    start_pts: int  # the next chunk's first frame: where this socket's media timeline begins
    audio_start: int = 0  # the next chunk's first audio sample on the session timeline


@dataclass
class SessionRegistry:
    engine: Engine
    settings: Settings
    records: dict[str, SessionRecord] = field(default_factory=dict)

    # --- lifetime ---------------------------------------------------------------------------------
    def create(
        self, caller: Caller, *, prompt: str | None = None, seed: int | None = None,
        options: SessionOptions | None = None, via: str,
    ) -> SessionRecord | CapacityFull:
        """A new session in ``created``; with a prompt, it starts when a socket attaches."""
        options = options or SessionOptions()
        self._check_options(options)
        limit = self.settings.max_sessions_per_client
        if limit is not None:
            held = sum(1 for r in self.records.values() if r.address == caller.address and r.session.is_open)
            if held >= limit:
                raise TooManySessions(f"this client already holds {held} open sessions (limit {limit})")
        session = self.engine.create_session(
            seed=seed, negative_prompt=options.negative_prompt or "", pace=options.pace
        )
        if isinstance(session, CapacityFull):
            log.info("session refused", extra={"reason": "capacity", "via": via})
            return session
        record = SessionRecord(
            session=session,
            owner=caller.principal,
            address=caller.address,
            rest_bucket=TokenBucket(self.settings.control_rate_per_s, self.settings.control_burst),
            deferred_start=DeferredStart(prompt, seed, options) if prompt is not None else None,
        )
        self.records[session.session_id] = record
        log.info("session created", extra={"session_id": session.session_id, "via": via, "pace": options.pace})
        return record

    def get(self, session_id: str) -> SessionRecord:
        record = self.records.get(session_id)
        if record is None:
            raise UnknownSession("unknown session")
        return record

    def status(self, session_id: str) -> SessionStatus:
        self.get(session_id)
        return self.engine.status(session_id)

    def visible(self, caller: Caller) -> list[SessionRecord]:
        """With auth on, only the caller's sessions; without it, all of them."""
        return [r for r in self.records.values() if caller.principal is None or r.owner == caller.principal]

    async def attach(self, session_id: str, connection: StreamConnection) -> Attachment:
        """Attach ``connection``; a socket already attached is replaced (it is told ``replaced``) first."""
        record = self.get(session_id)
        while record.connection is not None and record.connection is not connection:
            previous = record.connection
            await previous.replace()  # returns once it no longer consumes chunks
            if record.connection is previous:
                record.connection = None
        if not record.session.is_open:
            raise SessionClosed(f"session is closed ({record.session.close_reason})")
        # From here to the return nothing awaits: the engine's attach and the timeline start agree.
        session = self.engine.attach(session_id)
        record.connection = connection
        if record.deferred_start is not None:
            deferred, record.deferred_start = record.deferred_start, None
            self.start(session_id, deferred.prompt, deferred.seed, deferred.options)
        status = self.engine.status(session_id)
        return Attachment(session=session, start_pts=status.frames, audio_start=status.audio_samples)

    def detach(self, session_id: str, connection: StreamConnection) -> None:
        """The socket went away: the session waits the engine's grace period for a reconnect."""
        record = self.records.get(session_id)
        if record is None or record.connection is not connection:
            return
        record.connection = None
        self.engine.detach(session_id)

    def delete(self, session_id: str) -> None:
        """Close now and forget at once (GET answers 404); an attached socket is still told ``closed``."""
        self.get(session_id)
        self.engine.close(session_id, "client")
        self.engine.forget(session_id)
        del self.records[session_id]
        log.info("session deleted", extra={"session_id": session_id})

    def sweep(self, now: float | None = None) -> None:
        """Forget closed sessions no socket still reports on, once they were visible for the retention time."""
        now = time.monotonic() if now is None else now
        for session_id, record in list(self.records.items()):
            if record.session.is_open or record.connection is not None:
                continue
            if record.closed_seen_at is None:
                record.closed_seen_at = now
            if now - record.closed_seen_at >= self.settings.closed_retention_s:
                self.engine.forget(session_id)
                del self.records[session_id]

    # --- controls: each returns the new state when it changed, for the caller to announce ------------
    def start(self, session_id: str, prompt: str, seed: int | None, options: SessionOptions | None) -> str:
        record = self.get(session_id)
        if options is not None:
            self._check_options(options)
        self.engine.start_session(
            session_id,
            prompt,
            seed=seed,
            negative_prompt=options.negative_prompt if options is not None else None,
            pace=options.pace if options is not None else None,
        )
        log.info(
            "session started",
            extra={"session_id": session_id, "prompt_length": len(prompt), "pace": record.session.pace},
        )
        return "active"

    def set_prompt(self, session_id: str, prompt: str, policy: str) -> None:
        self.get(session_id)
        self.engine.set_prompt(session_id, prompt, policy)
        log.info("prompt changed", extra={"session_id": session_id, "prompt_length": len(prompt), "policy": policy})

    def pause(self, session_id: str) -> str | None:
        record = self.get(session_id)
        was = record.session.state
        self.engine.pause(session_id)
        return "paused" if was is not SessionState.PAUSED else None

    def resume(self, session_id: str) -> str | None:
        record = self.get(session_id)
        was = record.session.state
        self.engine.resume(session_id)
        return "active" if was is SessionState.PAUSED else None

    def reset(self, session_id: str) -> None:
        self.get(session_id)
        self.engine.reset(session_id)
        log.info("session reset", extra={"session_id": session_id})

    def close(self, session_id: str, reason: str = "client") -> None:
        self.get(session_id)
        self.engine.close(session_id, reason)

    def announce(self, session_id: str, state: str | None, reason: str | None = None) -> None:
        """Tell the attached socket (if any) about a state change made elsewhere (REST)."""
        record = self.records.get(session_id)
        if state is not None and record is not None and record.connection is not None:
            record.connection.post_state(state, reason)

    def _check_options(self, options: SessionOptions) -> None:
        configured = self.engine.config.guidance_scale
        if options.guidance is not None and abs(options.guidance - configured) > 1e-9:
            # CFG branches are fixed when the engine builds its KV pools; per-session guidance is not offered.
            raise InvalidRequest(f"options.guidance: this server runs guidance {configured:g} for every session")
