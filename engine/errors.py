"""Typed results and errors of the engine API; codes are the wire protocol's."""

from __future__ import annotations

from dataclasses import dataclass


class EngineError(Exception):
    """A request the engine refuses; ``code`` is the protocol error code."""

    code = "internal"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UnknownSession(EngineError):
    code = "unknown_session"


class SessionClosed(EngineError):
    code = "session_closed"


class AlreadyStarted(EngineError):
    code = "already_started"


class NotStarted(EngineError):
    code = "not_started"


class InvalidRequest(EngineError):
    code = "invalid_field"


class PromptTooLong(InvalidRequest):
    code = "prompt_too_long"


class NotLive(EngineError):
    """A live frame for a session whose live input is off (the socket answers it as any unexpected binary)."""

    code = "bad_json"


class InputUnsupported(EngineError):
    """Image, clip or live input on an engine whose video codec cannot encode (a decode-only TAEHV)."""

    code = "input_unsupported"


class TooManyControls(EngineError):
    """A session's controls arrive faster than ticks apply them."""

    code = "rate_limited"


class NoRealtimeCapacity(EngineError):
    """A session switching to pacing on at ``start`` would make the live sessions fall behind real time."""

    code = "capacity"


class EngineUnavailable(EngineError):
    """The engine is not ready, is draining, or is dead."""

    code = "internal"


@dataclass(frozen=True)
class CapacityFull:
    """Admission refused: every memory slot, or the device's time for live sessions, is taken.

    ``retry_after_s``: when the soonest blocking session must end on its own (a detached one's grace
    period, an idle one's timeout, anyone's maximum duration), clamped to [one block, 60 s].
    """

    retry_after_s: float
    message: str = "all session slots are in use; try again later"
    live_capacity: int | None = None  # for a refusal on time: the live sessions the device keeps, as decided
