"""The completer counts a write as done only for the lease it was made under."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from outbox_farm.completer import Completer
from outbox_farm.metrics import metrics
from outbox_farm.names import TableNames
from outbox_farm.outcome import Kind, Outcome, Reason
from outbox_farm.queries import Queries


def _value(metric: Any) -> float:
    return float(metric._value.get())


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
    m = metrics()
    acked, lost_ack = m.acked.labels("stale_ack"), m.lease_lost.labels("stale_ack", "ack")
    written = m.dlq_written.labels("stale_terminal", "retry_terminal")
    lost_terminal = m.lease_lost.labels("stale_terminal", "terminal")
    before = [_value(x) for x in (acked, lost_ack, written, lost_terminal)]

    async def flush() -> None:
        queries = Queries(TableNames.build("outbox", "outbox_dlq"))
        async with AsyncConnectionPool(dsn, kwargs={"autocommit": True}, open=False) as pool:
            terminal = {"reason": Reason.RETRY_TERMINAL, "last_exception": "x"}
            await Completer(pool, queries)._flush(
                [
                    Outcome(Kind.ACK, ids[0], stale, "stale_ack", 1),
                    Outcome(Kind.ACK, ids[0], current, "stale_ack", 2),
                    Outcome(Kind.TERMINAL, ids[1], stale, "stale_terminal", 1, **terminal),
                    Outcome(Kind.TERMINAL, ids[1], current, "stale_terminal", 2, **terminal),
                ]
            )

    asyncio.run(flush())
    after = [_value(x) for x in (acked, lost_ack, written, lost_terminal)]
    assert [a - b for a, b in zip(after, before, strict=True)] == [1, 1, 1, 1]
    assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)
    assert conn.execute("SELECT count(*) FROM outbox_dlq").fetchone() == (1,)
