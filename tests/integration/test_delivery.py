"""Delivery semantics of the runtime against a real Postgres (DESIGN.md §3, §4, §6).

Each test runs `Farm.running()` on its own event loop (`asyncio.run`) over the per-test
database of the `dsn` fixture, and waits for conditions with deadline-bounded polling; a
fixed sleep is only used before asserting that something did *not* happen. Metrics are
process-global, so tests read before/after deltas on queue names of their own.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from decimal import Decimal
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY
from psycopg import sql
from psycopg.conninfo import make_conninfo
from psycopg_pool import AsyncConnectionPool

from outbox_farm import (
    AckPolicy,
    ConfigurationError,
    ConstantBackoff,
    DeadLetter,
    Farm,
    Message,
    NoRetry,
    Retry,
    gauges,
)
from outbox_farm.completer import Completer
from outbox_farm.metrics import metrics
from outbox_farm.outcome import FRAMES_HEADER, TRUNCATED, Kind, Outcome, Reason
from outbox_farm.problems import Problems
from tests import samples
from tests.samples import claims
from tests.waits import eventually

DLQ = "outbox_dlq"
POLL = 0.05  # poll_interval of every runtime below, unless a test says otherwise

metrics()  # register the collectors before the first sample is read

Row = tuple[Any, ...]


# -- helpers ------------------------------------------------------------------------------


def qname(prefix: str) -> str:
    """A queue name of this test's own, so process-global metric deltas are this test's."""
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def publish(farm: Farm, conn: psycopg.Connection, body: object, **options: Any) -> int:
    row_id = farm.publish(conn, body, **options)
    assert row_id is not None
    return row_id


def sample(name: str, **labels: str) -> float:
    return samples.sample(f"outbox_farm_{name}_total", **labels)


@asynccontextmanager
async def database(dsn: str) -> AsyncIterator[Db]:
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as aconn:
        yield Db(aconn)


class Db:
    """Small query helpers over one autocommit async connection (the test's own)."""

    def __init__(self, aconn: psycopg.AsyncConnection[Any]) -> None:
        self.aconn = aconn

    async def one(self, query: str, params: Any = None) -> Row | None:
        cursor = await self.aconn.execute(query, params)
        return await cursor.fetchone()

    async def all(self, query: str, params: Any = None) -> list[Row]:
        cursor = await self.aconn.execute(query, params)
        return await cursor.fetchall()

    async def value(self, query: str, params: Any = None) -> Any:
        row = await self.one(query, params)
        assert row is not None
        return row[0]

    async def exists(self, row_id: int) -> bool:
        return bool(await self.value("SELECT count(*) FROM outbox WHERE id = %s", (row_id,)))

    async def outbox_count(self, queue: str) -> int:
        return int(await self.value("SELECT count(*) FROM outbox WHERE queue = %s", (queue,)))

    async def dlq_rows(self, queue: str) -> list[Row]:
        return await self.all(
            # The exception's repr: the first line of last_exception (frames follow it).
            "SELECT original_id, failure_reason, split_part(last_exception, E'\\n', 1), "
            "payload, headers, "
            "deliveries_count FROM outbox_dlq WHERE queue = %s ORDER BY original_id",
            (queue,),
        )

    async def lease(self, row_id: int) -> Row | None:
        return await self.one(
            "SELECT acquired_token, acquired_at, deliveries_count, attempts_count, "
            "next_attempt_at, first_attempt_at, last_attempt_at FROM outbox WHERE id = %s",
            (row_id,),
        )


def records(caplog: pytest.LogCaptureFixture, event: str, **fields: Any) -> list[logging.LogRecord]:
    return [
        r
        for r in caplog.records
        if getattr(r, "event", None) == event
        and all(getattr(r, k, None) == v for k, v in fields.items())
    ]


async def _zero(count: Awaitable[int]) -> bool:
    return await count == 0


async def _not(value: Awaitable[Any]) -> bool:
    return not await value


async def _count_is(db: Db, queue: str, n: int) -> bool:
    return await db.outbox_count(queue) == n


# -- invariant 1: a row is deleted only after its handler returned ------------------------


def test_row_exists_under_its_lease_while_the_handler_runs_and_goes_after_success(
    dsn: str, conn: psycopg.Connection
) -> None:
    q, control = qname("inv1"), qname("inv1c")
    farm = Farm(dlq_table=DLQ)
    seen: list[tuple[Row | None, Row | None, Message]] = []
    ids = [publish(farm, conn, {"n": n}, queue=q) for n in range(3)]

    @farm.handler(control)
    async def handle_control(msg: Message) -> None:
        pass

    async def scenario() -> None:
        async with database(dsn) as db:

            @farm.handler(q, lease_ttl=10)
            async def handle(msg: Message) -> None:
                at_start = await db.lease(msg.id)
                # The completer writes an ack (another queue's) while this handler runs, so it
                # had the chance to write anything of this row early (counted, not a sleep).
                acked = sample("acked", queue=control)
                await farm.apublish(db.aconn, "control", queue=control)
                await eventually(lambda: sample("acked", queue=control) > acked, "a flush")
                at_end = await db.lease(msg.id)
                seen.append((at_start, at_end, msg))

            async with farm.running(dsn, poll_interval=POLL):
                await eventually(lambda: len(seen) == 3, "three handler runs")
                await eventually(lambda: _zero(db.outbox_count(q)), "the acks")
            assert await db.outbox_count(q) == 0
            assert await db.dlq_rows(q) == []

    asyncio.run(scenario())
    assert sorted(m.id for _, _, m in seen) == sorted(ids)
    for at_start, at_end, msg in seen:
        for row in (at_start, at_end):
            assert row is not None, f"row {msg.id} was gone while its handler still ran"
            assert row[0] == msg.lease_token  # still held under this delivery's lease


def test_failed_handler_keeps_the_row_with_one_more_attempt_due_later_and_unleased(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("inv1f")
    farm = Farm(dlq_table=DLQ)
    calls: list[Message] = []
    row_id = publish(farm, conn, {"boom": True}, queue=q)
    retried = sample("retried", queue=q)

    @farm.handler(q, retry=ConstantBackoff(delay=30.0), lease_ttl=10)
    async def handle(msg: Message) -> None:
        calls.append(msg)
        raise ValueError("handler failed")

    async def scenario() -> None:
        async with database(dsn) as db:
            async with farm.running(dsn, poll_interval=POLL):
                await eventually(lambda: sample("retried", queue=q) == retried + 1, "the retry")
            row = await db.one(
                "SELECT attempts_count, deliveries_count, next_attempt_at > now() + interval "
                "'20 seconds', acquired_token, acquired_at, first_attempt_at IS NOT NULL, "
                "last_attempt_at IS NOT NULL FROM outbox WHERE id = %s",
                (row_id,),
            )
            assert row == (1, 1, True, None, None, True, True)
            assert await db.dlq_rows(q) == []

    asyncio.run(scenario())
    assert len(calls) == 1


# -- invariant 2: every terminal write matches id and lease token --------------------------


def test_slow_handler_loses_its_lease_the_second_runner_acks_and_the_stale_ack_is_lease_lost(
    dsn: str, conn: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    q = qname("inv2")
    farm_a, farm_b = Farm(dlq_table=DLQ), Farm(dlq_table=DLQ)
    row_id = publish(farm_a, conn, {"slow": True}, queue=q)
    a_calls: list[Message] = []
    b_calls: list[Message] = []
    lost = sample("lease_lost", queue=q, phase="ack")
    acked = sample("acked", queue=q)

    async def scenario() -> None:
        gate = asyncio.Event()

        @farm_a.handler(q, concurrency=1, prefetch=1, lease_ttl=0.3, timeout=5)
        async def slow(msg: Message) -> None:
            a_calls.append(msg)
            await gate.wait()  # outlives its lease; redeliveries to A queue up behind it

        @farm_b.handler(q, lease_ttl=0.3, timeout=5)
        async def fast(msg: Message) -> None:
            b_calls.append(msg)

        async with database(dsn) as db, farm_a.running(dsn, poll_interval=POLL) as runner_a:
            await eventually(lambda: a_calls, "runner A to start the handler")
            # Runner A stalls as far as its leases go (a worker cut off from the database):
            # its heartbeat stops, and the lease runs out while the handler still runs.
            await runner_a.heartbeats[0].stop()
            async with farm_b.running(dsn, poll_interval=POLL):
                await eventually(lambda: b_calls, "runner B to take the expired lease")
                await eventually(
                    lambda: _not(db.exists(row_id)), "runner B's ack to delete the row"
                )
                gate.set()  # now A's handler returns and A acks under its stale token
                await eventually(
                    lambda: records(
                        caplog, "lease_lost", phase="ack", row_id=row_id, deliveries_count=1
                    ),
                    "A's stale ack to be reported",
                )
            assert await db.dlq_rows(q) == []

    with caplog.at_level(logging.WARNING, logger="outbox_farm"):
        asyncio.run(scenario())
    assert a_calls[0].deliveries_count == 1
    assert b_calls[0].id == row_id
    assert b_calls[0].deliveries_count >= 2
    assert b_calls[0].lease_token != a_calls[0].lease_token
    assert sample("lease_lost", queue=q, phase="ack") >= lost + 1
    assert sample("acked", queue=q) == acked + 1  # B's ack only; A's matched nothing
    (record,) = records(caplog, "lease_lost", phase="ack", row_id=row_id, deliveries_count=1)
    assert record.levelno == logging.WARNING
    assert record.queue == q  # type: ignore[attr-defined]


@pytest.mark.parametrize("phase", ["ack", "retry", "terminal"])
def test_a_write_under_a_lease_taken_over_changes_nothing(
    dsn: str, conn: psycopg.Connection, caplog: pytest.LogCaptureFixture, phase: str
) -> None:
    q = qname(f"steal_{phase}")
    farm = Farm(dlq_table=DLQ)
    row_id = publish(farm, conn, {"phase": phase}, queue=q)
    counters = {name: sample(name, queue=q) for name in ("acked", "retried")}
    terminal = sample("terminal", queue=q, reason="rejected")
    lost = sample("lease_lost", queue=q, phase=phase)

    async def scenario() -> None:
        started, proceed = asyncio.Event(), asyncio.Event()

        @farm.handler(q, lease_ttl=60, retry=ConstantBackoff(delay=0.05))
        async def handle(msg: Message) -> None:
            started.set()
            await proceed.wait()
            if phase == "retry":
                raise ValueError("try again")
            if phase == "terminal":
                raise DeadLetter("give up")

        async with database(dsn) as db:
            async with farm.running(dsn, poll_interval=POLL):
                await asyncio.wait_for(started.wait(), 4)
                # Another process re-took the row under a fresh token meanwhile.
                taken = await db.one(
                    "UPDATE outbox SET acquired_token = gen_random_uuid(), acquired_at = now() "
                    "WHERE id = %s RETURNING acquired_token, acquired_at",
                    (row_id,),
                )
                before = await db.lease(row_id)
                proceed.set()
                await eventually(
                    lambda: sample("lease_lost", queue=q, phase=phase) == lost + 1,
                    f"the {phase} write to be counted as lease_lost",
                )
            after = await db.lease(row_id)
            assert taken is not None
            assert before is not None
            assert after == before  # token, lease time, counts and due time all intact
            assert after[0] == taken[0]
            assert await db.dlq_rows(q) == []

    with caplog.at_level(logging.WARNING, logger="outbox_farm"):
        asyncio.run(scenario())
    (record,) = records(caplog, "lease_lost", row_id=row_id)
    assert record.levelno == logging.WARNING
    assert (record.phase, record.queue, record.deliveries_count) == (phase, q, 1)  # type: ignore[attr-defined]
    assert {name: sample(name, queue=q) for name in counters} == counters
    # The terminal decision is counted when it is made: terminal_total outgrows
    # dlq_written_total by exactly the lost write.
    assert sample("terminal", queue=q, reason="rejected") == terminal + (phase == "terminal")


# -- invariant 3: the DLQ ------------------------------------------------------------------


def test_no_retry_failure_is_archived_with_its_payload_headers_and_exception(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("dlq")
    farm = Farm(dlq_table=DLQ)
    row_id = publish(farm, conn, {"order": 42}, queue=q, headers={"tenant": "acme"})
    stored = conn.execute("SELECT payload, headers FROM outbox WHERE id = %s", (row_id,)).fetchone()
    error = ValueError("no stock for order 42")
    calls: list[Message] = []

    @farm.handler(q, retry=NoRetry())
    async def handle(msg: Message) -> None:
        calls.append(msg)
        raise error

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: db.dlq_rows(q), "the DLQ row")
            assert not await db.exists(row_id)

    asyncio.run(scenario())
    assert stored is not None
    rows = conn.execute(
        "SELECT original_id, queue, payload, headers, deliveries_count, failure_reason, "
        "last_exception, failed_at >= created_at FROM outbox_dlq"
    ).fetchall()
    assert [(*r[:6], r[6].splitlines()[0], r[7]) for r in rows] == [
        (row_id, q, stored[0], stored[1], 1, "retry_terminal", repr(error), True)
    ]
    assert "raise error" in rows[0][6]  # and where it was raised
    assert stored[0] == b'{"order":42}'
    assert stored[1]["tenant"] == "acme"
    assert len(calls) == 1


def _dead_letter(msg: Message) -> None:
    raise DeadLetter("poison message")


def _reject(msg: Message) -> None:
    msg.reject()


def _raise(msg: Message) -> None:
    raise KeyError("missing field")


@pytest.mark.parametrize(
    ("behaviour", "ack", "exception"),
    [
        (_dead_letter, AckPolicy.ACK_ON_SUCCESS, repr(DeadLetter("poison message"))),
        (_reject, AckPolicy.ACK_ON_SUCCESS, None),
        (_raise, "reject_on_error", repr(KeyError("missing field"))),
    ],
    ids=["DeadLetter", "msg.reject", "reject_on_error"],
)
def test_rejections_go_to_the_dlq_as_rejected_at_once(
    dsn: str,
    conn: psycopg.Connection,
    behaviour: Callable[[Message], None],
    ack: AckPolicy | str,
    exception: str | None,
) -> None:
    q = qname("rej")
    farm = Farm(dlq_table=DLQ)
    row_id = publish(farm, conn, "x", queue=q)
    calls: list[Message] = []

    # A generous retry strategy: only the rejection can make the first failure terminal.
    @farm.handler(q, ack=ack, retry=ConstantBackoff(delay=0.05))
    async def handle(msg: Message) -> None:
        calls.append(msg)
        behaviour(msg)

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: db.dlq_rows(q), "the DLQ row")
            assert [(r[0], r[1], r[2], r[3], r[5]) for r in await db.dlq_rows(q)] == [
                (row_id, "rejected", exception, b"x", 1)
            ]
            assert not await db.exists(row_id)

    asyncio.run(scenario())
    assert len(calls) == 1


def test_row_claimed_more_than_max_deliveries_goes_to_the_dlq_unrun(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("maxd")
    farm = Farm(dlq_table=DLQ)
    at_limit = publish(farm, conn, "at-limit", queue=q)  # this claim is delivery 3 of 3: runs
    over = publish(farm, conn, "over", queue=q)  # this claim is delivery 4 of 3: never runs
    conn.execute("UPDATE outbox SET deliveries_count = 2 WHERE id = %s", (at_limit,))
    conn.execute("UPDATE outbox SET deliveries_count = 3 WHERE id = %s", (over,))
    ran: list[bytes] = []
    terminal = sample("terminal", queue=q, reason="max_deliveries")

    @farm.handler(q, max_deliveries=3)
    async def handle(msg: Message) -> None:
        ran.append(msg.body)

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: db.dlq_rows(q), "the DLQ row")
            await eventually(lambda: _zero(db.outbox_count(q)), "both rows to leave the outbox")
            assert [(r[0], r[1], r[2], r[5]) for r in await db.dlq_rows(q)] == [
                (over, "max_deliveries", None, 4)
            ]

    asyncio.run(scenario())
    assert ran == [b"at-limit"]
    assert sample("terminal", queue=q, reason="max_deliveries") == terminal + 1


def test_successes_never_reach_the_dlq_and_terminal_and_dlq_counters_agree_per_reason(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("mix")
    farm = Farm(dlq_table=DLQ)
    kinds = ["ok"] * 6 + ["fail"] * 3 + ["dead"] * 2 + ["over"] * 1
    ids = {publish(farm, conn, kind, queue=q): kind for kind in kinds}
    over_ids = [i for i, k in ids.items() if k == "over"]
    conn.execute("UPDATE outbox SET deliveries_count = 5 WHERE id = ANY(%s)", (over_ids,))
    reasons = ["retry_terminal", "rejected", "max_deliveries"]
    before = {
        r: (sample("terminal", queue=q, reason=r), sample("dlq_written", queue=q, reason=r))
        for r in reasons
    }
    acked = sample("acked", queue=q)

    @farm.handler(q, max_deliveries=5, retry=NoRetry())
    async def handle(msg: Message) -> None:
        if msg.body == b"fail":
            raise RuntimeError("fail")
        if msg.body == b"dead":
            raise DeadLetter()

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: _zero(db.outbox_count(q)), "every row to be done")

    asyncio.run(scenario())
    dlq: dict[int, str] = dict(
        conn.execute(
            "SELECT original_id, failure_reason FROM outbox_dlq WHERE queue = %s", (q,)
        ).fetchall()
    )
    expected = {"fail": "retry_terminal", "dead": "rejected", "over": "max_deliveries"}
    assert dlq == {i: expected[k] for i, k in ids.items() if k != "ok"}
    assert sample("acked", queue=q) == acked + 6
    for reason in reasons:
        terminal = sample("terminal", queue=q, reason=reason) - before[reason][0]
        written = sample("dlq_written", queue=q, reason=reason) - before[reason][1]
        in_table = sum(1 for r in dlq.values() if r == reason)
        assert terminal == written == in_table, reason


@pytest.mark.parametrize("fault", ["add_not_null_column", "drop_table"])
def test_failed_dlq_insert_keeps_the_row_in_the_outbox_and_says_run_check(
    dsn: str, conn: psycopg.Connection, caplog: pytest.LogCaptureFixture, fault: str
) -> None:
    q = qname("dlqfail")
    farm = Farm(dlq_table=DLQ)
    row_id = publish(farm, conn, {"doomed": True}, queue=q)
    if fault == "drop_table":
        conn.execute("DROP TABLE outbox_dlq")
    else:
        conn.execute("ALTER TABLE outbox_dlq ADD COLUMN must_have int NOT NULL")
    calls: list[Message] = []
    counts = (
        sample("terminal", queue=q, reason="rejected"),
        sample("dlq_written", queue=q, reason="rejected"),
        sample("write_failed", kind="terminal", queue=q),
    )

    def moved() -> tuple[float, float, float]:
        """Counters since the start: decided terminal, archived, failed to archive."""
        return (
            sample("terminal", queue=q, reason="rejected") - counts[0],
            sample("dlq_written", queue=q, reason="rejected") - counts[1],
            sample("write_failed", kind="terminal", queue=q) - counts[2],
        )

    @farm.handler(q, lease_ttl=0.5, timeout=0.4)
    async def handle(msg: Message) -> None:
        calls.append(msg)
        raise DeadLetter("cannot be delivered")

    def write_failures() -> list[logging.LogRecord]:
        return [
            r
            for r in records(caplog, "write_failed", phase="terminal", row_id=row_id)
            if r.levelno == logging.ERROR and "outbox-farm check" in r.getMessage()
        ]

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(write_failures, "the ERROR about the failed DLQ move")
            lease = await db.lease(row_id)
            assert lease is not None, "the row was deleted although its DLQ insert failed"
            assert lease[0] is not None  # still under a lease: delivered again when it expires
            # The decision is counted, the failed move too, and nothing claims it was archived:
            # an alert on terminal_total outgrowing dlq_written_total fires.
            terminal, written, failed = moved()
            assert terminal >= 1
            assert written == 0
            assert failed >= 1
            if fault == "add_not_null_column":
                # The operator fixes the table: the next delivery archives the row.
                await db.aconn.execute("ALTER TABLE outbox_dlq DROP COLUMN must_have")
                await eventually(lambda: db.dlq_rows(q), "the row to reach the fixed DLQ")
                assert not await db.exists(row_id)

    with caplog.at_level(logging.WARNING, logger="outbox_farm"):
        asyncio.run(scenario())
    if fault == "add_not_null_column":
        (dlq_row,) = conn.execute(
            "SELECT original_id, failure_reason, deliveries_count FROM outbox_dlq"
        ).fetchall()
        assert dlq_row[:2] == (row_id, "rejected")
        assert dlq_row[2] >= 2
        assert len(calls) >= 2
        assert moved() == (len(calls), 1, len(calls) - 1)
    else:
        still = conn.execute("SELECT count(*) FROM outbox WHERE id = %s", (row_id,)).fetchone()
        assert still == (1,)


def test_megabyte_exception_repr_is_cut_to_8192_chars_with_a_marker(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("huge")
    farm = Farm(dlq_table=DLQ)
    row_id = publish(farm, conn, "x", queue=q)
    huge = "é" * 5_000_000

    @farm.handler(q, retry=NoRetry())
    async def handle(msg: Message) -> None:
        raise ValueError(huge)

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: db.dlq_rows(q), "the DLQ row")

    asyncio.run(scenario())
    text, chars = conn.execute(
        "SELECT last_exception, char_length(last_exception) FROM outbox_dlq WHERE original_id = %s",
        (row_id,),
    ).fetchone() or (None, None)
    assert chars == 8192
    assert text is not None
    assert len(text) == 8192
    assert text.startswith("ValueError('éé")
    cut, frames = text.split(FRAMES_HEADER)
    assert cut.endswith(TRUNCATED)
    assert "raise ValueError(huge)" in frames  # where it was raised survives the cut


def test_farm_without_dlq_deletes_terminal_rows_and_writes_no_dlq(
    dsn: str, conn: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    q = qname("nodlq")
    farm = Farm(dlq_table=None)
    ids = [publish(farm, conn, kind, queue=q) for kind in ("fail", "dead", "ok")]
    before = {
        r: (sample("terminal", queue=q, reason=r), sample("dlq_written", queue=q, reason=r))
        for r in ("retry_terminal", "rejected")
    }

    @farm.handler(q, retry=NoRetry())
    async def handle(msg: Message) -> None:
        if msg.body == b"fail":
            raise RuntimeError("fail")
        if msg.body == b"dead":
            raise DeadLetter()

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: _zero(db.outbox_count(q)), "every row to be done")

    with caplog.at_level(logging.WARNING, logger="outbox_farm"):
        asyncio.run(scenario())
    (warning,) = records(caplog, "no_dlq")
    assert warning.levelno == logging.WARNING
    assert "will be deleted" in warning.getMessage()
    assert conn.execute("SELECT count(*) FROM outbox_dlq").fetchone() == (0,)
    assert conn.execute("SELECT count(*) FROM outbox WHERE id = ANY(%s)", (ids,)).fetchone() == (0,)
    for reason, (terminal, written) in before.items():
        assert sample("terminal", queue=q, reason=reason) == terminal + 1
        assert sample("dlq_written", queue=q, reason=reason) == written


def test_a_farm_keeps_failed_messages_in_outbox_dlq_unless_told_otherwise(
    dsn: str, conn: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    q = qname("defdlq")
    farm = Farm()
    assert str(farm.names.dlq) == "outbox_dlq"
    row_id = publish(farm, conn, "x", queue=q)

    @farm.handler(q)
    async def handle(msg: Message) -> None:
        raise DeadLetter("kept")

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            rows = await eventually(lambda: db.dlq_rows(q), "the DLQ row")
            assert [(r[0], r[1]) for r in rows] == [(row_id, "rejected")]

    with caplog.at_level(logging.WARNING, logger="outbox_farm"):
        asyncio.run(scenario())
    assert records(caplog, "no_dlq") == []


# -- invariant 4: deliveries count claims, attempts count handler runs ----------------------


def test_deliveries_and_attempts_over_two_retries_then_success(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("counts")
    farm = Farm(dlq_table=DLQ)
    row_id = publish(farm, conn, "x", queue=q)
    seen: list[tuple[int, int, Row | None]] = []

    async def scenario() -> None:
        async with database(dsn) as db:

            @farm.handler(q, retry=ConstantBackoff(delay=0.05))
            async def handle(msg: Message) -> None:
                stored = await db.one(
                    "SELECT deliveries_count, attempts_count FROM outbox WHERE id = %s",
                    (msg.id,),
                )
                seen.append((msg.deliveries_count, msg.attempts_count, stored))
                if len(seen) < 3:
                    raise RuntimeError(f"failure {len(seen)}")

            async with farm.running(dsn, poll_interval=POLL):
                await eventually(lambda: _not(db.exists(row_id)), "the final ack")

    asyncio.run(scenario())
    assert seen == [(1, 0, (1, 0)), (2, 1, (2, 1)), (3, 2, (3, 2))]


def test_claim_of_an_expired_lease_counts_a_delivery_but_no_attempt(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("crash")
    farm = Farm(dlq_table=DLQ)
    row_id = publish(farm, conn, "x", queue=q)
    # A process claimed the row an hour ago and died before running the handler.
    conn.execute(
        "UPDATE outbox SET deliveries_count = 1, acquired_token = gen_random_uuid(), "
        "acquired_at = now() - interval '1 hour' WHERE id = %s",
        (row_id,),
    )
    seen: list[tuple[int, int]] = []

    @farm.handler(q, lease_ttl=5)
    async def handle(msg: Message) -> None:
        seen.append((msg.deliveries_count, msg.attempts_count))

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: _not(db.exists(row_id)), "the ack")

    asyncio.run(scenario())
    assert seen == [(2, 0)]


# -- invariant 8: one bad row does not roll back the rest of its flush ----------------------


def test_failing_dlq_move_does_not_roll_back_acks_of_the_same_flush(
    dsn: str,
    conn: psycopg.Connection,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    q = qname("iso")
    farm = Farm(dlq_table=DLQ)
    good = [publish(farm, conn, "good", queue=q) for _ in range(20)]
    dead = [publish(farm, conn, "dead", queue=q) for _ in range(3)]
    bad = dead[1]
    conn.execute(f"ALTER TABLE outbox_dlq ADD CONSTRAINT no_bad CHECK (original_id <> {bad})")

    batches: list[list[tuple[Kind, int]]] = []
    write = Completer.write

    async def recording_write(self: Completer, batch: list[Outcome]) -> None:
        batches.append([(o.kind, o.row_id) for o in batch])
        await write(self, batch)

    monkeypatch.setattr(Completer, "write", recording_write)

    @farm.handler(q, lease_ttl=60)
    async def handle(msg: Message) -> None:
        if msg.body == b"dead":
            raise DeadLetter()

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL, flush_interval=0.2):
            await eventually(lambda: records(caplog, "write_failed", row_id=bad), "the failure")
            await eventually(lambda: _count_is(db, q, 1), "everything but the bad row to go")
            remaining = await db.lease(bad)
            assert remaining is not None
            assert remaining[0] is not None
            assert [(r[0], r[1]) for r in await db.dlq_rows(q)] == [
                (i, "rejected") for i in dead if i != bad
            ]

    with caplog.at_level(logging.WARNING, logger="outbox_farm"):
        asyncio.run(scenario())
    # The premise: the bad DLQ move and the good acks were written by one flush.
    shared = [b for b in batches if (Kind.TERMINAL, bad) in b]
    assert shared
    assert {(Kind.ACK, i) for i in good} <= set(shared[0])
    gone = conn.execute("SELECT count(*) FROM outbox WHERE id = ANY(%s)", (good,)).fetchone()
    assert gone == (0,)


# -- §6: bad input and faults ----------------------------------------------------------------


@pytest.mark.parametrize(
    "kind",
    [KeyboardInterrupt, SystemExit, GeneratorExit, asyncio.CancelledError],
    ids=lambda k: k.__name__,
)
@pytest.mark.parametrize("style", ["async", "sync"])
def test_a_base_exception_from_a_handler_is_retried_then_dead_lettered_and_the_worker_goes_on(
    dsn: str, conn: psycopg.Connection, kind: type[BaseException], style: str
) -> None:
    """Not only `Exception`: a handler that raises KeyboardInterrupt, SystemExit,
    GeneratorExit or a CancelledError of its own (no one cancelled it) fails like any other,
    and the worker keeps every other row it holds running."""
    q = qname("base")
    farm = Farm(dlq_table=DLQ)
    poison = publish(farm, conn, "poison", queue=q)
    fine = [publish(farm, conn, f"fine-{n}", queue=q) for n in range(3)]
    runs: list[bytes] = []

    def body(msg: Message) -> None:
        runs.append(msg.body)
        if msg.body == b"poison":
            raise kind("from the handler")

    async def handle_async(msg: Message) -> None:
        body(msg)

    options: dict[str, Any] = {
        "concurrency": 1,
        "retry": ConstantBackoff(delay=0.05, max_attempts=2),
    }
    farm.handler(q, **options)(handle_async if style == "async" else body)

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            rows = await eventually(lambda: db.dlq_rows(q), "the poison row's DLQ row")
            later = publish(farm, conn, "later", queue=q)
            await eventually(lambda: _zero(db.outbox_count(q)), "every other row's ack")
            ((original, reason, exception, *_),) = rows
            assert (original, reason) == (poison, "retry_terminal")
            assert exception.startswith(repr(kind("from the handler")))
            assert later not in fine

    asyncio.run(scenario())
    assert runs.count(b"poison") == 2
    assert sorted(r for r in runs if r != b"poison") == [b"fine-0", b"fine-1", b"fine-2", b"later"]


def test_undecodable_body_reaches_the_handler_raw_and_json_failure_is_an_ordinary_error(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("raw")
    farm = Farm(dlq_table=DLQ)
    body = b"\xff\xfe not json"
    row_id = publish(farm, conn, body, queue=q)
    seen: list[tuple[bytes, int, str]] = []
    retried = sample("retried", queue=q)

    @farm.handler(q, retry=ConstantBackoff(delay=0.05, max_attempts=2))
    async def handle(msg: Message) -> None:
        try:
            msg.json()
        except Exception as exc:
            seen.append((msg.body, msg.attempts_count, type(exc).__name__))
            raise
        seen.append((msg.body, msg.attempts_count, "decoded?!"))

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: db.dlq_rows(q), "the DLQ row")

    asyncio.run(scenario())
    assert seen == [(body, 0, "JSONDecodeError"), (body, 1, "JSONDecodeError")]
    assert sample("retried", queue=q) == retried + 1  # first failure: an ordinary retry
    (row,) = conn.execute(
        "SELECT original_id, payload, failure_reason, last_exception FROM outbox_dlq"
    ).fetchall()
    assert row[:3] == (row_id, body, "retry_terminal")
    assert "JSONDecodeError" in row[3]


def test_rows_of_a_queue_without_handler_are_left_alone(dsn: str, conn: psycopg.Connection) -> None:
    q, other = qname("known"), qname("unknown")
    farm = Farm(dlq_table=DLQ)
    orphan = publish(farm, conn, "nobody's", queue=other)
    stored = conn.execute("SELECT * FROM outbox WHERE id = %s", (orphan,)).fetchone()
    handled: list[int] = []

    @farm.handler(q)
    async def handle(msg: Message) -> None:
        handled.append(msg.id)

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            publish(farm, conn, "mine", queue=q)
            await eventually(lambda: _zero(db.outbox_count(q)), "the known queue's row")
            # Ten more claims (counted, not assumed from a sleep): the orphan must stay untouched.
            polls = claims(q)
            await eventually(lambda: claims(q) >= polls + 10, "ten more claims", timeout=30)

    asyncio.run(scenario())
    assert len(handled) == 1
    assert conn.execute("SELECT * FROM outbox WHERE id = %s", (orphan,)).fetchone() == stored
    assert conn.execute("SELECT count(*) FROM outbox_dlq").fetchone() == (0,)


def test_hanging_async_handler_is_abandoned_at_its_timeout(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("hang")
    farm = Farm(dlq_table=DLQ)
    row_id = publish(farm, conn, "x", queue=q)
    cancelled: list[int] = []

    @farm.handler(q, timeout=0.2, retry=NoRetry())
    async def handle(msg: Message) -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(msg.id)
            raise

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            started = time.monotonic()
            rows = await eventually(lambda: db.dlq_rows(q), "the DLQ row")
            assert time.monotonic() - started < 2.0
            assert not await db.exists(row_id)
            ((original, reason, exception, *_),) = rows
            assert (original, reason) == (row_id, "retry_terminal")
            assert exception.startswith("HandlerTimeout(")
            assert "0.2s" in exception

    asyncio.run(scenario())
    assert cancelled == [row_id]


def test_hanging_sync_handler_is_abandoned_at_its_timeout_and_retried(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("synchang")
    farm = Farm(dlq_table=DLQ)
    row_id = publish(farm, conn, "x", queue=q)
    unblock = threading.Event()
    calls: list[int] = []

    @farm.handler(q, concurrency=2, timeout=0.2, retry=ConstantBackoff(delay=0.05))
    def handle(msg: Message) -> None:
        calls.append(msg.attempts_count)
        if msg.attempts_count == 0:
            unblock.wait(5)  # hangs past its timeout; the thread cannot be killed

    async def scenario() -> None:
        try:
            async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
                await eventually(lambda: _not(db.exists(row_id)), "the retried run's ack")
        finally:
            unblock.set()

    asyncio.run(scenario())
    assert calls == [0, 1]


def test_a_hung_sync_handler_does_not_fail_other_messages_it_never_ran(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("starve")
    farm = Farm(dlq_table=DLQ)
    hung = publish(farm, conn, "hang", queue=q)
    unblock = threading.Event()
    ran: list[bytes] = []

    @farm.handler(q, concurrency=1, timeout=0.2, retry=NoRetry())
    def handle(msg: Message) -> None:
        ran.append(msg.body)
        if msg.body == b"hang":
            unblock.wait(5)

    async def scenario() -> None:
        try:
            async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
                await eventually(lambda: db.dlq_rows(q), "the hung row's DLQ row")
                fine = publish(farm, conn, "fine", queue=q)
                await eventually(lambda: _not(db.exists(fine)), "the next row to be done")
                dlq = [(r[0], r[1]) for r in await db.dlq_rows(q)]
                assert dlq == [(hung, "retry_terminal")], "a row was failed that never ran"
                assert ran == [b"hang", b"fine"]
        finally:
            unblock.set()

    asyncio.run(scenario())


class _Raises:
    def next_delay(self, attempt: int, exc: BaseException, elapsed: float) -> float | None:
        raise RuntimeError("strategy bug")


class _Returns:
    def __init__(self, value: Any) -> None:
        self.value = value

    def next_delay(self, attempt: int, exc: BaseException, elapsed: float) -> Any:
        return self.value


@pytest.mark.parametrize(
    "strategy",
    [_Raises(), _Returns(math.nan), _Returns(-1.0), _Returns(math.inf), _Returns("soon")],
    ids=["raises", "nan", "negative", "inf", "not-a-number"],
)
def test_broken_retry_strategy_makes_the_failure_terminal_and_the_worker_goes_on(
    dsn: str, conn: psycopg.Connection, caplog: pytest.LogCaptureFixture, strategy: Any
) -> None:
    q = qname("strat")
    farm = Farm(dlq_table=DLQ)
    failing = publish(farm, conn, "fail", queue=q)
    handled: list[bytes] = []

    @farm.handler(q, retry=strategy)
    async def handle(msg: Message) -> None:
        handled.append(msg.body)
        if msg.body == b"fail":
            raise ValueError("handler failed")

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            rows = await eventually(lambda: db.dlq_rows(q), "the DLQ row")
            assert [(r[0], r[1], r[2]) for r in rows] == [
                (failing, "retry_terminal", repr(ValueError("handler failed")))
            ]
            later = publish(farm, conn, "ok", queue=q)
            await eventually(lambda: _not(db.exists(later)), "the next row's ack")

    with caplog.at_level(logging.WARNING, logger="outbox_farm"):
        asyncio.run(scenario())
    assert handled == [b"fail", b"ok"]
    (record,) = records(caplog, "strategy_failed", row_id=failing)
    assert record.levelno == logging.ERROR


def test_sync_handler_runs_in_a_worker_thread(dsn: str, conn: psycopg.Connection) -> None:
    q = qname("sync")
    farm = Farm(dlq_table=DLQ)
    ids = [publish(farm, conn, {"n": n}, queue=q) for n in range(5)]
    seen: dict[int, tuple[Any, bool]] = {}
    lock = threading.Lock()

    @farm.handler(q, concurrency=4)
    def handle(msg: Message) -> None:
        with lock:
            seen[msg.id] = (msg.json(), threading.current_thread() is threading.main_thread())

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: _zero(db.outbox_count(q)), "the acks")

    asyncio.run(scenario())
    assert seen == {i: ({"n": n}, False) for n, i in enumerate(ids)}


def test_raised_retry_redelivers_after_its_delay_not_at_the_next_poll(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("retryexc")
    farm = Farm(dlq_table=DLQ)
    row_id = publish(farm, conn, "x", queue=q)
    runs: list[tuple[float, int, int]] = []

    # The default strategy would wait ~1 s: only Retry's own delay explains a ~0.3 s gap.
    @farm.handler(q)
    async def handle(msg: Message) -> None:
        runs.append((time.monotonic(), msg.deliveries_count, msg.attempts_count))
        if len(runs) == 1:
            raise Retry(delay=0.3)

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=5.0):
            await eventually(lambda: _not(db.exists(row_id)), "the second run's ack")

    asyncio.run(scenario())
    assert [r[1:] for r in runs] == [(1, 0), (2, 1)]
    gap = runs[1][0] - runs[0][0]
    assert 0.28 <= gap < 0.75, gap


def test_retry_with_a_decimal_delay_does_not_stop_the_completer(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("retrydec")
    farm = Farm(dlq_table=DLQ)
    first = publish(farm, conn, "first", queue=q)
    runs: list[bytes] = []

    @farm.handler(q)
    async def handle(msg: Message) -> None:
        runs.append(msg.body)
        if msg.body == b"first" and msg.attempts_count == 0:
            raise Retry(delay=Decimal("0.05"))  # type: ignore[arg-type]

    async def scenario() -> None:
        async with database(dsn) as db:
            try:
                async with farm.running(dsn, poll_interval=POLL):
                    await eventually(lambda: _not(db.exists(first)), "the retried row's ack", 3)
                    second = publish(farm, conn, "second", queue=q)
                    await eventually(lambda: _not(db.exists(second)), "the next row's ack", 3)
            except TypeError as exc:  # the completer's crash, re-raised at stop
                raise AssertionError(f"the completer crashed: {exc!r}") from None

    asyncio.run(scenario())


def test_manual_ack_policy(
    dsn: str, conn: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    q = qname("manual")
    farm = Farm(dlq_table=DLQ)
    ids = {
        kind: publish(farm, conn, kind, queue=q)
        for kind in ("ack", "nack", "none", "ack-raise", "reject")
    }
    runs: dict[bytes, list[int]] = {}

    @farm.handler(q, ack="manual", retry=ConstantBackoff(delay=0.05))
    async def handle(msg: Message) -> None:
        attempts = runs.setdefault(msg.body, [])
        attempts.append(msg.attempts_count)
        if msg.body == b"ack":
            msg.ack()
        elif msg.body in (b"nack", b"none"):
            if len(attempts) == 1:
                if msg.body == b"nack":
                    msg.nack(0.05)
                return  # "none": no decision at all, which is retried
            msg.ack()
        elif msg.body == b"ack-raise":
            msg.ack()  # the decision wins over the exception
            raise RuntimeError("after ack")
        elif msg.body == b"reject":
            msg.reject()

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            await eventually(lambda: _zero(db.outbox_count(q)), "every row to be done")
            assert [(r[0], r[1], r[2]) for r in await db.dlq_rows(q)] == [
                (ids["reject"], "rejected", None)
            ]

    with caplog.at_level(logging.WARNING, logger="outbox_farm"):
        asyncio.run(scenario())
    assert runs == {
        b"ack": [0],
        b"nack": [0, 1],
        b"none": [0, 1],
        b"ack-raise": [0],
        b"reject": [0],
    }
    assert any("without ack(), nack() or reject()" in r.getMessage() for r in caplog.records)


# -- §6 / configuration: refused at registration ---------------------------------------------


async def _noop(msg: Message) -> None:
    return None


class _NoNextDelay:
    def delay(self, attempt: int) -> float:
        return 1.0


@pytest.mark.parametrize(
    "options",
    [
        {"concurrency": 0},
        {"concurrency": -3},
        {"lease_ttl": math.nan},
        {"lease_ttl": 0},
        {"timeout": -1.0},
        {"timeout": math.inf},
        {"ack": "sometimes"},
        {"retry": _NoNextDelay()},
        {"max_deliveries": 0},
        {"prefetch": 0},
    ],
    ids=lambda o: "-".join(f"{k}={v!r}" for k, v in o.items()),
)
def test_bad_handler_options_are_refused_at_registration(options: dict[str, Any]) -> None:
    farm = Farm(dlq_table=DLQ)
    with pytest.raises(ConfigurationError):
        farm.handler("q", **options)(_noop)
    assert farm.handlers == {}


def test_second_handler_for_a_queue_is_refused() -> None:
    farm = Farm(dlq_table=DLQ)
    farm.handler("q")(_noop)

    async def other(msg: Message) -> None:
        return None

    with pytest.raises(ConfigurationError, match="already has a handler"):
        farm.handler("q")(other)
    assert farm.handlers["q"].func is _noop


def test_running_without_handlers_or_with_unknown_queues_is_refused() -> None:
    async def scenario(farm: Farm, **options: Any) -> None:
        async with farm.running("host=invalid.invalid dbname=never", **options):
            raise AssertionError("the runtime started")

    with pytest.raises(ConfigurationError, match="no handlers"):
        asyncio.run(scenario(Farm(dlq_table=DLQ)))
    farm = Farm(dlq_table=DLQ)
    farm.handler("q")(_noop)
    with pytest.raises(ConfigurationError, match="no handler registered"):
        asyncio.run(scenario(farm, queues=["elsewhere"]))


def test_unhashable_queue_name_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError):
        Farm(dlq_table=DLQ).handler(["q"])(_noop)  # type: ignore[arg-type]


# -- counters and health that tell the truth ------------------------------------------------


def _gauge(name: str, queue: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(f"outbox_farm_{name}", {"queue": queue, **labels})


def test_each_gauge_refreshes_on_its_own_so_a_missing_dlq_does_not_freeze_the_backlog(
    dsn: str, conn: psycopg.Connection
) -> None:
    q = qname("gauge")
    farm = Farm()
    problems = Problems()

    def refresh() -> None:
        async def once() -> None:
            pool = AsyncConnectionPool(dsn, kwargs={"autocommit": True}, open=False)
            async with pool:
                await gauges.refresh(pool, farm.queries, [q], problems)

        asyncio.run(once())

    for n in range(3):
        publish(farm, conn, n, queue=q)
    refresh()
    assert (_gauge("backlog", q), _gauge("dlq_rows", q, reason="rejected")) == (3, 0)
    assert problems.current is None

    conn.execute("DROP TABLE outbox_dlq")
    for n in range(2):
        publish(farm, conn, n, queue=q)
    refresh()
    assert _gauge("backlog", q) == 5  # still follows the table
    assert _gauge("dlq_rows", q, reason="rejected") == 0  # unknown: left as it was
    assert problems.current is not None
    assert problems.current.startswith("DLQ gauges: ")
    assert "outbox_dlq" in problems.current


@pytest.fixture
def stranger_dsn(dsn: str, conn: psycopg.Connection) -> Iterator[tuple[str, str]]:
    """A login role that may use the outbox but does not own it, and its name."""
    role = f"outbox_farm_worker_{uuid.uuid4().hex[:8]}"
    ident = sql.Identifier(role)
    conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(ident))
    try:
        conn.execute(sql.SQL("GRANT SELECT, INSERT, UPDATE, DELETE ON outbox TO {}").format(ident))
        yield make_conninfo(dsn, user=role), role
    finally:
        conn.execute(sql.SQL("DROP OWNED BY {}").format(ident))
        conn.execute(sql.SQL("DROP ROLE {}").format(ident))


def test_a_missing_privilege_is_the_runtimes_problem_until_it_is_granted_again(
    stranger_dsn: tuple[str, str], conn: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    worker_dsn, role = stranger_dsn
    q = qname("priv")
    farm = Farm()
    handled: list[int] = []

    @farm.handler(q)
    async def handle(msg: Message) -> None:
        handled.append(msg.id)

    grant = sql.SQL("{} UPDATE ON outbox {} {}")

    def permanent() -> list[logging.LogRecord]:
        return [r for r in records(caplog, "permanent_error") if r.levelno == logging.ERROR]

    async def scenario() -> None:
        async with farm.running(worker_dsn, poll_interval=POLL, vacuum_interval=None) as rt:
            first = publish(farm, conn, "before", queue=q)
            await eventually(lambda: first in handled, "a delivery while all is well")
            assert rt.problem is None
            conn.execute(grant.format(sql.SQL("REVOKE"), sql.SQL("FROM"), sql.Identifier(role)))
            reported: list[str] = []  # every failed claim the fetcher reports, logged or not
            report = rt.problems.report

            def counted(operation: str, *args: Any, **kwargs: Any) -> bool:
                reported.append(operation)
                return report(operation, *args, **kwargs)

            rt.problems.report = counted  # type: ignore[method-assign]
            problem = await eventually(lambda: rt.problem, "the problem to be reported")
            assert problem.startswith(f"claim for queue {q}: permission denied")
            assert "\n" not in problem
            # The claim is retried several times meanwhile (counted, not assumed from a sleep).
            await eventually(lambda: len(reported) >= 5, "five failed claims", timeout=30)
            assert rt.problem == problem
            assert len(permanent()) == 1  # logged once, not once per retry
            conn.execute(grant.format(sql.SQL("GRANT"), sql.SQL("TO"), sql.Identifier(role)))
            await eventually(lambda: rt.problem is None, "the problem to clear", timeout=10)
            later = publish(farm, conn, "after", queue=q)
            await eventually(lambda: later in handled, "a delivery once granted again")

    with caplog.at_level(logging.WARNING, logger="outbox_farm"):
        asyncio.run(scenario())
    (record,) = permanent()
    assert "permission denied" in record.getMessage()


def test_on_failure_hooks_see_every_failed_run_and_cannot_change_its_outcome(
    dsn: str, conn: psycopg.Connection, caplog: pytest.LogCaptureFixture
) -> None:
    """The farm's hook serves every queue without one of its own; a queue's own hook (async
    here) replaces it. A hook that raises is logged, and the row still goes where the handler's
    failure sent it: retried, then to the DLQ."""
    q, own = qname("hook"), qname("ownhook")
    seen: list[tuple[str, int, str, Kind, Reason | None]] = []

    def farm_hook(msg: Message, exc: BaseException, outcome: Outcome) -> None:
        seen.append(("farm", msg.id, repr(exc), outcome.kind, outcome.reason))
        raise RuntimeError("the error tracker is down")

    async def own_hook(msg: Message, exc: BaseException, outcome: Outcome) -> None:
        seen.append(("own", msg.id, repr(exc), outcome.kind, outcome.reason))
        raise KeyboardInterrupt  # not even this changes the outcome

    farm = Farm(on_failure=farm_hook)
    retry = ConstantBackoff(delay=0.05, max_attempts=2)

    @farm.handler(q, retry=retry)
    async def fails(msg: Message) -> None:
        raise ValueError(f"no {msg.attempts_count}")

    @farm.handler(own, retry=retry, on_failure=own_hook)
    async def also_fails(msg: Message) -> None:
        raise ValueError(f"no {msg.attempts_count}")

    @farm.handler(qname("fine"))
    async def fine(msg: Message) -> None:
        return None

    rows = {queue: publish(farm, conn, "x", queue=queue) for queue in (q, own)}

    async def scenario() -> None:
        async with database(dsn) as db, farm.running(dsn, poll_interval=POLL):
            for queue in (q, own):
                await eventually(lambda queue=queue: db.dlq_rows(queue), f"{queue}'s DLQ row")

    with caplog.at_level(logging.WARNING, logger="outbox_farm"):
        asyncio.run(scenario())
    for who, queue in (("farm", q), ("own", own)):
        assert [s[1:] for s in seen if s[0] == who] == [
            (rows[queue], repr(ValueError("no 0")), Kind.RETRY, None),
            (rows[queue], repr(ValueError("no 1")), Kind.TERMINAL, Reason.RETRY_TERMINAL),
        ]
    assert len(records(caplog, "hook_failed")) == 4
    assert farm.handlers[q].on_failure is farm_hook
    assert farm.handlers[own].on_failure is own_hook
