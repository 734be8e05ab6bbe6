"""One step of a graceful stop, bounded in time whatever the database does.

Its own module because how a step is run is not what the stop runs: `Runtime.stop` says the
order (claims, drain, relays, final flush, loops, pools) and each step's deadline; this holds
what every step gets alike: the wait, the cancellation when its time is up (repeated, since a
cancelled step may be waiting on something else by then), giving it up, and the log lines for
each. Its lines keep the runtime's logger, whose stop they are."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable

log = logging.getLogger("outbox_farm.runtime")
# A stop step still running when its time is up is cancelled, again every CANCEL_POLL seconds,
# for at most CANCEL_GRACE seconds; then the stop goes on without it.
CANCEL_GRACE = 0.2
CANCEL_POLL = 0.02


async def step(what: str, until: float | None, *steps: Awaitable[None]) -> None:
    """Run `steps` concurrently until `until` (monotonic; None: until they end, for a
    step that bounds its own time); log (with its traceback) whatever one of them raised.
    Steps still running then are cancelled, and left behind (logged) if they have not
    ended `CANCEL_GRACE` seconds later: each cancellation interrupts what a step waits for,
    a driver's attempt to cancel its query included."""
    tasks = [asyncio.ensure_future(awaitable) for awaitable in steps]
    if not tasks:
        return
    timeout = None if until is None else max(until - time.monotonic(), 0)
    _, running = await asyncio.wait(tasks, timeout=timeout)
    if running:
        log.warning(
            "stop: %s still under way when its time was up (is the database answering?); "
            "cancelling it: the rows it concerns come back when their leases expire",
            what,
            extra={"event": "stop_overrun", "step": what},
        )
        given_up = time.monotonic() + CANCEL_GRACE
        while running and time.monotonic() < given_up:
            for task in running:
                task.cancel()
            _, running = await asyncio.wait(running, timeout=CANCEL_POLL)
    if running:
        log.error(
            "stop: %s did not end when cancelled (is the database answering?); going on without it",
            what,
            extra={"event": "stop_abandoned", "step": what},
        )
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            log.error(
                "stop: %s failed",
                what,
                exc_info=task.exception(),
                extra={"event": "stop_failed", "step": what},
            )


async def cancel(task: asyncio.Task[None]) -> None:
    """Cancel `task` and wait for it to end: a loop's stop, as a step."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
