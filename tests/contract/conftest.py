"""The storage contract: one behaviour suite, run against both stores (`PostgresStore` on a
fresh migrated database, and `MemoryStore` on a clock the test moves), so they cannot drift.

Each test is a coroutine taking `outbox`, an `Outbox`: the store under test, and what a test
does around it the same way for both: publish through the producer, let time pass, read a row
or the DLQ back. Time passes by hand on both: the memory store's clock is moved; on Postgres,
whose clock is real, every timestamp of the tables is moved back by as much, which is the
same thing to every statement (and takes no real time). The few milliseconds the real clock
moves meanwhile are why times read back from Postgres are compared within a second.
"""

from __future__ import annotations

import asyncio
import inspect
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from datetime import datetime, timedelta
from typing import Any, Unpack

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from outbox_farm.db.pool import open_pool
from outbox_farm.db.store import PostgresStore
from outbox_farm.limits import Limits
from outbox_farm.message import Message
from outbox_farm.names import TableNames
from outbox_farm.producer import BatchOptions, Producer, PublishOptions
from outbox_farm.queries import Queries
from outbox_farm.storage import Claim, Store, Write, Written
from outbox_farm.testing import DeadLetter, ManualClock, MemoryStore, Row

LEASE = 30.0  # seconds: the lease of every claim that names none
MARKER = "~contract-marker"  # a NOTIFY payload no queue is named

ROW_COLUMNS = list(Row.__dataclass_fields__)
DLQ_COLUMNS = list(DeadLetter.__dataclass_fields__)
TIMES = {  # every timestamp of the tables, which `later` moves back on Postgres
    "outbox": [
        "created_at",
        "next_attempt_at",
        "first_attempt_at",
        "last_attempt_at",
        "acquired_at",
        "lease_expires_at",
    ],
    "outbox_dlq": ["created_at", "failed_at"],
    "outbox_farm_queues": [
        "paused_until",
        "changed_at",
        "tokens_at",
        "breaker_open_since",
        "breaker_probe_at",
    ],
}


def claim_of(
    queue: str = "q",
    limit: int | None = 10,
    lease_ttl: float = LEASE,
    held: Sequence[uuid.UUID] = (),
) -> Claim:
    """A claim as a fetcher makes one (`limit` None: a hand-over), under a fresh token."""
    return Claim(queue, limit, lease_ttl, uuid.uuid4(), 0.0, 0.0, list(held))


def close_to(actual: datetime | None, expected: datetime) -> bool:
    """Equal within a second: the real clock moves a little between two statements."""
    return actual is not None and abs((actual - expected).total_seconds()) < 1.0


class Outbox(ABC):
    """The store under test, and the steps of a test around it (see the module)."""

    store: Store

    @abstractmethod
    def opened(self) -> AbstractAsyncContextManager[None]:
        """The store, open for the test (in the test's event loop)."""

    @abstractmethod
    async def publish(self, body: object, **options: Unpack[PublishOptions]) -> int | None: ...

    @abstractmethod
    async def publish_batch(
        self, bodies: Sequence[object], **options: Unpack[BatchOptions]
    ) -> list[int]: ...

    @abstractmethod
    async def cancel_timer(self, queue: str, timer_id: str) -> bool: ...

    @abstractmethod
    async def later(self, seconds: float) -> None:
        """`seconds` pass on the store's clock."""

    @abstractmethod
    async def now(self) -> datetime:
        """The store's clock."""

    @abstractmethod
    async def find(self, row_id: int) -> Row | None:
        """The row as the table holds it; None once it is gone."""

    async def row(self, row_id: int | None) -> Row:
        """The row, which must be there."""
        assert row_id is not None
        found = await self.find(row_id)
        assert found is not None, f"row {row_id} is gone"
        return found

    async def gone(self, row_id: int | None) -> bool:
        assert row_id is not None
        return await self.find(row_id) is None

    @abstractmethod
    async def dead_letters(self) -> list[DeadLetter]:
        """The DLQ, oldest first."""

    @abstractmethod
    async def without_dlq(self) -> None:
        """From now on, a store of the same rows that keeps no DLQ (before any publish)."""

    @abstractmethod
    async def wakeups(self, step: Callable[[], Awaitable[object]]) -> list[str]:
        """The queues whose fetchers `step` wakes, in order (NOTIFY's payloads on Postgres)."""

    @abstractmethod
    async def pause(
        self, queue: str, until_in: float | None = None, reason: str | None = None
    ) -> None:
        """Pause `queue` as an operator would, until `until_in` seconds from now if given."""

    @abstractmethod
    async def resume(self, queue: str) -> None: ...

    @abstractmethod
    async def limit(self, queue: str, limits: Limits) -> None:
        """Set `queue`'s farm-wide limits as an operator would (`Limits()`: clear them)."""

    async def claim(self, queue: str = "q", **options: Any) -> list[Message]:
        return await self.store.claim(claim_of(queue, **options))

    async def write(self, write: Write, handover: Claim | None = None) -> Written:
        async with self.store.flush() as flush:
            return await flush.send(write, handover)


class InMemory(Outbox):
    def __init__(self) -> None:
        self.clock = ManualClock()
        self.memory = self.store = MemoryStore(clock=self.clock)

    @asynccontextmanager
    async def opened(self) -> AsyncIterator[None]:
        yield

    async def publish(self, body: object, **options: Unpack[PublishOptions]) -> int | None:
        return self.memory.publish(body, **options)

    async def publish_batch(
        self, bodies: Sequence[object], **options: Unpack[BatchOptions]
    ) -> list[int]:
        return self.memory.publish_batch(bodies, **options)

    async def cancel_timer(self, queue: str, timer_id: str) -> bool:
        return self.memory.cancel_timer(queue=queue, timer_id=timer_id)

    async def later(self, seconds: float) -> None:
        self.clock.advance(seconds)

    async def now(self) -> datetime:
        return self.memory.now()

    async def find(self, row_id: int) -> Row | None:
        return next((row for row in self.memory.rows if row.id == row_id), None)

    async def dead_letters(self) -> list[DeadLetter]:
        return self.memory.dead_letters

    async def without_dlq(self) -> None:
        self.memory = self.store = MemoryStore(dlq=False, clock=self.clock)

    async def pause(
        self, queue: str, until_in: float | None = None, reason: str | None = None
    ) -> None:
        until = None if until_in is None else self.memory.now() + timedelta(seconds=until_in)
        self.memory.pause(queue, until, reason)

    async def resume(self, queue: str) -> None:
        self.memory.resume(queue)

    async def limit(self, queue: str, limits: Limits) -> None:
        self.memory.limit(queue, limits)

    async def wakeups(self, step: Callable[[], Awaitable[object]]) -> list[str]:
        woken: list[str] = []
        unsubscribe = self.memory.subscribe(woken.append)
        try:
            await step()
        finally:
            unsubscribe()
        return woken


class OnPostgres(Outbox):
    NAMES = TableNames.build("outbox", "outbox_dlq")

    def __init__(self, dsn: str) -> None:
        self.dsn = dsn
        self.producer = Producer(Queries(self.NAMES))

    @asynccontextmanager
    async def opened(self) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            pool = await open_pool(self.dsn, 2, farm=True)
            stack.push_async_callback(pool.close)
            self.store = PostgresStore(pool, Queries(self.NAMES))
            self.conn = await psycopg.AsyncConnection.connect(self.dsn, autocommit=True)
            stack.push_async_callback(self.conn.close)
            yield

    async def publish(self, body: object, **options: Unpack[PublishOptions]) -> int | None:
        return await self.producer.apublish(self.conn, body, **options)

    async def publish_batch(
        self, bodies: Sequence[object], **options: Unpack[BatchOptions]
    ) -> list[int]:
        return await self.producer.apublish_batch(self.conn, bodies, **options)

    async def cancel_timer(self, queue: str, timer_id: str) -> bool:
        return await self.producer.acancel_timer(self.conn, queue=queue, timer_id=timer_id)

    async def later(self, seconds: float) -> None:
        for table, columns in TIMES.items():
            shifts = sql.SQL(", ").join(
                sql.SQL("{c} = {c} - make_interval(secs => %(s)s)").format(c=sql.Identifier(c))
                for c in columns
            )
            await self.conn.execute(
                sql.SQL("UPDATE {} SET {}").format(sql.Identifier(table), shifts), {"s": seconds}
            )

    async def now(self) -> datetime:
        row = await (await self.conn.execute("SELECT now()")).fetchone()
        assert row is not None
        return row[0]

    async def find(self, row_id: int) -> Row | None:
        query = sql.SQL("SELECT {} FROM outbox WHERE id = %s").format(
            sql.SQL(", ").join(map(sql.Identifier, ROW_COLUMNS))
        )
        async with self.conn.cursor(row_factory=dict_row) as cursor:
            found = await (await cursor.execute(query, [row_id])).fetchone()
        return None if found is None else Row(**found)

    async def dead_letters(self) -> list[DeadLetter]:
        query = sql.SQL("SELECT {} FROM outbox_dlq ORDER BY id").format(
            sql.SQL(", ").join(map(sql.Identifier, DLQ_COLUMNS))
        )
        async with self.conn.cursor(row_factory=dict_row) as cursor:
            return [DeadLetter(**found) for found in await (await cursor.execute(query)).fetchall()]

    async def pause(
        self, queue: str, until_in: float | None = None, reason: str | None = None
    ) -> None:
        await self.conn.execute(
            "INSERT INTO outbox_farm_queues (target, queue, paused, paused_until, reason)"
            " VALUES (%s, %s, true, now() + make_interval(secs => %s), %s)"
            " ON CONFLICT (target, queue) DO UPDATE SET paused = true,"
            " paused_until = excluded.paused_until, reason = excluded.reason",
            [str(self.NAMES.outbox), queue, until_in, reason],
        )

    async def resume(self, queue: str) -> None:
        await self.conn.execute(
            "UPDATE outbox_farm_queues SET paused = false WHERE target = %s AND queue = %s",
            [str(self.NAMES.outbox), queue],
        )

    async def limit(self, queue: str, limits: Limits) -> None:
        rate = limits.rate
        await self.conn.execute(
            "INSERT INTO outbox_farm_queues (target, queue, rate_count, rate_seconds, max_running)"
            " VALUES (%s, %s, %s, %s, %s) ON CONFLICT (target, queue) DO UPDATE SET"
            " rate_count = excluded.rate_count, rate_seconds = excluded.rate_seconds,"
            " max_running = excluded.max_running, tokens = CASE WHEN"
            " (outbox_farm_queues.rate_count, outbox_farm_queues.rate_seconds)"
            " IS DISTINCT FROM (excluded.rate_count, excluded.rate_seconds)"
            " THEN NULL ELSE outbox_farm_queues.tokens END",
            [
                str(self.NAMES.outbox),
                queue,
                rate.count if rate else None,
                rate.seconds if rate else None,
                limits.max_running,
            ],
        )

    async def without_dlq(self) -> None:
        assert isinstance(self.store, PostgresStore)
        self.store = PostgresStore(self.store.pool, Queries(TableNames.build("outbox", None)))

    async def wakeups(self, step: Callable[[], Awaitable[object]]) -> list[str]:
        """NOTIFY's payloads until a marker sent after `step`: whatever `step` sent arrives
        before it (notifications arrive in the order their transactions committed)."""
        channel = sql.Identifier(self.NAMES.channel)
        async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as listener:
            await listener.execute(sql.SQL("LISTEN {}").format(channel))
            await step()
            await self.conn.execute("SELECT pg_notify(%s, %s)", [self.NAMES.channel, MARKER])
            woken = []
            async for note in listener.notifies(timeout=30.0):
                if note.payload == MARKER:
                    return woken
                woken.append(note.payload)
        raise AssertionError("the marker's NOTIFY never came")


@pytest.fixture(params=["memory", "postgres"])
def outbox(request: pytest.FixtureRequest) -> Iterator[Outbox]:
    """Each store in turn; Postgres on a fresh database of its own (the `dsn` fixture)."""
    if request.param == "memory":
        yield InMemory()
    else:
        yield OnPostgres(request.getfixturevalue("dsn"))


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    """Run a coroutine test in an event loop of its own, its `outbox` opened around it."""
    test = pyfuncitem.obj
    if not inspect.iscoroutinefunction(test):
        return None
    args = {name: pyfuncitem.funcargs[name] for name in inspect.signature(test).parameters}

    async def run() -> None:
        async with args["outbox"].opened():
            await test(**args)

    asyncio.run(run())
    return True
