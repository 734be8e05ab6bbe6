"""The farm of the limits' accuracy run (`loadtests.bench.limits`): its handlers record when
each run began and ended, so that the run's rate and the most running at once are read from
what the handlers saw, not from what the farm believes it did.

    LOADTEST_DSN="$DSN" outbox-farm start loadtests.common.limitsapp:farm --dsn "$DSN" --procs 3

Queues `rated` and `narrow` (whatever their limits; the run sets them), each handler sleeping
LIMITS_SLEEP seconds (default 0.05) between its two records: a row in `limit_runs` written as it
starts, its `ended` filled in as it returns. A run that never returns (its process was killed)
keeps an empty `ended`. Each worker process writes through a connection of its own, made after
the fork on first use.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import psycopg

from loadtests.common import tables
from outbox_farm import Farm, Message

DSN = os.environ.get("LOADTEST_DSN") or os.environ.get("OUTBOX_FARM_DSN")
if not DSN:
    raise RuntimeError("set LOADTEST_DSN (the database whose limit_runs records the runs)")
SLEEP = float(os.environ.get("LIMITS_SLEEP", "0.05"))
CONCURRENCY = int(os.environ.get("LIMITS_CONCURRENCY", "32"))
LEASE_TTL = float(os.environ.get("LIMITS_LEASE_TTL", "30"))
QUEUES = ("rated", "narrow")

STARTED = "INSERT INTO limit_runs (msg_id, queue, pid, started) VALUES (%s, %s, %s, %s)"
ENDED = "UPDATE limit_runs SET ended = %s WHERE msg_id = %s AND pid = %s AND ended IS NULL"

farm = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)
_connections: dict[int, tuple[asyncio.Lock, list[psycopg.AsyncConnection[Any]]]] = {}


async def _record(statement: str, args: tuple[Any, ...]) -> None:
    """One statement on this process's connection, one at a time (a connection runs one)."""
    lock, box = _connections.setdefault(os.getpid(), (asyncio.Lock(), []))
    async with lock:
        if not box:
            box.append(await psycopg.AsyncConnection.connect(str(DSN), autocommit=True))
        await box[0].execute(statement, args)


async def handle(msg: Message) -> None:
    await _record(STARTED, (msg.id, msg.queue, os.getpid(), time.time()))
    await asyncio.sleep(SLEEP)
    await _record(ENDED, (time.time(), msg.id, os.getpid()))


for _queue in QUEUES:
    farm.handler(_queue, concurrency=CONCURRENCY, lease_ttl=LEASE_TTL)(handle)
