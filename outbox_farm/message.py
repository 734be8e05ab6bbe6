"""The message a handler receives, and the decision it may take by hand."""

from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import orjson

from .retry import check_seconds


class Decision(enum.Enum):
    ACK = "ack"
    NACK = "nack"
    REJECT = "reject"


@dataclass(eq=False)
class Message:
    """One claimed outbox row.

    `body` is the payload exactly as stored; `json()` decodes it (a decode error is an ordinary
    handler error, retried per the strategy). `ack()`, `nack()` and `reject()` record a decision
    that wins over the handler's return or exception; the row is written by the completer after
    the handler returns, never from inside it.
    """

    id: int
    queue: str
    body: bytes
    headers: dict[str, Any]
    deliveries_count: int
    attempts_count: int
    created_at: datetime
    next_attempt_at: datetime
    first_attempt_at: datetime | None
    timer_id: str | None
    lease_token: uuid.UUID
    claimed_at: datetime
    # Written by the handler (through ack/nack/reject), read by the executor afterwards.
    decision: Decision | None = field(default=None, repr=False)
    nack_delay: float | None = field(default=None, repr=False)
    # Written by the fetcher once per claim: when its result arrived (time.monotonic()), and
    # the claim's and this row's due time as epoch seconds on the database clock; `start_by`
    # (time.monotonic()) is when too little of the lease is left to start the handler.
    received_monotonic: float = field(default=0.0, repr=False)
    start_by: float = field(default=float("inf"), repr=False)
    claimed_epoch: float = field(default=0.0, repr=False)
    due_epoch: float = field(default=0.0, repr=False)

    @property
    def correlation_id(self) -> str | None:
        value = self.headers.get("correlation_id")
        return str(value) if value is not None else None

    @property
    def content_type(self) -> str | None:
        value = self.headers.get("content-type")
        return str(value) if value is not None else None

    def json(self) -> Any:
        return orjson.loads(self.body)

    def text(self) -> str:
        return self.body.decode("utf-8")

    def ack(self) -> None:
        """Delete the row once the handler returns."""
        self.decision = Decision.ACK

    def nack(self, delay: float | None = None) -> None:
        """Try again after `delay` seconds (the queue's retry strategy when None)."""
        check_seconds(delay, "nack delay", allow_none=True)
        self.decision, self.nack_delay = Decision.NACK, delay

    def reject(self) -> None:
        """Give up now: to the DLQ as `rejected` (deleted when there is no DLQ)."""
        self.decision = Decision.REJECT
