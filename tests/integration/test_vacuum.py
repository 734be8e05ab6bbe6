"""The farm vacuums its table under load, and stays out of the way when it should.

Against a real Postgres: dead rows made by real UPDATEs and DELETEs, statistics read from the
server, a real lock held by another session, a real role without ownership.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg_pool import AsyncConnectionPool

from outbox_farm import Farm, Message
from outbox_farm.chores.vacuum import MIN_DEAD_TUPLES, Pass, run, vacuum_once
from outbox_farm.names import TableNames
from outbox_farm.queries import Queries
from outbox_farm.settings import RuntimeSettings
from outbox_farm.worker.runtime import Runtime
from tests.steps import eventually

QUERIES = Queries(TableNames.build("outbox", "outbox_dlq"))
STATS = "SELECT n_dead_tup, vacuum_count FROM pg_stat_user_tables WHERE relname = 'outbox'"


@pytest.fixture(autouse=True)
def no_autovacuum(conn: psycopg.Connection[Any]) -> None:
    """Autovacuum visiting the table mid-test would make our VACUUM skip or not be due."""
    conn.execute("ALTER TABLE outbox SET (autovacuum_enabled = false)")


def make_dead_rows(conn: psycopg.Connection[Any], n: int) -> None:
    """n rows inserted, claimed (UPDATE) and deleted: 2n dead versions, counted at once."""
    conn.execute(
        "INSERT INTO outbox (queue, payload) SELECT 'q', 'x' FROM generate_series(1, %s)", [n]
    )
    conn.execute("UPDATE outbox SET acquired_token = gen_random_uuid(), acquired_at = now()")
    conn.execute("DELETE FROM outbox")
    conn.execute("SELECT pg_stat_force_next_flush()")


def stats(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    """(n_dead_tup, vacuum_count), waiting out the statistics flush of other sessions."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(STATS).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


@asynccontextmanager
async def pool_for(dsn: str) -> AsyncIterator[AsyncConnectionPool[Any]]:
    async with AsyncConnectionPool(
        dsn, min_size=1, max_size=1, kwargs={"autocommit": True}, open=False
    ) as pool:
        yield pool


async def once(dsn: str, interval: float = 10.0) -> Pass:
    async with pool_for(dsn) as pool:
        return await vacuum_once(pool, QUERIES, interval)


def vacuum_runs() -> float:
    return REGISTRY.get_sample_value("outbox_farm_vacuum_seconds_count") or 0.0


def test_vacuums_a_table_full_of_dead_rows(dsn: str, conn: psycopg.Connection[Any]) -> None:
    make_dead_rows(conn, 3000)
    dead, vacuums = stats(conn)
    assert dead >= 2 * 3000
    before = vacuum_runs()
    assert asyncio.run(once(dsn)) is Pass.VACUUMED
    dead_after, vacuums_after = stats(conn)
    assert vacuums_after == vacuums + 1
    assert dead_after < MIN_DEAD_TUPLES
    assert vacuum_runs() == before + 1
    # Empty tail pages stay (migration 0003: no truncation, so no ACCESS EXCLUSIVE lock).
    pages = conn.execute("SELECT pg_relation_size('outbox')").fetchone()
    assert pages is not None
    assert pages[0] > 0


def test_leaves_a_clean_or_freshly_vacuumed_table_alone(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    make_dead_rows(conn, MIN_DEAD_TUPLES // 4)  # 500 dead versions: not worth a VACUUM
    assert asyncio.run(once(dsn)) is Pass.NOT_DUE
    conn.execute("VACUUM outbox")  # someone else just vacuumed (autovacuum, a cron job)
    make_dead_rows(conn, 3000)
    assert asyncio.run(once(dsn, interval=10.0)) is Pass.NOT_DUE
    assert stats(conn)[1] == 1
    # An interval later (0.2 s, let pass on purpose) it is due again.
    time.sleep(0.2)
    assert asyncio.run(once(dsn, interval=0.2)) is Pass.VACUUMED
    assert stats(conn)[1] == 2


def test_without_statistics_every_pass_vacuums(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """track_counts off: no dead row is ever counted and autovacuum cannot run, so the farm's
    VACUUM is the only one the table gets; it must not wait for counts that never come."""
    dbname = sql.Identifier(str(conninfo_to_dict(dsn)["dbname"]))
    conn.execute(sql.SQL("ALTER DATABASE {} SET track_counts = off").format(dbname))
    with psycopg.connect(dsn, autocommit=True) as untracked:
        make_dead_rows(untracked, 3000)
    assert stats(conn)[0] == 0  # nothing counted
    before = vacuum_runs()
    assert asyncio.run(once(dsn)) is Pass.VACUUMED
    assert vacuum_runs() == before + 1


def test_skips_instead_of_waiting_when_the_table_is_locked(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    make_dead_rows(conn, 3000)
    with psycopg.connect(dsn) as holder:
        # The lock VACUUM itself takes: what autovacuum or another farm process would hold.
        holder.execute("LOCK TABLE outbox IN SHARE UPDATE EXCLUSIVE MODE")
        # Bounded: without SKIP_LOCKED the VACUUM would queue behind the lock for good.
        assert asyncio.run(asyncio.wait_for(once(dsn), timeout=5)) is Pass.SKIPPED
        holder.rollback()
    assert stats(conn)[1] == 0
    assert asyncio.run(once(dsn)) is Pass.VACUUMED


@pytest.fixture
def stranger_dsn(dsn: str, conn: psycopg.Connection[Any]) -> Iterator[str]:
    """A login role that may read and write the outbox but does not own it."""
    role = f"outbox_farm_stranger_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(role)
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(ident))
    try:
        conn.execute(sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON outbox TO {}").format(ident))
        yield make_conninfo(dsn, user=role)
    finally:
        conn.execute(sql.SQL("DROP OWNED BY {}").format(ident))
        conn.execute(sql.SQL("DROP ROLE {}").format(ident))


def test_a_role_that_may_not_vacuum_gives_up_once_and_says_why(
    stranger_dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    make_dead_rows(conn, 3000)

    async def loop() -> None:
        async with pool_for(stranger_dsn) as pool:
            await asyncio.wait_for(run(pool, QUERIES, 0.05), timeout=5)  # returns by itself

    with caplog.at_level(logging.WARNING, logger="outbox_farm"):
        asyncio.run(loop())
    disabled = [r for r in caplog.records if getattr(r, "event", None) == "vacuum_disabled"]
    assert len(disabled) == 1
    assert "--vacuum-interval 0" in disabled[0].getMessage()
    assert stats(conn)[1] == 0

    if conn.info.server_version >= 170000:
        # MAINTAIN (PostgreSQL 17+) is enough without ownership.
        role = str(conninfo_to_dict(stranger_dsn)["user"])
        conn.execute(sql.SQL("GRANT MAINTAIN ON outbox TO {}").format(sql.Identifier(role)))
        assert asyncio.run(once(stranger_dsn)) is Pass.VACUUMED
        assert stats(conn)[1] == 1


def test_a_missing_table_is_reported_and_the_loop_goes_on(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    conn.execute("ALTER TABLE outbox RENAME TO outbox_elsewhere")

    def failed() -> list[logging.LogRecord]:
        return [r for r in caplog.records if getattr(r, "event", None) == "vacuum_failed"]

    async def loop() -> None:
        async with pool_for(dsn) as pool:
            task = asyncio.create_task(run(pool, QUERIES, 0.05))

            def three_failed() -> bool:
                assert not task.done(), task  # still trying: the table may come back
                return len(failed()) >= 3

            # Three failed passes (counted, not assumed from a sleep): it went on after failing.
            await eventually(three_failed, "three failed passes")
            assert not task.done()
            task.cancel()

    with caplog.at_level(logging.WARNING, logger="outbox_farm"):
        asyncio.run(loop())
    records = failed()
    assert records
    assert "outbox" in records[0].getMessage()


def test_a_running_farm_keeps_its_table_vacuumed(dsn: str, conn: psycopg.Connection[Any]) -> None:
    farm = Farm(dlq_table="outbox_dlq")
    handled: list[int] = []

    @farm.handler("q", concurrency=8)
    async def handle(message: Message) -> None:
        handled.append(1)

    n = 3000

    async def scenario() -> None:
        runtime = Runtime(
            list(farm.handlers.values()), farm.queries, dsn, RuntimeSettings(vacuum_interval=0.3)
        )
        await runtime.start()
        try:
            with psycopg.connect(dsn) as producer:
                farm.publish_batch(producer, [{"n": i} for i in range(n)], queue="q")
            await eventually(
                lambda: stats(conn)[1] > 0 and len(handled) >= n, "every row handled and a vacuum"
            )
        finally:
            await runtime.stop()

    asyncio.run(scenario())
    assert len(handled) == n
    assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)
