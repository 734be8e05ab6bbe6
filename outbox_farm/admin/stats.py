"""Per-queue numbers for an operator, fast on a table of millions of rows.

Every count is read from an index range (the pending, lease and (queue, failed_at) indexes) and
capped: at most `exact_limit` rows are counted. Past that the number is the planner's estimate
of the same statement (EXPLAIN, from the table's statistics), and is marked as an estimate. A
count the planner expects to be expensive even with the cap (rows no index covers, such as
"retrying": attempts_count > 0, on a big queue) is estimated without running it. So `stats`
costs milliseconds per queue whatever the table's size, and exact numbers are shown whenever
they are small enough to matter one by one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psycopg

from ..errors import DatabaseError
from ..names import TableNames
from .sql import AdminSql

EXACT_LIMIT = 10_000  # rows counted one by one before the estimate is used
# Planner cost units (about one per page read) above which a capped count is not run at all.
COST_LIMIT = 5_000.0
HOUR, DAY = 3600.0, 86400.0
OUTBOX_COUNTS = {
    "ready": "admin_is_ready",
    "scheduled": "admin_is_scheduled",
    "in_flight": "admin_is_leased",
    "expired": "admin_is_expired",
    "retrying": "admin_is_retrying",
}


@dataclass(frozen=True)
class Count:
    """A number of rows; `exact` False: the planner's estimate (more than the exact limit, or
    too costly to count)."""

    value: int
    exact: bool


@dataclass(frozen=True)
class DlqCounts:
    """DLQ rows of one queue and reason that failed in the last hour, day, and ever."""

    reason: str
    last_hour: Count
    last_day: Count
    total: Count


@dataclass(frozen=True)
class QueueStats:
    queue: str
    counts: dict[str, Count]  # the keys of OUTBOX_COUNTS
    oldest_ready_age: float  # seconds since the oldest ready row became due; 0 when none
    dlq: list[DlqCounts] = field(default_factory=list)

    def dlq_total(self, window: str) -> Count:
        """Sum over reasons of one window (`last_hour`, `last_day`, `total`)."""
        counts = [getattr(line, window) for line in self.dlq]
        return Count(sum(c.value for c in counts), all(c.exact for c in counts))


def _estimate(plan: Any) -> tuple[float, int]:
    """(total cost, rows the scan under the LIMIT would return) from EXPLAIN's JSON."""
    top = plan[0]["Plan"]
    node = top
    while node.get("Node Type") != "Limit" and node.get("Plans"):
        node = node["Plans"][0]
    scanned = node["Plans"][0] if node.get("Plans") else node
    return float(top["Total Cost"]), int(scanned["Plan Rows"])


class RowCounter:
    """Capped counts over one connection, each checked with EXPLAIN first."""

    def __init__(self, conn: psycopg.Connection[Any], names: TableNames, limit: int) -> None:
        self.conn, self.sql, self.limit = conn, AdminSql(names), limit

    def _explain(self, table: str, condition: str, values: dict[str, Any]) -> tuple[float, int]:
        explain = self.sql.render(
            "admin_explain", statement="admin_count", table=table, condition=condition
        )
        row = self.conn.execute(explain, values).fetchone()
        assert row is not None
        return _estimate(row[0])

    def estimate(self, table: str, condition: str, params: dict[str, Any]) -> Count:
        return Count(self._explain(table, condition, params | {"cap": self.limit + 1})[1], False)

    def count(self, table: str, condition: str, params: dict[str, Any]) -> Count:
        values = params | {"cap": self.limit + 1}
        cost, estimate = self._explain(table, condition, values)
        if cost > COST_LIMIT:
            return Count(estimate, False)
        statement = self.sql.render("admin_count", table=table, condition=condition)
        counted = self.conn.execute(statement, values).fetchone()
        assert counted is not None
        if counted[0] <= self.limit:
            return Count(counted[0], True)
        return Count(max(estimate, counted[0]), False)

    def queues(self, block: str) -> list[str]:
        return [row[0] for row in self.conn.execute(self.sql.render(block)).fetchall()]

    def oldest_ready(self, queue: str) -> float:
        row = self.conn.execute(self.sql.render("admin_oldest_ready"), {"queue": queue}).fetchone()
        assert row is not None
        return float(row[0])


def _dlq(counter: RowCounter, queue: str) -> list[DlqCounts]:
    """One capped read of the queue's newest DLQ rows; a window it did not cover whole is
    estimated per reason."""
    statement = counter.sql.render("admin_dlq_newest")
    rows = counter.conn.execute(statement, {"queue": queue, "cap": counter.limit + 1}).fetchall()
    complete = sum(row[3] for row in rows) <= counter.limit
    oldest = rows[0][4] if rows else 0.0
    lines = []
    for reason, hour, day, total, _ in rows:
        found = []
        for window, seconds, value in ((HOUR, HOUR, hour), (DAY, DAY, day), (None, None, total)):
            if complete or (seconds is not None and oldest > seconds):
                found.append(Count(value, True))
            else:
                found.append(
                    counter.estimate(
                        "dlq",
                        "admin_is_dead",
                        {
                            "queue": queue,
                            "reason": reason,
                            "window": window,
                        },
                    )
                )
        lines.append(DlqCounts(reason, *found))
    return lines


def queue_stats(
    conn: psycopg.Connection[Any],
    names: TableNames,
    queue: str | None = None,
    exact_limit: int = EXACT_LIMIT,
) -> list[QueueStats]:
    """Numbers for `queue`, or for every queue with rows in the outbox or the DLQ."""
    counter = RowCounter(conn, names, exact_limit)
    try:
        if queue is not None:
            queues = [queue]
        else:
            found = set(counter.queues("outbox_queues"))
            if names.dlq is not None:
                found.update(counter.queues("dlq_queues"))
            queues = sorted(found)
        return [
            QueueStats(
                q,
                {
                    name: counter.count("outbox", condition, {"queue": q})
                    for name, condition in OUTBOX_COUNTS.items()
                },
                counter.oldest_ready(q),
                _dlq(counter, q) if names.dlq is not None else [],
            )
            for q in queues
        ]
    except psycopg.Error as exc:
        raise DatabaseError(f"stats query failed: {str(exc).strip()}") from exc
