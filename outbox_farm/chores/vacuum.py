"""Vacuums the outbox table at the pace it churns, because autovacuum cannot.

Every message leaves two dead row versions (the claim's UPDATE and the DELETE); at 10,000 msg/s
that is 20,000 a second. Autovacuum looks at a database at most once per `autovacuum_naptime`
(server-wide, one minute by default; the per-table thresholds shipped in the migration cannot
make it look sooner). Between visits the claim's index scan steps over ever more dead entries:
in a five-minute run at 10,000 msg/s the table grew to 365 MB, one claim of 64 rows read up to
17,300 buffers, and throughput swung between 5,500 and 14,500 msg/s with a backlog of 270,000.
With a VACUUM every 10 s the table stayed at 38 MB, claims read 1 to 11 buffers and each VACUUM
took about 30 ms.

One process of a farm runs this loop (as with the gauges). It asks the statistics first, so an
idle or lightly used table is left alone, and never queues behind autovacuum (SKIP_LOCKED).
Each pass then gives the table's space back if a backlog left it big and nearly empty
(`shrink`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from enum import Enum

from ..db import housekeeping
from ..db.pool import Pool
from ..errors import DatabaseError
from ..metrics import metrics
from ..queries import Queries
from .shrink import Shrinker

log = logging.getLogger("outbox_farm.vacuum")

MIN_DEAD_TUPLES = 1000  # below this a VACUUM costs more than the dead rows do


class Pass(Enum):
    """What one pass of the loop did."""

    VACUUMED = "vacuumed"
    NOT_DUE = "not_due"  # few dead rows, or someone vacuumed recently
    SKIPPED = "skipped"  # autovacuum or another process holds the table
    NOT_ALLOWED = "not_allowed"  # this role may not vacuum the table: the loop stops


async def vacuum_once(pool: Pool, queries: Queries, interval: float) -> Pass:
    """Vacuum the outbox table if it has enough dead rows and nobody did in half an interval
    (or, when the server keeps no statistics, every time)."""
    state = await housekeeping.vacuum_state(pool, queries)
    if not state.allowed:
        return Pass.NOT_ALLOWED
    since = state.since_vacuum
    # Without counts every pass vacuums: nothing else will (autovacuum needs them too).
    if state.counted and (
        state.dead_rows < MIN_DEAD_TUPLES or (since is not None and since < interval / 2)
    ):
        return Pass.NOT_DUE
    started = time.perf_counter()
    vacuumed = await housekeeping.vacuum(pool, queries)
    if vacuumed.skipped:
        return Pass.SKIPPED
    for message in vacuumed.warnings:
        log.warning("vacuum: %s", message, extra={"event": "vacuum_warning"})
    seconds = time.perf_counter() - started
    metrics().vacuum_seconds.observe(seconds)
    log.debug(
        "vacuumed %s (%d dead rows) in %.3f s",
        queries.names.outbox,
        state.dead_rows,
        seconds,
        extra={"event": "vacuumed", "dead_tuples": state.dead_rows},
    )
    return Pass.VACUUMED


async def run(pool: Pool, queries: Queries, interval: float) -> None:
    """Every `interval` seconds (jittered, so restarted processes drift apart) until cancelled,
    or until the role turns out not to be allowed to vacuum (nor, then, to shrink)."""
    shrinker = Shrinker(pool, queries, interval)
    while True:
        try:
            if await vacuum_once(pool, queries, interval) is not Pass.NOT_ALLOWED:
                await shrinker.once()
            else:
                log.warning(
                    "not vacuuming %s: this role neither owns it nor has MAINTAIN on it; "
                    "autovacuum alone will keep it (slower under load). Grant ownership or "
                    "MAINTAIN (PostgreSQL 17+), or pass --vacuum-interval 0 to silence this",
                    queries.names.outbox,
                    extra={"event": "vacuum_disabled"},
                )
                return
        except DatabaseError as exc:
            log.warning("vacuum failed: %s", exc, extra={"event": "vacuum_failed"})
        await asyncio.sleep(interval * random.uniform(0.9, 1.1))
