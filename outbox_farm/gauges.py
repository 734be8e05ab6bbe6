"""Database-derived gauges (backlog, oldest pending age, DLQ rows), refreshed by one process.

Only one process of a farm runs this, so N processes do not run N identical aggregate queries.
Each query is refreshed on its own: a missing DLQ table must not freeze the backlog.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable
from typing import TypeVar

from .db.housekeeping import DlqCount, QueueBacklog, backlog, dlq_counts
from .db.pool import Pool
from .errors import DatabaseError
from .metrics import metrics
from .outcome import Reason
from .problems import Problems
from .queries import Queries

log = logging.getLogger("outbox_farm.gauges")

T = TypeVar("T")


def _set_outbox(queues: list[str], rows: list[QueueBacklog]) -> None:
    """Queues with no rows are reported as 0, not left at their last value."""
    m = metrics()
    counts = dict.fromkeys(queues, 0)
    age = dict.fromkeys(queues, 0.0)
    for row in rows:
        counts[row.queue], age[row.queue] = row.rows, row.oldest_pending_age
    for queue, count in counts.items():
        m.backlog.labels(queue).set(count)
        m.oldest_pending_age.labels(queue).set(age[queue])


def _set_dlq(queues: list[str], rows: list[DlqCount]) -> None:
    """Every reason of every queue is set, 0 when it has no rows, so a purged DLQ reads 0."""
    m = metrics()
    counts = {(q, r.value): 0 for q in queues for r in Reason}
    counts |= {(row.queue, row.reason): row.rows for row in rows}
    for (queue, reason), count in counts.items():
        m.dlq_rows.labels(queue, reason).set(count)


async def _read(operation: str, read: Awaitable[T], problems: Problems) -> T | None:
    """The result of `read`, or None (logged, or reported as a problem) when it failed."""
    try:
        result = await read
    except DatabaseError as exc:
        if not problems.report(operation, exc, log):
            log.warning("%s refresh failed: %s", operation, exc, extra={"event": "gauges_failed"})
        return None
    problems.solved(operation)
    return result


async def refresh(pool: Pool, queries: Queries, queues: list[str], problems: Problems) -> None:
    """One refresh of every gauge; a failing query leaves only its own gauges unchanged."""
    rows = await _read("backlog gauges", backlog(pool, queries), problems)
    if rows is not None:
        _set_outbox(queues, rows)
    if queries.names.dlq is not None:
        counts = await _read("DLQ gauges", dlq_counts(pool, queries), problems)
        if counts is not None:
            _set_dlq(queues, counts)


async def run(
    pool: Pool,
    queries: Queries,
    queues: list[str],
    interval: float,
    problems: Problems,
) -> None:
    while True:
        await refresh(pool, queries, queues, problems)
        await asyncio.sleep(interval)
