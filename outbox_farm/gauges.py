"""Database-derived gauges (backlog, oldest pending age, DLQ rows), refreshed by one process.

Only one process of a farm runs this, so N processes do not run N identical aggregate queries.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from .metrics import metrics
from .queries import Queries

log = logging.getLogger("outbox_farm.gauges")


async def refresh(pool: AsyncConnectionPool[Any], queries: Queries, queues: list[str]) -> None:
    """One refresh. Queues with no rows are reported as 0, not left at their last value."""
    m = metrics()
    async with pool.connection() as conn:
        rows = await (await conn.execute(queries["gauges"])).fetchall()
        dlq_rows = []
        if queries.names.dlq is not None:
            dlq_rows = await (await conn.execute(queries["dlq_gauges"])).fetchall()
    backlog = {q: 0 for q in queues}
    age = {q: 0.0 for q in queues}
    for queue, count, oldest in rows:
        backlog[queue], age[queue] = count, oldest
    for queue, count in backlog.items():
        m.backlog.labels(queue).set(count)
        m.oldest_pending_age.labels(queue).set(age[queue])
    dlq = {q: 0 for q in queues} | dict(dlq_rows)
    for queue, count in dlq.items():
        m.dlq_rows.labels(queue).set(count)


async def run(
    pool: AsyncConnectionPool[Any], queries: Queries, queues: list[str], interval: float
) -> None:
    while True:
        try:
            await refresh(pool, queries, queues)
        except (psycopg.Error, OSError) as exc:
            log.warning(
                "gauge refresh failed: %s", str(exc).strip(), extra={"event": "gauges_failed"}
            )
        await asyncio.sleep(interval)
