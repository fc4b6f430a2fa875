"""The REST transport: one JSON shape for every error, the protocol code → HTTP status, and how REST words a
refusal (``app/transport/refusal.py``) or a denial (``app/transport/access.py``).

Every REST error is ``{"error": {"code", "message"}}``. Protocol codes map to HTTP statuses here, so
the socket and REST refuse the same things with the same codes.
"""

from __future__ import annotations

import logging
import math

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.schemas import ProtocolError, problems_to_protocol_error
from app.transport.access import AccessDenied
from app.transport.refusal import UNAVAILABLE_RETRY_AFTER_S, Refusal
from engine.errors import EngineError, EngineUnavailable

log = logging.getLogger("arstream.http")

STATUS_BY_CODE = {
    "bad_json": 400,
    "unknown_type": 400,
    "invalid_field": 400,
    "prompt_too_long": 413,
    "unauthorized": 401,
    "forbidden_origin": 403,
    "unknown_session": 404,
    "not_found": 404,
    "method_not_allowed": 405,
    "already_started": 409,
    "not_started": 409,
    "session_closed": 409,
    "conflict": 409,
    "rate_limited": 429,
    "internal": 500,
    "capacity": 503,
    "unavailable": 503,
}


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}

    @classmethod
    def from_code(cls, code: str, message: str, retry_after_s: float | None = None) -> "ApiError":
        headers = {"Retry-After": str(max(1, math.ceil(retry_after_s)))} if retry_after_s is not None else None
        return cls(STATUS_BY_CODE.get(code, 400), code, message, headers)

    @classmethod
    def from_engine(cls, error: EngineError) -> "ApiError":
        if isinstance(error, EngineUnavailable):
            return cls.from_code("unavailable", error.message, UNAVAILABLE_RETRY_AFTER_S)
        if error.code == "rate_limited":
            return cls.from_code("rate_limited", error.message, 1.0)
        return cls.from_code(error.code, error.message)

    @classmethod
    def refused(cls, refusal: Refusal) -> "ApiError":
        """A session refused (``app/transport/refusal.py``): 503 or 429, with ``Retry-After``."""
        return cls.from_code(refusal.code, refusal.message, refusal.retry_after_s)

    @classmethod
    def denied(cls, denied: AccessDenied) -> "ApiError":
        """A foreign browser origin (403), a missing or wrong token (401, with the scheme to use)."""
        if denied.reason == "origin":
            return cls(403, "forbidden_origin", denied.message)
        return cls(401, "unauthorized", denied.message, headers={"WWW-Authenticate": "Bearer"})


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, error: ApiError) -> JSONResponse:
        return error_response(error.status, error.code, error.message, error.headers)

    @app.exception_handler(EngineError)
    async def _engine_error(_: Request, error: EngineError) -> JSONResponse:
        api = ApiError.from_engine(error)
        return error_response(api.status, api.code, api.message, api.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        problems = error.errors()
        if any(problem.get("type") == "json_invalid" for problem in problems):
            count_rejected(request.app, "bad_json")
            return error_response(400, "bad_json", "the body is not valid JSON")
        protocol_error = _first_protocol_error(problems)
        count_rejected(request.app, protocol_error.code)
        return error_response(STATUS_BY_CODE[protocol_error.code], protocol_error.code, protocol_error.message)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, error: StarletteHTTPException) -> JSONResponse:
        # 400 comes from FastAPI's body parsing (e.g. bytes that are not UTF-8): the body is not JSON.
        code = {400: "bad_json", 404: "not_found", 405: "method_not_allowed"}.get(error.status_code, "invalid_field")
        if code == "bad_json":
            count_rejected(request.app, code)
        message = error.detail if isinstance(error.detail, str) else "request refused"
        return error_response(error.status_code, code, message, getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception) -> JSONResponse:
        log.error("unhandled error", extra={"path": request.url.path, "error": type(error).__name__}, exc_info=error)
        return error_response(500, "internal", "internal error")


def count_rejected(app, code: str) -> None:
    """Count a REST request refused for its input (the service may not exist yet during start-up)."""
    service = getattr(app.state, "service", None)
    if service is not None:
        service.metrics.message_rejected("rest", code)


def _first_protocol_error(problems: list[dict]) -> ProtocolError:
    """FastAPI's validation problems, read like the socket's (prompt_too_long wins), input never echoed."""
    return problems_to_protocol_error(problems, skip=("body",), root="body")
