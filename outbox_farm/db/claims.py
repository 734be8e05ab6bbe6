"""The fetcher's statements: claim a queue's due rows under a fresh lease, and ask when the
queue next has something to claim."""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any, NamedTuple

from psycopg import AsyncCursor
from psycopg.rows import RowMaker, no_result

from ..queries import Queries
from .boundary import boundary
from .pool import Pool


class ClaimedRow(NamedTuple):
    """One row as the claim returned it, its lease just taken. `acquired_at` is the claim's
    now() on the database clock, the same for every row of one claim."""

    id: int
    payload: bytes
    headers: dict[str, Any] | None
    deliveries_count: int
    attempts_count: int
    created_at: datetime
    next_attempt_at: datetime
    first_attempt_at: datetime | None
    timer_id: str | None
    acquired_at: datetime


def _claimed_rows(cursor: AsyncCursor[Any]) -> RowMaker[ClaimedRow]:
    """Rows by column name, whatever order the statement returns them in; a column the
    statement does not return is a bug in `runtime.sql`, refused at the first claim."""
    if cursor.description is None:
        return no_result  # called for results without rows too, whose maker is never used
    names = [column.name for column in cursor.description]
    if names == list(ClaimedRow._fields):
        return ClaimedRow._make  # the statement's own order: no reordering per row
    missing = set(ClaimedRow._fields) - set(names)
    if missing:
        raise RuntimeError(f"the claim statement does not return {sorted(missing)}")
    positions = [names.index(field) for field in ClaimedRow._fields]

    def make(values: Sequence[Any]) -> ClaimedRow:
        return ClaimedRow._make([values[i] for i in positions])

    return make


async def claim(
    pool: Pool,
    queries: Queries,
    *,
    queue: str,
    limit: int,
    lease_ttl: float,
    token: uuid.UUID,
    held: list[int],
) -> list[ClaimedRow]:
    """Take up to `limit` claimable rows of `queue` (expired leases first, then due rows) under
    `token`, for `lease_ttl` seconds on the database clock, counting a delivery on each. Rows
    whose ids are in `held` are never taken, even when their lease ran out."""
    params = {"queue": queue, "limit": limit, "lease_ttl": lease_ttl, "token": token, "held": held}
    with boundary():
        async with pool.connection() as conn:
            cursor = conn.cursor(row_factory=_claimed_rows)
            await cursor.execute(queries["claim"], params, binary=True)
            rows: list[ClaimedRow] = await cursor.fetchall()
    return rows


async def next_due(pool: Pool, queries: Queries, queue: str) -> float | None:
    """Seconds (database clock) until `queue` has a pending row due or a lease expiring;
    negative when one is already due; None when the queue holds no rows."""
    with boundary():
        async with pool.connection() as conn:
            cursor = await conn.execute(queries["next_due"], {"queue": queue})
            row = await cursor.fetchone()
    return None if row is None or row[0] is None else float(row[0])
