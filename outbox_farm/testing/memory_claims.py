"""Which rows of a `memory.MemoryStore` a claim takes, and in what order, as the `claim` and
`claim_fair` statements of `queries/runtime.sql` choose them; and the rows a limit counts as
running, a fetcher waits for, or `settled` still finds held or due.

Its own module because this is the part of the store `tests/contract/` holds to Postgres's
ranking row by row: the store around it only locks, leases what was chosen and wakes. Reads
only: the caller holds the store's lock and takes the rows itself (`Row.take`).
"""

from __future__ import annotations

import uuid
from collections import Counter
from datetime import datetime

from ..db.claims import SET_ASIDE_TOKEN
from ..storage import Claim
from .memory_rows import Row
from .memory_table import Heads, Tables, claim_order, due_order, fair_order, first_of_key, pending


def chosen(tables: Tables, claim: Claim, limit: int, now: datetime) -> list[Row]:
    """`claim`'s rows at `now`, before they are cut to `limit`: rows whose lease expired
    (soonest expired first), unless held under a token of `claim.held`; then due rows nobody
    holds, in `claim_order` for `limit`; a keyed row only while it is the oldest of its key
    left."""
    _, expired, due = _branches(tables, claim, now)
    return expired + claim_order(due, limit)


def chosen_fair(tables: Tables, claim: Claim, key_max: int, now: datetime) -> list[Row]:
    """`claim_fair`'s rows: the expired leases as `chosen` takes them, then the due rows in
    `fair_order`, each fair key's leased rows (expired leases too) counted against
    `key_max`."""
    rows, expired, due = _branches(tables, claim, now)
    leased = Counter(
        row.fair_key
        for row in rows
        if row.acquired_token not in (None, SET_ASIDE_TOKEN)  # expired ones too
    )
    return expired + fair_order(due, leased, key_max)


def running(tables: Tables, queue: str, now: datetime) -> int:
    """The rows of `queue` leased now, which `max_running` counts: a lease past its expiry, or
    a row set aside, is not running."""
    return sum(
        1
        for row in tables.rows.values()
        if row.queue == queue
        and row.acquired_token not in (None, SET_ASIDE_TOKEN)
        and row.lease_expires_at is not None
        and row.lease_expires_at > now
    )


def busy(tables: Tables, queues: set[str] | None, now: datetime) -> list[int]:
    """The ids of the rows of `queues` (every queue when None) held by a runtime (a set-aside
    row is not), or that a claim would take as due now."""
    heads = tables.heads()
    return [
        row.id
        for row in tables.rows.values()
        if (queues is None or row.queue in queues)
        and (
            row.acquired_token not in (None, SET_ASIDE_TOKEN)
            or (pending(row, heads) and row.next_attempt_at <= now)
        )
    ]


def next_times(tables: Tables, queue: str) -> list[datetime]:
    """The due times of the rows of `queue` a claim could take (free, and first of its key),
    and every lease's expiry: when a fetcher has something to claim next."""
    heads = tables.heads()
    rows = [row for row in tables.rows.values() if row.queue == queue]
    times = [row.next_attempt_at for row in rows if pending(row, heads)]
    times += [row.lease_expires_at for row in rows if row.lease_expires_at is not None]
    return times


def _branches(
    tables: Tables, claim: Claim, now: datetime
) -> tuple[list[Row], list[Row], list[Row]]:
    """The rows of `claim.queue`; the claim's first branch, its expired leases; and its second,
    the rows it may take as due at `now`, in `due_order`."""
    heads = tables.heads()
    rows = [row for row in tables.rows.values() if row.queue == claim.queue]
    due = [row for row in rows if pending(row, heads) and row.next_attempt_at <= now]
    due.sort(key=due_order)
    return rows, _expired(rows, set(claim.held), now, heads), due


def _expired(rows: list[Row], held: set[uuid.UUID], now: datetime, heads: Heads) -> list[Row]:
    """The claim's first branch: rows whose lease expired, soonest first, unless held under a
    token of `held`; a keyed row only while it is the oldest of its key left."""
    expired = [
        row
        for row in rows
        if row.acquired_token is not None
        and row.acquired_token not in held
        and row.lease_expires_at is not None
        and row.lease_expires_at < now
        and first_of_key(row, heads)
    ]
    expired.sort(key=lambda row: (row.lease_expires_at, row.id))
    return expired
