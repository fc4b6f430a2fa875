"""The service's settings: one validated tree, the engine's config nested inside.

Built explicitly (``Settings()`` reads ``ARSTREAM_*`` variables; nested fields use ``__``, e.g.
``ARSTREAM_ENGINE__PRESET=tiny``) and passed to :func:`app.main.create_app`; nothing builds settings
at import time, so tests and the CLI choose their own.

Outside development the settings refuse what would expose the service by accident: no token, a
short token, or a wildcard origin, unless the matching ``allow_*`` flag says so explicitly.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine.config import EngineConfig

WILDCARD_ORIGIN = "*"
MIN_PRODUCTION_TOKEN_CHARS = 16
# Tokens travel as a WebSocket subprotocol (`bearer.<token>`), which allows only RFC 7230 token
# characters; URL-safe base64 (`secrets.token_urlsafe`) fits.
TOKEN_CHARACTERS = set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_.~")


class WorkerSettings(BaseModel):
    """Present when this process is one engine worker behind a front end (``arstream serve --devices``,
    ``app/cluster``), which sets it through ``ARSTREAM_WORKER__*``: never by hand."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9:._-]+$", description="e.g. cuda:0, cpu-1")
    generation: int = Field(default=0, ge=0, description="+1 on every (re)start of this worker")
    secret: SecretStr | None = Field(
        default=None, description="when set, every request must carry it (X-Arstream-Internal): the front end only"
    )


class ClusterSettings(BaseModel):
    """Bounds of a front end in front of several workers (``arstream serve --devices``; docs/SCALE_OUT.md)."""

    model_config = ConfigDict(extra="forbid")

    capacity_poll_s: float = Field(default=0.5, gt=0, le=60, description="how often each worker's capacity is read")
    reconcile_s: float = Field(
        default=5.0, gt=0, le=600, description="how often each worker's session list is matched against the table"
    )
    proxy_timeout_s: float = Field(default=10.0, gt=0, le=300, description="a REST call or socket opening to a worker")
    max_proxied_body_bytes: int = Field(
        default=1024 * 1024, ge=1024, le=64 * 1024 * 1024, description="largest REST answer taken from a worker"
    )
    max_relay_message_bytes: int = Field(
        default=16 * 1024 * 1024, ge=64 * 1024, le=1024 * 1024 * 1024,
        description="largest message taken from a worker's socket (a media segment)",
    )
    relay_queue_messages: int = Field(
        default=4, ge=1, le=1024,
        description="messages read ahead from a worker's socket while the client is slow (then the worker waits)",
    )
    max_tracked_sessions: int = Field(
        default=4096, ge=1, le=1_000_000, description="session ids the front end routes; beyond: new sessions refused"
    )
    restart_backoff_s: float = Field(default=0.5, gt=0, le=600, description="first restart of a lost worker")
    restart_backoff_max_s: float = Field(default=30.0, gt=0, le=3600)
    max_restarts_per_minute: int = Field(default=5, ge=1, le=600, description="per worker")
    worker_start_timeout_s: float = Field(
        default=180.0, gt=0, le=3600, description="launch to listening (not the warm-up); then it is killed and restarted"
    )
    worker_hang_timeout_s: float = Field(
        default=30.0, gt=0, le=3600, description="a worker that answers no /healthz this long is killed and restarted"
    )


class IceServer(BaseModel):
    """A STUN or TURN server for WebRTC peers (the server's own and, through ``Link`` headers, its clients')."""

    model_config = ConfigDict(extra="forbid")

    urls: str = Field(max_length=512, pattern=r"^(stun|stuns|turn|turns):[^\s<>\",;]+$",
                      description="stun:, stuns:, turn: or turns: URL (RFC 7064/7065)")
    username: str | None = Field(default=None, max_length=256, pattern=r"^[^\s\"]*$")
    credential: str | None = Field(default=None, max_length=256, pattern=r"^[^\s\"]*$")

    @model_validator(mode="before")
    @classmethod
    def _from_url(cls, value):
        return {"urls": value} if isinstance(value, str) else value  # a plain URL: a STUN server, most often

    @model_validator(mode="after")
    def _turn_has_credentials(self) -> "IceServer":
        if self.urls.startswith("turn") and (self.username is None or self.credential is None):
            raise ValueError("a TURN server needs a username and a credential")
        return self


class InputLimits(BaseModel):
    """Bounds on pictures and video a client sends (docs/PROTOCOL.md, "Pictures and video in")."""

    model_config = ConfigDict(extra="forbid")

    max_image_bytes: int = Field(default=8 * 1024 * 1024, ge=1024, le=256 * 1024 * 1024)
    max_image_pixels: int = Field(default=4096 * 4096, ge=64 * 64, le=100_000_000, description="checked from the header")
    max_clip_bytes: int = Field(default=16 * 1024 * 1024, ge=1024, le=256 * 1024 * 1024)
    max_clip_seconds: float = Field(default=10.0, gt=0, le=600)
    max_clip_pixels: int = Field(default=1920 * 1080, ge=64 * 64, le=100_000_000, description="per decoded frame")
    max_frame_bytes: int = Field(default=1024 * 1024, ge=1024, le=64 * 1024 * 1024, description="one live frame")
    max_frame_pixels: int = Field(default=1920 * 1080, ge=64 * 64, le=100_000_000)
    announce_timeout_s: float = Field(
        default=10.0, gt=0, le=300, description="announced bytes must arrive within this (start/reset with input)"
    )

    @property
    def max_binary_bytes(self) -> int:
        """The largest binary message a client may send: the socket refuses anything larger (close 1009)."""
        return max(self.max_image_bytes, self.max_clip_bytes, self.max_frame_bytes)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="ARSTREAM_", env_nested_delimiter="__", extra="forbid", validate_default=True
    )

    environment: Literal["development", "production"] = "development"
    host: str = Field(default="127.0.0.1", min_length=1, max_length=255)
    port: int = Field(default=8000, ge=0, le=65535, description="0 picks a free port")
    engine: EngineConfig = Field(default_factory=EngineConfig)

    # --- access ---
    token: SecretStr | None = Field(default=None, description="bearer token; None turns authentication off")
    allow_no_token: bool = Field(default=False, description="production only: run without a token on purpose")
    allowed_origins: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="extra browser origins (scheme://host[:port]) besides the same host and localhost; '*' = any",
    )
    allow_wildcard_origin: bool = Field(default=False, description="production only: accept '*' on purpose")

    # --- bounds ---
    max_message_bytes: int = Field(default=16 * 1024, ge=1024, le=1024 * 1024, description="client message / body")
    control_rate_per_s: float = Field(default=20.0, gt=0, le=1000, description="control messages per socket")
    control_burst: int = Field(default=20, ge=1, le=1000)
    max_sessions_per_client: int | None = Field(
        default=None, ge=1, le=256, description="open sessions per client address; None: only engine capacity"
    )
    max_peers_per_client: int = Field(
        default=4, ge=1, le=256, description="WebRTC peer connections (and offers being answered) per client address"
    )
    webrtc_peer_timeout_s: float = Field(
        default=30.0, ge=1.0, le=600.0,
        description="a WebRTC peer whose network is gone (no ICE consent answers) is dropped after about this long",
    )
    webrtc_playout_margin_s: float | None = Field(
        default=None, ge=0.0, le=5.0,
        description="how long before it plays a paced piece reaches a WebRTC peer's track; None (the default): the "
                    "engine's playout_margin_s, as for the socket. The peer paces its frames in this process, so a "
                    "smaller one saves control-to-screen time where the engine's blocks keep time; on the 2-core CPU "
                    "0.05 s gave stalls, and sound later than the picture by its decoder's lookahead "
                    "(docs/BENCHMARKS.md)",
    )
    webrtc_ice_servers: list[IceServer] = Field(
        default_factory=list, max_length=16,
        description="STUN/TURN servers for WebRTC peers (a URL, or {urls, username, credential}), used by the server "
                    "and told to clients (Link headers); empty (the default): host candidates only, nothing is "
                    "contacted",
    )
    stall_chunks: float = Field(
        default=2.0, ge=0.5, le=64,
        description="a socket whose media send stays blocked this many chunk durations is detached (client stalled)",
    )
    ping_interval_s: float = Field(default=1.0, gt=0, le=600, description="keepalive ping every this many seconds")
    ping_timeout_s: float = Field(
        default=2.0, gt=0, le=600, description="a socket whose client answers no ping within this is dropped (detached)"
    )
    send_buffer_bytes: int = Field(
        default=64 * 1024, ge=4096, le=16 * 1024 * 1024,
        description="kernel send buffer per socket: bounds what a client that stops reading can leave queued",
    )
    closed_retention_s: float = Field(
        default=30.0, ge=0, le=3600, description="a closed session stays visible to GET this long (reason)"
    )
    inputs: InputLimits = Field(default_factory=InputLimits, description="pictures and video in")

    # --- runtime ---
    encode_threads: int = Field(default=2, ge=1, le=64, description="media encoder worker threads")
    drain_timeout_s: float = Field(default=10.0, ge=0, le=600, description="how long shutdown waits for sockets")
    log_format: Literal["json", "text"] = "json"
    worker: WorkerSettings | None = Field(default=None, description="set only for a worker behind a front end")
    cluster: ClusterSettings = Field(default_factory=ClusterSettings)

    @field_validator("allowed_origins")
    @classmethod
    def _origins_are_origins(cls, origins: list[str]) -> list[str]:
        cleaned = []
        for origin in origins:
            origin = origin.strip().rstrip("/")
            if origin != WILDCARD_ORIGIN and not origin.startswith(("http://", "https://")):
                raise ValueError(f"an origin is scheme://host[:port] or '*', got {origin!r}")
            cleaned.append(origin.lower())
        return cleaned

    @field_validator("token")
    @classmethod
    def _token_is_subprotocol_safe(cls, token: SecretStr | None) -> SecretStr | None:
        if token is None:
            return None
        value = token.get_secret_value()
        if not value or not set(value) <= TOKEN_CHARACTERS or len(value) > 512:
            raise ValueError("token must be 1-512 URL-safe characters (A-Z a-z 0-9 - _ . ~)")
        return token

    @model_validator(mode="after")
    def _refuse_unsafe_production(self) -> "Settings":
        if self.environment == "development":
            return self
        if self.token is None and not self.allow_no_token:
            raise ValueError("production needs ARSTREAM_TOKEN (or ARSTREAM_ALLOW_NO_TOKEN=true on purpose)")
        if self.token is not None and len(self.token.get_secret_value()) < MIN_PRODUCTION_TOKEN_CHARS:
            raise ValueError(f"production tokens need at least {MIN_PRODUCTION_TOKEN_CHARS} characters")
        if WILDCARD_ORIGIN in self.allowed_origins and not self.allow_wildcard_origin:
            raise ValueError("production refuses origin '*' (set ARSTREAM_ALLOW_WILDCARD_ORIGIN=true on purpose)")
        return self

    @property
    def auth_enabled(self) -> bool:
        return self.token is not None

    @property
    def max_socket_message_bytes(self) -> int:
        """What the WebSocket transport accepts: text is bounded again by ``max_message_bytes`` in the app."""
        return max(self.max_message_bytes, self.inputs.max_binary_bytes)
