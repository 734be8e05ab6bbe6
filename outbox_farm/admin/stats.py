"""Per-queue numbers for an operator, fast on a table of millions of rows.

Every count is read from an index range (the pending, lease, blocked and (queue, failed_at)
indexes) and capped: at most `exact_limit` rows are counted. Past that the number is the
planner's estimate of the same statement (EXPLAIN, from the table's statistics), and is marked
as an estimate. A
count the planner expects to be expensive even with the cap (rows no index covers, such as
"retrying": attempts_count > 0, on a big queue) is estimated without running it. So `stats`
costs milliseconds per queue whatever the table's size, and exact numbers are shown whenever
they are small enough to matter one by one.

A queue is marked stalled when its oldest claimable row has waited longer than `STALL_AFTER`
while no row of it is under a live lease: rows are due and nobody is working on them, the
mark of a farm that is not running for the queue (or whose claims of it never take a row).
A busy farm that is merely behind holds leases, and is not stalled: its lag is the oldest
ready row's age. Judged from two index probes; the claim itself is probed by `doctor`.

A paused queue is never stalled: its rows wait because an operator said so; nor is one whose
breaker is open: its rows wait for the downstream, and one probe row runs each interval. Each
queue shows its pause (`paused`, until when and why), its farm-wide `limits` and its `breaker`
(open since when, why, the next probe; or the failures counted), as `queue list` does.

The queues shown are those with rows in the outbox or the DLQ, those paused, limited or with a
breaker open or counting, and
those the caller knows of (`known`: the app's registered queues, those a running farm serves),
which show with zeros when idle: a queue that is registered and empty is news too. Each
queue's DLQ rows are also shown by cause, the few causes with most rows (`dlq_causes`, from
migration 0009's counts).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime

from ..db import queue_controls
from ..db.connect import Connection
from ..db.dlq import CauseGroup, counts_kept
from ..db.operator import OUTBOX_CONDITIONS, OutboxFigure, StallFacts, StatsReader
from ..limits import Limits
from ..names import TableNames
from .dlq import DlqFilter, dlq_causes
from .queues import BreakerState, QueueState, queue_states

EXACT_LIMIT = 10_000  # rows counted one by one before the estimate is used
# Planner cost units (about one per page read) above which a capped count is not run at all.
COST_LIMIT = 5_000.0
HOUR, DAY = 3600.0, 86400.0
# Seconds a claimable row may wait, with nothing of its queue leased, before the queue counts
# as stalled: the farm's own threshold for an idle queue whose row ages (the fetcher's).
STALL_AFTER = 60.0
OUTBOX_COUNTS: tuple[OutboxFigure, ...] = tuple(OUTBOX_CONDITIONS)  # in the order shown
CAUSES_PER_QUEUE = 3  # the causes with most DLQ rows, shown for each queue


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
    counts: dict[str, Count]  # by the names of OUTBOX_COUNTS
    oldest_ready_age: float  # seconds since the oldest ready row became due; 0 when none
    dlq: list[DlqCounts] = field(default_factory=list)
    stalled: str | None = None  # why the queue looks stalled (`stall_reason`); None: it is not
    causes: list[CauseGroup] = field(default_factory=list)  # its DLQ's top causes, most first
    paused: bool = False  # paused now by an operator (`outbox-farm queue pause`)
    paused_until: datetime | None = None  # when that pause ends by itself; None: at a resume
    pause_reason: str | None = None
    limits: Limits = field(default_factory=Limits)  # farm-wide (`outbox-farm queue limit`)
    breaker: BreakerState = field(default_factory=BreakerState)  # open or counting, or neither

    def dlq_total(self, window: str) -> Count:
        """Sum over reasons of one window (`last_hour`, `last_day`, `total`)."""
        counts = [getattr(line, window) for line in self.dlq]
        return Count(sum(c.value for c in counts), all(c.exact for c in counts))


def stall_reason(facts: StallFacts, after: float) -> str | None:
    """Why a queue with these facts is stalled, as one line; None when it is not: nothing has
    waited longer than `after` seconds, or some row of it is leased (a farm works on it)."""
    if facts.leased or facts.oldest_due <= after:
        return None
    return (
        f"stalled: oldest ready row {facts.oldest_due:.0f}s old and none of its rows leased: "
        "is a farm running for this queue?"
    )


def held(control: QueueState) -> bool:
    """Whether a queue's rows wait by design, so that waiting is no stall: it is paused, or
    its breaker is open."""
    return control.paused or control.breaker.open


def _count(reader: StatsReader, figure: OutboxFigure, queue: str, limit: int) -> Count:
    """Counted up to `limit`, unless the planner expects even that to be costly; past it, the
    planner's estimate (or the count, should that be higher)."""
    plan = reader.plan_outbox(figure, queue, limit + 1)
    if plan.cost > COST_LIMIT:
        return Count(plan.rows, False)
    counted = reader.count_outbox(figure, queue, limit + 1)
    if counted <= limit:
        return Count(counted, True)
    return Count(max(plan.rows, counted), False)


def _dlq(reader: StatsReader, queue: str, limit: int) -> list[DlqCounts]:
    """One capped read of the queue's newest DLQ rows; a window it did not cover whole is
    estimated per reason."""
    rows = reader.newest_dead(queue, limit + 1)
    complete = sum(row.total for row in rows) <= limit
    oldest = rows[0].oldest_age if rows else 0.0
    lines = []
    for row in rows:
        found = []
        for window, value in ((HOUR, row.last_hour), (DAY, row.last_day), (None, row.total)):
            if complete or (window is not None and oldest > window):
                found.append(Count(value, True))
            else:
                plan = reader.plan_dead(queue, row.reason, window, limit + 1)
                found.append(Count(plan.rows, False))
        lines.append(DlqCounts(row.reason, *found))
    return lines


def _causes(conn: Connection, names: TableNames, queues: list[str]) -> dict[str, list[CauseGroup]]:
    """Each queue's top causes; none at all on a DLQ migrated before migration 0009 (the
    other figures do not need it)."""
    if names.dlq is None or not counts_kept(conn, names):
        return {}
    return {q: dlq_causes(conn, names, DlqFilter(queue=q), CAUSES_PER_QUEUE) for q in queues}


def _controls(conn: Connection, names: TableNames) -> dict[str, QueueState]:
    """The queues' controls by queue; none on a database migrated before the controls table
    (the other figures do not need it; `check` reports it)."""
    if not queue_controls.controls_kept(conn, names):
        return {}
    return {state.queue: state for state in queue_states(conn, names)}


def queue_stats(
    conn: Connection,
    names: TableNames,
    queue: str | None = None,
    exact_limit: int = EXACT_LIMIT,
    stall_after: float = STALL_AFTER,
    *,
    known: Iterable[str] = (),
) -> list[QueueStats]:
    """Numbers for `queue`, or for every queue with rows in the outbox or the DLQ, every
    queue paused or limited and every queue of `known` (with zeros when it has none), sorted;
    each with its pause, limits and breaker, and marked stalled when its oldest claimable row
    has waited over `stall_after` seconds with none of its rows leased, unless it is paused or
    its breaker is open (its rows wait by design then)."""
    reader = StatsReader(conn, names)
    controls = _controls(conn, names)
    if queue is not None:
        queues = [queue]
    else:
        queues = sorted(set(reader.queues()) | set(known) | set(controls))
    causes = _causes(conn, names, queues)
    found = []
    for q in queues:
        control = controls.get(q) or QueueState.free(q)
        found.append(
            QueueStats(
                q,
                {figure: _count(reader, figure, q, exact_limit) for figure in OUTBOX_COUNTS},
                reader.oldest_ready(q),
                _dlq(reader, q, exact_limit) if names.dlq is not None else [],
                None if held(control) else stall_reason(reader.stall(q), stall_after),
                causes.get(q, []),
                control.paused,
                control.paused_until,
                control.reason if control.paused else None,
                control.limits,
                control.breaker,
            )
        )
    return found
