"""Priorities against a real Postgres: bad priorities are refused before any SQL; code and
schema one release apart in either order (a farm of this release before `outbox-farm migrate`,
the claim of the release before on a migrated table); the claim's plan when no priority is in
use; and a running farm under a steady load of high-priority rows, which still delivers the
rows of priority 0. The claim order itself is in tests/contract/test_store_priority.py."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import psycopg
import pytest

from outbox_farm import ConfigurationError, Farm, Message
from outbox_farm.db import claims as claims_module
from outbox_farm.db.claims import unranked
from outbox_farm.db.pool import open_pool
from outbox_farm.db.schema import MigrationRecord, migration_lock
from outbox_farm.db.store import PostgresStore
from outbox_farm.errors import SchemaError
from outbox_farm.names import TableNames
from outbox_farm.ops.migrate import migrate, selected
from outbox_farm.queries import Queries
from outbox_farm.settings import RuntimeSettings
from outbox_farm.storage import Claim
from tests.steps import eventually

Conn = psycopg.Connection[Any]
NAMES = TableNames.build("outbox", "outbox_dlq")
BEFORE_PRIORITY = 12  # the last migration before 0013 added `priority`


def migrate_to(dsn: str, last: int) -> None:
    """The schema as a release whose newest migration is `last` leaves it, records and all."""
    with psycopg.connect(dsn) as conn, migration_lock(conn) as ledger:
        for m in selected(NAMES):
            if m.version <= last:
                target = str(NAMES.outbox if m.target == "outbox" else NAMES.dlq)
                record = MigrationRecord(target, m.version, m.name, m.checksum)
                ledger.apply(m.statement(NAMES), record)


def claim_of(queue: str = "q", limit: int = 10) -> Claim:
    return Claim(queue, limit, 30.0, uuid.uuid4(), 0.0, 0.0, [])


def count(conn: Conn, least: int | None = None) -> int:
    """The outbox's rows; with `least`, those with a priority of at least that."""
    if least is None:
        row = conn.execute("SELECT count(*) FROM outbox").fetchone()
    else:
        row = conn.execute("SELECT count(*) FROM outbox WHERE priority >= %s", [least]).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize(
    ("priority", "message"),
    [
        (1.5, r"priority must be an int from 0 to 32767, got 1\.5 \(float\)"),
        (True, r"priority must be an int from 0 to 32767, got True \(bool\)"),
        ("3", r"priority must be an int .* got '3' \(str\)"),
        (-1, r"from 0 \(the default, the lowest\) to 32767, got -1; to put rows behind"),
        (32768, r"to 32767, got 32768"),
    ],
)
def test_bad_priorities_are_refused_before_any_sql(
    conn: Conn, priority: object, message: str
) -> None:
    farm = Farm()
    with conn.transaction():
        with pytest.raises(ConfigurationError, match=message):
            farm.publish(conn, "one", queue="q", priority=priority)  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match=message):
            farm.publish_batch(conn, ["a", "b"], queue="q", priority=priority)  # type: ignore[arg-type]
        assert count(conn) == 0  # and the transaction is still usable
    assert farm.publish(conn, "top", queue="q", priority=32767) is not None
    assert count(conn, 32767) == 1


def test_a_priority_on_a_table_without_the_column_says_to_migrate(empty_dsn: str) -> None:
    migrate_to(empty_dsn, BEFORE_PRIORITY)
    farm = Farm()
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        with conn.transaction():
            conn.execute("CREATE TABLE orders (id int)")  # the application's own write
            assert farm.publish(conn, b"plain", queue="q") is not None
            assert farm.publish(conn, b"zero", queue="q", priority=0) is not None
            with pytest.raises(SchemaError) as refused:
                farm.publish(conn, b"urgent", queue="q", priority=5)
            assert "has no priority column yet (migration 0013)" in str(refused.value)
            assert "run `outbox-farm migrate`" in str(refused.value)
            with pytest.raises(SchemaError, match="outbox-farm migrate"):
                farm.publish_batch(conn, [b"u"] * 3, queue="q", priority=5)
            # Refused before anything was sent: the caller's transaction goes on.
            assert len(farm.publish_batch(conn, [b"b"] * 3, queue="q")) == 3
        assert count(conn) == 5
        assert conn.execute("SELECT to_regclass('orders') IS NOT NULL").fetchone() == (True,)
        with psycopg.connect(empty_dsn) as admin:
            migrate(admin, NAMES)
        # The same connection asks the catalog again before refusing: the migration is seen.
        with conn.transaction():
            assert farm.publish(conn, b"urgent", queue="q", priority=5) is not None
            assert len(farm.publish_batch(conn, [b"u"] * 2, queue="q", priority=6)) == 2
        assert count(conn, 1) == 3


def test_async_publish_with_a_priority_on_a_table_without_the_column(empty_dsn: str) -> None:
    migrate_to(empty_dsn, BEFORE_PRIORITY)
    farm = Farm()

    async def publish() -> None:
        async with await psycopg.AsyncConnection.connect(empty_dsn, autocommit=True) as aconn:
            assert await farm.apublish(aconn, b"plain", queue="q") is not None
            with pytest.raises(SchemaError, match="outbox-farm migrate"):
                await farm.apublish(aconn, b"urgent", queue="q", priority=1)
            with pytest.raises(SchemaError, match="outbox-farm migrate"):
                await farm.apublish_batch(aconn, [b"u"], queue="q", priority=1)

    asyncio.run(publish())


def test_a_farm_started_before_the_migration_claims_and_ranks_once_it_ran(
    empty_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The claim asks the catalog: without the column it claims as the release before did
    (not failing), and once the migration ran (within `RECHECK`; no wait here) it ranks."""
    monkeypatch.setattr(claims_module, "RECHECK", 0.0)

    async def claims() -> None:
        migrate_to(empty_dsn, BEFORE_PRIORITY)
        farm = Farm()
        with psycopg.connect(empty_dsn, autocommit=True) as conn:
            before = farm.publish_batch(conn, [b"old"] * 3, queue="q")
        pool = await open_pool(empty_dsn, 2, farm=True)
        try:
            store = PostgresStore(pool, Queries(NAMES))
            assert sorted(m.id for m in await store.claim(claim_of())) == before
            with psycopg.connect(empty_dsn, autocommit=True) as admin:
                migrate(admin, NAMES)
                plain = [farm.publish(admin, f"p{n}".encode(), queue="s") for n in range(4)]
                urgent = farm.publish_batch(admin, [b"u"] * 3, queue="s", priority=9)
            assert {m.id for m in await store.claim(claim_of("s", 4))} == {*urgent, plain[0]}
        finally:
            await pool.close()

    asyncio.run(claims())


@pytest.mark.parametrize("recheck", [0.0, 3600.0])
def test_a_queue_is_claimed_the_cheaper_way_until_it_has_rows_above_0(
    dsn: str, monkeypatch: pytest.MonkeyPatch, recheck: float
) -> None:
    """A queue with no row above 0 is sent the claim of the release before (no ranking to
    plan); once a probe (every `RANK_RECHECK` seconds) finds one, the ranked claim."""
    monkeypatch.setattr(claims_module, "RANK_RECHECK", recheck)
    farm = Farm()

    async def claims() -> set[int]:
        pool = await open_pool(dsn, 2, farm=True)
        try:
            store = PostgresStore(pool, Queries(NAMES))
            assert await store.claim(claim_of()) == []  # the probe: no row above 0
            with psycopg.connect(dsn, autocommit=True) as conn:
                plain = [farm.publish(conn, f"p{n}".encode(), queue="q") for n in range(4)]
                urgent = farm.publish_batch(conn, [b"u"] * 3, queue="q", priority=9)
            taken = {m.id for m in await store.claim(claim_of(limit=4))}
            expected = set(plain) if recheck else {*urgent, plain[0]}
            assert taken == expected
            return taken
        finally:
            await pool.close()

    asyncio.run(claims())


def test_the_claim_of_the_release_before_works_on_a_migrated_table(conn: Conn) -> None:
    """What a farm of the release before sends (the claim without its ranking fragments)
    claims in due order from a table with prioritized rows, and writes no priority."""
    farm = Farm()
    plain = [farm.publish(conn, f"p{n}".encode(), queue="q") for n in range(3)]
    farm.publish_batch(conn, [b"u"] * 3, queue="q", priority=9)
    statement = unranked(Queries(NAMES))
    assert "priority" not in statement
    args = {
        "queue": "q",
        "limit": 3,
        "lease_ttl": 30.0,
        "token": uuid.uuid4(),
        "held": [],
    }
    taken = conn.execute(statement, args, binary=True).fetchall()
    assert {row[0] for row in taken} == set(plain)


def test_a_queue_without_priorities_claims_over_the_same_indexes(conn: Conn) -> None:
    """No priority in use: the ranked branch is one probe of the (empty) priority index, and
    the rest of the plan is the pending index's walk; nothing reads the table whole."""
    farm = Farm()
    farm.publish_batch(conn, [b"x"] * 200, queue="q")
    conn.execute("ANALYZE outbox")
    args = {
        "queue": "q",
        "limit": 50,
        "lease_ttl": 30.0,
        "token": uuid.uuid4(),
        "held": [],
    }
    conn.execute("SET enable_seqscan = off")  # a plan that needs one would still use it
    rows = conn.execute(
        "EXPLAIN (ANALYZE, COSTS OFF, FORMAT JSON) " + Queries(NAMES)["claim"], args
    ).fetchone()
    assert rows is not None
    plan = str(rows[0])
    assert "Seq Scan" not in plan
    assert "outbox_prio_idx" in plan
    assert "outbox_pending_idx" in plan


def test_a_steady_load_of_high_priority_rows_does_not_starve_the_others(dsn: str) -> None:
    """A farm that can run about 100 rows a second, fed 250 high-priority rows a second while
    40 rows of priority 0 wait: the high rows go first (most of the first 40 delivered), and
    every row of priority 0 is delivered while high ones are still waiting, within 20 s (a
    claim keeps a quarter of its rows for the plain due order, where the 40 are oldest)."""
    farm = Farm()
    queue = f"prio_{uuid.uuid4().hex[:8]}"
    delivered: list[tuple[int, int, float]] = []  # (row id, priority, when)
    began = time.monotonic()
    stop = threading.Event()

    @farm.handler(queue, concurrency=2)
    async def handle(msg: Message) -> None:
        await asyncio.sleep(0.02)
        delivered.append((msg.id, int(msg.body == b"high"), time.monotonic() - began))

    with psycopg.connect(dsn, autocommit=True) as conn:
        low = set(farm.publish_batch(conn, [b"low"] * 40, queue=queue))
        farm.publish_batch(conn, [b"high"] * 100, queue=queue, priority=5)

    def feed() -> None:
        with psycopg.connect(dsn, autocommit=True) as feeder:
            while not stop.wait(0.04):
                farm.publish_batch(feeder, [b"high"] * 10, queue=queue, priority=5)

    def low_done() -> bool:
        return low <= {row_id for row_id, _, _ in delivered}

    async def run() -> int:
        async with farm.running(dsn, RuntimeSettings(poll_interval=0.5)):
            await eventually(low_done, "every row of priority 0 delivered", timeout=20)
        with psycopg.connect(dsn, autocommit=True) as reader:
            row = reader.execute(
                "SELECT count(*) FROM outbox WHERE queue = %s AND priority > 0", [queue]
            ).fetchone()
            assert row is not None
            return int(row[0])

    feeder = threading.Thread(target=feed)
    feeder.start()
    try:
        high_waiting = asyncio.run(run())
    finally:
        stop.set()
        feeder.join()
    first = delivered[:40]
    assert sum(high for _, high, _ in first) >= 20, first  # priority works: mostly high first
    assert high_waiting > 50  # the load was steady: high rows still waiting at the end
