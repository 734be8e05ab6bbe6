"""Depth benchmark: a backlog of --rows rows (10 million) published with the farm stopped, then
drained by `outbox-farm start --procs 2`. Does the farm keep its pace, its claim time, its
producers' latency and its table's size at that depth?

    python -m loadtests.bench.depth --dsn "host=127.0.0.1 user=postgres dbname=postgres"
    python -m loadtests.bench.depth --rows 1000000 --json depth.json

In one scratch database (dropped at the end), loopback only, within --budget seconds:

1. the baseline: the table's and each index's size after the migrate; the 100,000-row drain of
   `farm.drain_run` (the same app, --procs 2), the run's own reference rate; `Farm.publish`,
   one message per transaction at --publish-rate, timed for --idle-seconds against the farm
   running idle;
2. the backlog: the server's free disk checked against the rows' estimate, then INSERT ...
   SELECT in chunks of --chunk rows, each its own transaction (the rows of `farm.preload`: one
   due time per statement, as its one statement gives its 100,000), then VACUUM ANALYZE;
3. the drain, the same producer publishing throughout: per --step rows drained, the rate and
   the claim time per row claimed (the farm's /metrics), the dead tuples, size and VACUUMs
   (the server's statistics);
4. the farm's own VACUUM cycle and shrink after the drain, then the sizes beside empty; then
   --reuse-rows more rows published, drained and vacuumed.

A budget or a disk that runs out stops the run where it is, and the report says where.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psycopg

from loadtests.common import tables
from loadtests.common.harness import free_port, note
from loadtests.common.waits import wait_until
from outbox_farm import Farm
from outbox_farm.chores.shrink import SHRINK_AT
from outbox_farm.chores.vacuum import MIN_DEAD_TUPLES
from outbox_farm.prefork.arbiter import GAUGES_INTERVAL
from outbox_farm.queries import Queries

from .common import (
    COUNTERS,
    QUEUE,
    Progress,
    add_dsn,
    add_json_path,
    outbox_stats,
    percentiles,
    raise_errors,
    readings,
    reap,
    scratch,
    server,
    server_info,
    time_limit,
    write_json,
)
from .farm import ANY_LEFT, APP, STARTED, drain_run, start_bench_farm, stop_bench_farm
from .report import Row, fmt, print_code, print_measures, verdict

BASELINE_ROWS = 100_000
TARGET_RATE = 0.9  # depth drain ÷ the 100,000-row drain
TARGET_CLAIM = 1.25  # claim time per row, last step ÷ first
TARGET_SIZE = 1.10  # sizes after the drain and the VACUUM cycle ÷ empty
TARGET_PUBLISH = 2.0  # publish p99 during the drain ÷ idle
# Heap and indexes per bare row as loaded (155 bytes in a 1,000,000-row run), and up to twice
# that for the drain: each claim's UPDATE writes its row again, into new space until a VACUUM
# has freed the old (the heap grew by 16 % in that run, by 90 % in one of 300,000 rows, which
# had no VACUUM for most of its drain). WAL comes on top, up to twice max_wal_size between
# checkpoints, and a GiB is left for everything else on the disk.
BYTES_PER_ROW = 160
DRAIN_GROWTH = 2
RESERVE = 2**30
MIB = 2**20

LOAD = tables.query(
    "INSERT INTO {outbox} (queue, payload) SELECT %s, '\\x7b7d' FROM generate_series(1, %s)"
)
SIZES = """
SELECT %(table)s::text, pg_relation_size(%(table)s::text::regclass)
UNION ALL
(SELECT indexrelid::regclass::text, pg_relation_size(indexrelid)
 FROM pg_index WHERE indrelid = %(table)s::text::regclass ORDER BY 1)
"""
# Since `since` (the server's clock), a VACUUM by anyone has ended and left the dead rows
# below the farm's own threshold: the farm's next pass finds nothing to do.
VACUUMED = """
SELECT coalesce(greatest(last_vacuum, last_autovacuum) > %s, false) AND n_dead_tup < %s
FROM pg_stat_user_tables WHERE relname = %s
"""
FREE_TABLE = "SELECT approx_free_percent, dead_tuple_percent FROM pgstattuple_approx(%s::regclass)"
FREE_INDEX = "SELECT leaf_pages, empty_pages, deleted_pages FROM pgstatindex(%s::regclass)"


class OutOfDisk(Exception):
    """The server's disk will not hold the rows: nothing more is loaded."""


def first_row(
    conn: psycopg.Connection[Any], query: str, params: Sequence[Any] | None = None
) -> tuple[Any, ...]:
    """The row of a statement that always returns one."""
    row = conn.execute(query, params).fetchone()
    if row is None:
        raise RuntimeError(f"no row from {query}")
    return tuple(row)


def database_bytes(conn: psycopg.Connection[Any]) -> int:
    return int(first_row(conn, "SELECT pg_database_size(current_database())")[0])


def sizes(conn: psycopg.Connection[Any]) -> dict[str, int]:
    """The table's main fork and each index, in bytes, the table first."""
    rows = conn.execute(SIZES, {"table": tables.OUTBOX}).fetchall()
    return {str(name): int(size) for name, size in rows}


# -- the producer ----------------------------------------------------------------------------


def publish_loop(dsn: str, rate: float, ready: Any, go: Any, halt: Any, out: Any) -> None:
    """Spawned: connected, `ready`; then `Farm.publish` of one message per transaction at
    `rate` a second from `go` until `halt`, each transaction timed from its start to its
    commit (ms)."""
    farm = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)
    ms: list[float] = []
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            ready.set()
            if not go.wait(timeout=600):
                raise TimeoutError("never told to start")
            interval, start = 1.0 / rate, time.perf_counter()
            while not halt.is_set():
                wait = start + len(ms) * interval - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                    continue
                began = time.perf_counter()
                with conn.transaction():
                    farm.publish(conn, {"n": len(ms)}, queue=QUEUE)
                ms.append((time.perf_counter() - began) * 1000)
        out.put({"ms": ms})
    except Exception as exc:
        out.put({"error": repr(exc), "ms": ms})


class Publisher:
    """The producer of the idle and the drain phases, in a process of its own, so that this
    one's scrapes and polls never delay a publish. Spawned (and connected) on entry; it
    publishes from `start` to `stop`."""

    def __init__(self, dsn: str, rate: float) -> None:
        ctx = mp.get_context("spawn")
        self._ready, self._go, self._halt = ctx.Event(), ctx.Event(), ctx.Event()
        self._out = ctx.Queue()
        self._proc = ctx.Process(
            target=publish_loop,
            args=(dsn, rate, self._ready, self._go, self._halt, self._out),
            daemon=True,
        )

    def __enter__(self) -> Publisher:
        self._proc.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._halt.set()
        self._go.set()
        reap([self._proc])

    def start(self) -> None:
        if not self._ready.wait(timeout=60):
            raise SystemExit("the producer did not connect within 60 s")
        self._go.set()

    def stop(self) -> dict[str, Any]:
        """How many it published, and its transactions' p50 and p99 (ms)."""
        self._halt.set()
        report = self._out.get(timeout=60)
        raise_errors([report], "the producer")
        p50, p99 = percentiles(report["ms"], 50, 99) or (None, None)
        return {"published": len(report["ms"]), "p50_ms": p50, "p99_ms": p99}


# -- the farm under test ---------------------------------------------------------------------


class RunningFarm:
    """`start --procs N` with /metrics on a free loopback port; with `ready`, answering on
    entry (else its counters are zero until it answers: each start has a fresh metrics
    directory)."""

    def __init__(self, dsn: str, procs: int, appdir: Path, name: str, ready: bool) -> None:
        self.url = f"http://127.0.0.1:{free_port()}/metrics"
        self.log = appdir / f"{name}.log"
        self._args = (dsn, procs, appdir, self.log)
        self._ready = ready

    def __enter__(self) -> RunningFarm:
        bind = self.url.removeprefix("http://").removesuffix("/metrics")
        self.proc = start_bench_farm(*self._args, metrics_bind=bind)
        try:
            if self._ready and not wait_until(
                lambda: self.read() is not None, 120, watch=self.proc
            ):
                raise SystemExit(f"the farm did not start; see {self.log}")
        except BaseException:
            stop_bench_farm(self.proc)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        stop_bench_farm(self.proc)

    def read(self) -> dict[str, float] | None:
        return readings(self.url)

    def reading(self) -> dict[str, float]:
        """A scrape that must answer (a few tries): the farm died or hangs otherwise."""
        for _ in range(10):
            found = self.read()
            if found is not None:
                return found
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        raise SystemExit(f"the farm's /metrics stopped answering; see {self.log}")


def server_now(conn: psycopg.Connection[Any]) -> Any:
    return first_row(conn, "SELECT clock_timestamp()")[0]


def vacuum_cycle(conn: psycopg.Connection[Any], since: Any, timeout: float) -> float | None:
    """Seconds until the farm's VACUUM cycle has caught up with what was deleted before `since`
    (autovacuum counts too, if the server runs it), or None if it did not within `timeout`."""
    began = time.monotonic()
    done = wait_until(
        lambda: first_row(conn, VACUUMED, [since, MIN_DEAD_TUPLES, tables.OUTBOX])[0],
        timeout,
        every=1.0,
    )
    return time.monotonic() - began if done else None


# -- the phases ------------------------------------------------------------------------------


def baseline(dsn: str, appdir: Path, args: argparse.Namespace, result: dict[str, Any]) -> None:
    """Sizes when empty, the 100,000-row drain, publish against the idle farm."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        result["sizes"] = {"empty": sizes(conn)}
    result["phase"] = f"the baseline drain of {BASELINE_ROWS:,} rows"
    result["baseline"] = drain_run(dsn, args.procs, BASELINE_ROWS, appdir)
    note(f"  baseline: {result['baseline']['rate']:,.0f} msg/s")
    result["phase"] = "publishing against the idle farm"
    with (
        RunningFarm(dsn, args.procs, appdir, "idle", ready=True),
        Publisher(dsn, args.publish_rate) as pub,
    ):
        pub.start()
        time.sleep(args.idle_seconds)
        result["publish_idle"] = pub.stop()
    note(f"  publish, farm idle: p99 {fmt(result['publish_idle']['p99_ms'], '.2f')} ms")


def disk_room(conn: psycopg.Connection[Any]) -> tuple[Path | None, int]:
    """The server's data directory, if this role may read it and this machine sees it, and
    the WAL the server may keep."""
    wal = int(first_row(conn, "SELECT pg_size_bytes(current_setting('max_wal_size'))")[0])
    try:
        path = Path(first_row(conn, "SHOW data_directory")[0])
    except psycopg.errors.InsufficientPrivilege:
        return None, wal
    return (path if path.exists() else None), wal


def check_disk(path: Path | None, rows: int, per_row: float, wal: int, loaded: int) -> None:
    """OutOfDisk when `rows` more rows of `per_row` bytes, the WAL and the reserve will not fit."""
    if path is None or rows <= 0:
        return
    need = rows * per_row * DRAIN_GROWTH + 2 * wal + RESERVE
    free = shutil.disk_usage(path).free
    if free < need:
        room = max(int((free - 2 * wal - RESERVE) / per_row / DRAIN_GROWTH), 0)
        where = f"out of disk with {loaded:,} rows loaded" if loaded else "refusing to load"
        raise OutOfDisk(
            f"{where}: {rows:,} {'more ' if loaded else ''}rows need about "
            f"{need / 2**30:.1f} GiB ({per_row:.0f} bytes a row, {DRAIN_GROWTH} times that for "
            "the drain, twice max_wal_size and "
            f"{RESERVE / 2**30:.0f} GiB spare) and {path} has {free / 2**30:.1f} GiB free; "
            f"about {room + loaded:,} rows would fit"
        )


def load(dsn: str, args: argparse.Namespace, result: dict[str, Any]) -> None:
    """The backlog, chunk by chunk, with the farm stopped; VACUUM ANALYZE; its sizes."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(tables.query("TRUNCATE {outbox}"))
        path, wal = disk_room(conn)
        before = database_bytes(conn)
        loaded, began = 0, time.monotonic()
        while loaded < args.rows:
            result["phase"] = f"the load, {loaded:,} of {args.rows:,} rows in"
            chunk = min(args.chunk, args.rows - loaded)
            try:
                loaded += conn.execute(LOAD, [QUEUE, chunk]).rowcount
            except psycopg.errors.DiskFull as exc:
                raise OutOfDisk(f"out of disk with {loaded:,} rows loaded: {exc}") from exc
            used = database_bytes(conn)
            seconds = time.monotonic() - began
            note(
                f"  loaded {loaded:,} rows, {loaded / seconds:,.0f} rows/s, "
                f"database {used / MIB:,.0f} MiB"
            )
            check_disk(path, args.rows - loaded, (used - before) / loaded, wal, loaded)
        result["load"] = {"rows": loaded, "seconds": time.monotonic() - began}
        result["phase"] = "VACUUM ANALYZE of the backlog"
        began = time.monotonic()
        conn.execute(tables.query("VACUUM ANALYZE {outbox}"))
        result["load"]["vacuum_analyze_seconds"] = time.monotonic() - began
        result["load"]["database_bytes"] = database_bytes(conn)
        # What the farm's housekeeper will run every GAUGES_INTERVAL through the drain.
        began = time.monotonic()
        conn.execute(Queries(tables.NAMES)["gauges"]).fetchall()
        result["load"]["gauges_seconds"] = time.monotonic() - began
        result["sizes"]["full"] = sizes(conn)


def step_row(
    upto: int, began: tuple[float, dict[str, float]], ended: tuple[float, dict[str, float]]
) -> dict[str, Any]:
    """One step of the drain, between two readings."""
    (t0, r0), (t1, r1) = began, ended
    claimed, claims = r1["claimed"] - r0["claimed"], r1["fetch_count"] - r0["fetch_count"]
    fetch = r1["fetch_sum"] - r0["fetch_sum"]
    return {
        "upto": upto,
        "rows": int(r1["acked"] - r0["acked"]),
        "rate": (r1["acked"] - r0["acked"]) / (t1 - t0),
        "claim_us_per_row": fetch * 1e6 / claimed if claimed else None,
        "rows_per_claim": claimed / claims if claims else None,
        "claim_ms": fetch * 1e3 / claims if claims else None,
        "vacuums": int(r1["vacuum_count"] - r0["vacuum_count"]),
        "vacuum_s": r1["vacuum_sum"] - r0["vacuum_sum"],
    }


def drain(
    conn: psycopg.Connection[Any],
    farm: RunningFarm,
    pub: Publisher,
    first: int,
    args: argparse.Namespace,
    result: dict[str, Any],
) -> Any:
    """Time the backlog's drain (whose lowest id was `first`) from the farm's first claim, as
    `farm.drain_run` does, `pub` publishing meanwhile; per --step rows, a line. Returns the
    server's clock when the table was empty."""
    rows, step = result["load"]["rows"], args.step
    steps: list[dict[str, Any]] = []
    result["steps"] = steps
    if not wait_until(
        lambda: first_row(conn, STARTED, [first])[0], 120, every=0.005, watch=farm.proc
    ):
        raise SystemExit(f"the farm did not begin the drain; see {farm.log}")
    began = (time.perf_counter(), dict.fromkeys(COUNTERS, 0.0))
    pub.start()
    mark, shown = began, began[0]
    next_mark = step if step <= rows - step // 2 else rows
    while True:
        time.sleep(1.0)
        now = (time.perf_counter(), farm.reading())
        done = int(now[1]["acked"])
        result["phase"] = f"the drain, {max(rows - done, 0):,} of {rows:,} rows left"
        if done >= next_mark:
            steps.append(step_row(min(done, rows), mark, now) | outbox_stats(conn))
            next_mark = (done // step + 1) * step
            if next_mark > rows - step // 2:  # a short remainder joins the last step
                next_mark = rows
            s = steps[-1]
            note(
                f"  drained {done:,}: {s['rate']:,.0f} msg/s, claim "
                f"{fmt(s['claim_us_per_row'], '.2f')} µs/row, {s['n_dead_tup']:,} dead, "
                f"{s['size'] / MIB:,.0f} MiB, {s['vacuums']} VACUUMs"
            )
            mark = now
        elif now[0] - shown >= 5:
            note(f"  {result['phase']}")
            shown = now[0]
        if done >= rows:
            break
    result["publish_drain"] = pub.stop()
    # The producer's rows came due after the backlog's: the farm takes them last.
    total = rows + result["publish_drain"]["published"]
    result["phase"] = "the drain's last rows"
    if not wait_until(lambda: farm.reading()["acked"] >= total, 120, every=0.02, watch=farm.proc):
        raise SystemExit(f"the drain did not finish; see {farm.log}")
    elapsed = time.perf_counter() - began[0]
    ended = server_now(conn)
    left = conn.execute(ANY_LEFT).fetchone()
    if left is not None:
        raise SystemExit(f"the farm acked every row, yet row {left[0]} is still there")
    result["drain"] = {"rows": total, "seconds": elapsed, "rate": total / elapsed}
    return ended


def settle(conn: psycopg.Connection[Any], since: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Wait for the farm's VACUUM cycle after `since`; the sizes then."""
    seconds = vacuum_cycle(conn, since, args.vacuum_wait)
    return {"vacuum_wait_s": seconds, "sizes": sizes(conn), "stats": outbox_stats(conn)}


def free_space(conn: psycopg.Connection[Any], names: list[str]) -> dict[str, Any] | None:
    """pgstattuple's view of the freed space: the table's free share (from its visibility and
    free space maps), and each index's empty or deleted leaf pages. None without the
    extension."""
    try:
        conn.execute("CREATE EXTENSION IF NOT EXISTS pgstattuple")
    except psycopg.Error as exc:
        note(f"  pgstattuple unavailable ({exc}): free space not estimated")
        return None
    table, *indexes = names
    free_pct, dead_pct = first_row(conn, FREE_TABLE, [table])
    return {
        "table_free_pct": free_pct,
        "table_dead_pct": dead_pct,
        "indexes": {name: tuple(first_row(conn, FREE_INDEX, [name])) for name in indexes},
    }


def after(
    conn: psycopg.Connection[Any],
    farm: RunningFarm,
    since: Any,
    args: argparse.Namespace,
    result: dict[str, Any],
) -> None:
    """The VACUUM cycle and the shrink after the drain, and the sizes; then the reuse check."""
    result["phase"] = "waiting for the farm's VACUUM cycle and shrink after the drain"
    shrinks = farm.reading()["shrinks"]
    began = time.monotonic()
    # A table below the farm's threshold is not shrunk: it may have been before this began.
    shrunk = wait_until(
        lambda: farm.reading()["shrinks"] > shrinks or sum(sizes(conn).values()) < SHRINK_AT,
        args.vacuum_wait,
        every=1.0,
        watch=farm.proc,
    )
    result["shrink_wait_s"] = time.monotonic() - began if shrunk else None
    result["after"] = settle(conn, since, args)
    result["sizes"]["after"] = result["after"]["sizes"]
    result["free_space"] = free_space(conn, list(result["after"]["sizes"]))
    if not args.reuse_rows:
        return
    result["phase"] = f"the reuse check ({args.reuse_rows:,} more rows)"
    start = farm.reading()["acked"]
    conn.execute(LOAD, [QUEUE, args.reuse_rows])
    if not wait_until(
        lambda: farm.reading()["acked"] - start >= args.reuse_rows, 300, watch=farm.proc
    ):
        raise SystemExit(f"the reuse check's rows were not drained; see {farm.log}")
    reused = settle(conn, server_now(conn), args)
    result["reuse"] = {"rows": args.reuse_rows} | reused
    result["sizes"]["reused"] = reused["sizes"]


def run(admin: str, args: argparse.Namespace, result: dict[str, Any]) -> None:
    progress = Progress(4)
    farm_tables = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)
    with scratch(admin, farm_tables) as dsn, tempfile.TemporaryDirectory() as folder:
        result["server"] = server_info(dsn)
        result["phase"] = "the disk check"
        with psycopg.connect(dsn, autocommit=True) as conn:
            path, wal = disk_room(conn)
        if path is None:
            note("the server's data directory is not in sight here: free disk not checked")
        check_disk(path, args.rows, BYTES_PER_ROW, wal, 0)
        appdir = Path(folder)
        (appdir / "benchapp.py").write_text(APP)
        progress.step("baseline: sizes, 100,000-row drain, publish against the idle farm")
        baseline(dsn, appdir, args, result)
        progress.step(f"loading {args.rows:,} rows with the farm stopped")
        load(dsn, args, result)
        full = result["sizes"]["full"].items()
        note("  full: " + ", ".join(f"{name} {size / MIB:,.0f} MiB" for name, size in full))
        progress.step(f"draining {args.rows:,} rows, --procs {args.procs}")
        result["phase"] = "starting the farm"
        with (
            psycopg.connect(dsn, autocommit=True) as conn,
            Publisher(dsn, args.publish_rate) as pub,
        ):
            first = first_row(conn, tables.query("SELECT min(id) FROM {outbox}"))[0]
            with RunningFarm(dsn, args.procs, appdir, "depth", ready=False) as farm:
                ended = drain(conn, farm, pub, first, args, result)
                note(f"  drained: {result['drain']['rate']:,.0f} msg/s")
                progress.step("after the drain: the farm's VACUUM cycle and shrink, sizes, reuse")
                after(conn, farm, ended, args, result)
        progress.show("done")
        result["phase"] = "done"


# -- the report ------------------------------------------------------------------------------


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def print_steps(steps: list[dict[str, Any]]) -> None:
    header = (
        f"{'drained':>12} {'msg/s':>8} {'claim µs/row':>12} {'claim ms':>8} {'rows/claim':>10} "
        f"{'dead tup':>10} {'table MiB':>9} {'VACUUMs':>7} {'VACUUM s':>8}"
    )
    print(header)
    print("-" * len(header))
    for s in steps:
        print(
            f"{s['upto']:>12,} {s['rate']:>8,.0f} {fmt(s['claim_us_per_row'], '.2f'):>12} "
            f"{fmt(s['claim_ms'], '.2f'):>8} "
            f"{fmt(s['rows_per_claim'], '.0f'):>10} {s['n_dead_tup']:>10,} "
            f"{s['size'] / MIB:>9,.0f} {s['vacuums']:>7} {s['vacuum_s']:>8.1f}"
        )


def print_sizes(result: dict[str, Any]) -> None:
    states = [s for s in ("empty", "full", "after", "reused") if s in result["sizes"]]
    names = list(result["sizes"]["empty"])
    header = (
        f"{'relation (MiB)':<28}" + "".join(f"{s:>10}" for s in states) + f"{'after/empty':>13}"
    )
    print(header)
    print("-" * len(header))
    for name in [*names, "total"]:
        values = [
            sum(result["sizes"][s].values()) if name == "total" else result["sizes"][s][name]
            for s in states
        ]
        r = ratio(values[states.index("after")], values[0]) if "after" in states else None
        print(
            f"{name:<28}" + "".join(f"{v / MIB:>10,.1f}" for v in values) + f"{fmt(r, ',.1f'):>13}"
        )


def why_not_back(result: dict[str, Any]) -> list[str]:
    """Why the sizes after the drain are not back near empty, and whether the space is reused."""
    lines = [
        "not back within 10 %: VACUUM frees the dead rows' space for reuse (the free space map)"
        " and leaves it in the files; the farm's shrink gives back the table's empty tail and"
        " rebuilds its loose indexes (its log says what it did: event=table_shrunk, or"
        " shrink_failed and why)"
    ]
    free = result.get("free_space")
    if free:
        lines.append(f"  pgstattuple: the table is {free['table_free_pct']:.1f} % free space")
        for name, (leaf, empty, deleted) in free["indexes"].items():
            if leaf + deleted > 1:
                lines.append(
                    f"  {name}: {empty + deleted:,} of {leaf + deleted:,} leaf pages reusable"
                )
    reuse = result.get("reuse")
    if reuse:
        then, before = (sum(result["sizes"][s].values()) for s in ("reused", "after"))
        lines.append(
            f"  reuse: {reuse['rows']:,} more rows published, drained and vacuumed: table and "
            f"indexes {(then - before) / MIB:+,.1f} MiB ({(then - before) / before:+.2%})"
        )
    return lines


def measures(result: dict[str, Any]) -> list[Row]:
    def line(measure: str, value: str) -> Row:
        return (measure, value, "-", "")

    def held(measure: str, value: float | None, target: float, at_most: bool = True) -> Row:
        ok = None if value is None else value <= target if at_most else value >= target
        return (measure, fmt(value, ",.2f"), f"{'<=' if at_most else '>='} {target:g}", verdict(ok))

    base, depth = result.get("baseline", {}).get("rate"), result.get("drain", {}).get("rate")
    rows = [
        line(f"drain: {result['rows']:,} rows, --procs {result['procs']}", f"{fmt(depth)} msg/s"),
        line(f"  baseline: {BASELINE_ROWS:,} rows (farm.drain_run)", f"{fmt(base)} msg/s"),
        held("  depth / baseline", ratio(depth, base), TARGET_RATE, at_most=False),
    ]
    claim = [s["claim_us_per_row"] for s in result.get("steps", []) if s["claim_us_per_row"]]
    if claim:
        rows += [
            line("claim time per row: first step / last", f"{claim[0]:.2f} / {claim[-1]:.2f} µs"),
            held("  last / first", claim[-1] / claim[0], TARGET_CLAIM),
            line("  every step: lowest - highest", f"{min(claim):.2f} - {max(claim):.2f} µs"),
        ]
    found = result.get("sizes", {})
    if "after" in found:
        after_, empty = (sum(found[s].values()) for s in ("after", "empty"))
        rows += [
            line("table + indexes after drain + VACUUM cycle", f"{after_ / MIB:,.1f} MiB"),
            line("  empty (after the migrate)", f"{empty / MIB:,.2f} MiB"),
            held("  after / empty", ratio(after_, empty), TARGET_SIZE),
        ]
        if "reused" in found:
            reused = sum(found["reused"].values())
            rows.append(line("  after the reuse check", f"{reused / MIB:,.1f} MiB"))
    idle, during = result.get("publish_idle"), result.get("publish_drain")
    for label, publish in (("farm idle", idle), ("during the drain", during)):
        if publish:
            cuts = f"{fmt(publish['p50_ms'], '.2f')} / {fmt(publish['p99_ms'], '.2f')} ms"
            rows.append(line(f"publish p50 / p99, {label}", cuts))
    if idle and during:
        p99 = ratio(during["p99_ms"], idle["p99_ms"])
        rows.append(held("  p99 during / idle", p99, TARGET_PUBLISH))
    return rows


def print_report(result: dict[str, Any], args: argparse.Namespace) -> None:
    print()
    if info := result.get("server"):
        print(
            f"outbox_farm depth benchmark: PostgreSQL {info['server_version']}, "
            f"synchronous_commit={info['synchronous_commit']}, autovacuum={info['autovacuum']}, "
            f"{info['cpus']} CPUs; {result['seconds']:,.0f} s"
        )
        print_code(info)
    if loaded := result.get("load"):
        print(
            f"load: {loaded['rows']:,} rows in {loaded['seconds']:,.0f} s "
            f"({loaded['rows'] / loaded['seconds']:,.0f} rows/s), VACUUM ANALYZE "
            f"{loaded.get('vacuum_analyze_seconds', 0):,.0f} s"
        )
        if "gauges_seconds" in loaded:
            print(
                f"the backlog gauges' query on the full table: {loaded['gauges_seconds']:.2f} s "
                f"(the farm's housekeeper runs it every {GAUGES_INTERVAL:g} s)"
            )
    if result.get("steps"):
        print(f"\nthe drain, per {args.step:,} rows (dead tuples and table size at the step's end)")
        print_steps(result["steps"])
    if drained := result.get("drain"):
        print(
            f"drained {drained['rows']:,} rows ({result['load']['rows']:,} + the producer's "
            f"{result['publish_drain']['published']:,}) in {drained['seconds']:,.1f} s"
        )
    if "sizes" in result:
        print()
        print_sizes(result)
    if settled := result.get("after"):
        waited = settled["vacuum_wait_s"]
        print(
            f"after: the farm's VACUUM cycle done {waited:,.0f} s after the drain"
            if waited is not None
            else f"after: no VACUUM cycle within {args.vacuum_wait:g} s of the drain"
        )
        shrink = result.get("shrink_wait_s")
        print(
            f"after: the farm's shrink done (or the files below {SHRINK_AT / MIB:g} MiB) "
            f"{shrink:,.0f} s after the drain"
            if shrink is not None
            else f"after: no shrink within {args.vacuum_wait:g} s of the drain"
        )
        after_, empty = (sum(result["sizes"][s].values()) for s in ("after", "empty"))
        if after_ > TARGET_SIZE * empty:
            print("\n".join(why_not_back(result)))
    print()
    print_measures(measures(result), widths=(48, 24, 8))
    if "stopped" in result:
        print(f"\nSTOPPED: {result['stopped']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.depth", description=__doc__.split("\n\n")[0]
    )
    add_dsn(parser)
    parser.add_argument("--rows", type=int, default=10_000_000, help="the backlog")
    parser.add_argument("--procs", type=int, default=2, help="the farm's, both drains")
    parser.add_argument("--chunk", type=int, default=500_000, help="rows per INSERT")
    parser.add_argument(
        "--step", type=int, help="rows per line of the drain (1,000,000; a tenth under 2 million)"
    )
    parser.add_argument("--publish-rate", type=float, default=200, help="producer's msg/s")
    parser.add_argument("--idle-seconds", type=float, default=10, help="publish against idle")
    parser.add_argument(
        "--vacuum-wait", type=float, default=600, help="for the VACUUM cycle and the shrink, s"
    )
    parser.add_argument("--reuse-rows", type=int, default=100_000, help="0: no reuse check")
    parser.add_argument("--budget", type=float, default=3600, help="the whole run, seconds")
    add_json_path(parser)
    args = parser.parse_args(argv)
    if args.step is None:
        args.step = 1_000_000 if args.rows >= 2_000_000 else max(args.rows // 10, 1)
    result: dict[str, Any] = {
        "rows": args.rows,
        "procs": args.procs,
        "step": args.step,
        "phase": "setting up",
    }
    began = time.monotonic()
    try:
        with time_limit(args.budget), server(args.dsn) as admin:
            run(admin, args, result)
    except TimeoutError:
        result["stopped"] = f"the budget of {args.budget:g} s ran out during {result['phase']}"
    except OutOfDisk as exc:
        result["stopped"] = f"{exc} (during {result['phase']})"
    except psycopg.errors.DiskFull as exc:
        result["stopped"] = f"the server ran out of disk during {result['phase']}: {exc}"
    except SystemExit as exc:
        result["stopped"] = f"{exc} (during {result['phase']})"
    result["seconds"] = time.monotonic() - began
    print_report(result, args)
    if args.json:
        write_json(args.json, result)
    return 0 if result["phase"] == "done" else 1


if __name__ == "__main__":
    sys.exit(main())
