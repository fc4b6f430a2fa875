"""Secrets never reach a log line: query strings and bearer tokens are redacted from server log records.

The service reads its token only from the ``Authorization`` header or the ``bearer.<token>``
subprotocol, but clients still put tokens in URLs (``?token=...``), and the HTTP server's access log
writes the full request target. A query string is therefore never logged (it is replaced by
``?<redacted>``), nor is anything shaped like a bearer credential, nor the configured token itself.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable

REDACTED = "<redacted>"
# Loggers whose records carry request targets: uvicorn's access and error logs (the latter has the
# WebSocket "accepted" lines), and websockets' own loggers for hosts that use them.
REQUEST_LOGGERS = ("uvicorn.access", "uvicorn.error", "websockets", "websockets.server")

_QUERY = re.compile(r"(/[^\s?\"']*)\?[^\s\"']*")  # a path followed by ?query, up to whitespace or a quote
_BEARER = re.compile(r"(?i)\b(bearer[ .])[A-Za-z0-9\-_.~+/=]+")


class RedactSecrets(logging.Filter):
    """Rewrites a record's message and arguments in place; never drops a record."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.secrets = tuple(secret for secret in secrets if secret)

    def redact(self, text: str) -> str:
        text = _QUERY.sub(rf"\1?{REDACTED}", text)
        text = _BEARER.sub(rf"\1{REDACTED}", text)
        for secret in self.secrets:
            text = text.replace(secret, REDACTED)
        return text

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.msg, str):
            record.msg = self.redact(record.msg)
        if isinstance(record.args, dict):
            record.args = {key: self._value(value) for key, value in record.args.items()}
        elif record.args:
            record.args = tuple(self._value(value) for value in record.args)
        return True

    def _value(self, value):
        return self.redact(value) if isinstance(value, str) else value


def install_log_redaction(secrets: Iterable[str] = (), loggers: Iterable[str] = REQUEST_LOGGERS) -> RedactSecrets:
    """Put one :class:`RedactSecrets` on each request logger (replacing one an earlier app installed)."""
    redaction = RedactSecrets(secrets)
    for name in loggers:
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, RedactSecrets)]:
            logger.removeFilter(old)
        logger.addFilter(redaction)
    return redaction


class QuietPolls(logging.Filter):
    """Drops the access-log lines of a front end's polls (``/internal/capacity``, ``/healthz``) on a worker:
    several a second, every second, they would bury the lines that matter."""

    POLLED_PATHS = ("/internal/capacity ", "/healthz ")

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not any(isinstance(arg, str) and (arg + " ").startswith(self.POLLED_PATHS) for arg in args)


def quiet_polls(logger: str = "uvicorn.access") -> None:
    target = logging.getLogger(logger)
    if not any(isinstance(f, QuietPolls) for f in target.filters):
        target.addFilter(QuietPolls())
