"""How exactly a queue's farm-wide limits hold across processes: a rate, and a most running at
once, measured from what the handlers recorded, not from what the farm believes it did.

A scratch database (beside the one named, dropped at the end) gets two deep queues: `rated`,
limited to --rate, and `narrow`, limited to --max-running. Then `outbox-farm start
loadtests.common.limitsapp:farm --procs N` runs them both for --seconds after a warm-up, every
handler recording when it began and ended (`limitsapp`). Printed: the rate the handlers saw
over the window beside the limit (and its error), and the most runs of `narrow` that ever
overlapped beside its limit (with the mean, which says whether the limit was what held it).

    python -m loadtests.bench.limits --dsn "host=127.0.0.1 user=postgres dbname=postgres"
    python -m loadtests.bench.limits --procs 3 --seconds 60 --rate 100/s --max-running 5

Exit status 1 when the rate is off by more than --tolerance (5 % by default) or a run of
`narrow` ever overlapped more than its limit: a limit that does not hold is a failed run.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psycopg

from loadtests.common import tables
from loadtests.common.farmproc import farm_process
from loadtests.common.harness import note
from outbox_farm import Farm
from outbox_farm.db.control import notify_changed
from outbox_farm.limits import Limits, Rate, parse_rate

from .common import add_dsn, scratch, server, time_limit

APP = "loadtests.common.limitsapp:farm"
WARMUP = 3.0  # seconds of the run before the window counted: processes start, buckets settle
RUNS = """
CREATE TABLE limit_runs (
    msg_id bigint NOT NULL, queue text NOT NULL, pid int NOT NULL,
    started float8 NOT NULL, ended float8
)"""
SET_LIMITS = tables.query("""
INSERT INTO outbox_farm_queues (target, queue, rate_count, rate_seconds, max_running)
VALUES (%(target)s, %(queue)s, %(count)s, %(seconds)s, %(most)s)
ON CONFLICT (target, queue) DO UPDATE SET rate_count = excluded.rate_count,
    rate_seconds = excluded.rate_seconds, max_running = excluded.max_running, tokens = NULL""")
RUNS_OF = "SELECT started, ended FROM limit_runs WHERE queue = %s"


@dataclass
class Measured:
    procs: int
    seconds: float
    rate_limit: str
    rate_limit_per_second: float
    rate_seen: float  # runs of `rated` begun per second over the window
    rate_error: float  # rate_seen / limit - 1
    max_running: int
    most_overlapping: int  # the most runs of `narrow` ever running at once
    mean_running: float  # runs of `narrow` running at once, averaged over the window


def set_limits(conn: psycopg.Connection[Any], queue: str, limits: Limits) -> None:
    """As `outbox-farm queue limit` does: the row, and the NOTIFY every farm reloads on."""
    rate = limits.rate
    with conn.transaction():
        args = {
            "target": str(tables.NAMES.outbox),
            "queue": queue,
            "count": rate.count if rate else None,
            "seconds": rate.seconds if rate else None,
            "most": limits.max_running,
        }
        conn.execute(SET_LIMITS, args)
        notify_changed(conn, tables.NAMES, queue)


def overlap(
    runs: list[tuple[float, float | None]], until: float, start: float
) -> tuple[int, float]:
    """The most `runs` (began, ended or None: never ended, so until `until`) running at once,
    and the mean running at once over [start, until]. An end sorts before a start at the same
    instant: what ended then was not running beside what began."""
    events = sorted(
        [(began, 1) for began, _ in runs] + [(ended or until, -1) for _, ended in runs],
        key=lambda event: (event[0], event[1]),
    )
    now, most, area, last = 0, 0, 0.0, start
    for at, step in events:
        if at > start:
            area += now * (min(at, until) - last)
            last = min(at, until)
        now += step
        most = max(most, now)
    return most, area / max(until - start, 1e-9)


def measure(
    admin: str, *, procs: int, seconds: float, rate: Rate, max_running: int, sleep: float
) -> Measured:
    farm = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)
    with scratch(admin, farm) as dsn, tempfile.TemporaryDirectory() as tmp:
        span = seconds + WARMUP + 5
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(RUNS)
            set_limits(conn, "rated", Limits(rate=rate))
            set_limits(conn, "narrow", Limits(max_running=max_running))
            rated = math.ceil(rate.per_second * span * 1.2)
            narrow = math.ceil(max_running / sleep * span * 1.5)
            note(f"publishing {rated:,} rows to rated, {narrow:,} to narrow")
            farm.publish_batch(conn, [{"n": n} for n in range(rated)], queue="rated")
            farm.publish_batch(conn, [{"n": n} for n in range(narrow)], queue="narrow")
        env = {"LIMITS_SLEEP": str(sleep)}
        with farm_process(dsn, procs, Path(tmp), APP, **env) as running:
            running.wait_healthy(60)
            note(f"{procs} processes running; measuring for {seconds:g}s after {WARMUP:g}s")
            time.sleep(WARMUP + seconds + 0.5)  # the run's length, not a wait for an event
            ended = time.time()
            running.stop()
        with psycopg.connect(dsn, autocommit=True) as conn:
            rated_runs = conn.execute(RUNS_OF, ["rated"]).fetchall()
            narrow_runs = conn.execute(RUNS_OF, ["narrow"]).fetchall()
    start = min(began for began, _ in rated_runs) + WARMUP
    window = [began for began, _ in rated_runs if start <= began < start + seconds]
    seen = len(window) / seconds
    most, mean = overlap(narrow_runs, ended, start)
    return Measured(
        procs,
        seconds,
        str(rate),
        rate.per_second,
        seen,
        seen / rate.per_second - 1,
        max_running,
        most,
        mean,
    )


def report(found: Measured, tolerance: float) -> bool:
    """Print the run; whether both limits held."""
    rate_ok = abs(found.rate_error) <= tolerance
    most_ok = found.most_overlapping <= found.max_running
    print(f"farm-wide limits over {found.seconds:g}s, {found.procs} processes")
    print(
        f"  rate {found.rate_limit} ({found.rate_limit_per_second:g}/s): "
        f"{found.rate_seen:.2f}/s seen by the handlers, {found.rate_error:+.2%} "
        f"({'within' if rate_ok else 'OUTSIDE'} ±{tolerance:.0%})"
    )
    print(
        f"  max running {found.max_running}: at most {found.most_overlapping} ran at once "
        f"(mean {found.mean_running:.2f}){'' if most_ok else ' ABOVE THE LIMIT'}"
    )
    return rate_ok and most_ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_dsn(parser)
    parser.add_argument("--procs", type=int, default=3, help="worker processes (default 3)")
    parser.add_argument("--seconds", type=float, default=60.0, help="window measured (60)")
    parser.add_argument("--rate", type=parse_rate, default=parse_rate("100/s"), help="100/s")
    parser.add_argument("--max-running", type=int, default=5, help="narrow's limit (5)")
    parser.add_argument("--sleep", type=float, default=0.05, help="each handler's sleep (0.05)")
    parser.add_argument("--tolerance", type=float, default=0.05, help="rate's (0.05: ±5 %%)")
    parser.add_argument("--json", action="store_true", help="also print the numbers as JSON")
    args = parser.parse_args(argv)
    with server(args.dsn) as admin, time_limit(args.seconds + 300):
        found = measure(
            admin,
            procs=args.procs,
            seconds=args.seconds,
            rate=args.rate,
            max_running=args.max_running,
            sleep=args.sleep,
        )
    ok = report(found, args.tolerance)
    if args.json:
        import json

        print(json.dumps(asdict(found)))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
