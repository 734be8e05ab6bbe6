"""Waiting for the farm to drain before the checker runs.

The invariants hold only of a finished run: checked while a message is still in flight, a
sound farm would look broken. The load test, the checker's command line and the chaos suite
all wait here, bounded in time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from loadtests.harness import Metrics
from loadtests.scenario import TABLE
from outbox_farm.names import TableNames


@dataclass
class Drain:
    drained: bool
    seconds: float
    outbox_rows: int
    inflight: float


def wait_for_drain(
    conn: psycopg.Connection[Any],
    metrics_url: str | None,
    timeout: float,
    *,
    table: str = TABLE,
    every: float = 1.0,
    say: Callable[[str], None] = lambda line: None,
) -> Drain:
    """Wait (at most `timeout` s) until the outbox is empty, nothing is in flight and neither
    the counters nor the ledger moved between two polls `every` s apart.

    An empty outbox alone is not enough: a slow handler whose row was taken over and acked
    elsewhere is still running, and will still write its ledger row and its lease_lost.
    `conn` must be in autocommit mode, so that every poll sees fresh data.
    """
    outbox = TableNames.build(table).identifiers()["outbox"]
    count_q = sql.SQL("SELECT (SELECT count(*) FROM {}), (SELECT count(*) FROM loadtest_ledger)")
    began = time.monotonic()
    deadline = began + max(timeout, 0)
    previous: object = None
    rows, inflight = -1, -1.0
    for _ in range(100_000):  # bounded by the deadline long before
        counts = conn.execute(count_q.format(outbox)).fetchone()
        rows, ledger = (int(counts[0]), int(counts[1])) if counts else (-1, -1)
        metrics = Metrics.scrape(metrics_url) if metrics_url else Metrics([])
        inflight = metrics.total("outbox_farm_inflight") if metrics is not None else -1.0
        state = (rows, ledger, metrics.counters() if metrics is not None else None)
        if rows == 0 and inflight == 0 and state == previous:
            return Drain(True, time.monotonic() - began, rows, inflight)
        previous = state
        now = time.monotonic()
        if now >= deadline:
            break
        flight = f"{inflight:g}" if inflight >= 0 else "? (no /metrics)"
        say(f"draining: {rows} outbox row(s), {flight} in flight")
        time.sleep(min(every, max(deadline - now, 0.0)))
    return Drain(False, time.monotonic() - began, rows, inflight)
