"""Per-database metrics of a fleet: what each database of the set got, next to the farm's
totals (the metrics of `outbox_farm.metrics` keep their labels and sum over every database).

    outbox_farm_database_messages_total{database, result}  verdicts, by RESULT_OF
    outbox_farm_database_served{database}  processes serving it
    outbox_farm_database_up{database}      1 when a process serving it runs it, else 0
    outbox_farm_database_backlog{database}  its outbox rows, counted by its holder
    outbox_farm_database_oldest_pending_age_seconds{database}  its oldest due row nobody holds
    outbox_farm_fleet_databases            databases in the set, as last read

Cardinality is what shapes this module. A process exports only the databases it serves:
`served()` makes a database's six series (served, up, and one counter per result), its first
count two more, and `unserved()` removes them from this process. So 1,000 databases shared out
over 10 processes are about 1,000 x 8 series at the scrape, whatever the number of processes; a
process that kept (or made up front) every database it ever saw would, as databases move
between processes, end near 10,000 x 8. The fleet member calls `served` before a database's runtimes
start and `unserved` after they stopped (a runtime's observer still counting into removed
children would count into nothing); `up` of a database this process does not serve is
ignored, so a late report cannot bring a let-go database back.

Under the farm's multiprocess registry, one thing more: prometheus_client cannot take a label
set out of its files (`remove()` only forgets this process's child, and warns, which is
silenced here). The merged scrape drops the pid for these gauges' modes, so the series are
still per database, not per process, but a process's file keeps every database it served
since the farm started (the farm empties the directory at every start; a process that ends
takes its live gauges with it). `unserved` therefore writes the neutral value of each gauge
before it removes it: 0 served (nothing to a sum), 0 up (below any 1 of a max), 0 rows and
age (a database let go for good reads 0; a new holder's next count, newer, wins). The counters
keep their totals, as the files of ended processes do: the farm's totals over its run.

The per-message event (`DatabaseObserver.decided`) tallies plain integers, added to the
counters at most FLUSH_EVERY seconds later and at the runtime's stop: a counter's `inc()` on
the multiprocess registry is a locked write to a shared file (about 1 µs), the cost the
notes of `outbox_farm.observe.prometheus` keep off the data path.
"""

from __future__ import annotations

import asyncio
import warnings
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from ..message import Message
from ..metrics import PREFIX
from ..observe.base import Observer, report_failure
from ..observe.prometheus import FLUSH_EVERY
from ..outcome import Kind, Outcome

if TYPE_CHECKING:
    from prometheus_client import Counter, Gauge

# The `result` label: the verdict's outcome kind, folded into what it means for the row.
# `released` is a row handed back unrun, by a stop (RELEASE) or because its lease ran short
# before it started (EXPIRE): either way it comes again; `dead` is failed for good (TERMINAL:
# moved to the DLQ, or deleted without one). A verdict is counted when decided: one whose
# write fails comes back and is decided (and counted) again.
RESULTS = ("acked", "retried", "dead", "released")
RESULT_OF: dict[Kind, str] = {
    Kind.ACK: "acked",
    Kind.RETRY: "retried",
    Kind.TERMINAL: "dead",
    Kind.RELEASE: "released",
    Kind.EXPIRE: "released",
}
# Read once: an Enum member read off its class, or hashed as a dict key, costs about 0.1 µs,
# and `decided` runs for every message.
_ACK, _RETRY, _TERMINAL = Kind.ACK, Kind.RETRY, Kind.TERMINAL
_RELEASE, _EXPIRE = Kind.RELEASE, Kind.EXPIRE
_ACKED, _RETRIED = RESULTS.index(RESULT_OF[_ACK]), RESULTS.index(RESULT_OF[_RETRY])
_DEAD, _RELEASED = RESULTS.index(RESULT_OF[_TERMINAL]), RESULTS.index(RESULT_OF[_RELEASE])
_REMOVAL_WARNING = "Removal of labels has not been implemented"


@dataclass(frozen=True)
class FleetMetrics:
    messages: Counter
    served: Gauge
    up: Gauge
    databases: Gauge
    backlog: Gauge
    oldest_pending_age: Gauge


@cache
def fleet_metrics() -> FleetMetrics:
    """The fleet's metric families (one set per process, in the default registry), made on
    first use: importing this module does not import prometheus_client, whose storage is
    picked at its import (see `outbox_farm.metrics`)."""
    from prometheus_client import Counter, Gauge

    return FleetMetrics(
        messages=Counter(
            PREFIX + "database_messages",
            "Verdicts on the database's rows, by result: acked, retried, dead (failed for "
            "good), released (handed back unrun); counted by the processes serving it.",
            ["database", "result"],
        ),
        served=Gauge(
            PREFIX + "database_served",
            "Processes serving the database (each exports only the databases it serves).",
            ["database"],
            multiprocess_mode="livesum",
        ),
        # livemax: 1 when a process serving the database runs it. A process that let the
        # database go leaves a 0 in its file (see the module's docstring) that a max ignores
        # and a min would be stuck at; during a hand-over, one process running it is enough.
        up=Gauge(
            PREFIX + "database_up",
            "1 while a process serving the database runs its runtimes, 0 while they cannot "
            "run (database unreachable, restarting) or no process serves it "
            "(outbox_farm_database_served says which).",
            ["database"],
            multiprocess_mode="livemax",
        ),
        # livemostrecent rather than livemax: the newest read wins, so a shrunk set shows at
        # once, and a process whose reads keep failing (its value grows stale) cannot pin it.
        databases=Gauge(
            PREFIX + "fleet_databases",
            "Databases in the fleet's set, as the latest read of a live process found it.",
            multiprocess_mode="livemostrecent",
        ),
        # The database's holder counts them (a fleet's runtimes leave the per-queue backlog
        # gauges alone: every database of a process would write the same queue's child).
        # livemostrecent: after a hand-over, the new holder's count wins over the last one the
        # old holder left in its file.
        backlog=Gauge(
            PREFIX + "database_backlog",
            "Rows in the database's outbox tables (every queue), counted by its holder.",
            ["database"],
            multiprocess_mode="livemostrecent",
        ),
        oldest_pending_age=Gauge(
            PREFIX + "database_oldest_pending_age_seconds",
            "Age of the database's oldest due row nobody holds (every table and queue).",
            ["database"],
            multiprocess_mode="livemostrecent",
        ),
    )


class DatabaseObserver(Observer):
    """Counts the verdicts on one database's rows into
    outbox_farm_database_messages_total{database=`database`}: one per runtime of it (several
    may share a database; their counts add up)."""

    _guarded = frozenset({"decided"})

    def __init__(self, database: str) -> None:
        self.database = database
        family = fleet_metrics().messages
        self._children: tuple[Counter, ...] = tuple(
            family.labels(database, result) for result in RESULTS
        )
        self._counts = [0] * len(RESULTS)  # decided since the last flush, by RESULTS' index
        self._flush_at: asyncio.TimerHandle | None = None
        self._reported: set[tuple[int, str]] = set()

    def __repr__(self) -> str:
        return f"DatabaseObserver({self.database!r})"

    def decided(self, msg: Message, outcome: Outcome) -> None:
        try:
            kind = outcome.kind
            if kind is _ACK:
                self._counts[_ACKED] += 1
            elif kind is _RETRY:
                self._counts[_RETRIED] += 1
            elif kind is _TERMINAL:
                self._counts[_DEAD] += 1
            elif kind is _RELEASE or kind is _EXPIRE:
                self._counts[_RELEASED] += 1
            else:
                return
            if self._flush_at is None:
                self._schedule()
        except Exception:
            report_failure(self, "decided", self._reported)

    def _schedule(self) -> None:
        """A count was tallied: make sure a flush follows within FLUSH_EVERY."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # outside an event loop (a test's direct call): at once
            self.flush()
            return
        self._flush_at = loop.call_later(FLUSH_EVERY, self.flush)

    def flush(self) -> None:
        """Add the tallied counts to their counters. Never raises: it runs from the event
        loop's timer, where an error would only be the loop's log line."""
        if self._flush_at is not None:
            self._flush_at.cancel()
            self._flush_at = None
        counts = self._counts
        try:
            for i, child in enumerate(self._children):
                n = counts[i]
                if n:
                    counts[i] = 0
                    child.inc(n)
        except Exception:
            report_failure(self, "flush", self._reported)

    def stopped(self) -> None:
        self.flush()


@dataclass
class _Served:
    """A database this process serves: its gauges' children, and how many holders serve it
    (several fleet members may share a process, as tests run them)."""

    holders: int
    served: Gauge
    up: Gauge


_serving: dict[str, _Served] = {}  # the databases this process exports


def served(database: str) -> None:
    """This process starts serving `database`: its series appear, served 1, up 0 (until its
    runtimes run) and each result's counter at 0 (a rate() or an alert on a counter that
    never moved would otherwise find no series)."""
    held = _serving.get(database)
    if held is not None:
        held.holders += 1
        return
    m = fleet_metrics()
    held = _serving[database] = _Served(1, m.served.labels(database), m.up.labels(database))
    held.served.set(1)
    held.up.set(0)
    for result in RESULTS:
        m.messages.labels(database, result)


def unserved(database: str) -> None:
    """This process no longer serves `database` (its runtimes stopped): its series go, as the
    module's docstring says. Nothing when it was not served here."""
    held = _serving.get(database)
    if held is None:
        return
    held.holders -= 1
    if held.holders > 0:
        return
    del _serving[database]
    held.served.set(0)
    held.up.set(0)
    m = fleet_metrics()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", _REMOVAL_WARNING, UserWarning)
        m.served.remove(database)
        m.up.remove(database)
        for gauge in (m.backlog, m.oldest_pending_age):
            gauge.labels(database).set(0)
            gauge.remove(database)
        for result in RESULTS:
            m.messages.remove(database, result)


def up(database: str, running: bool) -> None:
    """`database`'s runtimes run (`running`), or cannot (unreachable, restarting); ignored for
    a database this process does not serve."""
    held = _serving.get(database)
    if held is not None:
        held.up.set(1 if running else 0)


def backlog(database: str, rows: int, oldest_pending_age: float) -> None:
    """The holder's latest count of `database`'s outbox rows; ignored once unserved."""
    if database in _serving:
        m = fleet_metrics()
        m.backlog.labels(database).set(rows)
        m.oldest_pending_age.labels(database).set(oldest_pending_age)


def fleet_size(databases: int) -> None:
    """The set of databases as this process last read it holds `databases`."""
    fleet_metrics().databases.set(databases)
