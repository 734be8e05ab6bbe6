"""The farm of the stall scenario: a worker that stalls while it holds rows.

    long   sleeps LONG_RUN (3 s) under a 1 s lease: only the heartbeat keeps the row
    stall  in one worker of the farm (the "staller", the first to take a file lock), its
           first delivery blocks the event loop for STALL_FOR (2.5 s) and then returns;
           anywhere else, and on any later delivery, it runs as `long` does

While the staller is blocked its heartbeat cannot run: every lease it holds runs out, and the
other worker claims those rows and runs them, its heartbeat renewing them. When the staller
goes on, the `stall` run returns at once, so its ack is on its way before the heartbeat can
notice the loss: a stale write, which the lease token must refuse (the staller reports the lost
lease). Without the guard it would delete the row from under the other worker, and the other
worker, which never stalled, would report a lost lease.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import IO

from loadtests.common import tables
from loadtests.common.farmapp import record
from outbox_farm import Farm, Message

LONG_RUN = 3.0  # seconds a run takes: three leases
LEASE = 1.0
STALL_FOR = 2.5  # seconds the staller's loop stays blocked: 2.5 leases, well under its timeout

log = logging.getLogger("loadtests.stall")
farm = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)
_roles: dict[int, bool] = {}  # pid -> whether this process is the staller
_held: list[IO[str]] = []  # the staller's lock file, open for the process's life


def is_staller() -> bool:
    pid = os.getpid()
    if pid not in _roles:
        lock = (Path(tempfile.gettempdir()) / "stall.lock").open("a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            _roles[pid] = False
        else:
            _held.append(lock)
            _roles[pid] = True
    return _roles[pid]


@farm.handler("long", concurrency=256, lease_ttl=LEASE, timeout=LONG_RUN * 4)
async def runs_long(msg: Message) -> None:
    await record(msg, "success")
    await asyncio.sleep(LONG_RUN)


@farm.handler("stall", concurrency=8, lease_ttl=LEASE, timeout=LONG_RUN * 4)
async def stalls(msg: Message) -> None:
    await record(msg, "success")
    if msg.deliveries_count == 1 and is_staller():
        log.warning("stalling the event loop for %gs", STALL_FOR, extra={"event": "stalled"})
        time.sleep(STALL_FOR)  # noqa: ASYNC251 - blocking the loop is the point
        return
    await asyncio.sleep(LONG_RUN)
