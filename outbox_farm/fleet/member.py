"""A fleet's process: it takes its share of the databases, serves each (`served`), and gives
up what it no longer should serve, round after round (`db.fleet` holds the statements).

What a round decides, in this order: the databases it lost (taken by another process while
this one could not reach the home database) stop being served; the ones gone from the set,
or whose DSN changed, are drained and given up; above its share (a process joined), the ones
it prefers least are drained and given up; the ones it took start. A database is drained
before its lease is given up, so two processes of one fleet serve it together only while a
lease has lapsed (never a loss: every row's own lease token still guards its writes).

While the home database cannot be reached, the process keeps serving what it holds (no
other process can take it through an unreachable database either) and says so.

The set is read every `recheck` seconds, and at once when asked (`recheck()`: a HUP to the
arbiter, passed on to every worker): the next round starts then, without waiting for its
turn, and reads the set whatever the time since the last reading. Nothing else changes: the
databases that stay are served by the same objects, uninterrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
import time
from collections.abc import Callable

from ..db import fleet as statements
from ..db.pool import Pool, open_pool, probe
from ..dsn import redact, scrub
from ..errors import ConfigurationError, DatabaseError, SchemaError
from ..observe import Observer
from ..problems import one_line
from ..settings import RuntimeSettings
from . import metrics
from .databases import Listing, Sources
from .fleet import Fleet
from .served import ServedDatabase

log = logging.getLogger("outbox_farm.fleet")
LEAVE_TIMEOUT = 5.0  # seconds a stop waits to give its leases up; they expire otherwise
JOIN_WAIT = 1.0  # seconds between saying it is alive and taking its share, at start
ALL_DOWN = "every database this process serves is down"  # a problem of the farm only when
# every process of it says so (see `prefork.liveness.health`): one database down, or one host's,
# is the problem of those databases, which /healthz lists as degraded
MAX_WARNINGS = 20  # lines of warnings /healthz gets from one process; the rest are counted
SHOWN = 5  # databases named per kind of change when the set is read again on request


def member_name(pid: int | None = None) -> str:
    """The name of a process in its fleet, which its arbiter can also tell after it died."""
    return f"{socket.gethostname()}:{pid if pid is not None else os.getpid()}"


class FleetMember:
    """The process side of `fleet` with its leases on `home_dsn`; `settings` are every
    database's runtime settings (each database has one holder: it runs the chores too).

    Runs like a `Runtime` under the worker process: `start`, `stop`, `fatal`, `problem`,
    `warnings`. `observers(database)`: the user's observers for that database's runtimes.
    `name`: the process's name in the fleet (`member_name()`, which its arbiter can tell after
    it died, unless given: several members in one process, as tests run them).
    """

    def __init__(
        self,
        fleet: Fleet,
        home_dsn: str,
        settings: RuntimeSettings,
        observers: Callable[[str], list[Observer]] | None = None,
        name: str | None = None,
    ) -> None:
        self.fleet = fleet
        self.home_dsn = home_dsn
        self.settings = settings
        self.member = statements.Member(
            fleet.name, name or member_name(), socket.gethostname(), os.getpid()
        )
        self.sources = Sources(fleet.file, fleet.catalog, home_dsn)
        self.listing = Listing({}, {})
        self.served: dict[str, ServedDatabase] = {}
        self.leaving: dict[str, asyncio.Task[None]] = {}
        self.members = 1
        self.home_problem: str | None = None
        self.fatal = asyncio.Event()  # a process of a fleet never breaks as a whole
        self.fatal_reason: str | None = None
        self._observers = observers or (lambda name: [])
        self._pool: Pool | None = None
        self._loop: asyncio.Task[None] | None = None
        self._read_at = -float("inf")
        self._reread = False  # asked to read the set in the next round, whatever its age
        self._wake = asyncio.Event()  # ends the wait for the next round early

    # -- the process's life -------------------------------------------------------------

    async def start(self) -> None:
        """Reach the home database, say this process is alive, then take its share: a home
        database without the fleet's tables is refused here, with what to run.

        The wait between the two lets the processes started with this one say so too, so the
        first of them divides the set by all of them, instead of taking everything and then
        draining most of it again."""
        await probe(self.home_dsn)
        self._pool = await open_pool(self.home_dsn, max_size=2, farm=True)
        try:
            await statements.play_round(
                self._pool, self.member, self.fleet.expiry, [], lambda members: 0
            )
            await asyncio.sleep(JOIN_WAIT)
            await self.play()
        except SchemaError as exc:
            raise ConfigurationError(
                f"the fleet's tables are missing on the home database {redact(self.home_dsn)}: "
                f"run `outbox-farm migrate` there (migration 0015) ({one_line(exc)})"
            ) from exc
        self._loop = asyncio.create_task(self._rounds(), name="fleet rounds")
        log.info(
            "fleet %s: process %s joined %d others, serving %d of %d databases",
            self.fleet.name,
            self.member.name,
            self.members - 1,
            len(self.served),
            len(self.listing.databases),
            extra={"event": "fleet_joined", "member": self.member.name},
        )

    async def stop(self, graceful_timeout: float | None = None) -> None:
        """Stop taking; drain every database at once; give everything up; close."""
        if self._loop is not None:
            self._loop.cancel()
            await asyncio.gather(self._loop, return_exceptions=True)
        served, self.served = self.served, {}
        drains = [database.stop(graceful_timeout) for database in served.values()]
        await asyncio.gather(*drains, *self.leaving.values(), return_exceptions=True)
        for name in served:
            metrics.unserved(name)
        if self._pool is not None:
            try:
                await asyncio.wait_for(statements.leave(self._pool, self.member), LEAVE_TIMEOUT)
            except (DatabaseError, TimeoutError) as exc:
                log.warning(
                    "fleet %s: could not give up the leases of this process (%s); the other "
                    "processes take its databases when they expire",
                    self.fleet.name,
                    one_line(exc),
                    extra={"event": "fleet_leave_failed"},
                )
            await self._pool.close(timeout=0.2)

    # -- rounds ---------------------------------------------------------------------------

    def recheck(self) -> None:
        """Read the set again now, not at its next `recheck`: the next round starts at once
        (after the one under way, if any). Safe to call at any time, from the event loop's
        thread (a signal handler of the loop): before `start`, the start's own reading is
        the fresh one, and the next round reads it once more."""
        self._reread = True
        self._wake.set()

    async def _rounds(self) -> None:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.fleet.round_every)
            self._wake.clear()
            try:
                await self.play()
            except DatabaseError as exc:
                if self.home_problem is None:
                    log.warning(
                        "fleet %s: home database unreachable or failing (%s); serving the %d "
                        "databases this process holds until it answers",
                        self.fleet.name,
                        one_line(exc),
                        len(self.served),
                        extra={"event": "fleet_home_failed"},
                    )
                self.home_problem = scrub(one_line(exc), self.home_dsn)

    async def play(self) -> None:
        """One round: read the set when due, then renew, take, give up, as the module says."""
        assert self._pool is not None
        now = time.monotonic()
        asked, self._reread = self._reread, False
        if asked or now - self._read_at >= self.fleet.recheck:
            before = self.listing.databases
            try:
                self.listing = await self.sources.read()
            except BaseException:
                self._reread = self._reread or asked  # the request outlives a failed reading
                raise
            self._read_at = now
            metrics.fleet_size(len(self.listing.databases))
            if asked:
                self._say_reread(before)
        databases = self.listing.databases
        wanted = self._preferred(list(databases))
        fleet = self.fleet
        result = await statements.play_round(
            self._pool,
            self.member,
            fleet.expiry,
            wanted,
            lambda members: fleet.share(len(wanted), members),
        )
        if self.home_problem is not None:
            log.info("fleet %s: home database answers again", fleet.name)
            self.home_problem = None
        self.members = result.members
        held = result.held
        for name in [n for n in self.served if n not in held]:
            log.warning(
                "fleet %s: the lease of database %s was taken by another process; no longer "
                "serving it",
                fleet.name,
                name,
                extra={"event": "fleet_lease_lost", "database": name},
            )
            self._let_go(name, give_up=False)
        stale = [n for n in held if n not in databases]
        stale += [n for n, db in self.served.items() if n in databases and db.dsn != databases[n]]
        for name in stale:
            self._let_go(name, give_up=True)
        keep = [n for n in wanted if n in held and n not in stale and n not in self.leaving]
        share = fleet.share(len(wanted), result.members)
        for name in keep[share:]:
            self._let_go(name, give_up=True)
        for name in keep[:share]:
            if name not in self.served:
                self._serve(name, databases[name])

    def _say_reread(self, before: dict[str, str]) -> None:
        """One line for a reading asked for: what the set became, and what changed in it."""
        now = self.listing.databases
        added = sorted(set(now) - set(before))
        removed = sorted(set(before) - set(now))
        changed = sorted(n for n in set(now) & set(before) if now[n] != before[n])
        what = [
            f"{label} {', '.join(names[:SHOWN])}{' ...' if len(names) > SHOWN else ''}"
            for label, names in (("added", added), ("removed", removed), ("changed", changed))
            if names
        ]
        log.info(
            "fleet %s: set read again on request: %d databases (%s)",
            self.fleet.name,
            len(now),
            "; ".join(what) or "unchanged",
            extra={
                "event": "fleet_set_read",
                "added": len(added),
                "removed": len(removed),
                "changed": len(changed),
            },
        )

    def _preferred(self, names: list[str]) -> list[str]:
        """`names` in this process's order of preference: what it serves first (moving a
        database costs a drain), then an order of its own, so the processes of a fleet each
        start from a different place rather than all from the first."""

        def rank(name: str) -> tuple[bool, bytes]:
            mixed = hashlib.blake2b(f"{self.member.name}/{name}".encode(), digest_size=8)
            return name not in self.served, mixed.digest()

        return sorted(names, key=rank)

    def _serve(self, name: str, dsn: str) -> None:
        database = ServedDatabase(
            name,
            dsn,
            self.fleet.farms,
            self.settings,
            lambda: [metrics.DatabaseObserver(name), *self._observers(name)],
            lambda up: metrics.up(name, up),
            lambda rows, age: metrics.backlog(name, rows, age),
        )
        self.served[name] = database
        metrics.served(name)
        database.start()

    def _let_go(self, name: str, *, give_up: bool) -> None:
        """Drain `name` in the background; then, if `give_up`, delete its lease for another
        process to take at once."""
        if name in self.leaving:
            return
        database = self.served.pop(name, None)

        async def drain() -> None:
            try:
                if database is not None:
                    await database.stop()
                    metrics.unserved(name)
                if give_up and self._pool is not None:
                    await statements.release(self._pool, self.member, [name])
            except DatabaseError as exc:
                log.warning(
                    "fleet %s: could not give database %s up (%s); its lease expires instead",
                    self.fleet.name,
                    name,
                    one_line(exc),
                )
            finally:
                self.leaving.pop(name, None)

        self.leaving[name] = asyncio.create_task(drain(), name=f"let go of {name}")

    # -- what the process reports ---------------------------------------------------------

    @property
    def problem(self) -> str | None:
        """A reason only when this process serves nothing it should: every database it serves
        is down (`ALL_DOWN`), or it serves none and the home database cannot be reached."""
        if self.fatal_reason is not None:
            return self.fatal_reason
        if not self.served:
            return f"home database unreachable: {self.home_problem}" if self.home_problem else None
        down = {name: db.unready for name, db in self.served.items() if db.unready is not None}
        if len(down) == len(self.served):
            first = next(iter(sorted(down)))
            return f"{ALL_DOWN} ({first}: {down[first]})"
        return None

    @property
    def warnings(self) -> list[str]:
        """One line per database down or degraded, and per problem of the set or the home
        database; at most MAX_WARNINGS lines, then a count of the rest."""
        lines: list[str] = []
        if self.home_problem is not None and self.served:
            lines.append(
                f"fleet {self.fleet.name}: home database unreachable ({self.home_problem}); "
                f"serving the {len(self.served)} databases held"
            )
        for source, trouble in sorted(self.listing.problems.items()):
            lines.append(f"fleet {self.fleet.name}: databases: {source}: {trouble}")
        if not self.listing.databases and not self.listing.problems:
            lines.append(f"fleet {self.fleet.name}: the set of databases is empty")
        for name, database in sorted(self.served.items()):
            problem = database.problem
            if problem is not None:
                lines.append(f"database {name}: {problem}")
            lines.extend(f"database {name}: {warning}" for warning in database.warnings)
        if len(lines) > MAX_WARNINGS:
            rest = len(lines) - MAX_WARNINGS + 1
            lines = [*lines[: MAX_WARNINGS - 1], f"... and {rest} more"]
        return lines
