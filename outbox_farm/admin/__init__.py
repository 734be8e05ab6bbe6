"""The operator tools as a Python API, for admin scripts: what `outbox-farm stats`, `dlq`,
`queue` and `doctor` run. Every function takes a psycopg connection (outside a transaction:
replay and purge commit batch by batch, each queue change is a transaction of its own) and the
`TableNames` of the farm's tables.

    from outbox_farm.admin import DlqFilter, TableNames, When, dlq_replay

    names = TableNames.build("outbox", "outbox_dlq")
    with psycopg.connect(dsn, autocommit=True) as conn:
        done = dlq_replay(conn, names, DlqFilter(queue="orders", since=When.parse("2h")))
"""

from ..db.dlq import DlqRow, Done, Summary, SummaryLine
from ..names import TableNames
from .dlq import (
    CauseGroup,
    DlqEntry,
    DlqFilter,
    Payload,
    Selection,
    dlq_causes,
    dlq_count,
    dlq_list,
    dlq_purge,
    dlq_replay,
    dlq_show,
    dlq_summary,
)
from .durations import When, parse_duration
from .queues import (
    UNCHANGED,
    BreakerState,
    ClosedBreaker,
    QueueState,
    Unchanged,
    close_breaker,
    limit_queue,
    pause_queue,
    queue_state,
    queue_states,
    resume_queue,
)
from .stats import Count, DlqCounts, QueueStats, queue_stats

__all__ = [
    "UNCHANGED",
    "BreakerState",
    "CauseGroup",
    "ClosedBreaker",
    "Count",
    "DlqCounts",
    "DlqEntry",
    "DlqFilter",
    "DlqRow",
    "Done",
    "Payload",
    "QueueState",
    "QueueStats",
    "Selection",
    "Summary",
    "SummaryLine",
    "TableNames",
    "Unchanged",
    "When",
    "close_breaker",
    "dlq_causes",
    "dlq_count",
    "dlq_list",
    "dlq_purge",
    "dlq_replay",
    "dlq_show",
    "dlq_summary",
    "limit_queue",
    "parse_duration",
    "pause_queue",
    "queue_state",
    "queue_states",
    "queue_stats",
    "resume_queue",
]
