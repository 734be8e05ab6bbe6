"""The release of a dead worker's leases by its supervisor (the runtime's own lease statements
are `store.PostgresStore`'s)."""

from __future__ import annotations

from ..queries import Queries
from ..tokens import token_range
from .boundary import boundary
from .connect import Connection, bounded


def release_worker(conn: Connection, queries: Queries, worker_id: int) -> int:
    """Clear the lease of every row held under a token of `worker_id`; return how many.

    For a supervisor that has just reaped the worker: the rows become claimable at once. The
    delivery the dead worker's claim counted is kept, so a message that kills its worker on
    every run still reaches `max_deliveries` and the DLQ. Tokens are UUIDs, which Postgres
    orders bytewise, so one worker's tokens are one range; only leased rows are visited.
    The UPDATE runs in `conn`'s current transaction: use an autocommit connection, or commit.
    """
    low, high = token_range(worker_id)
    with boundary(), conn.cursor() as cursor:
        cursor.execute(queries["release_worker"], {"low": low, "high": high})
        return max(cursor.rowcount, 0)


def release_dead_worker(dsn: str, queries: Queries, worker_id: int, timeout: float) -> int:
    """`release_worker` on a connection of its own, bounded by `timeout` for the connect and
    for the statement: the supervisor holds no connection between forks, and must not hang."""
    with boundary(), bounded(dsn, timeout) as conn:
        return release_worker(conn, queries, worker_id)
