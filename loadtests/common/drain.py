"""Waiting for the farm to drain before the checker runs.

The invariants hold only of a finished run: checked while a message is still in flight, a
sound farm would look broken. The load test, the checker's command line and the chaos and
scale suites all wait here, bounded in time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from loadtests.common.harness import Metrics
from loadtests.common.tables import OUTBOX
from loadtests.common.waits import wait_until
from outbox_farm.names import TableNames


@dataclass
class Drain:
    drained: bool
    seconds: float
    outbox_rows: int
    inflight: float


def wait_for_drain(
    conn: psycopg.Connection[Any],
    metrics: str | Callable[[], Metrics | None] | None,
    timeout: float,
    *,
    table: str = OUTBOX,
    every: float = 1.0,
    say: Callable[[str], None] = lambda line: None,
) -> Drain:
    """Wait (at most `timeout` s) until the outbox is empty, nothing is in flight and neither
    the counters nor the ledger moved between two polls `every` s apart.

    `metrics` is the farm's /metrics URL, or what scrapes several farms as one (None while
    one does not answer), or None where there is no /metrics to read.

    An empty outbox alone is not enough: a slow handler whose row was taken over and acked
    elsewhere is still running, and will still write its ledger row and its lease_lost.
    `conn` must be in autocommit mode, so that every poll sees fresh data.
    """
    outbox = TableNames.build(table).identifiers()["outbox"]
    count_q = sql.SQL(
        "SELECT (SELECT count(*) FROM {}), (SELECT count(*) FROM loadtest_ledger)"
    ).format(outbox)
    scrape = _scraper(metrics)
    began = time.monotonic()
    drain = Drain(False, 0.0, -1, -1.0)
    previous: object = None

    def settled() -> bool:
        nonlocal previous
        counts = conn.execute(count_q).fetchone()
        rows, ledger = (int(counts[0]), int(counts[1])) if counts else (-1, -1)
        scraped = scrape()
        inflight = scraped.total("outbox_farm_inflight") if scraped is not None else -1.0
        state = (rows, ledger, scraped.counters() if scraped is not None else None)
        still = rows == 0 and inflight == 0 and state == previous
        previous, drain.outbox_rows, drain.inflight = state, rows, inflight
        if not still:
            flight = f"{inflight:g}" if inflight >= 0 else "? (no /metrics)"
            say(f"draining: {rows} outbox row(s), {flight} in flight")
        return still

    drain.drained = wait_until(settled, max(timeout, 0), every=every)
    drain.seconds = time.monotonic() - began
    return drain


def _scraper(metrics: str | Callable[[], Metrics | None] | None) -> Callable[[], Metrics | None]:
    """No /metrics reads as nothing in flight; a URL is scraped as it is."""
    if metrics is None:
        return lambda: Metrics([])
    if isinstance(metrics, str):
        url = metrics
        return lambda: Metrics.scrape(url)
    return metrics
