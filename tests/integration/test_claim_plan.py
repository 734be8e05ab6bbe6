"""The claim's cached plan against a real Postgres: planned while the outbox was small, it must
not read the whole table once dead rows have grown it (before any VACUUM or ANALYZE tells the
planner). The farm's sessions refuse the sequential scan (`db.pool._configure_farm`); a plain
session, the control, is shown to take it, so the test proves what it claims. The gauges, which
count whole tables, still may (`housekeeping.scanning`)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import psycopg
import pytest

from outbox_farm import Farm
from outbox_farm.db import housekeeping
from outbox_farm.db.pool import open_pool
from outbox_farm.db.store import PostgresStore
from outbox_farm.names import TableNames
from outbox_farm.queries import Queries
from outbox_farm.storage import Claim

NAMES = TableNames.build("outbox", "outbox_dlq")
DEAD_ROWS = 20_000  # a few hundred pages the claim's plan never heard of


def one_row_claim() -> Claim:
    now = time.monotonic()
    return Claim("q", 64, 30.0, uuid.uuid4(), now, now + 30.0, [], False)


async def last_claim_plan(dsn: str, farm_sessions: bool) -> str:
    """Claim one row at a time until the server runs the claim on a cached generic plan, made
    while the table was analyzed empty; grow the table with dead rows (no VACUUM, no ANALYZE:
    autovacuum is off for it); the plan of the claim after that, as auto_explain reports it."""
    farm = Farm()
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("ALTER TABLE outbox SET (autovacuum_enabled = false)")
        admin.execute("VACUUM ANALYZE outbox")
    pool = await open_pool(dsn, 1, farm=farm_sessions)
    notices: list[str] = []
    try:
        store = PostgresStore(pool, Queries(NAMES))
        with psycopg.connect(dsn, autocommit=True) as admin:
            for _ in range(15):  # prepared at the 5th; 5 custom plans, then the generic one
                farm.publish(admin, b"x", queue="q")
                (msg,) = await store.claim(one_row_claim())
                admin.execute("DELETE FROM outbox WHERE id = %s", (msg.id,))
            admin.execute(
                "INSERT INTO outbox (queue, payload)"
                " SELECT 'other', '{}' FROM generate_series(1, %s)",
                (DEAD_ROWS,),
            )
            admin.execute("DELETE FROM outbox WHERE queue = 'other'")
            farm.publish(admin, b"x", queue="q")
        async with pool.connection() as conn:
            conn.add_notice_handler(lambda diag: notices.append(diag.message_primary or ""))
            for setting in (
                "LOAD 'auto_explain'",
                "SET auto_explain.log_min_duration = 0",
                "SET auto_explain.log_level = 'notice'",
            ):
                await conn.execute(setting)
        (msg,) = await store.claim(one_row_claim())
    finally:
        await pool.close()
    plans = [text for text in notices if "acquired_token" in text]
    assert len(plans) == 1, notices
    return plans[0]


@pytest.mark.parametrize("farm_sessions", [True, False], ids=["farm", "plain"])
def test_a_claim_planned_on_a_small_table_does_not_read_it_whole_once_grown(
    dsn: str, farm_sessions: bool
) -> None:
    plan = asyncio.run(last_claim_plan(dsn, farm_sessions))
    whole = "Seq Scan on outbox o" in plan
    if farm_sessions:
        assert not whole, plan
        assert "outbox_pkey" in plan, plan
    else:  # the control: what the farm's sessions refuse is what the planner chose here
        assert whole, plan


def test_the_gauges_still_count_with_a_sequential_scan(dsn: str) -> None:
    """`scanning` turns the scan back on for its own transaction only: the gauges' counts
    read the table once, and the farm's setting holds again for the next statement."""

    async def read() -> tuple[list[Any], str]:
        pool = await open_pool(dsn, 1, farm=True)
        try:
            rows = await housekeeping.scanning(pool, "SELECT current_setting('enable_seqscan')")
            async with pool.connection() as conn:
                after = await (await conn.execute("SHOW enable_seqscan")).fetchone()
            assert after is not None
            return rows, str(after[0])
        finally:
            await pool.close()

    rows, after = asyncio.run(read())
    assert rows == [("on",)]
    assert after == "off"
