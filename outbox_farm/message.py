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


_ACK = Decision.ACK  # read once: an Enum member read off its class costs 0.1 µs (Python 3.11)

CONTENT_TYPE = "content-type"  # the headers the producer writes and `Message` reads
CORRELATION_ID = "correlation_id"


@dataclass(eq=False, kw_only=True, slots=True, weakref_slot=True)
class Message:
    """One claimed outbox row.

    `body` is the payload exactly as stored; `json()` decodes it (a decode error is an ordinary
    handler error, retried per the strategy). `ack()`, `nack()` and `reject()` record a decision
    that wins over the handler's return or exception (the last call wins); the row is written by
    the completer after the handler returns, never from inside it. That is how a batch handler
    (a relay, say) settles each row of its batch on its own.

    Its timestamps are aware datetimes in UTC, whatever the server's TimeZone (the farm's own
    sessions run in UTC). It has slots and no `__dict__`: an attribute it does not declare
    cannot be set on it (a weak reference can be taken).
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
    ordering_key: str | None = None  # rows of one queue and key run one at a time, in order
    # Written by the handler (through ack/nack/reject), read by the executor afterwards.
    decision: Decision | None = field(default=None, repr=False)
    nack_delay: float | None = field(default=None, repr=False)
    error: BaseException | None = field(default=None, repr=False)
    # Written by the store's claim: when its result arrived (time.monotonic()), and the
    # claim's and this row's due time as epoch seconds on the store's clock; `start_by`
    # (time.monotonic()) is when too little of the lease is left to start the handler.
    received_monotonic: float = field(default=0.0, repr=False)
    start_by: float = field(default=float("inf"), repr=False)
    claimed_epoch: float = field(default=0.0, repr=False)
    due_epoch: float = field(default=0.0, repr=False)
    # Written by the store's claim for a row it could not load (a timestamp no client can represent,
    # headers that are not a JSON object): which value and why. Such a row never reaches a
    # handler: the executor dead-letters it as `invalid_row` (`decision.before_run`), and the
    # fields that could not be loaded hold stand-ins (the claim's time, no headers).
    invalid: str | None = field(default=None, repr=False)

    @property
    def correlation_id(self) -> str | None:
        value = self.headers.get(CORRELATION_ID)
        return str(value) if value is not None else None

    @property
    def content_type(self) -> str | None:
        value = self.headers.get(CONTENT_TYPE)
        return str(value) if value is not None else None

    def json(self) -> Any:
        return orjson.loads(self.body)

    def text(self) -> str:
        return self.body.decode("utf-8")

    def ack(self) -> None:
        """Delete the row once the handler returns."""
        self.decision, self.error = _ACK, None

    def nack(self, delay: float | None = None, *, error: BaseException | None = None) -> None:
        """Try again after `delay` seconds (the queue's retry strategy when None).

        `error` says why: the strategy sees it, the retry is logged with it, `on_failure` gets
        it, and it is the DLQ's `last_exception` should the strategy give up. Without it, the
        handler's own exception, if it raised one, serves.
        """
        check_seconds(delay, "nack delay", allow_none=True)
        self.decision, self.nack_delay, self.error = Decision.NACK, delay, _checked(error)

    def reject(self, error: BaseException | None = None) -> None:
        """Give up now: to the DLQ as `rejected` (deleted when there is no DLQ), with `error`
        (else the handler's own exception, if any) as its `last_exception`."""
        self.decision, self.error = Decision.REJECT, _checked(error)


def _checked(error: BaseException | None) -> BaseException | None:
    if error is not None and not isinstance(error, BaseException):
        raise TypeError(f"error must be an exception, got {error!r}")
    return error
