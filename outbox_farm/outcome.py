"""What happened to one claimed row: the executor's verdict, handed to the completer."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass
from datetime import datetime

LAST_EXCEPTION_MAX = 8192
TRUNCATED = "…[truncated]"


class Kind(enum.Enum):
    ACK = "ack"  # handler succeeded: DELETE
    RETRY = "retry"  # try again later: UPDATE next_attempt_at, lease cleared
    RELEASE = "release"  # never started (stop): lease cleared, delivery taken back
    TERMINAL = "terminal"  # failed for good: DLQ move, or DELETE without a DLQ


class Reason(enum.StrEnum):
    MAX_DELIVERIES = "max_deliveries"
    RETRY_TERMINAL = "retry_terminal"
    REJECTED = "rejected"


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
    """`repr(exc)`, cut to 8 KiB with a visible marker; never raises.

    Some exceptions carry megabytes (a rejected request body, a whole row); an unbounded
    repr would slow every flush that carries it and bloat the DLQ.
    """
    if exc is None:
        return None
    try:
        text = repr(exc)
    except Exception as repr_error:  # a broken __repr__ must not lose the row
        text = f"<{type(exc).__qualname__}: repr() failed with {repr_error.__class__.__name__}>"
    if len(text) > LAST_EXCEPTION_MAX:
        text = text[: LAST_EXCEPTION_MAX - len(TRUNCATED)] + TRUNCATED
    return text.replace("\x00", "\\x00")  # Postgres text cannot hold NUL
