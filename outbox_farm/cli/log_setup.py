"""Log set-up for the CLI: one line per event, as text or JSON.

Structured fields passed with `extra=` (event, phase, row_id, queue, ...) become JSON keys, so a
log pipeline can alert on `event=lease_lost` without parsing messages. DSNs are logged only
through `dsn.redact`, and every line is scrubbed once more of the secrets `dsn.remember` was
given: a driver or pool logs its own errors, quoting what it failed to parse, out of our reach.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import orjson

from ..dsn import scrub
from ..observe import tracing

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "pid": record.process,
            "message": scrub(record.getMessage()),
        }
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = scrub(value) if isinstance(value, str) else value
        entry.setdefault("event", "log")
        if ids := tracing.current_ids():
            entry["trace_id"], entry["span_id"] = ids
        if record.exc_info:
            entry["exc"] = scrub(self.formatException(record.exc_info))
        return orjson.dumps(entry, default=str).decode()


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s [%(process)d] %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        event = getattr(record, "event", None)
        if event:
            text = f"{text} [event={event}]"
        if ids := tracing.current_ids():
            text = f"{text} [trace_id={ids[0]} span_id={ids[1]}]"
        return scrub(text)


def configure(fmt: str = "text", level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    os.environ["OUTBOX_FARM_LOG_FORMAT"] = fmt
