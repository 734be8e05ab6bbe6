"""The rows of the in-memory store (`memory.MemoryStore`): the outbox table's and the DLQ's, as
the Postgres tables hold them, and a clock a test moves by hand.

Times are aware datetimes in UTC, as the farm's sessions load them, and every time is the
store's clock: the claim's `now()`, a retry's due time, a lease's expiry.
"""

from __future__ import annotations

import copy
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from ..errors import DatabaseError
from ..message import Message
from ..storage import Claim

# The table's values check (migration 0006) keeps a day clear of the years 1 and 9999, so
# every client loads every value; a retry's due time stops a day short of the upper bound.
LOADABLE_FROM = datetime(1, 1, 2, tzinfo=UTC)
LOADABLE_UNTIL = datetime(9999, 12, 30, tzinfo=UTC)
RETRY_UNTIL = datetime(9999, 12, 29, tzinfo=UTC)
LONGEST_RETRY = 1e11  # seconds: the retry statement's own cap on a delay


def after(start: datetime, seconds: float, cap: datetime = LOADABLE_UNTIL) -> datetime:
    """`seconds` after `start`, but never past `cap` (the statements' `least(...)`)."""
    if start.timestamp() + seconds >= cap.timestamp():
        return cap
    return start + timedelta(seconds=seconds)


def check_due(due: datetime) -> datetime:
    """A publish's due time, refused as the table's values check refuses it."""
    if not LOADABLE_FROM <= due <= LOADABLE_UNTIL:
        raise DatabaseError(
            f"outbox write failed: a due time of {due} is outside what the outbox table's "
            "values check admits (the years 1 to 9999, a day clear of each end)"
        )
    return due


class ManualClock:
    """A clock for a `MemoryStore` that moves only when told to (`advance`): leases expire,
    timers and retries fall due exactly when a test says, never while it waits for something
    else. Starts at the wall clock's time unless given one (epoch seconds)."""

    def __init__(self, start: float | None = None) -> None:
        self.now = time.time() if start is None else start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@dataclass(slots=True)
class Row:
    """One outbox row, its columns named as the table's. `key_blocked` is not kept: it only
    spares Postgres the walk along a deep key's line, and a claim here takes the same rows
    without it."""

    id: int
    queue: str
    payload: bytes
    headers: dict[str, Any]
    created_at: datetime
    next_attempt_at: datetime
    timer_id: str | None = None
    ordering_key: str | None = None
    deliveries_count: int = 0
    attempts_count: int = 0
    first_attempt_at: datetime | None = None
    last_attempt_at: datetime | None = None
    acquired_token: uuid.UUID | None = None
    acquired_at: datetime | None = None
    lease_expires_at: datetime | None = None
    priority: int = 0  # migration 0013: among due rows, higher first (see `claim_order`)
    fair_key: str | None = None  # migration 0014: the tenant, for a per-key limit (`fair_order`)

    def take(self, claim: Claim, now: datetime) -> Message:
        """Lease the row under `claim` and count a delivery (the claim's UPDATE): the message
        its handler receives, which owns copies of the row's mutable values."""
        self.acquired_token = claim.token
        self.acquired_at = now
        self.lease_expires_at = after(now, claim.lease_ttl)
        self.deliveries_count += 1
        return Message(
            id=self.id,
            queue=self.queue,
            body=self.payload,
            headers=copy.deepcopy(self.headers),
            deliveries_count=self.deliveries_count,
            attempts_count=self.attempts_count,
            created_at=self.created_at,
            next_attempt_at=self.next_attempt_at,
            first_attempt_at=self.first_attempt_at,
            timer_id=self.timer_id,
            lease_token=claim.token,
            claimed_at=now,
            ordering_key=self.ordering_key,
            received_monotonic=time.monotonic(),
            start_by=claim.start_by,
            claimed_epoch=now.timestamp(),
            due_epoch=self.next_attempt_at.timestamp(),
        )

    def free(self) -> None:
        """Clear the lease."""
        self.acquired_token = self.acquired_at = self.lease_expires_at = None

    def snapshot(self) -> Row:
        """A copy a test may keep and read while the store changes the row."""
        return copy.deepcopy(self)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One DLQ row, its columns named as the table's (`id` is the DLQ's own; `original_id`
    the outbox row's)."""

    id: int
    original_id: int
    queue: str
    payload: bytes
    headers: dict[str, Any]
    deliveries_count: int
    created_at: datetime
    failed_at: datetime
    failure_reason: str
    last_exception: str | None
    timer_id: str | None
