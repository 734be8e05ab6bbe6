"""After a backlog the farm gives its table's space back, and stays out of the way otherwise.

Against a real Postgres: a backlog inserted, claimed and deleted as the farm would, sizes read
from the server, real REINDEX CONCURRENTLY, a rebuild really cut short, a real advisory lock held
by another session, and a running farm publishing and claiming throughout a shrink.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict
from psycopg_pool import AsyncConnectionPool

from outbox_farm import Farm, Message
from outbox_farm.chores import shrink as shrink_chore
from outbox_farm.chores.shrink import Shrinker
from outbox_farm.chores.vacuum import vacuum_once
from outbox_farm.db.housekeeping import Shrunk
from outbox_farm.names import TableNames
from outbox_farm.queries import Queries
from outbox_farm.settings import RuntimeSettings
from outbox_farm.worker.runtime import Runtime
from tests.steps import eventually

QUERIES = Queries(TableNames.build("outbox", "outbox_dlq"))
BACKLOG = 40_000  # a few MiB of table and indexes: sparse once deleted, against SHRINK_AT below
SIZES = """
SELECT c.relname::text, pg_relation_size(c.oid)
FROM pg_class AS c
WHERE c.oid = 'outbox'::regclass
   OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = 'outbox'::regclass)
ORDER BY 1
"""
CONNECTION_STATE = """
SELECT current_setting('lock_timeout'), current_setting('statement_timeout'),
       (SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid())
"""
VALID = """
SELECT c.relname::text, i.indisvalid
FROM pg_index AS i JOIN pg_class AS c ON c.oid = i.indexrelid
WHERE i.indrelid = 'outbox'::regclass ORDER BY 1
"""


@pytest.fixture(autouse=True)
def small_tables(monkeypatch: pytest.MonkeyPatch, conn: psycopg.Connection[Any]) -> None:
    """A table of a few MiB counts as big; autovacuum stays away (it would race our VACUUMs)."""
    monkeypatch.setattr(shrink_chore, "SHRINK_AT", 2**20)
    conn.execute("ALTER TABLE outbox SET (autovacuum_enabled = false)")


def sizes(conn: psycopg.Connection[Any]) -> dict[str, int]:
    return {str(name): int(size) for name, size in conn.execute(SIZES).fetchall()}


def valid(conn: psycopg.Connection[Any]) -> dict[str, bool]:
    return {str(name): bool(ok) for name, ok in conn.execute(VALID).fetchall()}


def backlog(conn: psycopg.Connection[Any], rows: int = BACKLOG) -> None:
    """`rows` rows published, each claimed once (the UPDATE that leaves a dead version)."""
    conn.execute(
        "INSERT INTO outbox (queue, payload) SELECT 'q', '\\x7b7d' FROM generate_series(1, %s)",
        [rows],
    )
    conn.execute("UPDATE outbox SET acquired_token = gen_random_uuid(), acquired_at = now()")
    conn.execute("SELECT pg_stat_force_next_flush()")  # the inserts counted at once


def vacuum_count(conn: psycopg.Connection[Any]) -> int:
    conn.execute("SELECT pg_stat_clear_snapshot()")
    row = conn.execute(
        "SELECT vacuum_count FROM pg_stat_user_tables WHERE relname = 'outbox'"
    ).fetchone()
    assert row is not None
    return int(row[0])


def shrinks() -> float:
    return REGISTRY.get_sample_value("outbox_farm_shrinks_total") or 0.0


async def with_pool(dsn: str, *steps: str, interval: float = 10.0) -> list[Shrunk | None]:
    """On one pool of one connection: for each of `steps`, a vacuum pass (`vacuum`) or a shrink
    pass of one `Shrinker` (`shrink`; `look`: one whose result is not kept, as the first two of
    a new shrinker, which only learn how busy the table is); what each `shrink` returned. The
    connection must come back from every pass as it went: no lock held, no setting changed."""
    async with AsyncConnectionPool(
        dsn, min_size=1, max_size=1, kwargs={"autocommit": True}, open=False
    ) as pool:
        shrinker = Shrinker(pool, QUERIES, interval)
        done: list[Shrunk | None] = []
        for step in steps:
            if step == "vacuum":
                await vacuum_once(pool, QUERIES, interval)
            elif step == "look":
                await shrinker.once()
            else:
                done.append(await shrinker.once())
        async with pool.connection() as c:
            cursor = await c.execute(CONNECTION_STATE)
            assert await cursor.fetchone() == ("0", "0", 0)
        return done


def test_a_drained_backlog_gives_all_its_space_back(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    empty = sizes(conn)
    backlog(conn)
    conn.execute("DELETE FROM outbox")
    full = sizes(conn)
    assert sum(full.values()) > 2**20  # big enough to be worth it
    before = shrinks()
    with caplog.at_level(logging.INFO, logger="outbox_farm"):
        (done,) = asyncio.run(with_pool(dsn, "vacuum", "look", "look", "shrink"))
    assert done is not None
    assert not done.locked
    assert not done.vacuum_skipped
    assert not done.failed
    # Every index, and the table despite migration 0003's vacuum_truncate = false: back to the
    # size they had after the migrate.
    assert sizes(conn) == empty
    # The indexes the backlog made big are rebuilt; partial ones it left at a page or two are not.
    big = {name for name, size in full.items() if size > shrink_chore.INDEX_PAGES * 8192}
    assert set(done.rebuilt) == big - {"outbox"}
    assert len(done.rebuilt) >= 3
    assert all(valid(conn).values())
    assert shrinks() == before + 1
    said = [r for r in caplog.records if getattr(r, "event", None) == "table_shrunk"]
    assert len(said) == 1
    assert said[0].bytes_before == sum(full.values())  # type: ignore[attr-defined]
    assert said[0].bytes_after == sum(empty.values())  # type: ignore[attr-defined]


def test_a_table_in_use_is_left_alone(dsn: str, conn: psycopg.Connection[Any]) -> None:
    backlog(conn)  # every row still there: big, but not sparse
    full = sizes(conn)
    assert asyncio.run(with_pool(dsn, "vacuum", "look", "look", "shrink")) == [None]
    assert sizes(conn) == full


def test_a_busy_table_is_left_alone_however_empty(dsn: str, conn: psycopg.Connection[Any]) -> None:
    """A table that takes as many rows an interval as it has pages refills its space before
    the next pass: shrinking it would fight every claim and publish for nothing. Empty at the
    look or not, it is left alone."""
    backlog(conn)
    conn.execute("DELETE FROM outbox")
    full = sizes(conn)

    async def passes() -> list[Shrunk | None]:
        async with AsyncConnectionPool(
            dsn, min_size=1, max_size=1, kwargs={"autocommit": True}, open=False
        ) as pool:
            shrinker = Shrinker(pool, QUERIES, 10.0)
            first = await shrinker.once()
            await asyncio.to_thread(backlog, conn)  # an interval's traffic: claimed, deleted
            conn.execute("DELETE FROM outbox")
            await vacuum_once(pool, QUERIES, 0.0)
            return [first, await shrinker.once()]

    assert asyncio.run(passes()) == [None, None]
    assert sum(sizes(conn).values()) >= sum(full.values()) - 8192


def test_without_statistics_the_table_is_never_shrunk(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """track_counts off: nothing says how busy the table is."""
    backlog(conn)
    conn.execute("DELETE FROM outbox")
    dbname = sql.Identifier(str(conninfo_to_dict(dsn)["dbname"]))
    conn.execute(sql.SQL("ALTER DATABASE {} SET track_counts = off").format(dbname))
    assert asyncio.run(with_pool(dsn, "vacuum", "look", "look", "shrink", interval=0)) == [None]
    conn.execute(sql.SQL("ALTER DATABASE {} RESET track_counts").format(dbname))
    assert (
        asyncio.run(with_pool(dsn, "vacuum", "look", "look", "shrink", interval=0))[0] is not None
    )


def test_a_small_table_is_left_alone(
    dsn: str, conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shrink_chore, "SHRINK_AT", 2**30)
    backlog(conn)
    conn.execute("DELETE FROM outbox")
    assert asyncio.run(with_pool(dsn, "vacuum", "look", "look", "shrink")) == [None]
    assert sum(sizes(conn).values()) > 2**20


def test_a_table_that_stays_sparse_is_shrunk_again_only_after_a_wait(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Its last row at the end of the file: the tail cannot be given back, and shrinking again
    at every pass would rebuild for nothing. The wait doubles from one interval."""
    backlog(conn)
    conn.execute("DELETE FROM outbox WHERE id < (SELECT max(id) FROM outbox)")
    table = sizes(conn)["outbox"]
    first, second = asyncio.run(with_pool(dsn, "vacuum", "look", "look", "shrink", "shrink"))
    assert first is not None
    assert first.rebuilt
    assert sizes(conn)["outbox"] == table  # the live last row holds the tail
    assert second is None  # sparse still, but the wait is not over
    # With a short interval the wait passes: shrunk again, then the wait is two intervals.
    third, fourth, fifth = asyncio.run(
        with_pool(dsn, "look", "look", "shrink", "shrink", "shrink", interval=0)
    )
    assert third is not None
    assert fourth is not None
    assert fifth is not None
    assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (1,)


def test_the_wait_doubles_up_to_its_bound(dsn: str, conn: psycopg.Connection[Any]) -> None:
    backlog(conn)
    conn.execute("DELETE FROM outbox WHERE id < (SELECT max(id) FROM outbox)")

    async def gaps() -> list[int]:
        async with AsyncConnectionPool(
            dsn, min_size=1, max_size=1, kwargs={"autocommit": True}, open=False
        ) as pool:
            shrinker = Shrinker(pool, QUERIES, 0.0)
            assert await shrinker.once() is None  # the first pass notes the inserts so far
            assert await shrinker.once() is None  # the second finds the table quiet, once
            assert shrinker.gap == 1
            seen = []
            for _ in range(8):
                assert await shrinker.once() is not None
                seen.append(shrinker.gap)
            # Once the table is no longer sparse the wait starts again from one interval.
            async with pool.connection() as c:
                await c.execute("DELETE FROM outbox")
            assert await shrinker.once() is not None  # all of it given back now
            seen.append(shrinker.gap)
            assert await shrinker.once() is None  # small: nothing to do
            seen.append(shrinker.gap)
            return seen

    assert asyncio.run(gaps()) == [2, 4, 8, 16, 16, 16, 16, 16, 16, 1]


def cut_rebuild(dsn: str, conn: psycopg.Connection[Any]) -> str:
    """A REINDEX CONCURRENTLY of the primary key cut short by its statement timeout while it
    waits for an old snapshot: the name of the invalid copy it leaves."""
    with psycopg.connect(dsn) as reader:
        reader.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        reader.execute("SELECT count(*) FROM outbox").fetchone()  # a snapshot, held open
        with psycopg.connect(dsn, autocommit=True) as rebuilder:
            rebuilder.execute("SET statement_timeout = '1s'")
            with pytest.raises(psycopg.errors.QueryCanceled):
                rebuilder.execute("REINDEX INDEX CONCURRENTLY outbox_pkey")
        reader.rollback()
    left = [name for name, ok in valid(conn).items() if not ok]
    assert len(left) == 1, left
    assert left[0].startswith("outbox_pkey_ccnew"), left
    return left[0]


def test_the_leftover_of_a_cut_rebuild_is_dropped_and_a_users_invalid_index_kept(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    leftover = cut_rebuild(dsn, conn)
    # A user's own index that failed to build is invalid too, and not the farm's to drop.
    conn.execute("INSERT INTO outbox (queue, payload) VALUES ('q', 'a'), ('q', 'a')")
    with pytest.raises(psycopg.errors.UniqueViolation):
        conn.execute("CREATE UNIQUE INDEX CONCURRENTLY users_own ON outbox (payload)")
    vacuums = vacuum_count(conn)
    (done,) = asyncio.run(with_pool(dsn, "shrink"))  # a small table: the leftover, nothing else
    assert done is not None
    assert done.dropped == [leftover]
    assert not done.rebuilt
    assert vacuum_count(conn) == vacuums  # no truncating VACUUM for a table not due a shrink
    assert leftover not in valid(conn)
    assert valid(conn)["users_own"] is False
    assert valid(conn)["outbox_pkey"] is True


def test_another_session_shrinking_the_table_is_left_to_it(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    backlog(conn)
    conn.execute("DELETE FROM outbox")
    full = sizes(conn)
    table = QUERIES.names.outbox.identifier().as_string(None)
    begin = {"table": table, "lock_timeout": "1s", "statement_timeout": "1min"}
    with psycopg.connect(dsn, autocommit=True) as other:
        assert other.execute(QUERIES["shrink_begin"], begin).fetchone() == (True,)
        (done,) = asyncio.run(with_pool(dsn, "look", "look", "shrink"))
        assert done is not None
        assert done.locked
        assert sizes(conn) == full
    (done,) = asyncio.run(with_pool(dsn, "vacuum", "look", "look", "shrink"))  # the other one ended
    assert done is not None
    assert not done.locked
    assert sum(sizes(conn).values()) < sum(full.values())


def test_a_rebuild_that_cannot_have_its_lock_is_reported_and_the_rest_done(
    dsn: str, conn: psycopg.Connection[Any], monkeypatch: pytest.MonkeyPatch, caplog: Any
) -> None:
    """A migration (or a user's REINDEX) holding the table: each rebuild gives up after the
    time out instead of queueing behind it for good, says so, and leave no leftover."""
    monkeypatch.setattr(shrink_chore, "REBUILD_TIMEOUT", 0.3)
    backlog(conn)
    conn.execute("DELETE FROM outbox")
    asyncio.run(with_pool(dsn, "vacuum"))
    full = sizes(conn)
    with psycopg.connect(dsn) as holder:
        holder.execute("LOCK TABLE outbox IN SHARE UPDATE EXCLUSIVE MODE")
        with caplog.at_level(logging.WARNING, logger="outbox_farm"):
            (done,) = asyncio.run(
                asyncio.wait_for(with_pool(dsn, "look", "look", "shrink"), timeout=30)
            )
        holder.rollback()
    assert done is not None
    assert done.vacuum_skipped
    assert not done.rebuilt
    big = {name for name, size in full.items() if size > shrink_chore.INDEX_PAGES * 8192}
    assert {index for index, _ in done.failed} == big - {"outbox"}
    assert done.failed
    assert all(valid(conn).values())  # nothing left half-built
    failed = [r for r in caplog.records if getattr(r, "event", None) == "shrink_failed"]
    assert len(failed) == len(done.failed)
    assert "statement timeout" in failed[0].getMessage()
    # Said once per index: the next shrink that fails the same way says it at DEBUG.
    with psycopg.connect(dsn) as holder:
        holder.execute("LOCK TABLE outbox IN SHARE UPDATE EXCLUSIVE MODE")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="outbox_farm"):
            shrinking = with_pool(dsn, "look", "look", "shrink", "shrink", interval=0)
            asyncio.run(asyncio.wait_for(shrinking, timeout=30))
        holder.rollback()
    again = [r for r in caplog.records if getattr(r, "event", None) == "shrink_failed"]
    assert len(again) == len(done.failed)


def test_a_running_farm_shrinks_its_table_after_a_backlog_and_loses_nothing(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """The backlog drains, the vacuum loop shrinks the table while a producer keeps publishing
    one row at a time and the farm keeps claiming: every row is handled once the shrink is
    done, and the table and its indexes end near their size after the migrate."""
    empty = sum(sizes(conn).values())
    farm = Farm(dlq_table="outbox_dlq")
    handled: set[int] = set()

    @farm.handler("q", concurrency=16)
    async def handle(message: Message) -> None:
        handled.add(int(message.json()["n"]))

    with psycopg.connect(dsn) as producer:
        farm.publish_batch(producer, [{"n": i} for i in range(BACKLOG)], queue="q")
    stop = threading.Event()
    published: list[int] = []

    def trickle() -> None:
        with psycopg.connect(dsn, autocommit=True) as producer:
            n = BACKLOG
            while not stop.is_set():
                farm.publish(producer, {"n": n}, queue="q")
                published.append(n)
                n += 1
                time.sleep(0.1)  # quiet: a trickle, as after a backlog

    before = shrinks()

    async def scenario() -> None:
        runtime = Runtime(
            list(farm.handlers.values()), farm.queries, dsn, RuntimeSettings(vacuum_interval=0.2)
        )
        await runtime.start()
        thread = threading.Thread(target=trickle)
        thread.start()
        try:
            await eventually(lambda: shrinks() > before, "a shrink", timeout=120)
        finally:
            stop.set()
            await asyncio.to_thread(thread.join)
        total = BACKLOG + len(published)
        try:
            await eventually(lambda: len(handled) >= total, "every row handled", timeout=60)
        finally:
            await runtime.stop()

    asyncio.run(scenario())
    assert handled == set(range(BACKLOG + len(published)))
    assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)
    assert all(valid(conn).values())
    # A few pages each at most (the trickle's rows came and went meanwhile), not the backlog's.
    assert sum(sizes(conn).values()) < empty + 2**20


def test_the_shrink_statements_compose_index_names_safely() -> None:
    from outbox_farm.db.housekeeping import Relation, _on_index

    odd = Relation('we"ird', "in dex; DROP TABLE x", "index", 0, 0)
    text = _on_index("shrink_reindex", odd)
    assert text == sql.SQL("REINDEX INDEX CONCURRENTLY {}").format(
        sql.Identifier('we"ird', "in dex; DROP TABLE x")
    ).as_string(None)
