"""Database-derived gauges (backlog, oldest pending age, DLQ rows), refreshed by one process.

Only one process of a farm runs this, so N processes do not run N identical aggregate queries.
Each query is refreshed on its own: a missing DLQ table must not freeze the backlog.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from .metrics import metrics
from .outcome import Reason
from .problems import Problems
from .queries import Queries

log = logging.getLogger("outbox_farm.gauges")


def _set_outbox(queues: list[str], rows: list[Any]) -> None:
    """Queues with no rows are reported as 0, not left at their last value."""
    m = metrics()
    backlog = dict.fromkeys(queues, 0)
    age = dict.fromkeys(queues, 0.0)
    for queue, count, oldest in rows:
        backlog[queue], age[queue] = count, oldest
    for queue, count in backlog.items():
        m.backlog.labels(queue).set(count)
        m.oldest_pending_age.labels(queue).set(age[queue])


def _set_dlq(queues: list[str], rows: list[Any]) -> None:
    """Every reason of every queue is set, 0 when it has no rows, so a purged DLQ reads 0."""
    m = metrics()
    counts = {(q, r.value): 0 for q in queues for r in Reason} | {(q, r): n for q, r, n in rows}
    for (queue, reason), count in counts.items():
        m.dlq_rows.labels(queue, reason).set(count)


async def refresh(
    pool: AsyncConnectionPool[Any],
    queries: Queries,
    queues: list[str],
    problems: Problems,
) -> None:
    """One refresh of every gauge; a failing query leaves only its own gauges unchanged."""
    parts: list[tuple[str, str, Callable[[list[str], list[Any]], None]]] = [
        ("backlog gauges", "gauges", _set_outbox)
    ]
    if queries.names.dlq is not None:
        parts.append(("DLQ gauges", "dlq_gauges", _set_dlq))
    for operation, statement, apply in parts:
        try:
            async with pool.connection() as conn:
                rows = await (await conn.execute(queries[statement])).fetchall()
        except (psycopg.Error, OSError) as exc:
            if not problems.report(operation, exc, log):
                log.warning(
                    "%s refresh failed: %s",
                    operation,
                    str(exc).strip(),
                    extra={"event": "gauges_failed"},
                )
            continue
        problems.solved(operation)
        apply(queues, rows)


async def run(
    pool: AsyncConnectionPool[Any],
    queries: Queries,
    queues: list[str],
    interval: float,
    problems: Problems,
) -> None:
    while True:
        await refresh(pool, queries, queues, problems)
        await asyncio.sleep(interval)
