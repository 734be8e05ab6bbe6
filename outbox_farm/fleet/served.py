"""One database a fleet's process serves: a runtime per outbox table of the fleet, started
when the database can be reached, restarted when one of them breaks, never the process's
problem. Whatever happens here stays this database's: the others keep flowing."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence

from ..backoff import Backoff
from ..chores.gauges import Pace
from ..db.boundary import translate
from ..db.housekeeping import backlog
from ..dsn import scrub
from ..errors import ConnectionLost, DatabaseError
from ..farm import Farm
from ..observe import Observer
from ..problems import one_line
from ..settings import RuntimeSettings
from ..worker.runtime import Runtime
from ..worker.supervised import started_unless_stopped

log = logging.getLogger("outbox_farm.fleet")
RETRY_FIRST = 0.5  # seconds before the second attempt to start on an unreachable database
RETRY_CAP = 5.0  # the longest wait between two attempts while it is unreachable
BROKEN_CAP = 60.0  # the longest wait after an error retrying does not fix by itself (a missing
# table: an operator migrates, and the database is served again within this much)
COUNT_EVERY = 5.0  # seconds between two counts of the backlog, at least (paced as the gauges)


def _reason(exc: BaseException, dsn: str) -> tuple[bool, str]:
    """(unreachable, a line that says why, secret masked) for a failed start."""
    driver = exc.__cause__ or exc.__context__
    lost = isinstance(translate(exc), ConnectionLost) or (
        driver is not None and isinstance(translate(driver), ConnectionLost)
    )
    return lost, scrub(one_line(exc), dsn)


class ServedDatabase:
    """The runtimes of `farms` on database `name` at `dsn`, under `settings`, reporting to
    `observers()` (made once per start) besides each farm's own.

    `run()` keeps them running until `stop()`: an unreachable database is waited out with
    backoff (`problem` says so meanwhile), an error retrying does not fix by itself (a table
    not migrated there) is retried less often, and a runtime that broke for good is stopped and
    started afresh. `up` is True while every runtime runs. While they run, the rows of every
    table are counted (`on_count(rows, oldest pending age)`), paced like the farm's gauges.

    The runtimes run no per-queue gauges (`settings.gauges_interval` is ignored): one process
    serves many databases, whose queues would all write the same gauges.
    """

    def __init__(
        self,
        name: str,
        dsn: str,
        farms: Sequence[Farm],
        settings: RuntimeSettings,
        observers: Callable[[], list[Observer]] = list,
        on_up: Callable[[bool], None] = lambda up: None,
        on_count: Callable[[int, float], None] = lambda rows, age: None,
    ) -> None:
        self.name = name
        self.dsn = dsn
        self.farms = farms
        self.settings = settings
        self.observers = observers
        self.on_up = on_up
        self.on_count = on_count
        self.runtimes: list[Runtime] = []
        self.up = False
        self.unready: str | None = None  # why it is not running, once a start failed
        self.since = time.monotonic()
        self._stop = asyncio.Event()
        self._graceful: float | None = None  # the drain's deadline: the settings' unless told
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self.run(), name=f"database {self.name}")

    @property
    def problem(self) -> str | None:
        """Why this database is not served as it should be, if so: not started (and why), or
        the gravest problem of one of its runtimes."""
        if self.unready is not None:
            return self.unready
        return next((r.problem for r in self.runtimes if r.problem), None)

    @property
    def warnings(self) -> list[str]:
        return [warning for runtime in self.runtimes for warning in runtime.warnings]

    async def run(self) -> None:
        backoff = Backoff(RETRY_FIRST, RETRY_CAP)
        while not self._stop.is_set():
            try:
                started = await self._start_all()
            except Exception as exc:
                await self._stop_all(0)
                lost, why = _reason(exc, self.dsn)
                self.unready = f"unreachable: {why}" if lost else why
                delay = backoff.next() if lost else BROKEN_CAP
                log.warning(
                    "database %s not served: %s; trying again in %.1fs",
                    self.name,
                    self.unready,
                    delay,
                    extra={"event": "database_unready", "database": self.name},
                )
                await self._wait(delay)
                continue
            if not started:
                break
            backoff = Backoff(RETRY_FIRST, RETRY_CAP)
            self._set_up(True)
            log.info(
                "serving database %s",
                self.name,
                extra={"event": "database_served", "database": self.name},
            )
            broken = await self._until_stopped_or_broken()
            if broken is None:
                break
            self._set_up(False)
            self.unready = f"restarting: {broken}"
            log.error(
                "database %s: %s; restarting its runtimes",
                self.name,
                broken,
                extra={"event": "database_restart", "database": self.name},
            )
            await self._stop_all(None)
            await self._wait(backoff.next())
        await self._stop_all(self._graceful)
        self._set_up(False)

    async def stop(self, graceful_timeout: float | None = None) -> None:
        """Drain (each runtime's graceful stop, within `graceful_timeout` if given), then
        return."""
        self._graceful = graceful_timeout
        self._stop.set()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)

    def _set_up(self, up: bool) -> None:
        if up:
            self.unready = None
        if up != self.up:
            self.up = up
            self.since = time.monotonic()
            self.on_up(up)

    async def _wait(self, delay: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stop.wait(), delay)

    async def _start_all(self) -> bool:
        """Start a runtime per farm; False when told to stop first (a connection attempt to a
        database that does not answer takes its whole timeout: a stop does not wait for it)."""
        self.runtimes = []
        for farm in self.farms:
            runtime = Runtime(
                list(farm.handlers.values()),
                farm.queries,
                self.dsn,
                dataclasses.replace(self.settings, queues=None, gauges_interval=None),
                [*farm.observers, *self.observers()],
            )
            self.runtimes.append(runtime)
            if not await started_unless_stopped(runtime.start(), self._stop):
                return False
        return True

    async def _count(self) -> None:
        """Count every table's rows, again and again, no sooner than the pace allows; a count
        that fails is skipped (the runtime reports what is wrong with the database)."""
        pace = Pace()
        while True:
            began = time.monotonic()
            if pace.ready(began):
                rows, age = 0, 0.0
                try:
                    for runtime in self.runtimes:
                        if runtime.pool is not None:
                            for queue in await backlog(runtime.pool, runtime.queries):
                                rows += queue.rows
                                age = max(age, queue.oldest_pending_age)
                except DatabaseError as exc:
                    log.debug("database %s: backlog not counted: %s", self.name, exc)
                else:
                    self.on_count(rows, age)
                pace.ran(began, time.monotonic())
            await asyncio.sleep(COUNT_EVERY)

    async def _until_stopped_or_broken(self) -> str | None:
        """None once told to stop; why, once one of the runtimes broke for good."""
        waits = [asyncio.create_task(self._stop.wait()), asyncio.create_task(self._count())]
        waits += [asyncio.create_task(r.fatal.wait()) for r in self.runtimes]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if self._stop.is_set():
            return None
        return next((r.fatal_reason for r in self.runtimes if r.fatal_reason), "runtime broken")

    async def _stop_all(self, graceful_timeout: float | None) -> None:
        runtimes, self.runtimes = self.runtimes, []
        await asyncio.gather(*(r.stop(graceful_timeout) for r in runtimes), return_exceptions=True)
