"""The DLQ gauge counts the DLQ again only when its rows may have changed.

A DLQ can hold millions of rows, and counting them reads them all; a housekeeper that did it
every five seconds would keep a core busy on a table nobody touches. These tests run against a
real server, whose statistics are what the farm goes by.
"""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from outbox_farm import Farm
from outbox_farm.chores import gauges
from outbox_farm.db.housekeeping import dlq_signature
from outbox_farm.metrics import metrics
from outbox_farm.problems import Problems
from tests.steps import wait_for

metrics()  # register the collectors before the first sample is read

FARM = Farm(table="outbox", dlq_table="outbox_dlq")
ADD_DLQ_ROWS = (
    "INSERT INTO outbox_dlq (original_id, queue, payload, deliveries_count, created_at, "
    "failed_at, failure_reason) SELECT g, 'dq', 'x', 1, now(), now(), 'rejected' "
    "FROM generate_series(1, %s) AS g"
)


def run(dsn: str, step: Any) -> Any:
    async def once() -> Any:
        pool = AsyncConnectionPool(dsn, kwargs={"autocommit": True}, open=False)
        async with pool:
            return await step(pool)

    return asyncio.run(once())


def refresh(dsn: str, watch: gauges.DlqWatch, problems: Problems) -> None:
    run(dsn, lambda pool: gauges.refresh(pool, FARM.queries, ["dq"], problems, dlq=watch))


def signature(dsn: str) -> tuple[int, int] | None:
    result: tuple[int, int] | None = run(dsn, lambda pool: dlq_signature(pool, FARM.queries))
    return result


def rejected() -> float | None:
    return REGISTRY.get_sample_value("outbox_farm_dlq_rows", {"queue": "dq", "reason": "rejected"})


def add_rows(conn: psycopg.Connection[Any], n: int) -> None:
    """Insert `n` DLQ rows and have this backend's statistics reach the server at once (they
    would otherwise follow within seconds)."""
    conn.execute(ADD_DLQ_ROWS, [n])
    if conn.info.server_version >= 150000:
        conn.execute("SELECT pg_stat_force_next_flush()")


def test_an_untouched_dlq_is_counted_once_and_a_changed_one_again(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    watch, problems = gauges.DlqWatch(pause=0), Problems()  # refreshes follow at once
    before = signature(dsn)
    add_rows(conn, 5)
    wait_for(lambda: signature(dsn) != before, "the statistics to see the new rows", 20, every=0.2)
    refresh(dsn, watch, problems)
    assert (watch.counts, rejected()) == (1, 5)

    for _ in range(3):
        refresh(dsn, watch, problems)
    assert (watch.counts, rejected()) == (1, 5)  # nothing changed: not counted again

    before = signature(dsn)
    add_rows(conn, 2)
    wait_for(lambda: signature(dsn) != before, "the statistics to see the new rows", 20, every=0.2)
    refresh(dsn, watch, problems)
    assert (watch.counts, rejected()) == (2, 7)

    conn.execute("TRUNCATE outbox_dlq")  # no row is deleted one by one: a new file
    refresh(dsn, watch, problems)
    assert (watch.counts, rejected()) == (3, 0)
    assert problems.current is None


def test_a_dropped_dlq_stays_a_problem_until_it_is_back(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    watch, problems = gauges.DlqWatch(pause=0), Problems()  # refreshes follow at once
    refresh(dsn, watch, problems)
    assert watch.counts == 1

    conn.execute("ALTER TABLE outbox_dlq RENAME TO outbox_dlq_away")
    for _ in range(2):
        refresh(dsn, watch, problems)
        assert problems.current is not None
        assert "outbox_dlq" in problems.current
    assert watch.counts == 1

    conn.execute("ALTER TABLE outbox_dlq_away RENAME TO outbox_dlq")
    conn.execute(ADD_DLQ_ROWS, [3])
    refresh(dsn, watch, problems)  # the failed count makes the next one due, moved or not
    assert (watch.counts, rejected(), problems.current) == (2, 3, None)


@pytest.mark.parametrize(
    ("moved", "since", "took", "due"),
    [
        (False, 1.0, 0.001, False),  # unchanged, recent: skipped
        (True, 1.0, 0.001, True),  # changed: counted
        (False, 301.0, 0.001, True),  # unchanged but old: counted anyway
        (True, 10.0, 2.0, False),  # changed, but the last count took 2 s: wait 40 s
        (True, 41.0, 2.0, True),
    ],
)
def test_when_a_count_is_due(moved: bool, since: float, took: float, due: bool) -> None:
    watch = gauges.DlqWatch(recount_after=300.0, pause=20.0)
    watch.counted((1, 10), began=100.0, ended=100.0 + took)
    assert watch.due((1, 11) if moved else (1, 10), now=100.0 + since) is due
    assert watch.due(None, now=100.0 + since) is (since >= took * 20.0)
