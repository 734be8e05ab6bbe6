"""Shutdown written once (issue 25, item 5): `Runtime.stop` stops claiming everywhere, then
drains every queue at once: no handler starts after the stop began, in any queue; rows not yet
started are released (lease cleared, their claim's delivery taken back); running handlers finish
and are acked, concurrently, so the stop takes one handler's time, not one per queue."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import psycopg

from outbox_farm import Farm, Message
from tests.steps import eventually

DURATION = 2.5  # each handler's run time
PER_QUEUE = 3  # rows per queue: one running, two prefetched


def qname(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def test_stop_drains_every_queue_at_once_and_starts_nothing_new(dsn: str) -> None:
    queues = [qname("slow_a"), qname("slow_b")]
    farm = Farm(dlq_table="outbox_dlq")
    started: dict[str, list[tuple[int, float]]] = {q: [] for q in queues}
    finished: dict[str, list[int]] = {q: [] for q in queues}

    for queue in queues:

        @farm.handler(queue, concurrency=1, prefetch=PER_QUEUE - 1, timeout=60)
        async def handle(msg: Message) -> None:
            started[msg.queue].append((msg.id, time.monotonic()))
            await asyncio.sleep(DURATION)  # running still when the stop comes, on purpose
            finished[msg.queue].append(msg.id)

    async def scenario() -> None:
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
            ids = {
                q: [await farm.apublish(aconn, {"n": n}, queue=q) for n in range(PER_QUEUE)]
                for q in queues
            }
            async with farm.running(dsn, poll_interval=0.05, graceful_timeout=30) as rt:
                await eventually(lambda: all(started[q] for q in queues), "both handlers run")
                await eventually(
                    lambda: _all_leased(aconn, 2 * PER_QUEUE),
                    "every row claimed (the rest prefetched)",
                )
                began = time.monotonic()
                await rt.stop()
                took = time.monotonic() - began

            late = [(q, i) for q in queues for i, at in started[q] if at >= began]
            assert not late, f"handlers started after the stop began: {late}"
            running = {q: started[q][0][0] for q in queues}
            assert finished == {q: [running[q]] for q in queues}
            # Both handlers finished within one handler's time: drained together, not one
            # queue after another while the other queue's executor took its next row.
            assert took < 1.5 * DURATION, f"the stop took {took:.2f}s"

            cursor = await aconn.execute(
                "SELECT id, acquired_token, deliveries_count FROM outbox ORDER BY id"
            )
            rows = await cursor.fetchall()
            unstarted = sorted(
                i for q in queues for i in ids[q] if i is not None and i != running[q]
            )
            assert [row[0] for row in rows] == unstarted  # the two that ran were acked
            assert all(token is None and count == 0 for _, token, count in rows), rows

    asyncio.run(scenario())


async def _all_leased(aconn: psycopg.AsyncConnection[Any], n: int) -> bool:
    cursor = await aconn.execute("SELECT count(*) FROM outbox WHERE acquired_token IS NOT NULL")
    row = await cursor.fetchone()
    assert row is not None
    return int(row[0]) == n
