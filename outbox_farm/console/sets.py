"""The console over a fleet's set of databases: which databases there are, each one's pages
under `/db/NAME/`, and the overview of them all.

- **The set** is read as the fleet's processes read it (`fleet.databases.Sources`: its TOML
  file and/or its catalog query on the home database), at start and every `recheck` seconds
  of the Fleet, so a database added to the catalog is picked within one recheck; one that
  leaves the set is let go (its idle connections closed), its pages then a 404.
- **Names** in a URL are checked against the set before anything reads a database: anything
  else (not a name at all, or a name the set does not hold) is a 404 listing the set's names,
  never a DSN, never a connection attempt.
- **Connections** go through one `Budget` for the whole set: a few in use, a few idle (closed
  after a minute), however many databases the set holds.
- **The overview** reads each database in the thread pool, a few at a time, each bounded
  (connecting, then every statement, and the whole line): a database that cannot be reached
  or does not answer in time is a line saying so, by name, and the others are shown.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from ..admin import queue_stats
from ..dsn import scrub
from ..errors import ConnectionLost, OutboxFarmError
from ..fleet.databases import NAME, Sources
from ..names import TableNames
from .database import IDLE_FOR, Budget, Database
from .pages import error_page, page
from .picked import Picked

log = logging.getLogger("outbox_farm.console")
SWEEP_EVERY = 5.0  # seconds between two closings of the connections idle too long
CONNECT_TIMEOUT = 3  # seconds to connect to one database of the set
LINE_TIMEOUT = 5.0  # seconds one database's line of the overview may take, all in all
PARALLEL = 8  # databases the overview reads at once
SECTIONS = {"overview": "/", "dlq": "/dlq", "queues": "/queues", "farm": "/farm"}
SHOWN_NAME = 80  # characters of an unknown name echoed back


class DatabaseSet:
    """The databases of a fleet's set, by name, each served on demand: a `Picked` made when
    the name is first read from the set, its connections drawn from one `budget`."""

    def __init__(
        self,
        sources: Sources,
        recheck: float,
        statement_timeout: float = 5.0,
        budget: Budget | None = None,
    ) -> None:
        self._sources = sources
        self.recheck = recheck
        self.statement_timeout = statement_timeout
        self.budget = budget if budget is not None else Budget(idle_for=IDLE_FOR)
        self._picked: dict[str, Picked] = {}
        self._dsns: dict[str, str] = {}
        self.problems: dict[str, str] = {}
        self.read_at: float | None = None  # time.time() of the last reading

    def names(self) -> list[str]:
        return sorted(self._picked)

    def get(self, name: str) -> Picked | None:
        """The database `name` of the set; None for anything else (a name checked first)."""
        return self._picked.get(name) if NAME.fullmatch(name) else None

    async def refresh(self) -> None:
        """Read the set now: new databases served, those gone let go, the rest kept as they
        are (their connections and recent queues) unless their DSN changed."""
        listing = await self._sources.read()
        kept: dict[str, Picked] = {}
        for name, dsn in sorted(listing.databases.items()):
            old = self._picked.get(name)
            if old is not None and self._dsns.get(name) == dsn:
                kept[name] = old
                continue
            database = Database(
                dsn,
                name,
                self.statement_timeout,
                budget=self.budget,
                connect_timeout=CONNECT_TIMEOUT,
            )
            kept[name] = Picked(database, name)
        gone = [p for n, p in self._picked.items() if kept.get(n) is not p]
        added = sorted(set(kept) - set(self._picked))
        removed = sorted(set(self._picked) - set(kept))
        self._picked, self._dsns = kept, dict(listing.databases)
        self.problems = dict(sorted(listing.problems.items()))
        self.read_at = time.time()
        for stale in gone:
            stale.database.close()
        if added or removed:
            log.info(
                "console: the fleet's set now holds %d database(s) (%d added, %d removed)",
                len(kept),
                len(added),
                len(removed),
                extra={"event": "console_set", "added": added, "removed": removed},
            )

    async def run(self) -> None:
        """Read the set every `recheck` seconds and close connections idle too long, until
        cancelled. A reading that fails keeps the set as it was (and says so in the log)."""
        last = time.monotonic()
        while True:
            await asyncio.sleep(min(self.recheck, SWEEP_EVERY))
            await run_in_threadpool(self.budget.sweep)
            if time.monotonic() - last < self.recheck:
                continue
            last = time.monotonic()
            try:
                await self.refresh()
            except Exception:  # never the end of the console: the next round tries again
                log.warning("console: reading the fleet's set failed", exc_info=True)

    def close(self) -> None:
        self.budget.drop()


class PickedDatabase:
    """The pages of one database of the set, under `/db/{database}`: the name checked against
    the set, the request then bound to that database (`picked.picked`) and nothing else; an
    unknown name is a 404 naming the set's databases."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        name = str(scope.get("path_params", {}).get("database", ""))
        sets: DatabaseSet = scope["app"].state.sets
        found = sets.get(name)
        if found is None:
            response = unknown(Request(scope, receive), sets, name)
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})["picked"] = found
        await self.app(scope, receive, send)


def unknown(request: Request, sets: DatabaseSet, name: str) -> Response:
    """The 404 of a name the set does not hold (echoed, cut, escaped by the template)."""
    shown = name if len(name) <= SHOWN_NAME else name[:SHOWN_NAME] + "..."
    known = sets.names()
    message = f"There is no database {shown!r} in the fleet's set ({len(known)} databases)."
    if is_htmx(request):
        return error_page(request, 404, "No such database", message)
    return page(request, "error.html", 404, title="No such database", message=message, known=known)


def is_htmx(request: Request) -> bool:
    return request.headers.get("hx-request") == "true"


# -- the overview of the set -----------------------------------------------------------------


@dataclass
class Line:
    """One database on the overview: its backlog, dead letters and queues held or stalled;
    or, when it could not be read, `error` (what to tell the operator, never its DSN)."""

    name: str
    error: str | None = None
    pending: int = 0
    ready: int = 0
    exact: bool = True  # every count exact (not the planner's estimate of a large queue)
    oldest_ready: float = 0.0
    dlq: int | None = None  # None: no DLQ table served
    queues: int = 0
    paused: list[str] = field(default_factory=list)
    stalled: list[str] = field(default_factory=list)

    @property
    def reachable(self) -> bool:
        return self.error is None


PENDING = ("ready", "scheduled", "waiting", "in_flight")  # disjoint: every row of the outbox


def read_line(chosen: Picked, names: TableNames, timeout: float) -> Line:
    """The overview's line of one database, each statement and the wait for a connection
    bounded by `timeout` seconds (its connecting by `CONNECT_TIMEOUT`)."""
    assert chosen.name is not None
    with chosen.database.connection(statement_timeout=timeout, wait=timeout) as conn:
        stats = queue_stats(conn, names)
    line = Line(chosen.name, queues=len(stats))
    for q in stats:
        counts = [q.counts[figure] for figure in PENDING]
        line.pending += sum(c.value for c in counts)
        line.ready += q.counts["ready"].value
        line.exact = line.exact and all(c.exact for c in counts)
        line.oldest_ready = max(line.oldest_ready, q.oldest_ready_age)
        if names.dlq is not None:
            total = q.dlq_total("total")
            line.dlq = (line.dlq or 0) + total.value
            line.exact = line.exact and total.exact
        if q.paused:
            line.paused.append(q.queue)
        if q.stalled:
            line.stalled.append(q.queue)
    if names.dlq is not None and line.dlq is None:
        line.dlq = 0
    return line


async def read_lines(sets: DatabaseSet, names: TableNames, timeout: float) -> list[Line]:
    """Every database's line, read `PARALLEL` at a time; one that fails or takes longer than
    `timeout` (plus a second for its connection) is a line saying so."""
    gate = asyncio.Semaphore(PARALLEL)

    async def one(name: str) -> Line:
        chosen = sets.get(name)
        if chosen is None:  # left the set while the page was being read
            return Line(name, error="no longer in the set")
        async with gate:
            try:
                return await asyncio.wait_for(
                    run_in_threadpool(read_line, chosen, names, timeout),
                    timeout + CONNECT_TIMEOUT + 1.0,
                )
            except TimeoutError:
                return Line(name, error=f"no answer within {timeout + CONNECT_TIMEOUT:.0f}s")
            except ConnectionLost:
                log.warning("console: database %s cannot be reached", name, exc_info=True)
                return Line(name, error="cannot be reached (the console's log says why)")
            except OutboxFarmError as exc:
                log.warning("console: database %s: %s", name, exc)
                return Line(name, error=_short(exc))

    return list(await asyncio.gather(*(one(name) for name in sets.names())))


def _short(exc: OutboxFarmError) -> str:
    """An error of one database as the overview shows it: its first line, no server named
    (a `ConnectionLost` is caught before: its message names the server)."""
    return scrub(str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)


async def _overview_data(request: Request) -> dict[str, Any]:
    settings = request.app.state.settings
    sets: DatabaseSet = request.app.state.sets
    lines = await read_lines(sets, settings.names, settings.database_timeout)
    return {
        "lines": lines,
        "problems": sets.problems,
        "unreachable": [line.name for line in lines if not line.reachable],
        "has_dlq": settings.names.dlq is not None,
    }


async def overview(request: Request) -> Response:
    """Every database of the set: its backlog, dead letters, and whether it answered."""
    return page(request, "fleet.html", **await _overview_data(request))


async def overview_live(request: Request) -> Response:
    return page(request, "_fleet_live.html", **await _overview_data(request))


async def pick(request: Request) -> Response:
    """The picker's answer: the same page (`page`: overview, dlq, queues, farm) of the
    database chosen; a name the set does not hold is its 404."""
    sets: DatabaseSet = request.app.state.sets
    name = str(request.query_params.get("database") or "")
    if sets.get(name) is None:
        return unknown(request, sets, name)
    section = SECTIONS.get(str(request.query_params.get("page") or ""), "/")
    return RedirectResponse(f"/db/{name}{section}", status_code=303)


@contextlib.asynccontextmanager
async def reading(sets: DatabaseSet) -> AsyncIterator[None]:
    """Keep `sets` read (and its idle connections closed) for the block."""
    task = asyncio.create_task(sets.run(), name="console-set")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
