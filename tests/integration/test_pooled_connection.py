"""`db.pool.pooled`, the store's way to borrow a pooled connection: whatever the block did, the
pool gets the connection back ready for its next user, or replaces it. A connection handed out
in an open or failed transaction would make every later statement on it fail."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import psycopg_pool
import pytest
from psycopg.pq import TransactionStatus

from outbox_farm.db.pool import KEEP_WARM, RecentFirstPool, open_pool, pooled


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def next_user(pool: psycopg_pool.AsyncConnectionPool[Any], query: str) -> tuple[Any, ...]:
    """What the pool's next user finds: its connection's transaction status as it gets it, and
    the first row of `query` run on it (within 10 s: a connection never given back would
    leave it waiting for the pool's timeout)."""
    async with asyncio.timeout(10), pooled(pool) as conn:
        status = conn.pgconn.transaction_status
        row = await (await conn.execute(query)).fetchone()
    return status, row


async def broken_off(pool: psycopg_pool.AsyncConnectionPool[Any], *statements: str) -> None:
    """A block that runs `statements`, then leaves by an error."""
    async with pooled(pool) as conn:
        for statement in statements:
            await conn.execute(statement)
        raise RuntimeError("the block broke off")


def test_a_connection_is_given_back_idle_after_a_refused_statement(dsn: str) -> None:
    async def scenario() -> tuple[Any, ...]:
        pool = await open_pool(dsn, max_size=1)
        try:
            with pytest.raises(psycopg.errors.DivisionByZero):
                async with pooled(pool) as conn:
                    await conn.execute("SELECT 1 / 0")
            return await next_user(pool, "SELECT 7")
        finally:
            await pool.close()

    assert run(scenario()) == (TransactionStatus.IDLE, (7,))


def test_a_connection_left_in_a_transaction_is_rolled_back_before_its_next_user(
    dsn: str,
) -> None:
    """A block that began a transaction and left by an error: the write it made is undone, and
    the next user of the same connection starts outside any transaction."""

    async def scenario() -> tuple[Any, ...]:
        pool = await open_pool(dsn, max_size=1)
        try:
            async with pooled(pool) as conn:
                await conn.execute("CREATE TEMP TABLE pooled_probe (n int)")
            with pytest.raises(RuntimeError):
                await broken_off(pool, "BEGIN", "INSERT INTO pooled_probe VALUES (1)")
            return await next_user(pool, "SELECT count(*) FROM pooled_probe")
        finally:
            await pool.close()

    assert run(scenario()) == (TransactionStatus.IDLE, (0,))


def test_a_connection_whose_session_ended_is_replaced(dsn: str) -> None:
    """The server ended the session under the block (a restart, a terminated backend): the
    block fails, and the pool's next user gets a new, working connection."""

    async def scenario() -> tuple[int, int]:
        pool = await open_pool(dsn, max_size=1)
        try:
            async with pooled(pool) as conn:
                first = conn.info.backend_pid
            async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as admin:
                await admin.execute("SELECT pg_terminate_backend(%s)", [first])
            with pytest.raises(psycopg.OperationalError):
                async with pooled(pool) as conn:
                    await conn.execute("SELECT 1")
            async with pooled(pool) as again:
                row = await (await again.execute("SELECT pg_backend_pid()")).fetchone()
            return first, row[0] if row else first
        finally:
            await pool.close()

    first, second = run(scenario())
    assert second != first


def test_a_block_cancelled_midway_gives_its_connection_back(dsn: str) -> None:
    """A stop (or a timeout) that cancels the task inside the block: the pool of one connection
    still serves its next user, outside any transaction."""

    async def scenario() -> tuple[Any, ...]:
        pool = await open_pool(dsn, max_size=1)
        try:
            inside = asyncio.Event()

            async def sleeper() -> None:
                async with pooled(pool) as conn:
                    await conn.execute("BEGIN")
                    inside.set()
                    await conn.execute("SELECT pg_sleep(30)")

            task = asyncio.create_task(sleeper())
            await inside.wait()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return await next_user(pool, "SELECT 3")
        finally:
            await pool.close()

    assert run(scenario()) == (TransactionStatus.IDLE, (3,))


def test_a_pool_that_is_not_autocommit_keeps_what_the_block_wrote(dsn: str) -> None:
    """Not a pool `open_pool` made: the block's transaction is committed as it ends (and rolled
    back when it raised), as `pool.connection()` does, instead of being undone by the pool."""

    async def scenario() -> tuple[Any, Any]:
        async with (
            psycopg_pool.AsyncConnectionPool(dsn, min_size=1, max_size=1, open=False) as pool,
            await psycopg.AsyncConnection.connect(dsn, autocommit=True) as other,
        ):
            await other.execute("CREATE TABLE pooled_kept (n int)")
            try:
                async with pooled(pool) as conn:
                    await conn.execute("INSERT INTO pooled_kept VALUES (1)")
                with pytest.raises(RuntimeError):
                    await broken_off(pool, "INSERT INTO pooled_kept VALUES (2)")
                kept = await (
                    await other.execute("SELECT array_agg(n) FROM pooled_kept")
                ).fetchone()
                async with pooled(pool) as again:
                    status = again.pgconn.transaction_status
                return kept, status
            finally:
                await other.execute("DROP TABLE pooled_kept")

    assert run(scenario()) == (([1],), TransactionStatus.IDLE)


def handouts(dsn: str, keep_warm: float, checkouts: int) -> tuple[list[int], list[int]]:
    """The backends of three connections of a farm pool given back one after the other, and
    those of the `checkouts` blocks that borrow one after that, one at a time."""

    async def scenario() -> tuple[list[int], list[int]]:
        pool = await open_pool(dsn, max_size=3)
        assert isinstance(pool, RecentFirstPool)
        pool.keep_warm = keep_warm
        try:
            held = [await pool.getconn(timeout=10) for _ in range(3)]
            returned = [conn.info.backend_pid for conn in held]
            for conn in held:
                await pool.putconn(conn)
            taken = []
            for _ in range(checkouts):
                async with pooled(pool) as conn:
                    taken.append(conn.info.backend_pid)
            return returned, taken
        finally:
            await pool.close()

    returned, taken = run(scenario())
    assert len(set(returned)) == 3
    return returned, taken


def test_the_pool_hands_out_the_connection_given_back_last(dsn: str) -> None:
    """Three connections given back one after the other: the next users get the last one, as
    long as they give it back before the next checkout; the others stay idle."""
    returned, taken = handouts(dsn, KEEP_WARM, 5)
    assert taken == [returned[-1]] * 5


def test_a_connection_not_handed_out_for_keep_warm_seconds_goes_first(dsn: str) -> None:
    """Unused for `keep_warm` seconds (0 here: at once), the connection idle longest is handed
    out before the one given back last, so none sits unused until a server or a NAT drops it;
    each in turn, as long as each was unused that long."""
    returned, taken = handouts(dsn, 0.0, 4)
    assert taken == [*returned, returned[0]]
