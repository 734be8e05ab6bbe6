"""A queue's farm-wide limits on Postgres, in one process: the runtime bounds its handlers to
`max_running` from the limit's NOTIFY on, and a farm deployed before `migrate` applied 0012
(the controls table without the limits' columns) still reads its pauses and limits nothing."""

from __future__ import annotations

import asyncio

import psycopg

from outbox_farm import Farm, Message
from outbox_farm.db.control import notify_changed
from outbox_farm.db.pool import open_pool
from outbox_farm.db.store import PostgresStore
from outbox_farm.limits import Limits
from outbox_farm.names import TableNames
from outbox_farm.queries import Queries
from outbox_farm.storage import Allowed, Claim, QueueControl
from tests.steps import eventually

NAMES = TableNames.build("outbox", "outbox_dlq")


def set_max_running(dsn: str, queue: str, most: int | None) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO outbox_farm_queues (target, queue, max_running) VALUES (%s, %s, %s)"
            " ON CONFLICT (target, queue) DO UPDATE SET max_running = excluded.max_running",
            [str(NAMES.outbox), queue, most],
        )
        notify_changed(conn, NAMES, queue)


def test_max_running_bounds_a_runtime_from_the_limits_notify_on(dsn: str) -> None:
    farm = Farm(dlq_table="outbox_dlq")
    running, most, done = [0], [0], []
    go = asyncio.Event()

    @farm.handler("q", concurrency=16)
    async def handle(msg: Message) -> None:
        running[0] += 1
        most[0] = max(most[0], running[0])
        await go.wait()
        running[0] -= 1
        done.append(msg.id)

    async def scenario() -> None:
        async with farm.running(dsn, poll_interval=0.05, flush_interval=0.01) as runtime:
            fetcher = runtime.fetchers["q"]
            limited = asyncio.Event()
            claim_limited = fetcher.store.claim_limited

            async def noted(claim: Claim) -> Allowed:
                limited.set()
                return await claim_limited(claim)

            fetcher.store.claim_limited = noted  # type: ignore[method-assign]
            set_max_running(dsn, "q", 3)
            await eventually(lambda: fetcher.limits == Limits(max_running=3), "the limit")
            # A claim sent before the limit came still takes what it was sent for (as one under
            # way when a pause comes does): the rows go in once a claim under the limit began.
            await eventually(limited.is_set, "a claim under the limit")
            with psycopg.connect(dsn, autocommit=True) as conn:
                farm.publish_batch(conn, [{"n": n} for n in range(30)], queue="q")
            await eventually(lambda: running[0] == 3, "three rows running")
            go.set()
            await eventually(lambda: len(done) == 30, "every row")
        assert most[0] == 3

    asyncio.run(scenario())


def test_a_database_before_0012_still_pauses_and_limits_nothing(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "ALTER TABLE outbox_farm_queues DROP COLUMN rate_count, DROP COLUMN rate_seconds,"
            " DROP COLUMN max_running, DROP COLUMN tokens, DROP COLUMN tokens_at"
        )
        conn.execute(
            "INSERT INTO outbox_farm_queues (target, queue, paused, reason)"
            " VALUES (%s, 'emails', true, 'smtp down'), (%s, 'sms', false, NULL)",
            [str(NAMES.outbox)] * 2,
        )

    async def controls() -> dict[str, QueueControl]:
        pool = await open_pool(dsn, 1, farm=True)
        try:
            return await PostgresStore(pool, Queries(NAMES)).controls()
        finally:
            await pool.close()

    assert asyncio.run(controls()) == {
        "emails": QueueControl("emails", True, None, "smtp down", Limits())
    }
