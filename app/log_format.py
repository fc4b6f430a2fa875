"""Log lines: one line per event, JSON (default) or text for people, with the ``extra={...}`` fields.

``arstream serve`` and ``generate`` configure the root logger with :func:`configure_logging`; a Ray Serve worker
replica puts the same :class:`StructuredFormatter` on its own handlers (``app/cluster/ray_worker.py``).
What may never reach a line (query strings, tokens) is kept out by ``app/log_redaction.py``.
"""

from __future__ import annotations

import json
import logging
import sys
import time

# uvicorn adds `color_message` (the same text with terminal colours) to its records: not a field.
_RECORD_FIELDS = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName", "color_message",
}


class StructuredFormatter(logging.Formatter):
    """One line per event: the message plus the ``extra={...}`` fields (session ids, reasons, numbers).
    Callers never put prompt text or media in either."""

    def __init__(self, style: str = "json") -> None:
        super().__init__()
        self.json_style = style == "json"

    def format(self, record: logging.LogRecord) -> str:
        fields = {key: value for key, value in vars(record).items() if key not in _RECORD_FIELDS}
        timestamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"
        if self.json_style:
            line = {"ts": timestamp, "level": record.levelname.lower(), "logger": record.name,
                    "event": record.getMessage(), **fields}
            if record.exc_info:
                line["exception"] = self.formatException(record.exc_info)
            return json.dumps(line, default=str, ensure_ascii=False)
        extras = " ".join(f"{key}={value}" for key, value in fields.items())
        text = f"{timestamp} {record.levelname} {record.name} {record.getMessage()}" + (f" {extras}" if extras else "")
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def configure_logging(style: str = "text", level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(StructuredFormatter(style))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
