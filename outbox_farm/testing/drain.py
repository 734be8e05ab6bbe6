"""`drain`: run a farm's handlers on what its outbox holds, in the test's own process, until
nothing is left to run; report what became of each row.

It is the real runtime (the same claim, executors, completer, lease guard and outcome rules as
`outbox-farm start`), started for the drain and stopped after it, with a clock the test
controls: rows due within `within` seconds run now, without sleeping, because the drain moves
their due times (and their past attempts) back instead of waiting.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable

from ..db import scratch
from ..db.connect import AsyncConnection
from ..errors import ConfigurationError, OutboxFarmError
from ..farm import Farm
from ..worker.runtime import Runtime
from .results import Collector, Drained

IDLE_CHECK = 0.005  # seconds between looks at the outbox while rows are held or due


class DrainTimeout(OutboxFarmError):
    """Rows were still held or due when the drain's `timeout` ran out (a hung handler?)."""


def drain(
    farm: Farm,
    dsn: str,
    *,
    queues: Iterable[str] | None = None,
    within: float = 0.0,
    limit: int = 100_000,
    timeout: float = 60.0,
) -> Drained:
    """Run `farm`'s handlers against the database at `dsn` until its queues hold nothing due.

    `within`: also run what falls due in the next so many seconds (delayed publishes, retries
    and the retries of retries), moving the clock instead of sleeping. `limit`: stop after
    about this many verdicts (several handlers run at once). `timeout`: real seconds before
    `DrainTimeout`. The handlers run in this thread's new event loop; from a coroutine, await
    `adrain` instead.
    """
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        pass
    else:
        raise ConfigurationError("drain() was called inside an event loop: await adrain() instead")
    return asyncio.run(
        adrain(farm, dsn, queues=queues, within=within, limit=limit, timeout=timeout)
    )


async def adrain(
    farm: Farm,
    dsn: str,
    *,
    queues: Iterable[str] | None = None,
    within: float = 0.0,
    limit: int = 100_000,
    timeout: float = 60.0,
) -> Drained:
    """`drain` from a coroutine, on the running event loop."""
    names = _queues(farm, queues)
    if within < 0 or limit < 1 or timeout <= 0:
        raise ConfigurationError("drain needs within >= 0, limit >= 1 and timeout > 0")
    collector = Collector()
    result = Drained(collector.runs)
    conn = await scratch.watch(dsn)
    try:
        async with farm.running(
            dsn,
            observers=[collector],
            queues=names,
            listen=False,  # the drain wakes the fetchers itself, as soon as it sees work
            poll_interval=0.05,
            vacuum_interval=None,
            graceful_timeout=min(timeout, 10.0),
        ) as runtime:
            result.advanced = await _run(runtime, conn, names, collector, within, limit, timeout)
        result.left = (await scratch.drain_state(conn, farm.queries, names)).rows
    finally:
        await conn.close()
    return result


def _queues(farm: Farm, queues: Iterable[str] | None) -> tuple[str, ...]:
    if not farm.handlers:
        raise ConfigurationError("the farm has no handlers: register one with @farm.handler")
    names = tuple(farm.handlers) if queues is None else tuple(queues)
    unknown = sorted(set(names) - set(farm.handlers))
    if unknown:
        raise ConfigurationError(f"no handler registered for queues {unknown}")
    return names


async def _run(
    runtime: Runtime,
    conn: AsyncConnection,
    queues: tuple[str, ...],
    collector: Collector,
    within: float,
    limit: int,
    timeout: float,
) -> float:
    """Wait while rows are held or due; then move the clock to the next due row while that
    stays within `within`. The seconds the clock moved."""
    deadline = time.monotonic() + timeout
    advanced = 0.0
    while len(collector.runs) < limit:
        state = await scratch.drain_state(conn, runtime.queries, queues)
        if state.held or (state.next_in is not None and state.next_in <= 0):
            if time.monotonic() > deadline:
                raise DrainTimeout(
                    f"drain: after {timeout:g}s, {state.held} rows of queues {list(queues)} "
                    "are still held (a handler that does not return?) and more may be due; "
                    "raise `timeout`, or give the handler a `timeout` of its own"
                )
            for fetcher in runtime.fetchers.values():
                fetcher.wake()
            await asyncio.sleep(IDLE_CHECK)
            continue
        if state.next_in is None or advanced + state.next_in > within:
            break
        await scratch.advance(conn, runtime.queries, queues, state.next_in)
        advanced += state.next_in
    return advanced
