"""Batch handlers, against a real Postgres (middleware chains are tested over the in-memory
store, in tests/unit/test_runtime_middleware.py). Batch handlers: batches of at most
`batch` rows, formed from what waits and what arrives within `linger`; each row decided on its
own (the handler's ack/nack/reject, else what its return or exception gives); rows over
`max_deliveries` never passed in; the timeout bounds the whole call.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import psycopg
import pytest

from outbox_farm import (
    AckPolicy,
    CallNext,
    ConstantBackoff,
    DeadLetter,
    Farm,
    Kind,
    Message,
    NoRetry,
    Outcome,
    Retry,
)
from tests.integration.delivery_kit import DLQ, POLL, Db, database, qname, records
from tests.steps import eventually, publish


async def empty(db: Db, queue: str) -> bool:
    return await db.outbox_count(queue) == 0


# -- batch handlers --------------------------------------------------------------------------


def test_batches_hold_at_most_batch_rows_taking_what_is_waiting(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("b_size")
    farm = Farm(dlq_table=DLQ)
    ids = publish(conn, [n for n in range(25)], queue=q)
    calls: list[list[int]] = []

    @farm.handler(q, batch=10, concurrency=1)
    async def handle(batch: list[Message]) -> None:
        calls.append([msg.id for msg in batch])

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: empty(db, q), "every row's ack")

    asyncio.run(scenario())
    assert sorted(row for call in calls for row in call) == ids
    assert max(len(call) for call in calls) == 10
    assert farm.handlers[q].capacity == 20  # a batch running, a batch's worth prefetched


def test_a_trickle_lingers_into_one_batch_and_a_lone_row_waits_no_longer_than_linger(
    dsn: str, conn: psycopg.Connection
) -> None:
    """With many idle executors, rows arriving while one of them lingers join its batch."""
    q = qname("b_linger")
    farm = Farm(dlq_table=DLQ)
    calls: list[tuple[float, list[bytes]]] = []

    @farm.handler(q, batch=10, linger=0.5)
    async def handle(batch: list[Message]) -> None:
        calls.append((time.monotonic(), [msg.body for msg in batch]))

    async def scenario() -> float:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            for n in range(3):
                publish(conn, [f"t{n}"], queue=q)
                await asyncio.sleep(0.05)  # a trickle, on purpose: a row every 50 ms
            await eventually(lambda: empty(db, q), "the trickle's acks")
            published = time.monotonic()
            publish(conn, ["alone"], queue=q)
            await eventually(lambda: empty(db, q), "the lone row's ack")
            return published

    published = asyncio.run(scenario())
    assert [bodies for _, bodies in calls] == [[b"t0", b"t1", b"t2"], [b"alone"]]
    assert calls[1][0] - published < 0.5 + 0.4


def test_each_row_of_a_batch_gets_the_handlers_own_decision_the_rest_are_acked(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("b_mixed")
    farm = Farm(dlq_table=DLQ)
    bodies = ["ack", "nack", "reject", "a", "b"]
    ids = dict(zip(bodies, publish(conn, bodies, queue=q), strict=True))
    calls: list[list[tuple[bytes, int]]] = []

    @farm.handler(q, batch=10, concurrency=1, retry=ConstantBackoff(60.0))
    async def handle(batch: list[Message]) -> None:
        calls.append([(msg.body, msg.attempts_count) for msg in batch])
        for msg in batch:
            if msg.body == b"ack":
                msg.ack()
            elif msg.body == b"nack" and msg.attempts_count == 0:
                msg.nack(0.05)  # its own delay, not the strategy's minute
            elif msg.body == b"reject":
                msg.reject(ValueError("the broker refused it"))

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: empty(db, q), "every row to be done")
            assert [r[:3] for r in await db.dlq_rows(q)] == [
                (ids["reject"], "rejected", repr(ValueError("the broker refused it")))
            ]

    asyncio.run(scenario())
    assert calls == [
        [(b"ack", 0), (b"nack", 0), (b"reject", 0), (b"a", 0), (b"b", 0)],
        [(b"nack", 1)],
    ]


def test_manual_batch_rows_left_undecided_are_retried(
    dsn: str, conn: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    q = qname("b_manual")
    farm = Farm(dlq_table=DLQ)
    bodies = ["acked", "forgotten"]
    ids = dict(zip(bodies, publish(conn, bodies, queue=q), strict=True))
    calls: list[list[tuple[bytes, int]]] = []

    @farm.handler(q, batch=10, concurrency=1, ack="manual", retry=ConstantBackoff(0.05))
    async def handle(batch: list[Message]) -> None:
        calls.append([(msg.body, msg.attempts_count) for msg in batch])
        for msg in batch:
            if msg.body == b"acked" or msg.attempts_count:
                msg.ack()

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: empty(db, q), "both rows to be done")

    with caplog.at_level(logging.WARNING, logger="outbox_farm"):
        asyncio.run(scenario())
    assert calls == [[(b"acked", 0), (b"forgotten", 0)], [(b"forgotten", 1)]]
    assert [r.row_id for r in records(caplog, "no_decision")] == [ids["forgotten"]]  # type: ignore[attr-defined]


class _Down(RuntimeError):
    pass


@pytest.mark.parametrize(
    ("ack", "raised", "reason"),
    [
        (AckPolicy.ACK_ON_SUCCESS, _Down("broker down"), "retry_terminal"),
        (AckPolicy.REJECT_ON_ERROR, _Down("broker down"), "rejected"),
        (AckPolicy.ACK_ON_SUCCESS, DeadLetter("poison batch"), "rejected"),
        (AckPolicy.ACK_ON_SUCCESS, Retry(delay=0.05), None),
    ],
    ids=["strategy", "reject_on_error", "DeadLetter", "Retry"],
)
def test_a_batch_that_raises_decides_every_undecided_row_by_the_policy(
    dsn: str, conn: psycopg.Connection, ack: AckPolicy, raised: Exception, reason: str | None
) -> None:
    """The rows the handler acked before raising stay acked; the others get what the exception
    gives a single row (NoRetry: terminal at once; Retry: its delay), and the on_failure hook
    hears of every row of the failed call."""
    q = qname("b_raise")
    hooked: list[tuple[bytes, Kind]] = []

    def hook(msg: Message, exc: BaseException, outcome: Outcome) -> None:
        assert exc is raised
        hooked.append((msg.body, outcome.kind))

    farm = Farm(dlq_table=DLQ, on_failure=hook)
    bodies = ["done", "x", "y"]
    ids = dict(zip(bodies, publish(conn, bodies, queue=q), strict=True))
    calls: list[list[bytes]] = []

    @farm.handler(q, batch=10, concurrency=1, ack=ack, retry=NoRetry())
    async def handle(batch: list[Message]) -> None:
        calls.append([msg.body for msg in batch])
        for msg in batch:
            if msg.body == b"done":
                msg.ack()
        if len(calls) == 1:
            raise raised

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: empty(db, q), "every row to be done")
            expected = [] if reason is None else [(ids[b], reason, repr(raised)) for b in "xy"]
            assert [r[:3] for r in await db.dlq_rows(q)] == expected

    asyncio.run(scenario())
    failed = Kind.RETRY if reason is None else Kind.TERMINAL
    assert calls == ([[b"done", b"x", b"y"]] + ([[b"x", b"y"]] if reason is None else []))
    assert hooked == [(b"done", Kind.ACK), (b"x", failed), (b"y", failed)]


def test_rows_over_max_deliveries_go_to_the_dlq_without_joining_the_batch(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("b_maxd")
    farm = Farm(dlq_table=DLQ)
    bodies = ["a", "over-1", "b", "over-2"]
    ids = dict(zip(bodies, publish(conn, bodies, queue=q), strict=True))
    over = [ids["over-1"], ids["over-2"]]
    conn.execute("UPDATE outbox SET deliveries_count = 3 WHERE id = ANY(%s)", (over,))
    calls: list[list[bytes]] = []

    @farm.handler(q, batch=10, concurrency=1, max_deliveries=3)
    async def handle(batch: list[Message]) -> None:
        calls.append([msg.body for msg in batch])

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: empty(db, q), "every row to be done")
            assert [r[:3] for r in await db.dlq_rows(q)] == [
                (row_id, "max_deliveries", None) for row_id in over
            ]

    asyncio.run(scenario())
    assert calls == [[b"a", b"b"]]


def test_the_timeout_bounds_the_whole_batch_call(dsn: str, conn: psycopg.Connection) -> None:
    q = qname("b_hang")
    farm = Farm(dlq_table=DLQ)
    bodies = ["confirmed", "x", "y"]
    ids = dict(zip(bodies, publish(conn, bodies, queue=q), strict=True))

    @farm.handler(q, batch=10, concurrency=1, timeout=0.3, retry=NoRetry())
    async def handle(batch: list[Message]) -> None:
        batch[0].ack()
        await asyncio.sleep(60)  # past its timeout, which cancels it

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            started = time.monotonic()
            await eventually(lambda: empty(db, q), "every row to be done")
            assert time.monotonic() - started < 2.0
            rows = await db.dlq_rows(q)
            assert [(r[0], r[1], r[2].split("(")[0]) for r in rows] == [
                (ids["x"], "retry_terminal", "HandlerTimeout"),
                (ids["y"], "retry_terminal", "HandlerTimeout"),
            ]

    asyncio.run(scenario())


def test_a_stop_past_its_deadline_keeps_what_the_batch_decided_and_retries_the_rest_at_once(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("b_stop")
    farm = Farm(dlq_table=DLQ)
    bodies = ["confirmed", "x", "y"]
    ids = dict(zip(bodies, publish(conn, bodies, queue=q), strict=True))
    started = threading.Event()

    @farm.handler(q, batch=10, concurrency=1, retry=ConstantBackoff(60.0))
    async def handle(batch: list[Message]) -> None:
        batch[0].ack()
        started.set()
        await asyncio.sleep(60)  # past the stop's grace, which cancels it

    async def scenario() -> None:
        async with farm.running(dsn, poll_interval=POLL, graceful_timeout=0.2):
            await eventually(started.is_set, "the batch to start")

    asyncio.run(scenario())
    rows = conn.execute(
        "SELECT id, attempts_count, acquired_token IS NULL, next_attempt_at <= now() "
        "FROM outbox WHERE queue = %s ORDER BY id",
        (q,),
    ).fetchall()
    assert rows == [(ids["x"], 1, True, True), (ids["y"], 1, True, True)]


def test_a_sync_batch_handler_runs_in_a_thread_and_middleware_sees_the_batch(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("b_sync")
    seen: list[tuple[str, Any]] = []

    async def middleware(batch: list[Message], call_next: CallNext) -> Any:
        seen.append(("middleware", [msg.body for msg in batch]))
        return await call_next(batch)

    farm = Farm(dlq_table=DLQ, middleware=[middleware])
    ids = publish(conn, [f"m{n}" for n in range(4)], queue=q)

    @farm.handler(q, batch=4, concurrency=1)
    def handle(batch: list[Message]) -> None:
        seen.append(("handler", threading.current_thread() is threading.main_thread()))
        for msg in batch:
            if msg.id % 2:
                msg.reject()

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: empty(db, q), "every row to be done")
            assert [r[:3] for r in await db.dlq_rows(q)] == [
                (row_id, "rejected", None) for row_id in ids if row_id % 2
            ]

    asyncio.run(scenario())
    assert seen == [("middleware", [b"m0", b"m1", b"m2", b"m3"]), ("handler", False)]
