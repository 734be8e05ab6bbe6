"""The completer counts a write as done only for the lease it was made under, and tells a
write lost to another lease from one whose reply was lost."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from outbox_farm.metrics import metrics
from outbox_farm.names import TableNames
from outbox_farm.observe import observers
from outbox_farm.outcome import Kind, Outcome, Reason
from outbox_farm.queries import Queries
from outbox_farm.worker.completer import KEYED_AT_ONCE, Completer
from outbox_farm.worker.inflight import Ledger

metrics()  # register the collectors before the first sample is read


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(f"outbox_farm_{name}_total", labels) or 0.0


def test_a_stale_and_a_current_outcome_of_one_row_in_one_flush(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """Two deliveries of one row whose outcomes land in one flush: only the one that holds
    the lease is counted as acked (or archived); the other is a lease_lost."""
    stale, current = uuid.uuid4(), uuid.uuid4()
    ids = []
    for queue in ("stale_ack", "stale_terminal"):
        row = conn.execute(
            "INSERT INTO outbox (queue, payload, acquired_token, acquired_at, deliveries_count)"
            " VALUES (%s, 'x', %s, now(), 2) RETURNING id",
            [queue, current],
        ).fetchone()
        assert row is not None
        ids.append(row[0])

    def counts() -> list[float]:
        return [
            _sample("acked", queue="stale_ack"),
            _sample("lease_lost", queue="stale_ack", phase="ack"),
            _sample("dlq_written", queue="stale_terminal", reason="retry_terminal"),
            _sample("lease_lost", queue="stale_terminal", phase="terminal"),
        ]

    before = counts()

    async def flush() -> None:
        queries = Queries(TableNames.build("outbox", "outbox_dlq"))
        async with AsyncConnectionPool(dsn, kwargs={"autocommit": True}, open=False) as pool:
            terminal = {"reason": Reason.RETRY_TERMINAL, "last_exception": "x"}
            await Completer(pool, queries).write(
                [
                    Outcome(Kind.ACK, ids[0], stale, "stale_ack", 1),
                    Outcome(Kind.ACK, ids[0], current, "stale_ack", 2),
                    Outcome(Kind.TERMINAL, ids[1], stale, "stale_terminal", 1, **terminal),
                    Outcome(Kind.TERMINAL, ids[1], current, "stale_terminal", 2, **terminal),
                ]
            )

    asyncio.run(flush())
    after = counts()
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 1, 1]
    assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)
    assert conn.execute("SELECT count(*) FROM outbox_dlq").fetchone() == (1,)


@pytest.mark.parametrize("connection_lost", [True, False], ids=["resent", "first-try"])
def test_a_resent_ack_that_finds_its_row_gone_is_unconfirmed_not_lease_lost(
    dsn: str, conn: psycopg.Connection[Any], connection_lost: bool
) -> None:
    """The completer's connection dies with its ack in flight; the ack had committed (here:
    the row is deleted just before, as the first attempt would have). Sent again, it matches
    nothing: a row that is gone is outcome_unconfirmed; a row held under another token is
    still lease_lost. Without a lost connection, both are lease_lost as before."""
    queue = f"unconfirmed_{connection_lost}"
    token, other = uuid.uuid4(), uuid.uuid4()
    ids = []
    for _ in range(2):
        row = conn.execute(
            "INSERT INTO outbox (queue, payload, acquired_token, acquired_at, lease_expires_at,"
            " deliveries_count) VALUES (%s, 'x', %s, now(), now() + interval '1 minute', 1)"
            " RETURNING id",
            [queue, token],
        ).fetchone()
        assert row is not None
        ids.append(row[0])
    gone, taken = ids
    before = {
        name: _sample(name, queue=queue, phase="ack")
        for name in ("outcome_unconfirmed", "lease_lost")
    }
    acked = _sample("acked", queue=queue)

    async def flush() -> None:
        queries = Queries(TableNames.build("outbox", "outbox_dlq"))
        pool = AsyncConnectionPool(
            dsn, min_size=1, max_size=1, kwargs={"autocommit": True}, open=False
        )
        async with pool:
            async with pool.connection() as pooled:
                pid = await (await pooled.execute("SELECT pg_backend_pid()")).fetchone()
            conn.execute("DELETE FROM outbox WHERE id = %s", [gone])
            conn.execute("UPDATE outbox SET acquired_token = %s WHERE id = %s", [other, taken])
            if connection_lost:
                assert pid is not None
                # Waits until the backend is gone, so that the ack meets a dead connection.
                conn.execute("SELECT pg_terminate_backend(%s, 5000)", [pid[0]])
            await Completer(pool, queries).write(
                [Outcome(Kind.ACK, i, token, queue, 1) for i in (gone, taken)]
            )

    asyncio.run(flush())
    after = {
        name: _sample(name, queue=queue, phase="ack")
        for name in ("outcome_unconfirmed", "lease_lost")
    }
    expected = (
        {"outcome_unconfirmed": 1, "lease_lost": 1}
        if connection_lost
        else {
            "outcome_unconfirmed": 0,
            "lease_lost": 2,
        }
    )
    assert {name: after[name] - before[name] for name in after} == expected
    assert _sample("acked", queue=queue) == acked
    assert conn.execute("SELECT acquired_token FROM outbox WHERE id = %s", [taken]).fetchone() == (
        other,
    )


def test_put_and_put_all_wait_while_the_completer_is_high_water_behind(dsn: str) -> None:
    """Executors stop handing over outcomes while `high_water` of them wait unwritten: a batch
    handler's whole batch waits as one row's outcome does, and both go on, in the order they
    came, as flushes take what is waiting."""

    def acks(first: int, count: int) -> list[Outcome]:
        return [Outcome(Kind.ACK, i, uuid.uuid4(), "q", 1) for i in range(first, first + count)]

    async def settled() -> None:  # let every task run up to its next wait (no clock involved)
        for _ in range(10):
            await asyncio.sleep(0)

    async def scenario() -> None:
        queries = Queries(TableNames.build("outbox", "outbox_dlq"))
        async with AsyncConnectionPool(dsn, kwargs={"autocommit": True}, open=False) as pool:
            completer = Completer(pool, queries, flush_size=5, high_water=5)
            await completer.put_all(acks(0, 5))  # under the mark when it came: taken at once
            batch = asyncio.create_task(completer.put_all(acks(5, 6)))
            single = asyncio.create_task(completer.put(acks(11, 1)[0]))
            await settled()
            assert not batch.done()
            assert not single.done()
            first = await completer._collect()
            assert [o.row_id for o in first] == [0, 1, 2, 3, 4]
            await settled()
            assert batch.done()  # the batch went in whole, past the mark ...
            assert not single.done()  # ... so the next outcome waits again
            second = await completer._collect()
            assert [o.row_id for o in second] == [5, 6, 7, 8, 9, 10]
            await settled()
            assert single.done()
            assert [o.row_id for o in await completer._collect()] == [11]

    asyncio.run(scenario())


def test_a_keyed_outcome_goes_at_once_when_the_process_holds_only_a_handful(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    """The next row of a key cannot be claimed before this one's ack: with nothing else held,
    the batch is written now, not `flush_interval` (an hour here) after its first outcome. Held
    rows without a key, or more than a handful, keep the interval."""
    token = uuid.uuid4()
    row = conn.execute(
        "INSERT INTO outbox (queue, payload, ordering_key, acquired_token, acquired_at)"
        " VALUES ('q', 'x', 'k', %s, now()) RETURNING id",
        [token],
    ).fetchone()
    assert row is not None

    async def scenario() -> None:
        queries = Queries(TableNames.build("outbox", "outbox_dlq"))
        ledger = Ledger("q", 16, observers())
        ledger.hold([row[0]], token)
        ledger.keyed = True
        async with AsyncConnectionPool(dsn, kwargs={"autocommit": True}, open=False) as pool:
            completer = Completer(pool, queries, flush_interval=3600, ledgers={"q": ledger})
            await completer.put(Outcome(Kind.ACK, row[0], token, "q", 1))
            assert completer.awaited()
            batch = await asyncio.wait_for(completer._collect(), 30)
            await completer.write(batch)
            assert len(ledger) == 0
            ledger.hold(range(1000, 1000 + KEYED_AT_ONCE + 1), token)
            completer._pending = [Outcome(Kind.ACK, i, token, "q", 1) for i in ledger.rows]
            assert not completer.awaited()  # a busy process keeps its batches
            ledger.keyed = False
            completer._pending = completer._pending[:1]
            ledger.settle_all([(i, token) for i in list(ledger.rows)[1:]])
            assert not completer.awaited()  # nobody waits on an unkeyed row's ack

    asyncio.run(scenario())
    assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)
