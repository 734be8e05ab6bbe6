"""Transactional handlers (`transactional=True`) against a real Postgres: the handler's writes
and its row's deletion commit together or not at all."""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

import psycopg
import pytest

from outbox_farm import ConfigurationError, ConstantBackoff, Farm, Message
from outbox_farm.metrics import metrics
from outbox_farm.settings import RuntimeSettings
from tests.samples import sample
from tests.steps import run_until

metrics()  # register the collectors before the first sample is read
SETTINGS = RuntimeSettings(poll_interval=0.05)
AConn = psycopg.AsyncConnection[Any]


def qname() -> str:
    return f"tx_{uuid.uuid4().hex[:8]}"


def scalar(conn: psycopg.Connection[Any], query: str, *params: Any) -> Any:
    conn.commit()
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


@pytest.fixture
def effects(conn: psycopg.Connection[Any]) -> psycopg.Connection[Any]:
    conn.execute("CREATE TABLE effects (msg_id bigint NOT NULL, attempt int NOT NULL)")
    conn.commit()
    return conn


def test_the_handlers_writes_and_the_rows_deletion_commit_together(
    dsn: str, effects: psycopg.Connection[Any]
) -> None:
    queue, farm = qname(), Farm()
    ids = [farm.publish(effects, {"n": n}, queue=queue) for n in range(20)]
    effects.commit()
    acked_before = sample("outbox_farm_acked_total", queue=queue)
    calls: list[int] = []

    @farm.handler(queue, transactional=True, concurrency=4)
    async def handle(msg: Message, conn: AConn) -> None:
        await conn.execute("INSERT INTO effects VALUES (%s, %s)", (msg.id, msg.attempts_count))
        calls.append(msg.id)

    run_until(farm, dsn, lambda: len(calls) == 20, "20 handler calls", SETTINGS)
    assert sorted(r[0] for r in effects.execute("SELECT msg_id FROM effects")) == sorted(ids)
    assert scalar(effects, "SELECT count(*) FROM outbox") == 0
    assert sample("outbox_farm_acked_total", queue=queue) - acked_before == 20  # once each


def test_a_raise_rolls_back_the_writes_and_the_retry_runs_them_once(
    dsn: str, effects: psycopg.Connection[Any]
) -> None:
    queue, farm = qname(), Farm()
    ids = [farm.publish(effects, n, queue=queue) for n in range(5)]
    effects.commit()
    runs: list[int] = []

    @farm.handler(queue, transactional=True, retry=ConstantBackoff(0.01))
    async def handle(msg: Message, conn: AConn) -> None:
        await conn.execute("INSERT INTO effects VALUES (%s, %s)", (msg.id, msg.attempts_count))
        runs.append(msg.id)
        if msg.attempts_count == 0:
            raise RuntimeError("first attempt fails after writing")

    run_until(farm, dsn, lambda: len(runs) == 10, "10 runs", SETTINGS)
    rows = effects.execute("SELECT msg_id, attempt FROM effects ORDER BY msg_id").fetchall()
    assert rows == [(i, 1) for i in sorted(ids)]  # only the second attempts' writes
    assert scalar(effects, "SELECT count(*) FROM outbox") == 0


def test_a_nack_rolls_back_and_a_row_failing_for_good_leaves_no_writes(
    dsn: str, effects: psycopg.Connection[Any]
) -> None:
    queue, farm = qname(), Farm()
    nacked = farm.publish(effects, "nack once", queue=queue)
    poison = farm.publish(effects, "poison", queue=queue)
    effects.commit()
    runs: list[int] = []

    @farm.handler(queue, transactional=True, max_deliveries=2, retry=ConstantBackoff(0.01))
    async def handle(msg: Message, conn: AConn) -> None:
        await conn.execute("INSERT INTO effects VALUES (%s, %s)", (msg.id, msg.attempts_count))
        runs.append(msg.id)
        if msg.id == poison:
            raise RuntimeError("poison")
        if msg.attempts_count == 0:
            msg.nack(0.01)

    def dead_lettered() -> bool:  # by a third claim, unrun: its deliveries are used up
        return bool(
            scalar(effects, "SELECT count(*) FROM outbox_dlq WHERE original_id = %s", poison)
        )

    run_until(
        farm,
        dsn,
        lambda: runs.count(nacked) == 2 and dead_lettered(),
        "two nacks, then the DLQ",
        SETTINGS,
    )
    assert runs.count(poison) == 2
    assert effects.execute("SELECT msg_id, attempt FROM effects").fetchall() == [(nacked, 1)]
    reason = scalar(effects, "SELECT failure_reason FROM outbox_dlq WHERE original_id = %s", poison)
    assert reason == "max_deliveries"
    assert scalar(effects, "SELECT count(*) FROM outbox") == 0


def test_a_handler_that_outlives_its_lease_writes_nothing(
    dsn: str, effects: psycopg.Connection[Any]
) -> None:
    """Another runner took the row over while the handler ran (its lease had expired): the
    completion matches nothing, so the handler's transaction rolls back and the row stays."""
    queue, farm = qname(), Farm()
    row_id = farm.publish(effects, "slow", queue=queue)
    effects.commit()
    thief = uuid.uuid4()
    lost_before = sample("outbox_farm_lease_lost_total", queue=queue, phase="ack")
    finished: list[int] = []

    @farm.handler(queue, transactional=True, max_deliveries=1)
    async def handle(msg: Message, conn: AConn) -> None:
        await conn.execute("INSERT INTO effects VALUES (%s, %s)", (msg.id, msg.attempts_count))
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as other:
            await other.execute(
                "UPDATE outbox SET acquired_token = %s WHERE id = %s", (thief, msg.id)
            )
        finished.append(msg.id)

    run_until(farm, dsn, lambda: bool(finished), "the handler to finish", SETTINGS)
    assert scalar(effects, "SELECT count(*) FROM effects") == 0
    assert scalar(effects, "SELECT acquired_token FROM outbox WHERE id = %s", row_id) == thief
    assert sample("outbox_farm_lease_lost_total", queue=queue, phase="ack") - lost_before == 1


def test_transactional_needs_an_async_single_row_handler() -> None:
    farm = Farm()
    with pytest.raises(ConfigurationError, match="not a batch handler"):

        @farm.handler("a", transactional=True, batch=10)
        async def batch(msgs: list[Message], conn: AConn) -> None: ...

    with pytest.raises(ConfigurationError, match="not a plain function"):

        @farm.handler("b", transactional=True)
        def plain(msg: Message, conn: AConn) -> None: ...


def test_a_messages_timestamps_are_in_utc_and_a_handlers_session_keeps_its_zone(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """The farm's own sessions run in UTC (the driver loads a timestamp cheaper that way), so
    a message's timestamps come in UTC whatever the server's zone; the same instants. A
    transactional handler's connection is the user's: it keeps the zone its DSN asks for."""
    zoned = psycopg.conninfo.make_conninfo(dsn, options="-c TimeZone=Asia/Kolkata")
    queue, farm = qname(), Farm()
    row_id = farm.publish(conn, {"n": 1}, queue=queue)
    created = scalar(conn, "SELECT created_at FROM outbox WHERE id = %s", row_id)
    seen: list[tuple[datetime, datetime, str]] = []

    @farm.handler(queue, transactional=True)
    async def handle(msg: Message, tx: AConn) -> None:
        cur = await tx.execute("SHOW TimeZone")
        zone = await cur.fetchone()
        assert zone is not None
        seen.append((msg.created_at, msg.claimed_at, zone[0]))

    run_until(farm, zoned, lambda: bool(seen), "a run", SETTINGS)
    (created_at, claimed_at, zone), *_ = seen
    assert created_at == created  # the same instant ...
    assert created_at.utcoffset() == timedelta(0)  # ... in UTC
    assert claimed_at.utcoffset() == timedelta(0)
    assert zone == "Asia/Kolkata"
