"""Database-derived gauges (backlog, oldest pending age, DLQ rows, the xmin horizon's age),
refreshed by one process.

Only one process of a farm runs this, so N processes do not run N identical aggregate queries.
Each query is refreshed on its own: a missing DLQ table must not freeze the backlog.

Both counts read every row they count, so neither runs again sooner than twenty times its last
duration after it started (`Pace`): a backlog of ten million rows took 2.9 s to count, which
every 5 s was half a core of the database busy counting while the farm drained it; paced, it
is a twentieth, and the gauge is at most a minute old at that depth (a 100,000-row backlog is
counted in tens of milliseconds: every refresh, as before). The DLQ is the one table here that
can grow without bound (no retention set, nobody replaying), so it is counted again only when
the server's statistics say its rows may have changed, as well: a DLQ of millions that nobody
touches costs one catalog lookup per refresh.

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

from ..db.housekeeping import (
    DlqCount,
    QueueBacklog,
    backlog,
    dlq_counts,
    dlq_signature,
    xmin_holders,
)
from ..db.operator import XminHolder
from ..db.pool import Pool
from ..errors import DatabaseError
from ..metrics import metrics
from ..outcome import Reason
from ..problems import Problems
from ..queries import Queries

log = logging.getLogger("outbox_farm.gauges")

T = TypeVar("T")
XMIN_WARN_AFTER = 60.0  # seconds a snapshot may hold the horizon back before the farm warns
XMIN_WARN_EVERY = 60.0  # seconds between two warnings while it lasts
DLQ_RECOUNT_AFTER = 300.0  # seconds after which the DLQ is counted again, changed or not
PAUSE = 20.0  # a count is followed by at least this many times its own duration


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


async def _read(
    operation: str, read: Awaitable[T], problems: Problems, *, solves: bool = True
) -> T | None:
    """The result of `read`, or None (logged, or reported as a problem) when it failed.
    `solves`: its success ends the operation's problem (not so for a read that cannot see it)."""
    try:
        result = await read
    except DatabaseError as exc:
        if not problems.report(operation, exc, log):
            log.warning("%s refresh failed: %s", operation, exc, extra={"event": "gauges_failed"})
        return None
    if solves:
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


class Pace:
    """When a count may run again: not sooner than its last run's duration times `pause` after
    that run began, so counting takes at most a `pause`-th of a connection's time (a count that
    took 2 s waits 40 s)."""

    def __init__(self, pause: float = PAUSE) -> None:
        self.pause = pause
        self._began = -math.inf
        self._took = 0.0

    def ready(self, now: float) -> bool:
        return now - self._began >= self._took * self.pause

    def ran(self, began: float, ended: float) -> None:
        self._began, self._took = began, ended - began


class DlqWatch:
    """Decides when the DLQ is worth counting again.

    A count is due when the table's signature (its file, and the statistics' row changes)
    moved since the last count, when there is no signature to go by, or when the last count is
    `recount_after` seconds old (statistics can be reset or lag); and its `Pace` allows it.
    """

    def __init__(self, recount_after: float = DLQ_RECOUNT_AFTER, pause: float = PAUSE) -> None:
        self.recount_after = recount_after
        self.pace = Pace(pause)
        self.counts = 0  # how many counts were run: what the tests observe
        self._signature: tuple[int, int] | None = None
        self._counted_at = -math.inf

    def due(self, signature: tuple[int, int] | None, now: float) -> bool:
        if not self.pace.ready(now):
            return False
        since = now - self._counted_at
        return signature is None or signature != self._signature or since >= self.recount_after

    def counted(self, signature: tuple[int, int] | None, began: float, ended: float) -> None:
        """A count that started at `began`, after `signature` was read, succeeded."""
        self.counts += 1
        self._signature, self._counted_at = signature, began
        self.pace.ran(began, ended)

    def failed(self) -> None:
        """The count failed: the next refresh tries again, whatever the signature says."""
        self._signature = None


async def _refresh_dlq(
    pool: Pool, queries: Queries, queues: list[str], problems: Problems, watch: DlqWatch
) -> None:
    # The signature is read before the count: a change committed after the count then moves
    # a signature read later, and is counted at the next refresh.
    signature = await _read("DLQ gauges", dlq_signature(pool, queries), problems, solves=False)
    began = time.monotonic()
    if not watch.due(signature, began):
        return
    counts = await _read("DLQ gauges", dlq_counts(pool, queries), problems)
    if counts is None:
        watch.failed()
        return
    _set_dlq(queues, counts)
    watch.counted(signature, began, time.monotonic())


async def refresh(
    pool: Pool,
    queries: Queries,
    queues: list[str],
    problems: Problems,
    xmin: XminWatch | None = None,
    dlq: DlqWatch | None = None,
    pace: Pace | None = None,
) -> None:
    """One refresh of every gauge; a failing query leaves only its own gauges unchanged.
    Without a `dlq` watch or a backlog `pace` (one refresh, no history), both are counted."""
    began = time.monotonic()
    if pace is None or pace.ready(began):
        rows = await _read("backlog gauges", backlog(pool, queries), problems)
        if rows is not None:
            _set_outbox(queues, rows)
            if pace is not None:
                pace.ran(began, time.monotonic())
    if xmin is not None:
        holders = await _read("xmin gauge", xmin_holders(pool, queries), problems)
        if holders is not None:
            xmin.saw(holders[0] if holders else None)
    if queries.names.dlq is not None:
        await _refresh_dlq(pool, queries, queues, problems, dlq or DlqWatch())


async def run(
    pool: Pool,
    queries: Queries,
    queues: list[str],
    interval: float,
    problems: Problems,
) -> None:
    xmin, dlq, pace = XminWatch(), DlqWatch(), Pace()
    while True:
        await refresh(pool, queries, queues, problems, xmin, dlq, pace)
        await asyncio.sleep(interval)
