"""Database-derived gauges (backlog, oldest pending age, DLQ rows, the xmin horizon's age),
refreshed by one process.

Only one process of a farm runs this, so N processes do not run N identical aggregate queries.
Each query is refreshed on its own: a missing DLQ table must not freeze the backlog.

The xmin horizon matters to an outbox more than to most tables: every delivered row is deleted,
and while an open snapshot holds the horizon back, VACUUM can remove none of those dead rows, so
claims slow down as they step over them. The farm cannot end such a transaction; it says so, with
the backend that holds it, once a minute while it lasts.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable
from typing import TypeVar

from .db.housekeeping import DlqCount, QueueBacklog, backlog, dlq_counts, xmin_holders
from .db.operator import XminHolder
from .db.pool import Pool
from .errors import DatabaseError
from .metrics import metrics
from .outcome import Reason
from .problems import Problems
from .queries import Queries

log = logging.getLogger("outbox_farm.gauges")

T = TypeVar("T")
XMIN_WARN_AFTER = 60.0  # seconds a snapshot may hold the horizon back before the farm warns
XMIN_WARN_EVERY = 60.0  # seconds between two warnings while it lasts


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


class XminWatch:
    """Sets the horizon gauge, and warns (at most every XMIN_WARN_EVERY seconds) while a
    snapshot has held it back for more than `warn_after` seconds."""

    def __init__(self, warn_after: float = XMIN_WARN_AFTER) -> None:
        self.warn_after = warn_after
        self._warned_at = -math.inf

    def saw(self, holder: XminHolder | None) -> None:
        seconds = holder.seconds if holder is not None and holder.seconds is not None else 0.0
        metrics().xmin_horizon_age.set(seconds)
        if holder is None or seconds <= self.warn_after:
            self._warned_at = -math.inf
            return
        now = time.monotonic()
        if now - self._warned_at < XMIN_WARN_EVERY:
            return
        self._warned_at = now
        log.warning(
            "the xmin horizon has been held back for %.0fs by %s %s: VACUUM cannot remove the "
            "outbox's dead rows meanwhile and claims slow down; end that transaction (or drop "
            "the slot) if it is not meant to last",
            seconds,
            holder.kind,
            holder.who,
            extra={"event": "xmin_held", "holder": holder.who, "seconds": round(seconds, 1)},
        )


async def refresh(
    pool: Pool,
    queries: Queries,
    queues: list[str],
    problems: Problems,
    xmin: XminWatch | None = None,
) -> None:
    """One refresh of every gauge; a failing query leaves only its own gauges unchanged."""
    rows = await _read("backlog gauges", backlog(pool, queries), problems)
    if rows is not None:
        _set_outbox(queues, rows)
    if xmin is not None:
        holders = await _read("xmin gauge", xmin_holders(pool, queries), problems)
        if holders is not None:
            xmin.saw(holders[0] if holders else None)
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
    xmin = XminWatch()
    while True:
        await refresh(pool, queries, queues, problems, xmin)
        await asyncio.sleep(interval)
