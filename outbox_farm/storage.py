"""The storage port: everything one process's runtime asks of the outbox table, and nothing of
how it is stored.

The runtime's loops (fetcher, completer, heartbeat) speak only this: claim due rows under a
lease, write outcomes in flushes, extend leases, ask when something is next due. Two stores
implement it with the same semantics: `db.store.PostgresStore` (the product: `FOR UPDATE SKIP
LOCKED` claims, pipelined token-guarded writes) and `testing.memory.MemoryStore` (a dict and a
clock, for the runtime's own unit tests and for users' tests). The contract suite
(`tests/contract/`) runs the same behaviour tests against both, so they cannot drift.

What both keep, row by row: a claim counts a delivery and takes a lease (a token and an expiry);
every write matches id and token, and a row held under another token is not written; rows of one
ordering key run one at a time, in id order; a row is due at its `next_attempt_at` (timers,
retries); a terminal outcome moves the row to the DLQ when there is one, in the same step as its
deletion.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Protocol, runtime_checkable

from .breaker import Breaker
from .errors import DatabaseError
from .limits import Limits
from .message import Message


@dataclass(slots=True)
class Claim:
    """A claim as its fetcher made it.

    `limit` rows of `queue` at most (expired leases first, then due rows), under `token`, for
    `lease_ttl` seconds on the store's clock, counting a delivery on each; rows held under a
    token in `held` are never taken, even when their lease ran out. `sweep`: look for expired
    leases and for rows due beyond what a client can load as well; without it a store may
    leave both for a later claim (the fetcher sweeps whenever something due was left behind).
    A hand-over (`limit` None) instead takes the next row of each key an ack deletes a row of,
    with that ack (see `Flush.send`).

    `sent` (monotonic) is when it was made, which the lease's deadline is counted from, and
    `start_by` (monotonic) when too little of that lease is left to start a handler: both are
    carried into each `Message` the claim builds. `keep`: the store may keep what the claim
    used (a connection) for the queue's next claim, until `Store.rest` or a statement of the
    queue that does not keep it; a fetcher's claims, whose fetcher says when it rests."""

    queue: str
    limit: int | None
    lease_ttl: float
    token: uuid.UUID
    sent: float
    start_by: float
    held: list[uuid.UUID] = field(default_factory=list)
    sweep: bool = True
    keep: bool = False


@dataclass(slots=True)
class Write:
    """One outcome write over the rows `ids` (parallel to `tokens` and to each of `columns`):
    `kind` is `ack`, `retry` (columns `delays`, `ran`, `started`), `release`, or `dlq_move`
    (columns `reasons`, `exceptions`). A description rather than a call: it may be sent more
    than once, and `resent` is set by the store when it was in flight as its connection broke.
    """

    kind: str
    ids: list[int]
    tokens: list[uuid.UUID]
    columns: dict[str, list[Any]] = field(default_factory=dict)
    resent: bool = False

    def row(self, index: int) -> Write:
        """The same write for the one row at `index`."""
        one = slice(index, index + 1)
        columns = {name: values[one] for name, values in self.columns.items()}
        return Write(self.kind, self.ids[one], self.tokens[one], columns)


def ack(ids: list[int], tokens: list[uuid.UUID]) -> Write:
    """Delete the rows: their handlers succeeded (or they failed for good, with no DLQ)."""
    return Write("ack", ids, tokens)


def retry(
    ids: list[int],
    tokens: list[uuid.UUID],
    *,
    delays: list[float],
    ran: list[bool],
    started: list[datetime | None],
) -> Write:
    """Free the rows' leases and make them due `delays` seconds after the write (the store's
    clock); a row whose handler `ran` (from `started`) counts an attempt."""
    columns: dict[str, list[Any]] = {"delays": delays, "ran": ran, "started": started}
    return Write("retry", ids, tokens, columns)


def release(ids: list[int], tokens: list[uuid.UUID]) -> Write:
    """Free the rows' leases and take back the delivery their claim counted: never started."""
    return Write("release", ids, tokens)


def dead_letter(
    ids: list[int],
    tokens: list[uuid.UUID],
    *,
    reasons: list[str],
    exceptions: list[str | None],
) -> Write:
    """Move the rows to the DLQ (needs one): archived and deleted together, or neither."""
    return Write("dlq_move", ids, tokens, {"reasons": reasons, "exceptions": exceptions})


@dataclass(frozen=True, slots=True)
class Written:
    """What one write did, its rows named by their positions in the write (from 0).
    `matched`: the rows written. Of the others, `refused` were refused by the store (each tried
    alone), `unconfirmed` were found gone or free after a resend (the first attempt most likely
    wrote them), and the rest are held under another token or gone. `claimed`: the messages a
    hand-over sent with the write took."""

    matched: set[int]
    unconfirmed: set[int] = field(default_factory=set)
    refused: dict[int, DatabaseError] = field(default_factory=dict)
    claimed: list[Message] = field(default_factory=list)


# What a NOTIFY's payload starts with when it announces a change of controls (see `db.control`).
CONTROL_PREFIX = "outbox_farm.control:"


def is_control(payload: str) -> bool:
    """Whether a wake-up's payload announces a change of controls rather than names a queue."""
    return payload.startswith(CONTROL_PREFIX)


@dataclass(frozen=True, slots=True)
class Tripped:
    """An open breaker, as the farms see it: open `since`, for `reason` (the failure that
    opened it); its next probe may run `probe_in` seconds after it was read (the store's
    clock; negative: already)."""

    since: datetime
    probe_in: float
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class QueueControl:
    """The operator's hand on one queue, as the farms see it: paused (until `paused_until`, or
    until resumed when None), and why; its farm-wide `limits`; and its breaker's state, open
    (`tripped`) or counting `failures` in a row."""

    queue: str
    paused: bool
    paused_until: datetime | None = None
    reason: str | None = None
    limits: Limits = field(default_factory=Limits)
    tripped: Tripped | None = None
    failures: int = 0


@dataclass(frozen=True, slots=True)
class Allowed:
    """What a claim of a limited queue took (`Store.claim_limited`): `messages`; `allowed`,
    how many rows the queue's limits let it take (no more than it asked); and `wait`, the
    seconds after which the limits may let the queue take more (0: at once)."""

    messages: list[Message]
    allowed: int
    wait: float = 0.0


class Flush(Protocol):
    """The writes of one completer flush, sent in order; see `Store.flush`."""

    async def send(self, write: Write, handover: Claim | None = None) -> Written:
        """Run `write`. Raises `ConnectionLost` when the store could not be reached (the flush
        is over: open another and send the write again); any other refusal is in the result,
        row by row. `handover` (an ack only): also claim the next row of each key the ack
        deletes a row of (`Written.claimed`); refused, the ack's rows are written alone."""
        ...


class Store(Protocol):
    """The outbox table of one farm, as the runtime uses it. Every method may raise
    `DatabaseError` (`ConnectionLost` when the store is out of reach)."""

    @property
    def has_dlq(self) -> bool:
        """Whether terminal rows are kept (`dlq_move`) or deleted (`ack`)."""
        ...

    async def claim(self, claim: Claim) -> list[Message]:
        """Take up to `claim.limit` rows under `claim.token`: the messages, in claim order.
        A row whose stored values cannot be loaded comes back with `Message.invalid` set."""
        ...

    async def claim_limited(self, claim: Claim) -> Allowed:
        """`claim`, for a queue with farm-wide limits (`QueueControl.limits`): within what
        they allow now, taken from the budget every process and host of the outbox shares
        (a rate's bucket, a most running at once), in one step with the claim, so two claims
        never both spend one share. A queue whose limits were cleared is claimed whole."""
        ...

    async def breaker_failed(
        self, queue: str, breaker: Breaker, reason: str, *, down: bool
    ) -> tuple[bool, bool]:
        """Count a failed run of `queue`'s handler toward its breaker, farm-wide: (whether
        this failure opened it, whether it is open now). It opens at the `breaker.failures`-th
        failure in a row, or at once when `down`, with `reason`, its first probe
        `breaker.probe_every` seconds on; opening it tells every runtime on the store. A failure
        while it is open is not counted."""
        ...

    async def breaker_reset(self, queue: str) -> None:
        """A run of `queue` succeeded: its breaker's count of failures in a row starts again."""
        ...

    async def breaker_probe(self, queue: str, every: float) -> bool:
        """Whether this caller may run the next probe of `queue`'s open breaker now: one caller
        of every runtime on the store wins it each `every` seconds."""
        ...

    async def breaker_close(self, queue: str) -> bool:
        """Close `queue`'s breaker (a run succeeded while it was open), telling every runtime
        on the store; False when it was not open."""
        ...

    async def next_due(self, queue: str) -> float | None:
        """Seconds until `queue` has a row due or a lease expiring; negative when one is due
        already; None when the queue holds no rows."""
        ...

    async def rest(self, queue: str) -> None:
        """The fetcher of `queue` waits now for longer than a NOTIFY's gap in a stream, or
        stops: what its claims kept (`Claim.keep`) goes back. Never raises. A store without
        it (one written before it) is given no claim with `keep`."""
        ...

    async def free_stranded(self, queue: str) -> int:
        """Unmark rows of `queue` left waiting at the head of their ordering key; how many."""
        ...

    async def set_aside(self, ids: list[int], token: uuid.UUID, seconds: float) -> list[int]:
        """Park rows claimed under `token` that can be neither loaded nor dead-lettered for
        `seconds`; the ids parked (the others were lost to a newer lease)."""
        ...

    async def give_back(self, ids: list[int], token: uuid.UUID) -> None:
        """Release rows claimed under `token` that will not run, their deliveries taken back."""
        ...

    async def extend_leases(
        self, ids: list[int], tokens: list[uuid.UUID], lease_ttl: float
    ) -> set[int]:
        """Move these rows' leases to `lease_ttl` seconds from now; the ids still held."""
        ...

    def flush(self, *, single: bool = False) -> AbstractAsyncContextManager[Flush]:
        """A flush of outcome writes (`single`: of one write only). Raises `ConnectionLost`
        when the store cannot be reached."""
        ...

    async def refusal(self, write: Write) -> DatabaseError | None:
        """Why a write of this kind is refused for want of a privilege, tried without effect;
        None when it would be allowed (what the fetcher's pause probes)."""
        ...

    async def controls(self) -> dict[str, QueueControl]:
        """The queues of this outbox with a control in force, by queue: paused now (a pause
        whose `paused_until` has passed on the store's clock is over), or limited. Raises
        `SchemaError` when the store keeps no controls (a database not yet migrated): the
        caller claims as if nothing were paused or limited."""
        ...


@runtime_checkable
class Notifier(Protocol):
    """A store that says when rows are published, as Postgres's NOTIFY does for the listener:
    a runtime over it wakes the queue's fetcher at once instead of at its next poll. Optional:
    a store without it is polled."""

    def subscribe(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """Call `callback` with the queue of every row published from now on (or a payload
        `is_control` tells apart, when the controls change); the function returned ends that."""
        ...
