"""Farm-wide limits across hosts: a queue's rate and its most running at once, held by farms on
three hosts against the one database, measured from what the handlers recorded.

The single-host run (`loadtests.bench.limits`) on the bed: `outbox-farm start
loadtests.common.limitsapp:farm` on every farm host, queue `rated` limited to 100/s and queue
`narrow` to 5 running at once, both far deeper than the run drains, for 60 s after a warm-up
counted from the moment every host is ready. Each handler writes when it began and ended to
`limit_runs`, over the network, with `time.time()`: every namespace reads the one kernel's
clock, so the records of different hosts compare. Read back: the rate the handlers saw over the
window beside the limit, and the most runs of `narrow` that ever overlapped (from the first run
to the farms' stop, warm-up included) beside its limit, with the mean over the window (near the
limit when the limit is what held it), and each host's share of both queues (a host that ran
none of a queue shared nothing). It fails when the rate is off by more than 5 %, when the most
running at once ever passed the limit, or when a host ran none of either queue.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import psutil
import psycopg

from loadtests.bench.limits import (
    APP,
    RUNS,
    RUNS_OF,
    WARMUP,
    Measured,
    overlap,
    set_limits,
)
from loadtests.common import tables
from outbox_farm import Farm
from outbox_farm.limits import Limits, Rate

from . import hosts
from .bed import Bed, database, farms, say
from .hosts import FarmHost

RATE = Rate(100, 1.0)  # `rated`'s limit: 100/s
RUNS_BY_PID = "SELECT pid, queue, count(*) FROM limit_runs GROUP BY pid, queue"


@dataclass(frozen=True)
class Plan:
    hosts: int = 3
    procs: int = 2
    seconds: float = 60.0  # the window measured, after WARMUP
    rate: Rate = RATE
    max_running: int = 5  # `narrow`'s limit
    sleep: float = 0.05  # each handler run's length
    tolerance: float = 0.05  # the rate's, either way


FULL = Plan()


@contextlib.contextmanager
def _limits_app() -> Iterator[None]:
    """The farm hosts start the limits app instead of the scale app while inside: `farm_host`
    takes the app from its module, not from its caller."""
    scale_app, hosts.APP = hosts.APP, APP
    try:
        yield
    finally:
        hosts.APP = scale_app


def _pids(run: FarmHost) -> set[int]:
    """The farm's arbiter and its workers, as they are now (a restarted worker has a pid the
    map does not know; its runs are counted as an unknown host's)."""
    with contextlib.suppress(psutil.Error):
        main = psutil.Process(run.proc.pid)
        return {main.pid, *(child.pid for child in main.children(recursive=True))}
    return set()


def _publish(conn: psycopg.Connection[Any], plan: Plan) -> dict[str, int]:
    """Both queues deeper than the run drains, with their limits set first (the farms read
    them when they start)."""
    farm = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)
    span = plan.seconds + WARMUP + 60  # the hosts' boot, one after another, included
    depth = {
        "rated": math.ceil(plan.rate.per_second * span * 1.2),
        "narrow": math.ceil(plan.max_running / plan.sleep * span * 1.5),
    }
    conn.execute(RUNS)
    set_limits(conn, "rated", Limits(rate=plan.rate))
    set_limits(conn, "narrow", Limits(max_running=plan.max_running))
    for queue, rows in depth.items():
        farm.publish_batch(conn, [{"n": n} for n in range(rows)], queue=queue)
    return depth


def _by_host(conn: psycopg.Connection[Any], pids: dict[str, set[int]]) -> dict[str, dict[str, int]]:
    """Runs of each queue by host, from the pids each run recorded."""
    host_of = {pid: role for role, group in pids.items() for pid in group}
    out: dict[str, dict[str, int]] = {role: {"rated": 0, "narrow": 0} for role in pids}
    for pid, queue, n in conn.execute(RUNS_BY_PID).fetchall():
        role = host_of.get(pid, "unknown")
        out.setdefault(role, {"rated": 0, "narrow": 0})[queue] += int(n)
    return out


def analyse(
    plan: Plan,
    rated: Sequence[tuple[float, float | None]],
    narrow: Sequence[tuple[float, float | None]],
    start: float,
    stopped: float,
) -> Measured:
    """As `loadtests.bench.limits.measure` reads its runs: runs of `rated` begun in the
    window [start, start + seconds) per second; the most runs of `narrow` at once over the
    whole run (a run not ended counts until `stopped`), and their mean over the window."""
    end = start + plan.seconds
    seen = sum(1 for began, _ in rated if start <= began < end) / plan.seconds
    most, _ = overlap(list(narrow), stopped, start)
    _, mean = overlap([(b, e) for b, e in narrow if b < end], end, start)
    return Measured(
        plan.hosts * plan.procs,
        plan.seconds,
        str(plan.rate),
        plan.rate.per_second,
        seen,
        seen / plan.rate.per_second - 1,
        plan.max_running,
        most,
        mean,
    )


def run(bed: Bed, plan: Plan = FULL) -> dict[str, Any]:
    with (
        database(bed) as dsn,
        psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn,
    ):
        depth = _publish(conn, plan)
        say(f"limits: published {depth['rated']:,} rows to rated, {depth['narrow']:,} to narrow")
        env = {"LOADTEST_DSN": dsn, "LIMITS_SLEEP": str(plan.sleep)}
        with (
            _limits_app(),
            farms(bed, dsn, plan.hosts, plan.procs, env, name="limits") as runs,
        ):
            ready = time.time()
            pids = {r.host.role: _pids(r) for r in runs}
            say(
                f"limits: {plan.hosts} hosts x --procs {plan.procs} ready; rated {plan.rate}, "
                f"narrow at most {plan.max_running}; measuring {plan.seconds:g}s after "
                f"{WARMUP:g}s"
            )
            start = ready + WARMUP
            time.sleep(max(start + plan.seconds + 0.5 - time.time(), 0))  # the run's length
            stops = {r.host.role: r.stop() for r in runs}
            stopped = time.time()
        rated = conn.execute(RUNS_OF, ["rated"]).fetchall()
        narrow = conn.execute(RUNS_OF, ["narrow"]).fetchall()
        by_host = _by_host(conn, pids)
    found = analyse(plan, rated, narrow, start, stopped)
    return summary(plan, found, by_host, stops)


def summary(
    plan: Plan,
    found: Measured,
    by_host: dict[str, dict[str, int]],
    stops: dict[str, int | None],
) -> dict[str, Any]:
    rate_ok = abs(found.rate_error) <= plan.tolerance
    most_ok = found.most_overlapping <= found.max_running
    shared = all(n["rated"] > 0 and n["narrow"] > 0 for role, n in by_host.items() if role in stops)
    stopped = all(status == 0 for status in stops.values())
    out = {
        "scenario": "limits",
        "ok": rate_ok and most_ok and shared and stopped,
        **asdict(found),  # its `procs` is every host's: the hosts' --procs is set below
        "hosts": plan.hosts,
        "procs": plan.procs,
        "processes": found.procs,
        "sleep": plan.sleep,
        "tolerance": plan.tolerance,
        "rate_ok": rate_ok,
        "most_ok": most_ok,
        "every_host_ran_both": shared,
        "runs_by_host": by_host,
        "stop_status": stops,
    }
    say(
        f"limits: rate {found.rate_seen:.2f}/s ({found.rate_error:+.2%}), most at once "
        f"{found.most_overlapping} of {found.max_running} (mean {found.mean_running:.2f})"
    )
    return out
