"""DLQ retention: `start --dlq-retention 30d` deletes DLQ rows older than that, a little at a time.

Seed 000 leaves retention to the operator ("a plain DELETE ... from a daily cron"); a farm that
already runs a housekeeping worker can do it without the cron. One process of the farm runs this
loop. Each pass walks the DLQ's queues (a loose scan of the (queue, failed_at) index) and
deletes each queue's rows past the retention in batches of BATCH, each batch its own short
transaction found on that index: a pass costs the rows it deletes, never a scan of the table,
and never holds locks long enough to stall the farm's DLQ moves. Ages are on the database clock.
"""

from __future__ import annotations

import asyncio
import logging
import random

from ..db.housekeeping import dlq_queues, expire_dlq
from ..db.pool import Pool
from ..errors import DatabaseError
from ..metrics import metrics
from ..queries import Queries

log = logging.getLogger("outbox_farm.retention")

BATCH = 500


async def expire_once(pool: Pool, queries: Queries, retention: float, batch: int = BATCH) -> int:
    """Delete every DLQ row that failed more than `retention` seconds ago; how many."""
    total = 0
    for queue in await dlq_queues(pool, queries):
        while True:
            deleted = await expire_dlq(pool, queries, queue, retention, batch)
            if deleted:
                metrics().dlq_purged.labels(queue).inc(deleted)
                total += deleted
            if deleted < batch:
                break
    return total


async def run(pool: Pool, queries: Queries, retention: float, interval: float = 60.0) -> None:
    """Every `interval` seconds (jittered) until cancelled; a failed pass is logged and the
    next one tries again."""
    while True:
        try:
            deleted = await expire_once(pool, queries, retention)
            if deleted:
                log.info(
                    "DLQ retention deleted %d row(s) older than %gs",
                    deleted,
                    retention,
                    extra={"event": "dlq_purged", "rows": deleted},
                )
        except DatabaseError as exc:
            log.warning("DLQ retention failed: %s", exc, extra={"event": "dlq_purge_failed"})
        await asyncio.sleep(interval * random.uniform(0.9, 1.1))
