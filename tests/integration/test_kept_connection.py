"""`db.pool.Keeper`, through which a fetcher's claims keep their connection from one claim to the
next while NOTIFYs keep coming: the key's next blocks get that connection, and it goes back to
the pool at `give_back` (the fetcher's `Store.rest`), after a block that failed, and whenever
the fetcher waits for longer. A connection kept and never given back would shrink the pool for
good: the flushes would wait for one, and a pool of one would stop."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import psycopg
import pytest

from outbox_farm import Farm, Message
from outbox_farm.db.pool import Keeper, Pool, open_pool, pooled
from outbox_farm.db.store import PostgresStore
from outbox_farm.names import TableNames
from outbox_farm.queries import Queries
from outbox_farm.storage import Claim
from tests.steps import eventually


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def idle(pool: Pool) -> bool:
    """Every connection the pool opened is in it, none handed out."""
    stats = pool.get_stats()
    return bool(stats["pool_available"] == stats["pool_size"])


async def pid(keeper: Keeper, key: str, *, keep: bool = False) -> int:
    async with asyncio.timeout(10), keeper.use(key, keep=keep) as conn:
        row = await (await conn.execute("SELECT pg_backend_pid()")).fetchone()
    assert row is not None
    return int(row[0])


def test_a_kept_connection_serves_its_key_until_given_back(dsn: str) -> None:
    async def scenario() -> None:
        pool = await open_pool(dsn, max_size=2)
        keeper = Keeper(pool)
        try:
            first = await pid(keeper, "q", keep=True)
            assert not idle(pool)
            assert await pid(keeper, "q", keep=True) == first
            async with pooled(pool) as other:  # the pool's other users get another one
                assert other.info.backend_pid != first
            assert await pid(keeper, "r") != first  # and so does another key
            assert idle(pool) is False
            await keeper.give_back("q")
            assert idle(pool)
            await keeper.give_back("q")  # nothing kept: nothing to do
            assert idle(pool)
            # A block without `keep` takes what its key kept, and gives it back to the pool.
            kept_pid = await pid(keeper, "q", keep=True)
            assert await pid(keeper, "q") == kept_pid
            assert idle(pool)
        finally:
            await pool.close()

    run(scenario())


def test_a_block_without_keep_leaves_nothing_kept(dsn: str) -> None:
    async def scenario() -> None:
        pool = await open_pool(dsn, max_size=1)
        keeper = Keeper(pool)
        try:
            await pid(keeper, "q")
            assert idle(pool)
            assert keeper.kept == {}
        finally:
            await pool.close()

    run(scenario())


def test_a_block_that_failed_or_left_a_transaction_gives_its_connection_back(dsn: str) -> None:
    """With a pool of one connection: after each, the pool's next user gets it, outside any
    transaction (the pool rolls back what the block left open)."""

    async def scenario() -> None:
        pool = await open_pool(dsn, max_size=1)
        keeper = Keeper(pool)
        try:
            with pytest.raises(psycopg.errors.DivisionByZero):
                async with keeper.use("q", keep=True) as conn:
                    await conn.execute("SELECT 1 / 0")
            assert keeper.kept == {}
            async with keeper.use("q", keep=True) as conn:
                await conn.execute("BEGIN")
            assert keeper.kept == {}
            async with asyncio.timeout(10), pooled(pool) as conn:
                assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        finally:
            await pool.close()

    run(scenario())


def test_two_blocks_of_one_key_at_once_keep_one_connection(dsn: str) -> None:
    """The second block to end finds the key's connection kept already: its own goes back."""

    async def scenario() -> None:
        pool = await open_pool(dsn, max_size=2)
        keeper = Keeper(pool)
        try:
            both = asyncio.Barrier(2)

            async def block() -> int:
                async with keeper.use("q", keep=True) as conn:
                    await both.wait()  # each holds its own connection here
                    return conn.info.backend_pid

            pids = await asyncio.gather(block(), block())
            assert len(set(pids)) == 2
            assert list(keeper.kept) == ["q"]
            assert pool.get_stats()["pool_available"] == 1
            await keeper.give_back("q")
            assert idle(pool)
        finally:
            await pool.close()

    run(scenario())


def test_the_store_keeps_a_claims_connection_only_when_the_claim_says_so(dsn: str) -> None:
    """A claim with `keep` (a fetcher's) leaves its connection with the store until `rest`;
    one without (any other caller's) gives it back at once."""

    async def claim(store: PostgresStore, *, keep: bool) -> list[Message]:
        made = Claim("q", 10, 30.0, uuid.uuid4(), 0.0, 30.0, keep=keep)
        return await store.claim(made)

    async def scenario() -> None:
        pool = await open_pool(dsn, max_size=1, farm=True)
        store = PostgresStore(pool, Queries(TableNames.build("outbox", None)))
        try:
            await claim(store, keep=False)
            assert idle(pool)
            await claim(store, keep=True)
            assert not idle(pool)
            async with asyncio.timeout(5):  # the kept connection: a pool of one does not wait
                await store.next_due("q")
            assert idle(pool)  # a look before a rest gives it back
            await claim(store, keep=True)
            await claim(store, keep=True)
            assert not idle(pool)
            await store.rest("q")
            assert idle(pool)
        finally:
            await pool.close()

    run(scenario())


def test_a_farm_gives_its_claims_connection_back_once_its_stream_ends(dsn: str) -> None:
    """A stream of messages a few milliseconds apart, then nothing: the fetcher, resting until
    the next poll, has given its claims' connection back, and the pool holds every
    connection it opened."""
    farm = Farm()
    done: list[int] = []

    @farm.handler("q")
    async def handle(msg: Message) -> None:
        done.append(msg.id)

    async def scenario() -> None:
        async with farm.running(dsn, flush_interval=0.01) as runtime:
            with psycopg.connect(dsn, autocommit=True) as conn:
                for n in range(40):
                    farm.publish(conn, {"n": n}, queue="q")
                    await asyncio.sleep(0.003)  # a stream: the next NOTIFY within the look
            await eventually(lambda: len(done) == 40, "every row handled")
            await eventually(lambda: idle(runtime.pool), "every connection back in the pool")

    run(scenario())
