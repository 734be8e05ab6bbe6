"""What the delivery tests share: queue names of their own, metric deltas, a small async
query helper over the test's own connection, and log records by event."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any

import psycopg
import pytest

from outbox_farm.metrics import metrics
from tests import samples

DLQ = "outbox_dlq"
POLL = 0.05  # poll_interval of every runtime below, unless a test says otherwise

metrics()  # register the collectors before the first sample is read

Row = tuple[Any, ...]


def qname(prefix: str) -> str:
    """A queue name of this test's own, so process-global metric deltas are this test's."""
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


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


async def zero(count: Awaitable[int]) -> bool:
    return await count == 0


async def falsy(value: Awaitable[Any]) -> bool:
    return not await value


async def count_is(db: Db, queue: str, n: int) -> bool:
    return await db.outbox_count(queue) == n
