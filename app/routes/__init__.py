"""HTTP and WebSocket routes, one router per resource, declared once for a single server and a front end.

A route only declares: its path, body and answers. ``app.state.sessions`` serves it (``app/backend.py``);
errors take the REST transport's one shape (``app/transport/rest.py``).
"""

from __future__ import annotations

from app.schemas import ErrorResponse

# For OpenAPI: what the session routes may answer besides success.
ERROR_RESPONSES = {
    status: {"model": ErrorResponse, "description": description}
    for status, description in {
        400: "invalid request (bad_json, invalid_field)",
        401: "missing or wrong bearer token",
        403: "foreign browser origin",
        404: "unknown session",
        409: "already_started, not_started or session_closed",
        413: "prompt_too_long, or body too large",
        429: "rate_limited (+ Retry-After)",
        503: "capacity or unavailable (+ Retry-After)",
    }.items()
}
