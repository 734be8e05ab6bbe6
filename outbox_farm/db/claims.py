"""The fetcher's statements: claim a queue's due rows under a fresh lease, and ask when the
queue next has something to claim."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from psycopg import AsyncCursor

from ..queries import Queries
from .boundary import boundary
from .pool import Pool

ClaimedRow = tuple[
    int,  # id
    bytes,  # payload
    dict[str, Any] | None,  # headers
    int,  # deliveries_count
    int,  # attempts_count
    datetime,  # created_at
    datetime,  # next_attempt_at
    datetime | None,  # first_attempt_at
    str | None,  # timer_id
    datetime,  # acquired_at: the claim's now(), the same for every row of one claim
    str | None,  # ordering_key
]
"""One row as the claim returned it, its lease just taken, in the order of `CLAIMED_COLUMNS`.

A plain tuple rather than a named one: the fetcher turns each row into a `Message` at once, and
psycopg builds plain tuples on its fast path (a row factory costs about a microsecond a row,
a few percent of the whole per-message cost). The order is guaranteed by column name here, so a
reordered `runtime.sql` still works and a missing column is refused at the first claim."""

CLAIMED_COLUMNS = (
    "id",
    "payload",
    "headers",
    "deliveries_count",
    "attempts_count",
    "created_at",
    "next_attempt_at",
    "first_attempt_at",
    "timer_id",
    "acquired_at",
    "ordering_key",
)


def _in_order(cursor: AsyncCursor[Any], rows: list[Any]) -> list[ClaimedRow]:
    """`rows` in the order of `CLAIMED_COLUMNS`, whatever order the statement returned."""
    names = tuple(column.name for column in cursor.description or ())
    if names == CLAIMED_COLUMNS:
        return rows
    missing = set(CLAIMED_COLUMNS) - set(names)
    if missing:
        raise RuntimeError(f"the claim statement does not return {sorted(missing)}")
    positions = [names.index(name) for name in CLAIMED_COLUMNS]
    return [tuple(row[i] for i in positions) for row in rows]


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
            cursor = await conn.execute(queries["claim"], params, binary=True)
            return _in_order(cursor, await cursor.fetchall())


async def next_due(pool: Pool, queries: Queries, queue: str) -> float | None:
    """Seconds (database clock) until `queue` has a pending row due or a lease expiring;
    negative when one is already due; None when the queue holds no rows."""
    with boundary():
        async with pool.connection() as conn:
            cursor = await conn.execute(queries["next_due"], {"queue": queue})
            row = await cursor.fetchone()
    return None if row is None or row[0] is None else float(row[0])
