"""The test bed every scenario runs on, and what scenarios share: the hosts' network, the
database host's server, a database per scenario, farms on n hosts, the drain, the journals.

`build_bed()` is the one place that builds and removes everything: a stale run's namespaces
first, then (in order) a temporary directory, the network, the server; on the way out the
server stops, the namespaces go (with any process left in them) and the directory is removed,
whatever happened in between.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg

from loadtests.common import tables
from loadtests.common.harness import Metrics, scratch_database
from loadtests.common.ledger import create_schema

from . import dbserver, netns
from .hosts import FarmHost, farm_host

TEMP_PREFIX = "outbox-farm-scale-"
FARM_OCTETS = (11, 12, 13)


def say(line: str) -> None:
    """Progress goes to stderr, stamped: stdout carries only the summary."""
    print(f"scale {time.strftime('%H:%M:%S')} {line}", file=sys.stderr, flush=True)


@dataclass
class Bed:
    net: netns.Network
    server: dbserver.Server
    work: Path

    @property
    def db(self) -> netns.Host:
        return self.net.hosts["db"]

    @property
    def producer(self) -> netns.Host:
        return self.net.hosts["producer"]

    def farm_hosts(self, n: int) -> list[netns.Host]:
        return [self.net.hosts[f"farm{i + 1}"] for i in range(n)]


def _clean_stale_dirs() -> None:
    """Temporary directories of earlier runs whose process is gone (named with its pid)."""
    folders = {Path(tempfile.gettempdir()), Path("/tmp")}
    for path in (p for folder in folders for p in folder.glob(f"{TEMP_PREFIX}*")):
        pid = path.name[len(TEMP_PREFIX) :].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def build_bed(farms: int, keep: bool = False) -> Iterator[Bed]:
    """The network with a database host, a producer host and `farms` farm hosts, and the
    database host's server; removed on the way out (the work folder too, unless `keep`)."""
    netns.preflight()
    stale = netns.clean_stale()
    if stale:
        say(f"removed what a run that died left: {', '.join(stale)}")
    _clean_stale_dirs()
    work = Path(tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-"))
    try:
        roles = [("db", 2), ("producer", 3)]
        roles += [(f"farm{i + 1}", octet) for i, octet in enumerate(FARM_OCTETS[:farms])]
        with netns.network(roles) as net:
            say(
                f"network {net.subnet}: "
                + ", ".join(f"{h.role} {h.address}" for h in net.hosts.values())
            )
            with dbserver.server(net.hosts["db"], work, str(net.subnet)) as server:
                say(f"database host: PostgreSQL from {server.bindir} on {server.admin_dsn}")
                yield Bed(net, server, work)
    finally:
        if keep:
            say(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def _prepare(conn: psycopg.Connection[Any]) -> None:
    create_schema(conn)
    # The farm hosts journal their runs on disk; loaded here after the drain, with the host.
    conn.execute(
        "ALTER TABLE loadtest_ledger ADD COLUMN host text, ADD COLUMN started float8, "
        "ADD COLUMN ended float8"
    )


@contextlib.contextmanager
def database(bed: Bed) -> Iterator[str]:
    """A scratch database on the bed's server, migrated, with the load test's tables."""
    with scratch_database(
        bed.server.admin_dsn, tables.NAMES, prefix="outbox_farm_scale_", prepare=_prepare
    ) as dsn:
        yield dsn


def via(dsn: str, port: int) -> str:
    """`dsn` on another port of the same host (the delaying proxy)."""
    return psycopg.conninfo.make_conninfo(dsn, port=str(port))


@contextlib.contextmanager
def farms(
    bed: Bed,
    dsn: str,
    n: int,
    procs: int,
    env: Mapping[str, str],
    *,
    name: str,
    options: Sequence[str] = (),
) -> Iterator[list[FarmHost]]:
    """`outbox-farm start` on the first `n` farm hosts, all ready; killed on the way out if
    still running. Each host's log and metrics directory are named after `name`."""
    work = bed.work / name
    work.mkdir(exist_ok=True)
    with contextlib.ExitStack() as stack:
        runs = [
            stack.enter_context(farm_host(host, dsn, procs, work, env=env, options=options))
            for host in bed.farm_hosts(n)
        ]
        yield runs


def merged(scrapes: Sequence[Metrics | None]) -> Metrics:
    return Metrics(s for scrape in scrapes if scrape is not None for s in scrape.samples)


def outbox_rows(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute(tables.query("SELECT count(*) FROM {outbox}")).fetchone()
    return int(row[0]) if row else -1


BACKLOG = tables.query(
    "SELECT count(*) FILTER (WHERE acquired_token IS NULL), count(*) FROM {outbox}"
)
EMPTY = tables.query("SELECT id FROM {outbox} ORDER BY id LIMIT 1")


def backlog_state(conn: psycopg.Connection[Any]) -> tuple[int, int]:
    """(rows no one holds, all rows) of the outbox: the first falls when a claim takes rows,
    the second when acks delete them."""
    row = conn.execute(BACKLOG).fetchone()
    return (int(row[0]), int(row[1])) if row else (-1, -1)


def _empty(conn: psycopg.Connection[Any]) -> bool:
    """Whether the outbox is empty, cheaply enough to ask ten times a second during a drain:
    the primary key's lowest entry (its dead entries are marked so on the first pass, and
    skipped after), not a count of every page."""
    return conn.execute(EMPTY).fetchone() is None


def timed_drain(
    conn: psycopg.Connection[Any],
    rows: int,
    due: float,
    window: float,
    at_start: Callable[[], None] = lambda: None,
    every: float = 0.1,
) -> tuple[float, int]:
    """Time a backlog of `rows` due at epoch `due`: from the first poll that finds a row
    claimed to the one that finds the table empty, or `window` s if that comes first; (seconds,
    rows handled meanwhile). `at_start` runs when the clock starts (to sample CPU counters).
    The harness's own polls are in what the database spent: a few milliseconds each."""
    start: float | None = None
    deadline = due + window + 60
    while time.time() < deadline:
        if start is None:
            if backlog_state(conn)[0] < rows:
                start = time.time()
                at_start()
        elif _empty(conn):
            return time.time() - start, rows
        elif time.time() - start >= window:
            seconds = time.time() - start
            return seconds, rows - backlog_state(conn)[1]
        time.sleep(every)
    return 0.0, 0


def scraped(runs: Sequence[FarmHost]) -> Callable[[], Metrics | None]:
    """Every host's /metrics as one scrape, for the drain; None while a host does not answer
    (one that does not answer is not drained)."""

    def scrape() -> Metrics | None:
        scrapes = [run.scrape() for run in runs]
        return None if None in scrapes else merged(scrapes)

    return scrape


# -- journals: the handler runs of every host ------------------------------------------------


@dataclass
class Run:
    msg_id: str
    started: float
    ended: float
    pid: int
    host: str


def read_journals(folder: Path) -> list[Run]:
    runs = []
    for path in sorted(folder.glob("*.tsv")):
        for line in path.read_text(encoding="utf-8").splitlines():
            parts = line.split("\t")
            if len(parts) == 5:  # a line cut short by a kill is not a finished run
                runs.append(
                    Run(parts[0], float(parts[1]), float(parts[2]), int(parts[3]), parts[4])
                )
    return runs


def load_ledger(conn: psycopg.Connection[Any], runs: Sequence[Run]) -> None:
    """The journals as `loadtest_ledger` rows, so the load test's checker reads them."""
    columns = "msg_id, queue, outcome, pid, at, run_id, host, started, ended"
    with conn.cursor() as cur, cur.copy(f"COPY loadtest_ledger ({columns}) FROM STDIN") as copy:
        for run in runs:
            at = datetime.fromtimestamp(run.ended, UTC)
            row = (
                run.msg_id,
                "work",
                "success",
                run.pid,
                at,
                str(uuid.uuid4()),
                run.host,
                run.started,
                run.ended,
            )
            copy.write_row(row)


def read_commits(path: Path) -> dict[str, float]:
    commits = {}
    if path.exists():
        for line in path.read_text(encoding="utf-8").splitlines():
            msg_id, _, at = line.partition("\t")
            commits[msg_id] = float(at)
    return commits


def lags(commits: Mapping[str, float], runs: Sequence[Run]) -> list[float]:
    """Seconds from each message's commit (producer host) to its first handler start (farm
    host): both `time.time()` of the one kernel every namespace shares."""
    first: dict[str, float] = {}
    for run in runs:
        if run.msg_id in commits and run.started < first.get(run.msg_id, float("inf")):
            first[run.msg_id] = run.started
    return [first[m] - commits[m] for m in first]


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=1000, method="inclusive")[int(q * 10) - 1]


def by_host(runs: Sequence[Run]) -> dict[str, list[Run]]:
    out: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        out[run.host].append(run)
    return out


def machine_busy() -> float:
    """Seconds every core of the machine was busy (not idle or iowait), from /proc/stat."""
    fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    ticks = [int(f) for f in fields]
    idle = ticks[3] + ticks[4]
    return (sum(ticks[:8]) - idle) / dbserver.TICKS
