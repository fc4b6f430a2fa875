"""Wire schemas of protocol v1 (docs/PROTOCOL.md): socket messages both ways and REST bodies.

Every inbound model forbids unknown fields and bounds every length, so a client message is either
one of these or an ``error`` with a protocol code — never an exception that reaches the socket.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError

from engine.api import MAX_PROMPT_CHARS, MAX_SEED
from engine.errors import EngineError
from engine.prompts import check_prompt

PROTOCOL_VERSION = 1
MAX_ID_CHARS = 64
MAX_MESSAGE_CHARS = 200  # human-readable error messages we send
MAX_ECHOED_NAME_CHARS = 32  # a field name longer than this is not repeated back


def valid_unicode(text: str) -> str:
    """Refuse a string that is not valid Unicode: JSON's ``\\ud800`` escapes decode to lone surrogates,
    which no encoder (tokenizer, JSON writer, log line) accepts — caught here, not deep in the engine."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise PydanticCustomError("invalid_unicode", "not valid Unicode (a lone surrogate)") from None
    return text


def _protocol_prompt(value: str) -> str:
    """engine/prompts.py's rules (not only whitespace, valid Unicode) as a schema check: one rule for every
    entry point. Emptiness and length are the Field bounds (their errors keep their own codes)."""
    try:
        return check_prompt(value, allow_empty=True)
    except EngineError as error:
        raise PydanticCustomError("invalid_prompt", error.message) from None


Prompt = Annotated[str, Field(min_length=1, max_length=MAX_PROMPT_CHARS), AfterValidator(_protocol_prompt)]
NegativePrompt = Annotated[str, Field(max_length=MAX_PROMPT_CHARS), AfterValidator(_protocol_prompt)]
Seed = Annotated[int, Field(ge=0, le=MAX_SEED, strict=True)]
MessageId = Annotated[str, Field(max_length=MAX_ID_CHARS), AfterValidator(valid_unicode)]
PromptPolicy = Literal["soft", "recache", "reset"]
SessionState = Literal["created", "active", "paused", "detached", "closed", "draining"]
CloseReason = Literal["client", "replaced", "idle_timeout", "max_duration", "draining", "capacity", "failed", "evicted"]
ErrorCode = Literal[
    "bad_json",
    "unknown_type",
    "invalid_field",
    "prompt_too_long",
    "already_started",
    "not_started",
    "rate_limited",
    "session_closed",
    "invalid_media",
    "media_too_large",
    "input_unsupported",
    "internal",
]


class Strict(BaseModel):
    """Inbound: unknown fields refused, no coercion (``"false"`` is not a boolean, ``"1"`` not an integer)."""

    model_config = ConfigDict(extra="forbid", strict=True)


# --- client -> server ----------------------------------------------------------------------------


class SessionOptions(Strict):
    """Per-session generation options (``start.options`` and the REST create body)."""

    pace: bool = Field(default=True, description="false: generate as fast as the engine allows (batch, bench)")
    negative_prompt: NegativePrompt | None = None
    guidance: float | None = Field(
        default=None, ge=1.0, le=20.0, description="must equal the server's configured guidance scale"
    )


class ClientMessage(Strict):
    id: MessageId | None = Field(default=None, description="echoed in the ack or error that answers it")


MAX_ANNOUNCED_BYTES = 2**40  # a sanity bound for the field; the real bounds are the server's (InputLimits)


class MediaAnnouncement(Strict):
    """An image or clip whose bytes are the next message on the socket (docs/PROTOCOL.md)."""

    kind: Literal["image", "clip"]
    bytes: int = Field(ge=1, le=MAX_ANNOUNCED_BYTES, description="size of the binary message that follows")


class NoMedia(Strict):
    """``reset`` from the prompt alone (no picture follows)."""

    kind: Literal["none"]


class StartMessage(ClientMessage):
    type: Literal["start"]
    prompt: Prompt
    seed: Seed | None = None
    options: SessionOptions | None = None
    input: MediaAnnouncement | None = Field(default=None, description="an image or clip to start from")


class PromptMessage(ClientMessage):
    type: Literal["prompt"]
    prompt: Prompt
    policy: PromptPolicy = "soft"


class PauseMessage(ClientMessage):
    type: Literal["pause"]


class ResumeMessage(ClientMessage):
    type: Literal["resume"]


class ResetMessage(ClientMessage):
    type: Literal["reset"]
    input: Annotated[MediaAnnouncement | NoMedia, Field(discriminator="kind")] | None = Field(
        default=None, description="what the content restarts from; unset: the image or clip it last started from"
    )


class LiveMessage(ClientMessage):
    type: Literal["live"]
    strength: Annotated[float, Field(ge=0.0, le=1.0)] | None = Field(
        description="live input on at this strength (0: the input as the codec reproduces it, 1: ignored), or null: off"
    )


class CloseMessage(ClientMessage):
    type: Literal["close"]


CLIENT_MESSAGES: dict[str, type[ClientMessage]] = {
    "start": StartMessage,
    "prompt": PromptMessage,
    "pause": PauseMessage,
    "resume": ResumeMessage,
    "reset": ResetMessage,
    "close": CloseMessage,
    "live": LiveMessage,
}
AnyClientMessage = (
    StartMessage | PromptMessage | PauseMessage | ResumeMessage | ResetMessage | CloseMessage | LiveMessage
)


class ProtocolError(Exception):
    """A message the server answers with ``error``; ``message_id`` is echoed when it was readable."""

    def __init__(self, code: str, message: str, message_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = serialisable(message[:MAX_MESSAGE_CHARS])
        self.message_id = message_id


def serialisable(text: str) -> str:
    """``text`` with anything a UTF-8 writer would refuse escaped: an error reply must always be sendable."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def readable_id(payload: object) -> str | None:
    """The message's ``id`` if it is one we may echo (valid Unicode, at most 64 characters)."""
    if isinstance(payload, dict):
        value = payload.get("id")
        if isinstance(value, str) and len(value) <= MAX_ID_CHARS:
            try:
                return valid_unicode(value)
            except PydanticCustomError:
                return None
    return None


def _refuse_json_constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")  # NaN, Infinity: Python's json accepts them, JSON does not


def decode_client_json(text: str) -> object:
    """A client's text frame as JSON, or ``bad_json``: whatever the text (NaN, nesting deeper than Python's
    recursion limit, an integer over its 4300-digit limit), the one way every reader of client text decodes it."""
    try:
        return json.loads(text, parse_constant=_refuse_json_constant)
    except (ValueError, RecursionError):
        raise ProtocolError("bad_json", "the message is not valid JSON") from None


def parse_client_message(text: str) -> AnyClientMessage:
    """One text frame -> a validated message, or :class:`ProtocolError` with the protocol's code."""
    payload = decode_client_json(text)
    if not isinstance(payload, dict):
        raise ProtocolError("bad_json", "a message is a JSON object with a 'type'")
    message_id = readable_id(payload)
    if _has_invalid_key(payload):
        raise ProtocolError("invalid_field", "<field>: a field name is not valid Unicode", message_id)
    kind = payload.get("type")
    model = CLIENT_MESSAGES.get(kind) if isinstance(kind, str) else None
    if model is None:
        known = ", ".join(CLIENT_MESSAGES)
        raise ProtocolError("unknown_type", f"'type' must be one of: {known}", message_id)
    try:
        return model.model_validate(payload)
    except ValidationError as error:
        raise validation_to_protocol_error(error, message_id) from None


def _has_invalid_key(payload: dict) -> bool:
    """A key anywhere in the object that is not valid Unicode (pydantic would only say "not a string")."""
    pending = [payload]
    while pending:
        current = pending.pop()
        for key, value in current.items():
            if not key.isascii():
                try:
                    key.encode("utf-8")
                except UnicodeEncodeError:
                    return True
            if isinstance(value, dict):
                pending.append(value)
    return False


def validation_to_protocol_error(error: ValidationError, message_id: str | None = None) -> ProtocolError:
    """The first problem of a validation error, without echoing the input (it may be a prompt)."""
    return problems_to_protocol_error(error.errors(include_input=False, include_url=False, include_context=False),
                                      message_id)


def problems_to_protocol_error(problems: Sequence[dict], message_id: str | None = None,
                               skip: Sequence[str] = (), root: str = "message") -> ProtocolError:
    """pydantic's problems read as the protocol's error: ``prompt_too_long`` wins, else the first one is
    ``invalid_field`` naming where it is (``skip``: location parts that are not fields, like FastAPI's "body")."""
    for problem in problems:
        if problem.get("type") == "string_too_long" and tuple(problem.get("loc", ()))[-1:] == ("prompt",):
            return ProtocolError("prompt_too_long", f"prompt longer than {MAX_PROMPT_CHARS} characters", message_id)
    first = problems[0] if problems else {"loc": (), "msg": "invalid"}
    where = describe_location(part for part in first.get("loc", ()) if part not in skip) or root
    return ProtocolError("invalid_field", f"{where}: {first.get('msg', 'invalid')}", message_id)


_ECHOABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def describe_location(parts) -> str:
    """A dotted field path for an error message. Names come from the client (an unknown field's key),
    so only short plain identifiers are repeated; anything else — a lone surrogate, markup, 10 KB of
    text — is shown as ``<field>``."""
    shown = []
    for part in parts:
        if isinstance(part, int):
            shown.append(str(part))
        elif isinstance(part, str) and len(part) <= MAX_ECHOED_NAME_CHARS and _ECHOABLE_NAME.fullmatch(part):
            shown.append(part)
        else:
            shown.append("<field>")
    return ".".join(shown)


# --- server -> client ----------------------------------------------------------------------------


class VideoInfo(BaseModel):
    codec: str = Field(description="RFC 6381 codec string, e.g. avc1.64001f")
    width: int
    height: int
    fps: int


class AudioInfo(BaseModel):
    codec: str
    sample_rate: int
    channels: int


class SessionMessage(BaseModel):
    type: Literal["session"] = "session"
    session_id: str
    state: SessionState
    mime: str = Field(description='MSE type string, e.g. video/mp4; codecs="avc1.64001f"')
    video: VideoInfo
    audio: AudioInfo | None
    protocol: int = PROTOCOL_VERSION
    # How this session's media travels to this client: "websocket" (fragmented MP4 segments after each `chunk`)
    # or "webrtc" (RTP tracks of a peer connection; `mime` is then the video track's codec).
    transport: Literal["websocket", "webrtc"] = "websocket"


class ChunkTimingsOut(BaseModel):
    started_at: float = Field(description="server epoch ms when the block's denoising began")
    queued_ms: float
    denoise_ms: float
    decode_ms: float
    encode_ms: float
    sent_at: float = Field(description="server epoch ms when this message was sent")


class ChunkMessage(BaseModel):
    type: Literal["chunk"] = "chunk"
    index: int
    pts: int
    frames: int
    audio_samples: int
    timings: ChunkTimingsOut
    # The ids of the controls (`prompt`, `reset`, `live`) first shown in this chunk's frames: its first frame is
    # the first that shows them. Left out when there are none.
    controls: list[str] | None = None
    # The live input frame this chunk's first frame shows: its number among the live frames the session received
    # (from 0, in arrival order, dropped ones included). Left out when the chunk is not made from live input.
    input_frame: int | None = None


class AckMessage(BaseModel):
    type: Literal["ack"] = "ack"
    id: str | None
    of: str
    # On `start` and `prompt`: the prompt's words the model cannot read (a fixed vocabulary, as the tiny
    # model's); left out when there are none or the model reads any text. The prompt is not refused.
    unknown_words: list[str] | None = None
    # On `live` turning it on: the noise level used (a point of the model's schedule) and the steps a block runs.
    strength: float | None = None
    steps: int | None = None


class StateMessage(BaseModel):
    type: Literal["state"] = "state"
    state: SessionState
    reason: str | None = None


class ErrorMessage(BaseModel):
    type: Literal["error"] = "error"
    code: ErrorCode
    message: str
    id: str | None = None


class ClosedMessage(BaseModel):
    type: Literal["closed"] = "closed"
    reason: CloseReason
    retry_after_s: float | None = Field(
        default=None, description="with reason capacity or draining: seconds after which trying again may succeed"
    )


def to_text(message: BaseModel) -> str:
    """Serialize a server message; optional fields that are unset are left out (``audio`` stays)."""
    if isinstance(message, AckMessage):  # `id` stays even when null; the optional fields only when set
        optional = ("unknown_words", "strength", "steps")
        return message.model_dump_json(exclude={name for name in optional if getattr(message, name) is None})
    exclude_none = not isinstance(message, SessionMessage)
    return message.model_dump_json(exclude_none=exclude_none)


# --- REST ------------------------------------------------------------------------------------------


class CreateSessionRequest(Strict):
    prompt: Prompt | None = Field(default=None, description="generation starts when a socket attaches")
    seed: Seed | None = None
    options: SessionOptions | None = None


class SessionCreated(BaseModel):
    session_id: str
    state: SessionState
    stream_url: str


class Snapshot(BaseModel):
    """A response read from the engine's snapshot by attribute (``SessionStatus``), never copied field by field."""

    model_config = ConfigDict(from_attributes=True)


class SessionSummary(Snapshot):
    session_id: str
    state: SessionState


class SessionList(BaseModel):
    sessions: list[SessionSummary]


class SessionCounters(Snapshot):
    chunks: int
    frames: int
    blocks_since_reset: int
    queue_depth: int
    decoder_state_bytes: int = Field(description="the session's streaming decoder caches on the device")
    encoder_state_bytes: int = Field(description="the session's streaming encoder state (live input) on the device")


class SessionInput(Snapshot):
    """Pictures and video in (docs/PROTOCOL.md): live input and what its frames did."""

    live: bool
    strength: float | None = Field(description="the noise level blocks take live input to; null while off")
    frames_received: int
    frames_used: int
    frames_dropped: int = Field(description="over the rate, or pushed out of a full buffer")
    frames_invalid: int
    context_frames: int = Field(description="latent frames of the image or clip the content last started from")


class SessionRealtime(Snapshot):
    """How the session keeps up with its playback clock (docs/ENGINE.md: realtime admission)."""

    live: bool = Field(description="pacing on: the session has a playback clock and deadlines")
    frames_per_second: Annotated[float, AfterValidator(lambda rate: round(rate, 3))] = Field(
        description="frames emitted per second over the last few chunks"
    )
    deadline_misses: int = Field(description="chunks emitted later than their playback time")
    block_cost_ms: float | None = Field(description="running estimate of device time per block")
    below_realtime: bool = Field(description="the live sessions together need more device time than there is")
    live_capacity: int | None = Field(description="live sessions this engine keeps in real time, at the measured cost")


class SessionControlLatency(Snapshot):
    """The session's recent controls (prompt, reset, live), from their arrival to their first frame on the viewer's
    screen by the server's playback clock (seconds)."""

    count: int = Field(description="controls timed here (the session's most recent ones)")
    last_s: float
    median_s: float
    p90_s: float
    max_s: float


class SessionTimings(Snapshot):
    """The last delivered block's engine timings (ms; ``started_at`` is server epoch ms)."""

    started_at: float
    queued_ms: float
    denoise_ms: float
    decode_ms: float


class SessionDetail(Snapshot):
    """Everything about a session except its prompt text, which never leaves the server."""

    session_id: str
    state: SessionState
    attached: bool
    prompt_length: int
    prompt_unknown_words: int | None = Field(
        description="words of the prompt the model cannot read and so cannot show (the prompt is not refused); "
        "null when the model reads any text")
    seed: int
    pace: bool
    created_at: float = Field(description="epoch seconds")
    counters: SessionCounters
    realtime: SessionRealtime
    last_timings: SessionTimings | None
    time_to_first_chunk_ms: float | None
    close_reason: str | None
    input: SessionInput | None = Field(default=None, description="pictures and video in (null from an older worker)")
    control_latency: SessionControlLatency | None = Field(
        default=None, description="recent controls' time to the screen (null until one was shown)")


class PromptRequest(Strict):
    prompt: Prompt
    policy: PromptPolicy = "soft"


class SessionStateResponse(Snapshot):
    session_id: str
    state: SessionState


class ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok", "unavailable"]
    detail: str | None = None


class WorkerCapacity(BaseModel):
    """``GET /internal/capacity`` of a worker: what a front end places sessions by (docs/SCALE_OUT.md).

    The fields up to ``generation`` are the shared interface (``app/cluster/pool.py``); the rest are
    additions a front end may use when present.
    """

    ready: bool = Field(description="warm, alive and not draining")
    admitting: bool = Field(description="a new live (paced) session would be admitted now")
    live_sessions: int = Field(description="open sessions with pacing on")
    live_headroom: int | None = Field(description="more live sessions it keeps in real time (null: not measured)")
    slots_free: int = Field(description="memory (KV) slots no open session holds")
    utilisation: float = Field(description="device time the running live sessions need per second")
    device: str
    generation: int
    name: str
    open_sessions: int = Field(description="open sessions, paced or not")
    retry_after_s: float = Field(description="when not admitting: when the soonest blocking session must end")
