"""The farm under load test: `outbox-farm start loadtests.common.farmapp:farm` from the
repository's root.

    LOADTEST_DSN="$DSN" outbox-farm start loadtests.common.farmapp:farm --dsn "$DSN" --procs 2

Every handler run records itself in `loadtest_ledger` (msg_id, queue, outcome, pid) in its
own short transaction, through a connection pool that each worker process creates for itself
on first use: after the fork, inside the worker's running event loop (a pool made at import
would be made in the arbiter and shared, broken, by every child). The queues and their
intended fates are described in `scenario.py`.

Outcomes: `success` (the handler is about to return), `error` (about to raise an ordinary
exception), `reject` (about to raise DeadLetter), `hang` (maxdel's run, about to hang).
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from loadtests.common import scenario, tables
from outbox_farm import ConstantBackoff, DeadLetter, Farm, Message, NoRetry

DSN = os.environ.get("LOADTEST_DSN") or os.environ.get("OUTBOX_FARM_DSN")
if not DSN:
    raise RuntimeError("set LOADTEST_DSN (the database whose loadtest_ledger records deliveries)")
LEDGER_POOL_SIZE = int(os.environ.get("LOADTEST_LEDGER_POOL", "6"))

farm = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)

# pid -> (lock, [pool]). Keyed by pid so that nothing made in one process is used in another.
_pools: dict[int, tuple[asyncio.Lock, list[AsyncConnectionPool[Any]]]] = {}


async def _ledger_pool() -> AsyncConnectionPool[Any]:
    pid = os.getpid()
    entry = _pools.get(pid)
    if entry is None:
        entry = _pools[pid] = (asyncio.Lock(), [])
    lock, box = entry
    if not box:
        async with lock:
            if not box:
                pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
                    DSN,
                    min_size=1,
                    max_size=LEDGER_POOL_SIZE,
                    open=False,
                    name=f"loadtest-ledger-{pid}",
                    # Told apart from the farm's own connections (the chaos suite counts those).
                    kwargs={"application_name": "loadtest-ledger"},
                )
                await pool.open(wait=True, timeout=30)
                box.append(pool)
    return box[0]


async def record(msg: Message, outcome: str) -> str:
    """Write one ledger row in its own transaction; return the message's id.

    A database restart can break the connection after the COMMIT took effect but before its
    reply arrived. Raising then would make the farm run the handler again and the ledger show
    two runs where the farm ran the handler only once more because of the app's own write: so
    the row is looked up by its run id, and only a write that did not happen raises.
    """
    msg_id = str(msg.json()["id"])
    run_id = uuid.uuid4()
    pool = await _ledger_pool()
    try:
        async with pool.connection() as conn, conn.transaction():
            await conn.execute(
                "INSERT INTO loadtest_ledger (msg_id, queue, outcome, pid, run_id) "
                "VALUES (%s, %s, %s, %s, %s)",
                (msg_id, msg.queue, outcome, os.getpid(), run_id),
            )
    except psycopg.OperationalError:
        if not await _written(run_id):
            raise
    return msg_id


async def _written(run_id: uuid.UUID) -> bool:
    """Whether the ledger row of `run_id` exists, asked on a fresh connection for up to 20 s
    (the server may be restarting); False when that cannot be known."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            async with await psycopg.AsyncConnection.connect(DSN, autocommit=True) as conn:
                cur = await conn.execute(
                    "SELECT 1 FROM loadtest_ledger WHERE run_id = %s", (run_id,)
                )
                return await cur.fetchone() is not None
        except psycopg.OperationalError:
            await asyncio.sleep(0.2)
    return False


class LoadTestFailure(Exception):
    """A failure the load test asked for."""


@farm.handler("ok")
async def handle_ok(msg: Message) -> None:
    await record(msg, "success")


@farm.handler(
    "flaky",
    retry=ConstantBackoff(
        delay=scenario.FLAKY_RETRY_DELAY, max_attempts=scenario.MAX_FLAKY_FAILURES + 1
    ),
)
async def handle_flaky(msg: Message) -> None:
    fail_times = int(msg.json().get("fail_times", 0))
    if msg.attempts_count < fail_times:
        await record(msg, "error")
        raise LoadTestFailure(f"flaky failure {msg.attempts_count + 1} of {fail_times}")
    await record(msg, "success")


@farm.handler(
    "slow",
    concurrency=64,
    lease_ttl=scenario.SHORT_LEASE,
    timeout=scenario.LONG_TIMEOUT,
)
async def handle_slow(msg: Message) -> None:
    if msg.deliveries_count == 1:
        await asyncio.sleep(scenario.SLOW_SLEEP)  # twice its lease: the heartbeat holds it
    await record(msg, "success")


@farm.handler("poison", retry=NoRetry())
async def handle_poison(msg: Message) -> None:
    await record(msg, "error")
    raise LoadTestFailure("poison message")


@farm.handler("reject")
async def handle_reject(msg: Message) -> None:
    await record(msg, "reject")
    raise DeadLetter("rejected by the load test")


@farm.handler(
    "maxdel",
    concurrency=64,
    max_deliveries=1,
    lease_ttl=scenario.SHORT_LEASE,
    timeout=scenario.LONG_TIMEOUT,
    retry=ConstantBackoff(delay=0.05),  # never terminal: only max_deliveries may end it
)
async def handle_maxdel(msg: Message) -> None:
    await record(msg, "hang")
    await asyncio.sleep(scenario.MAXDEL_HANG)
    raise LoadTestFailure("hung past the lease")
