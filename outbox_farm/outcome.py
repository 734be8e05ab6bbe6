"""What happened to one claimed row: the executor's verdict, handed to the completer."""

from __future__ import annotations

import enum
import traceback
import uuid
from dataclasses import dataclass
from datetime import datetime

LAST_EXCEPTION_MAX = 8192
FRAMES_MAX = 4096  # of those, at most this much for the innermost frames
LINE_MAX = 300  # an exception's summary on a log line
TRUNCATED = "…[truncated]"
FRAMES_HEADER = "\nTraceback (innermost frames last):\n"


class Kind(enum.Enum):
    ACK = "ack"  # handler succeeded: DELETE
    RETRY = "retry"  # try again later: UPDATE next_attempt_at, lease cleared
    RELEASE = "release"  # never started (stop): lease cleared, delivery taken back
    EXPIRE = "expire"  # never started, its lease ran short while it waited: as RELEASE
    TERMINAL = "terminal"  # failed for good: DLQ move, or DELETE without a DLQ


class Reason(enum.StrEnum):
    MAX_DELIVERIES = "max_deliveries"
    RETRY_TERMINAL = "retry_terminal"
    REJECTED = "rejected"
    INVALID_ROW = "invalid_row"  # a value another writer stored that the farm cannot load


@dataclass(slots=True)
class Outcome:
    kind: Kind
    row_id: int
    token: uuid.UUID
    queue: str
    deliveries_count: int
    delay: float = 0.0  # RETRY: seconds from the flush (database clock)
    ran: bool = False  # RETRY: the handler ran (counts an attempt)
    started_at: datetime | None = None  # RETRY: when the handler started
    reason: Reason | None = None  # TERMINAL
    last_exception: str | None = None  # TERMINAL


def describe_exception(exc: BaseException | None) -> str | None:
    """`repr(exc)` and the innermost frames of its traceback, within 8 KiB; never raises.

    Some exceptions carry megabytes (a rejected request body, a whole row); an unbounded text
    would slow every flush that carries it and bloat the DLQ. The repr comes first (cut with a
    visible marker when it must be), the frames nearest the raise after it: they say where it
    failed, which the outer frames (the runtime's own) do not.
    """
    if exc is None:
        return None
    try:
        text = repr(exc)
    except Exception as repr_error:  # a broken __repr__ must not lose the row
        text = f"<{type(exc).__qualname__}: repr() failed with {repr_error.__class__.__name__}>"
    frames = innermost_frames(exc)
    room = LAST_EXCEPTION_MAX - len(frames)
    if len(text) > room:
        text = text[: room - len(TRUNCATED)] + TRUNCATED
    return (text + frames).replace("\x00", "\\x00")  # Postgres text cannot hold NUL


def exception_type(exc: BaseException) -> str:
    """The exception's class as a traceback's last line names it: qualified by its module,
    unless it is a built-in."""
    cls = type(exc)
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def exception_line(exc: BaseException) -> str:
    """`Type: first line of the message`, within `LINE_MAX` characters; never raises.

    What a log line says of an exception: one line whatever the exception carries (a
    multi-line message or megabytes of one would turn a line per retry into a page), enough to
    tell one failure from another. The DLQ keeps the fuller `describe_exception`.
    """
    try:
        text = str(exc).strip()
    except Exception as str_error:  # a broken __str__ must not lose the line
        text = f"<str() failed with {str_error.__class__.__name__}>"
    first, newline, _ = text.partition("\n")
    first, feed, _ = first.partition("\r")
    line = f"{exception_type(exc)}: {first}" if first else exception_type(exc)
    if len(line) > LINE_MAX:
        return line[: LINE_MAX - len(TRUNCATED)] + TRUNCATED
    return line + TRUNCATED if newline or feed else line


def innermost_frames(exc: BaseException) -> str:
    """The frames nearest the raise, as a block under `FRAMES_HEADER`, within `FRAMES_MAX`
    characters; empty when there are none or they cannot be read."""
    try:
        lines = traceback.format_list(traceback.extract_tb(exc.__traceback__))
    except Exception:  # a frame whose source cannot be read: the repr alone still says a lot
        return ""
    kept: list[str] = []
    size = len(FRAMES_HEADER)
    for line in reversed(lines):
        if size + len(line) > FRAMES_MAX:
            break
        kept.append(line)
        size += len(line)
    return FRAMES_HEADER + "".join(reversed(kept)).rstrip("\n") if kept else ""
