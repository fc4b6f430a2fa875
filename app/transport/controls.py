"""The v1 control messages (docs/PROTOCOL.md), applied to a session: one dispatcher for every transport that
carries them (the WebSocket, and a WebRTC peer's data channel).

    parsed client message ──▶ the registry's control ──▶ Applied: the new state to announce, extra ``ack`` fields

What a control does to a session is the engine's (``engine/controls.py``); this only routes a message to it
and says what the client is answered. Sending the ``ack`` and ``state`` is the transport's.
"""

from __future__ import annotations

from typing import NamedTuple

from app.registry import SessionRegistry
from app.schemas import (
    AnyClientMessage,
    CloseMessage,
    LiveMessage,
    PauseMessage,
    PromptMessage,
    ProtocolError,
    ResetMessage,
    ResumeMessage,
    StartMessage,
)
from engine.errors import EngineError


class Applied(NamedTuple):
    """What a client is told after its control was applied."""

    state: str | None  # the session's new state, to announce after the ``ack`` (None: unchanged)
    ack: dict  # extra ``ack`` fields: ``unknown_words`` (start, prompt), ``strength`` and ``steps`` (live)


def apply_control(registry: SessionRegistry, session_id: str, message: AnyClientMessage, context=None,
                  arrived: float | None = None) -> Applied:
    """Apply one control message to ``session_id``. ``context``: the decoded image or clip a ``start`` (frames) or
    ``reset`` (an ``InputContext``) carries; ``arrived``: when the message came in (a prompt change, reset or live
    change is followed to the screen from then, and its id named in the chunk that first shows it).

    A refusal is raised as the :class:`ProtocolError` the client is answered with."""
    try:
        applied = _dispatch(registry, session_id, message, context, arrived)
    except EngineError as error:
        # A session deleted over REST is gone from the table: to a client attached to it, it is closed.
        code = "session_closed" if error.code == "unknown_session" else error.code
        raise ProtocolError(code, error.message, message.id) from None
    if isinstance(message, (StartMessage, PromptMessage)):
        unknown = list(registry.unknown_words(message.prompt) or ()) or None
        applied = applied._replace(ack={**applied.ack, "unknown_words": unknown})
    return applied


def _dispatch(registry: SessionRegistry, session_id: str, message: AnyClientMessage, context,
              arrived: float | None) -> Applied:
    marked = {"control_id": message.id, "arrived_at": arrived}
    if isinstance(message, StartMessage):
        return Applied(registry.start(session_id, message.prompt, message.seed, message.options, context), {})
    if isinstance(message, PromptMessage):
        registry.set_prompt(session_id, message.prompt, message.policy, **marked)
        return Applied(None, {})
    if isinstance(message, PauseMessage):
        return Applied(registry.pause(session_id), {})
    if isinstance(message, ResumeMessage):
        return Applied(registry.resume(session_id), {})
    if isinstance(message, ResetMessage):
        registry.reset(session_id, context, **marked)
        return Applied(None, {})
    if isinstance(message, LiveMessage):
        used = registry.set_live(session_id, message.strength, **marked)
        return Applied(None, {} if used is None else {"strength": used[0], "steps": used[1]})
    if isinstance(message, CloseMessage):
        registry.close(session_id, "client")  # the transport then sees the session end and says `closed`
        return Applied(None, {})
    raise ProtocolError("unknown_type", f"unhandled message type {message.type}", message.id)
