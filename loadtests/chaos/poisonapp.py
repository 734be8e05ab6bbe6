"""The farm of the poison scenario: handlers that try to take their worker down with them.

    exit   os._exit(1): the worker dies mid-run     -> DLQ max_deliveries (2 runs)
    kbint  raise KeyboardInterrupt                   -> DLQ retry_terminal (1 run)
    hang   awaits forever; timeout 1 s               -> DLQ retry_terminal (1 run)
    block  time.sleep() on the event loop            -> the arbiter kills the worker for a
                                                        stale heartbeat; DLQ max_deliveries
    ok     succeeds (the load that must keep flowing)

Every run is recorded in the load test's ledger first, as `farmapp` does.
"""

from __future__ import annotations

import asyncio
import os
import time

from loadtests.common import tables
from loadtests.common.farmapp import record
from outbox_farm import Farm, Message, NoRetry

farm = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)


@farm.handler("exit", max_deliveries=2, concurrency=1, prefetch=1)
async def exits(msg: Message) -> None:
    await record(msg, "error")
    os._exit(1)


@farm.handler("kbint", retry=NoRetry())
async def interrupts(msg: Message) -> None:
    await record(msg, "error")
    raise KeyboardInterrupt


@farm.handler("hang", retry=NoRetry(), timeout=1.0)
async def hangs(msg: Message) -> None:
    await record(msg, "hang")
    await asyncio.sleep(3600)


@farm.handler("block", max_deliveries=2, concurrency=1, prefetch=1)
async def blocks(msg: Message) -> None:
    await record(msg, "hang")
    time.sleep(30)  # noqa: ASYNC251 - blocking the loop is the point


@farm.handler("ok")
async def succeeds(msg: Message) -> None:
    await record(msg, "success")
