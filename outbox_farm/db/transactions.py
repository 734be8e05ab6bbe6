"""Transactional handlers: the handler's writes and its row's completion in one transaction.

The row is deleted (token-guarded) after the handler's own statements and before the commit, so
both become permanent together or not at all; the row is not locked while the handler runs, so
the heartbeat keeps extending its lease meanwhile. The connections come from a pool of their own
(one per running transactional handler): a handler's transaction must never wait for, or hold
up, the claims and outcome writes of the runtime's pool.
"""

from __future__ import annotations

import enum
import uuid
from collections.abc import Awaitable, Callable

import psycopg

from ..queries import Queries
from .boundary import boundary
from .connect import AsyncConnection
from .pool import Pool, pooled


class Completion(enum.Enum):
    COMPLETED = "completed"  # committed: the handler's writes and the row's deletion
    DECLINED = "declined"  # the handler decided otherwise (nack, reject, no ack): rolled back
    LEASE_LOST = "lease_lost"  # another token holds the row, or it is gone: rolled back


async def run_completing(
    pool: Pool,
    queries: Queries,
    row_id: int,
    token: uuid.UUID,
    work: Callable[[AsyncConnection], Awaitable[bool]],
) -> Completion:
    """Run `work(conn)` in a transaction; when it returns True, delete the row under `token`
    in the same transaction and commit. What `work` raises rolls everything back and is raised
    as it is (the handler's own error); a failure to get a connection, of the deletion or of the
    commit is translated at the boundary (`ConnectionLost` at the commit: outcome unknown)."""
    completion = Completion.DECLINED
    in_work = False
    try:
        async with pooled(pool) as conn, conn.transaction() as tx:
            in_work = True
            completes = await work(conn)
            in_work = False
            if not completes:
                raise psycopg.Rollback(tx)
            cursor = await conn.execute(
                queries["complete_in_transaction"], {"id": row_id, "token": token}
            )
            if await cursor.fetchone() is None:
                completion = Completion.LEASE_LOST
                raise psycopg.Rollback(tx)
            completion = Completion.COMPLETED
    except psycopg.Error:
        if in_work:
            raise
        with boundary():
            raise
    return completion
