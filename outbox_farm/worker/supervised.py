"""Supervision of the runtime's long-running tasks: none of them ends quietly.

Every loop of a runtime (a queue's fetcher, lease heartbeat, executor tasks and their watchdog;
the completer's flush task; the listener; the gauge, vacuum and retention chores) runs under the
runtime's `Supervisor`. A loop that returns has done its job (a stop, or a chore that found it
may not run) and stays ended. An exception it did not expect (the loops already handle the
database errors they expect) is logged with its traceback, and the loop is started again after a
jittered backoff. From the failure until `SETTLE` seconds after the restart the supervisor
reports it (`Runtime.problem`, which turns the arbiter's /healthz 503), so a component that keeps
failing is visible however briefly each restart takes.

What happens when restarts do not help is chosen per component (`Policy`):

- The data path (fetchers, executors and their watchdog, the completer, lease heartbeats) is
  `FATAL`: after `FATAL_FAILURES` failures within `FATAL_WINDOW` seconds the worker is declared
  broken (`on_fatal`), so it drains and exits non-zero and the arbiter forks a fresh one; its
  leased rows come back when their leases end. A worker that cannot claim, run or write
  delivers nothing, and a fresh process may well not share what broke this one (a corrupted
  state, a leaked resource). It restarts first rather than exiting at once because each of
  these components keeps its state in its object (the ledger, the completer's pending
  outcomes), so a restart loses nothing, and a one-off bug should cost a backoff, not every row
  the worker holds.
- The listener and the chores (gauges, vacuum, DLQ retention) are `RESTART`: restarted for ever,
  with a backoff capped at `RESTART_CAP`. Rows keep flowing without them (fetchers poll), and a
  fresh process would run into the same bug; the problem stays reported while they keep
  failing, so the failure is seen without the farm's deliveries paying for it.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable

from ..backoff import Backoff
from ..problems import one_line

log = logging.getLogger("outbox_farm.supervised")

FATAL_FAILURES = 5  # failures of one data-path component ...
FATAL_WINDOW = 60.0  # ... within this many seconds make the worker fatally broken
SETTLE = 10.0  # seconds a restarted component is still reported after its restart
FIRST_DELAY = 0.1  # the first restart's backoff
FATAL_CAP = 5.0  # the longest backoff of a data-path component
RESTART_CAP = 60.0  # the longest backoff of the listener and the chores


class Policy(enum.Enum):
    """What the supervisor does with a component that keeps failing."""

    FATAL = "fatal"  # restart, until it failed FATAL_FAILURES times in FATAL_WINDOW seconds
    RESTART = "restart"  # restart for ever


class Supervisor:
    """Runs the loops of one runtime, restarting those that fail.

    State: `_failures` and `_reported` are written by the supervised tasks (on the one event
    loop) and read through `problem` by whoever reports health.
    """

    def __init__(self, on_fatal: Callable[[str], None]) -> None:
        self.on_fatal = on_fatal
        self._failures: dict[str, deque[float]] = {}
        self._reported: dict[str, tuple[str, float]] = {}  # name -> (reason, reported until)

    def spawn(
        self,
        name: str,
        run: Callable[[], Awaitable[None]],
        policy: Policy = Policy.FATAL,
    ) -> asyncio.Task[None]:
        """A task running `run()` under supervision, named `name` in logs and problems.

        `run` is awaited in the task itself, not in a task of its own, so cancelling the
        returned task cancels whatever `run` awaits (a stop, an executor's timeout watchdog).
        """
        return asyncio.create_task(self._supervise(name, run, policy), name=f"outbox-farm {name}")

    @property
    def problem(self) -> str | None:
        """The component that failed last and is restarting (or restarted less than SETTLE
        seconds ago), as one line; None when none is."""
        now = time.monotonic()
        for name, (_, until) in list(self._reported.items()):
            if until <= now:
                del self._reported[name]
        if not self._reported:
            return None
        name, (reason, _) = next(reversed(self._reported.items()))
        return f"{name} failed and is restarting: {reason}"

    async def _supervise(
        self, name: str, run: Callable[[], Awaitable[None]], policy: Policy
    ) -> None:
        backoff = Backoff(FIRST_DELAY, FATAL_CAP if policy is Policy.FATAL else RESTART_CAP)
        while True:
            began = time.monotonic()
            try:
                await run()
                return
            except Exception as exc:  # CancelledError is a BaseException: a stop goes through
                if time.monotonic() - began > FATAL_WINDOW:
                    backoff.reset()  # it ran well for a while: this is a new failure
                delay = self._failed(name, exc, policy, backoff.next())
            if delay is None:
                return
            await asyncio.sleep(delay)

    def _failed(self, name: str, exc: Exception, policy: Policy, delay: float) -> float | None:
        """Log and count the failure; the delay before the restart, or None when the worker
        was declared broken instead."""
        now = time.monotonic()
        times = self._failures.setdefault(name, deque())
        times.append(now)
        while times and times[0] < now - FATAL_WINDOW:
            times.popleft()
        reason = f"{type(exc).__name__}: {one_line(exc)}"
        fields = {"event": "task_failed", "component": name, "failures": len(times)}
        if policy is Policy.FATAL and len(times) >= FATAL_FAILURES:
            log.critical(
                "%s failed %d times within %gs, the last time with %s; this worker is broken "
                "and stops",
                name,
                len(times),
                FATAL_WINDOW,
                reason,
                exc_info=exc,
                extra=fields | {"event": "worker_broken"},
            )
            self._reported.pop(name, None)
            self.on_fatal(f"{name} failed {len(times)} times within {FATAL_WINDOW:g}s: {reason}")
            return None
        log.error(
            "%s failed with %s; restarting it in %.2fs (failure %d within %gs)",
            name,
            reason,
            delay,
            len(times),
            FATAL_WINDOW,
            exc_info=exc,
            extra=fields,
        )
        self._reported.pop(name, None)
        self._reported[name] = (reason, now + delay + SETTLE)
        return delay


async def started_unless_stopped(start: Awaitable[None], stop: asyncio.Event) -> bool:
    """Run `start` unless `stop` is set first: then it is cancelled, and False. A connection
    attempt to a database that does not answer takes its whole timeout, so a stop must not
    wait for the attempt to end. What `start` raised is raised."""
    starting = asyncio.ensure_future(start)
    stopping = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if not starting.done():
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        return False
    starting.result()
    return True
