"""What every benchmark does the same way: pick the server and make the scratch database,
bound the run in time, reap its producer processes, describe the server and the code, read
the server's transaction count, cut percentiles, write JSON, and parse the shared flags.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import psycopg
import uvloop

from loadtests.common import tables
from loadtests.common.harness import Metrics, admin_server, note, scratch_database
from outbox_farm import Farm

QUEUE = "bench"


# -- the run ---------------------------------------------------------------------------------


def server(given: str | None) -> AbstractContextManager[str]:
    """The admin DSN: --dsn, else $OUTBOX_FARM_DSN, else an embedded Postgres."""
    return admin_server(given, (os.environ.get("OUTBOX_FARM_DSN"),))


def scratch(admin: str, farm: Farm) -> AbstractContextManager[str]:
    """A migrated database of `farm`'s tables beside `admin`'s, dropped at the end."""
    return scratch_database(admin, farm.names, prefix="outbox_farm_bench_")


@contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """A TimeoutError wherever the run is after `seconds`: whatever hangs, the run still ends,
    and its farm and scratch database are still cleaned up on the way out."""

    def expired(signum: int, frame: Any) -> None:
        raise TimeoutError(f"time limit of {seconds:g}s reached")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(max(int(seconds), 1))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


class Progress:
    """A plain-text progress bar on stderr, one line per step: `[###.......] 30% label`."""

    def __init__(self, total: float) -> None:
        self.total, self.done = max(total, 1e-9), 0.0

    def step(self, label: str, weight: float = 1.0) -> None:
        self.show(label)
        self.done += weight

    def show(self, label: str) -> None:
        frac = min(self.done / self.total, 1.0)
        bar = "#" * round(frac * 10)
        note(f"[{bar:.<10}] {frac:4.0%} {label}")


def reap(procs: Iterable[BaseProcess]) -> None:
    """Join spawned producers; terminate any still running, so none outlives the run."""
    for proc in procs:
        proc.join(timeout=10)
        if proc.is_alive():
            proc.terminate()
            proc.join(timeout=5)


def raise_errors(reports: Iterable[dict[str, Any]], who: str) -> None:
    """Spawned producers report their exception instead of a result: fail the run with it."""
    errors = [r["error"] for r in reports if "error" in r]
    if errors:
        raise RuntimeError(f"{who} failed: {errors}")


def percentiles(values: Sequence[float], *points: int) -> tuple[float, ...] | None:
    """The `points` percentiles of `values` (None below two values), cut the one way every
    report here uses: `statistics.quantiles`, inclusive method."""
    if len(values) < 2:
        return None
    cuts = statistics.quantiles(values, n=100, method="inclusive")
    return tuple(cuts[p - 1] for p in points)


# -- what was measured -----------------------------------------------------------------------

# The settings that move the numbers. Read from pg_settings, not SHOW: the naptime in seconds.
SETTINGS = (
    "server_version",
    "synchronous_commit",
    "fsync",
    "wal_sync_method",
    "max_connections",
    "autovacuum",
    "autovacuum_naptime",
    "track_counts",
)


def server_info(dsn: str) -> dict[str, Any]:
    """The server's settings, this machine and the code measured: a number means little
    without them, and a before/after comparison needs them equal."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT name, setting FROM pg_settings WHERE name = ANY(%s)", [list(SETTINGS)]
        ).fetchall()
    return {
        **dict(rows),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "uvloop": uvloop.__version__,
        "code": code_version(),
    }


def code_version() -> dict[str, Any]:
    """The outbox_farm code measured: git commit, and whether the package had local edits."""
    import outbox_farm

    root = Path(outbox_farm.__file__).resolve().parent.parent

    def git(*args: str) -> str:
        done = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10
        )
        return done.stdout.strip() if done.returncode == 0 else ""

    commit = git("rev-parse", "--short", "HEAD")
    if not commit:
        return {"commit": None, "dirty": None}
    return {"commit": commit, "dirty": bool(git("status", "--porcelain", "--", "outbox_farm"))}


XACTS = "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s"
CLIENTS = (
    "SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
    "AND backend_type = 'client backend' AND pid <> pg_backend_pid() "
    "AND application_name IS DISTINCT FROM %s"
)


def settled_xacts(
    admin: psycopg.Connection[Any], dbname: str, ignore_app: str | None = None
) -> int:
    """pg_stat_database's transaction count of `dbname` once no client (but one named
    `ignore_app`) is connected to it and the count stopped moving.

    Backends report their counts at most once a second while connected, and for certain when
    they exit: read too early, a count misses the last statements of the run.
    """
    deadline = time.monotonic() + 15.0
    while admin.execute(CLIENTS, [dbname, ignore_app]).fetchone()[0]:
        if time.monotonic() > deadline:
            break
        time.sleep(0.05)
    admin.execute("SELECT pg_stat_force_next_flush()")  # PG15+: our own counts, if any
    time.sleep(0.1)
    previous, deadline = -1, time.monotonic() + 5.0
    while time.monotonic() < deadline:
        admin.execute("SELECT pg_stat_clear_snapshot()")
        value = int(admin.execute(XACTS, [dbname]).fetchone()[0])
        if value == previous:
            break
        previous = value
        time.sleep(0.2)
    return previous


# n_tup_upd + n_tup_del: dead row versions made (each UPDATE and DELETE leaves one), which a
# VACUUM during the run does not reset the way it resets n_dead_tup.
OUTBOX_STATS = (
    "SELECT n_tup_upd + n_tup_del, n_dead_tup, pg_table_size(relid), vacuum_count, "
    "autovacuum_count FROM pg_stat_user_tables WHERE relname = %s"
)


def outbox_stats(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """The outbox table's churn as the server counts it: dead row versions made and left,
    its size in bytes, and the VACUUMs by the farm and by autovacuum so far."""
    row = conn.execute(OUTBOX_STATS, [tables.OUTBOX]).fetchone()
    keys = ("dead_made", "n_dead_tup", "size", "vacuum_count", "autovacuum_count")
    return dict(zip(keys, (int(v) for v in row), strict=True))


# -- output and flags ------------------------------------------------------------------------


def write_json(destination: str, doc: dict[str, Any]) -> None:
    """`doc` to stdout ("-") or to a file."""
    text = json.dumps(doc, indent=2, default=str)
    if destination == "-":
        print(text)
    else:
        with open(destination, "w", encoding="utf-8") as out:
            out.write(text + "\n")
        print(f"JSON written to {destination}")


def add_dsn(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dsn", help="admin DSN (default: $OUTBOX_FARM_DSN, else an embedded Postgres)"
    )


def _rates(text: str) -> list[float]:
    return [float(rate) for rate in text.split(",")]


def turns_parser(prog: str, doc: str | None) -> argparse.ArgumentParser:
    """The command line of a latency benchmark whose contenders take turns at each offered
    rate (`args.rates` is a list of msg/s); the module's docstring's first paragraph is its
    description."""
    parser = argparse.ArgumentParser(prog=prog, description=(doc or "").split("\n\n")[0])
    add_dsn(parser)
    parser.add_argument("--rates", type=_rates, default="200,2000", help="comma-separated msg/s")
    parser.add_argument("--runs", type=int, default=5, help="runs per rate, the order rotated")
    parser.add_argument(
        "--seconds", type=float, default=8.0, help="of messages per run (at least 1,000)"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    return parser


def add_json_path(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="also write the results as JSON (to stdout when no PATH)",
    )


def add_limits(
    parser: argparse.ArgumentParser,
    phase_timeout: float,
    time_limit: float,
    time_limit_help: str = "hard limit for the whole run, in seconds",
) -> None:
    parser.add_argument(
        "--phase-timeout",
        type=float,
        default=phase_timeout,
        help="seconds after which a phase stops and reports what it did by then",
    )
    parser.add_argument("--time-limit", type=float, default=time_limit, help=time_limit_help)


# -- the farm's own counters ---------------------------------------------------------------

COUNTERS = ("acked", "claimed", "fetch_sum", "fetch_count", "vacuum_sum", "vacuum_count")


def readings(url: str) -> dict[str, float] | None:
    """The farm's counters the depth and sustained reports read (acks, claims, claim time,
    VACUUM time, shrinks), or None while its /metrics does not answer."""
    metrics = Metrics.scrape(url)
    if metrics is None:
        return None
    return {
        "acked": metrics.total("outbox_farm_acked_total", queue=QUEUE),
        "claimed": metrics.total("outbox_farm_claimed_total", queue=QUEUE),
        "fetch_sum": metrics.total("outbox_farm_fetch_seconds_sum", queue=QUEUE),
        "fetch_count": metrics.total("outbox_farm_fetch_seconds_count", queue=QUEUE),
        "vacuum_sum": metrics.total("outbox_farm_vacuum_seconds_sum"),
        "vacuum_count": metrics.total("outbox_farm_vacuum_seconds_count"),
        "shrinks": metrics.total("outbox_farm_shrinks_total"),
    }
