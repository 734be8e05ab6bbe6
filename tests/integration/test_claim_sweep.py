"""The claim's sweep (`Claim.sweep`): expired leases and rows due beyond year 9999 are looked
for by a claim that sweeps, which the fetcher sends whenever something due was left behind, and
not by the claim a NOTIFY wakes on an idle queue, whose time is most of an idle farm's
commit-to-handler latency."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg

from outbox_farm import Farm, Message
from outbox_farm.db.pool import open_pool
from outbox_farm.db.store import PostgresStore
from outbox_farm.names import TableNames
from outbox_farm.queries import Queries
from outbox_farm.storage import Claim
from tests.steps import eventually, publish

Conn = psycopg.Connection[Any]
NAMES = TableNames.build("outbox", "outbox_dlq")
TRICKLE = 10  # rows published one by one to an idle farm
SPIN_LEAST = 6  # claims an expired lease may cost before it is taken (a spin makes hundreds)


def expired_lease(conn: Conn, queue: str) -> int:
    """A row another runner leased, whose lease ran out a minute ago."""
    row = conn.execute(
        "INSERT INTO outbox (queue, payload, acquired_token, acquired_at, lease_expires_at) "
        "VALUES (%s, 'x', %s, now() - interval '2 minutes', now() - interval '1 minute') "
        "RETURNING id",
        [queue, uuid.uuid4()],
    ).fetchone()
    assert row is not None
    conn.commit()
    return int(row[0])


def test_only_a_claim_that_sweeps_takes_an_expired_lease(dsn: str, conn: Conn) -> None:
    gone = expired_lease(conn, "q")

    async def claims() -> list[list[int]]:
        pool = await open_pool(dsn, 1)
        try:
            store = PostgresStore(pool, Queries(NAMES))
            took = []
            for sweep in (False, True):
                claim = Claim("q", 10, 60.0, uuid.uuid4(), sent=0.0, start_by=60.0, sweep=sweep)
                took.append([msg.id for msg in await store.claim(claim)])
            return took
        finally:
            await pool.close()

    assert asyncio.run(claims()) == [[], [gone]]
    row = conn.execute("SELECT deliveries_count FROM outbox WHERE id = %s", [gone]).fetchone()
    assert row == (1,)


def test_an_idle_farm_claims_a_published_row_without_the_sweep_and_still_retakes_an_expired_lease(
    dsn: str, conn: Conn
) -> None:
    """The rows a NOTIFY wakes the fetcher for come from claims without the sweep (one every
    `SWEEP_EVERY` seconds at most sweeps, so that rows due beyond year 9999 are found under a
    steady trickle too); an expired lease on the same idle queue is still taken, by a sweep, as
    soon as it is due."""
    farm = Farm()
    handled: dict[int, bool] = {}  # row id -> whether the claim that took it swept

    async def run() -> tuple[dict[int, bool], list[int]]:
        async with farm.running(dsn) as runtime:
            store = runtime.store
            assert store is not None
            claim = store.claim
            sweeps: dict[int, bool] = {}
            made: list[bool] = []  # whether each claim swept, in order

            async def noted(request: Claim) -> list[Message]:
                made.append(request.sweep)
                msgs = await claim(request)
                sweeps.update((msg.id, request.sweep) for msg in msgs)
                return msgs

            store.claim = noted  # type: ignore[method-assign,assignment]
            assert runtime.listener is not None
            await runtime.listener.connected.wait()
            published: list[int] = []

            def last_handled() -> bool:
                return published[-1] in handled

            for _ in range(TRICKLE):  # one at a time, each to an idle fetcher
                published.extend(await asyncio.to_thread(publish, dsn, 1, queue="q"))
                await eventually(last_handled, "the published row handled")
            before = len(made)
            gone = await asyncio.to_thread(expired_lease, conn, "q")
            await eventually(lambda: gone in handled, "the expired lease taken again", 30)
            # Found due by `next_due` after a claim without the sweep, it is swept for at once,
            # not claimed for in a loop until the next periodic sweep.
            assert len(made) - before <= SPIN_LEAST, made[before:]
            return sweeps, published

    @farm.handler("q")
    async def handle(msg: Message) -> None:
        handled[msg.id] = True

    sweeps, published = asyncio.run(run())
    unswept = [row for row in published if not sweeps[row]]
    assert unswept, "every claim a NOTIFY woke swept for expired leases and far rows"
    expired = [row for row in handled if row not in published]
    assert [sweeps[row] for row in expired] == [True]
