"""DLQ retention (`start --dlq-retention`): old rows go in small batches, young ones stay, and
the deletions are counted."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from outbox_farm.chores.retention import expire_once, run
from outbox_farm.names import TableNames
from outbox_farm.queries import Queries
from tests.steps import eventually

QUERIES = Queries(TableNames.build("outbox", "outbox_dlq"))
DAY = 86400.0


def fill(conn: psycopg.Connection[Any], queue: str, rows: int, age: str) -> None:
    conn.execute(
        "INSERT INTO outbox_dlq (original_id, queue, payload, deliveries_count, created_at, "
        "failed_at, failure_reason) SELECT g, %s, 'x', 1, now(), now() - %s::interval, "
        "'rejected' FROM generate_series(1, %s) AS g",
        [queue, age, rows],
    )


def purged(queue: str) -> float:
    return REGISTRY.get_sample_value("outbox_farm_dlq_purged_total", {"queue": queue}) or 0.0


def remaining(conn: psycopg.Connection[Any]) -> list[tuple[str, int]]:
    rows = conn.execute(
        "SELECT queue, count(*)::int FROM outbox_dlq GROUP BY queue ORDER BY queue"
    ).fetchall()
    return [(str(q), int(n)) for q, n in rows]


async def _expire(dsn: str, retention: float, batch: int) -> int:
    async with AsyncConnectionPool(dsn, min_size=1, max_size=2, open=False) as pool:
        return await expire_once(pool, QUERIES, retention, batch)


def test_rows_past_the_retention_are_deleted_in_batches_and_counted(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    fill(conn, "orders", 25, "31 days")
    fill(conn, "orders", 3, "29 days")
    fill(conn, "mail", 4, "40 days")
    before = purged("orders"), purged("mail")
    assert asyncio.run(_expire(dsn, 30 * DAY, batch=10)) == 29
    assert remaining(conn) == [("orders", 3)]
    assert (purged("orders") - before[0], purged("mail") - before[1]) == (25, 4)
    assert asyncio.run(_expire(dsn, 30 * DAY, batch=10)) == 0


def test_a_row_held_by_an_operator_is_skipped_not_waited_for(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    fill(conn, "orders", 2, "100 days")
    with psycopg.connect(dsn) as other:
        other.execute("SELECT id FROM outbox_dlq ORDER BY id LIMIT 1 FOR UPDATE")
        assert asyncio.run(asyncio.wait_for(_expire(dsn, DAY, batch=10), timeout=10)) == 1
    assert asyncio.run(_expire(dsn, DAY, batch=10)) == 1


def test_the_loop_keeps_deleting_until_cancelled(dsn: str, conn: psycopg.Connection[Any]) -> None:
    fill(conn, "orders", 3, "2 days")

    async def scenario() -> None:
        async with AsyncConnectionPool(dsn, min_size=1, max_size=2, open=False) as pool:
            task = asyncio.create_task(run(pool, QUERIES, DAY, interval=0.05))

            def emptied() -> bool:
                assert not task.done(), task
                return not remaining(conn)

            await eventually(emptied, "the expired rows deleted by the first pass")
            fill(conn, "orders", 2, "3 days")
            await eventually(emptied, "rows added after the first pass deleted by a later one")
            task.cancel()

    asyncio.run(scenario())
    assert remaining(conn) == []
