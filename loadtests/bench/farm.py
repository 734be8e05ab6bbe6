"""Farm benchmark: drain throughput of `outbox-farm start --procs N`, and worker memory.

    python -m loadtests.bench.farm --dsn "host=127.0.0.1 user=postgres dbname=postgres"
    python -m loadtests.bench.farm --steady 300        # the 5-minute memory run

For each --procs value: pre-load --rows rows, start the real CLI as a subprocess with a no-op
handler, and time from the first row claimed to the table being empty (process
start-up is not counted). Then, with --steady S, publish at --rate messages/s for S seconds
against --procs 2 and report each worker's resident memory at the start and the end.
Runs in a scratch database that is dropped at the end; loopback only; bounded in time.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import psutil
import psycopg

from loadtests.common import tables
from loadtests.common.harness import note, start_farm, stop_farm
from outbox_farm import Farm

from .common import QUEUE, add_dsn, scratch, server
from .report import print_measures, verdict

# 256 executors a process, as the instruction count's drain (`instructions.CONCURRENCY`): a
# claim takes up to half the queue's capacity, so at 64 each claim and flush carries a quarter
# of the rows, and the database's cost per statement is spread over fewer messages.
APP = """
from outbox_farm import Farm
from loadtests.common.tables import DLQ, OUTBOX
farm = Farm(table=OUTBOX, dlq_table=DLQ)

@farm.handler("bench", concurrency=256)
async def handle(msg):
    pass
"""
TARGET_DRAIN_2 = 60_000.0  # msg/s, --procs 2
ROOT = Path(__file__).resolve().parents[2]


def start_bench_farm(
    dsn: str,
    procs: int,
    appdir: Path,
    log: Path,
    *,
    app: str = "benchapp:farm",
    metrics_bind: str = "",
    env: Mapping[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """`outbox-farm start` as the benchmarks run it: the app in `appdir` (the repository on its
    path: an app may import the harness's tables), warnings only in the log, no /metrics unless
    `metrics_bind`, `env` on top of this process's environment."""
    options = ["--metrics-bind", metrics_bind, "--log-level", "WARNING"]
    path = os.pathsep.join(filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))
    return start_farm(
        app,
        dsn,
        procs,
        cwd=appdir,
        log=log,
        options=options,
        env={**os.environ, "PYTHONPATH": path, **(env or {})},
    )


def stop_bench_farm(proc: subprocess.Popen[bytes]) -> None:
    stop_farm(proc, timeout=40)


PRELOAD_BATCH = 1000


def preload(dsn: str, rows: int, keys: int | None = None, *, published: bool = False) -> None:
    """`rows` due rows; with `keys`, row g gets ordering key g % keys (keys interleaved, so each
    key's rows are spread over the whole table, as many entities' events would be), published
    by `publish_batch` as an app's would be (a publish marks the rows deep in a key's line).
    Without keys, one INSERT of bare rows (no headers), unless `published`: then by the same
    `publish_batch` without keys, rows that differ from the keyed ones by their key alone."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(tables.query("TRUNCATE {outbox}"))
        if keys is None and not published:
            conn.execute(
                tables.query(
                    "INSERT INTO {outbox} (queue, payload) SELECT %s, '\\x7b7d' "
                    "FROM generate_series(1, %s)"
                ),
                [QUEUE, rows],
            )
        else:
            farm = Farm()
            for start in range(0, rows, PRELOAD_BATCH):
                batch = range(start + 1, min(start + PRELOAD_BATCH, rows) + 1)
                farm.publish_batch(
                    conn,
                    [{}] * len(batch),
                    queue=QUEUE,
                    ordering_keys=[f"key-{g % keys}" for g in batch] if keys else None,
                )
        conn.execute(tables.query("VACUUM ANALYZE {outbox}"))


def count(conn: psycopg.Connection) -> int:
    row = conn.execute(tables.query("SELECT count(*) FROM {outbox}")).fetchone()
    return int(row[0]) if row else 0


# The drain's polls must cost the database next to nothing: a count(*) of 50,000 rows takes
# about 4.5 ms, and polled every 20 ms it held a fifth of a core through the drain (about 5 µs
# of the machine's CPU per message), and all of one while the farm started; the floor it is
# compared with polls nothing. Each of these reads a few index entries.
STARTED = tables.query("""
    SELECT EXISTS (SELECT FROM {outbox} WHERE acquired_token IS NOT NULL)
        OR (SELECT min(id) FROM {outbox}) IS DISTINCT FROM %s
""")
# The drain claims in publish order, so the newest row is among the last to go: the walk from
# the top of the primary key meets a live row at once, until the very end, and kills the dead
# entries it passes on the way (each is read once).
# (Not inside EXISTS, which drops the ORDER BY and scans the table.)
ANY_LEFT = tables.query("SELECT id FROM {outbox} ORDER BY id DESC LIMIT 1")


def _started(conn: psycopg.Connection, first: int | None) -> bool:
    """A row is claimed or gone: the farm has begun on the table whose lowest id was `first`."""
    row = conn.execute(STARTED, [first]).fetchone()
    return bool(row and row[0])


def _any_left(conn: psycopg.Connection) -> bool:
    return conn.execute(ANY_LEFT).fetchone() is not None


def _cpu_seconds(processes: list[psutil.Process]) -> float:
    """User + system CPU time the processes used so far (0 for one that is gone)."""
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def _machine_busy() -> float:
    """CPU seconds every core of this machine spent busy (database included)."""
    times = psutil.cpu_times()
    return sum(times) - times.idle - getattr(times, "iowait", 0.0)


def drain_run(
    dsn: str,
    procs: int,
    rows: int,
    appdir: Path,
    on_loaded: Callable[[], None] | None = None,
    *,
    keys: int | None = None,
    published: bool = False,
    app: str = "benchapp:farm",
    env: Mapping[str, str] | None = None,
) -> dict[str, float]:
    """Pre-load (over `keys` ordering keys, if given; `published`: see `preload`), start the
    farm (`app` in `appdir`, with `env`), time the drain, stop it (waits for the arbiter to
    exit).

    `on_loaded` runs after the pre-load, before the farm starts (to take "before" readings).
    Returns rate (msg/s), seconds, rows counted at the start, `polls` (the statements this
    function ran against the bench database), and the CPU time per message of the workers and
    of the whole machine during the drain: on a box whose cores the farm and the database
    saturate, these move far less from run to run than msg/s does, so they are what a
    before/after comparison should read.
    """
    preload(dsn, rows, keys, published=published)
    if on_loaded is not None:
        on_loaded()
    polls = 0
    proc = start_bench_farm(dsn, procs, appdir, appdir / f"drain-{procs}.log", app=app, env=env)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            deadline = time.monotonic() + 300
            polls += 1
            lowest = conn.execute(tables.query("SELECT min(id) FROM {outbox}")).fetchone()
            first = lowest[0] if lowest else None
            while (polls := polls + 1) and not _started(conn, first):
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit(f"farm did not start; see {appdir}/drain-{procs}.log")
                time.sleep(0.005)
            began, left_at_start = time.perf_counter(), count(conn)
            workers = psutil.Process(proc.pid).children()
            cpu_before, busy_before = _cpu_seconds(workers), _machine_busy()
            polls += 1
            while (polls := polls + 1) and _any_left(conn):
                if time.monotonic() > deadline:
                    raise SystemExit(f"drain did not finish: {count(conn)} rows left")
                time.sleep(0.02)
            elapsed = time.perf_counter() - began
            worker_cpu = _cpu_seconds(workers) - cpu_before
            machine_cpu = _machine_busy() - busy_before
    finally:
        stop_bench_farm(proc)
    return {
        "rate": left_at_start / elapsed,
        "seconds": elapsed,
        "rows_at_start": left_at_start,
        "polls": polls,
        "worker_cpu_us_per_message": worker_cpu * 1e6 / left_at_start,
        "machine_cpu_us_per_message": machine_cpu * 1e6 / left_at_start,
    }


def steady(dsn: str, seconds: float, rate: float, appdir: Path) -> dict[str, object]:
    farm = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)
    proc = start_bench_farm(dsn, 2, appdir, appdir / "steady.log")
    halt = threading.Event()

    def produce() -> None:
        with psycopg.connect(dsn) as conn:
            interval, next_at = 1.0 / rate, time.perf_counter()
            while not halt.is_set():
                with conn.transaction():
                    farm.publish_batch(conn, [{"n": i} for i in range(10)], queue=QUEUE)
                next_at += 10 * interval
                time.sleep(max(0.0, next_at - time.perf_counter()))

    try:
        time.sleep(3)
        children = psutil.Process(proc.pid).children()
        start_rss = {c.pid: c.memory_info().rss for c in children}
        producer = threading.Thread(target=produce, daemon=True)
        producer.start()
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            time.sleep(min(10.0, max(end - time.monotonic(), 0)))
            note(f"  steady: {int(end - time.monotonic())} s left")
        end_rss = {c.pid: c.memory_info().rss for c in children if c.is_running()}
        halt.set()
        producer.join()
    finally:
        stop_bench_farm(proc)
    mib = 1024 * 1024
    return {
        "seconds": seconds,
        "rate": rate,
        "rss_start_mib": {str(p): round(v / mib, 1) for p, v in start_rss.items()},
        "rss_end_mib": {str(p): round(v / mib, 1) for p, v in end_rss.items()},
        "growth_pct": {
            str(p): round(100 * (end_rss[p] - start_rss[p]) / start_rss[p], 1)
            for p in end_rss
            if p in start_rss
        },
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.farm", description=__doc__.split("\n\n")[0]
    )
    add_dsn(parser)
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--procs", default="1,2", help="comma-separated --procs values")
    parser.add_argument("--steady", type=float, default=0, help="seconds of steady load (0: skip)")
    parser.add_argument("--rate", type=float, default=2000, help="messages/s during --steady")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args(argv)
    rates: dict[int, float] = {}
    memory: dict[str, object] | None = None
    with (
        server(args.dsn) as admin,
        scratch(admin, Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)) as dsn,
        tempfile.TemporaryDirectory() as folder,
    ):
        appdir = Path(folder)
        (appdir / "benchapp.py").write_text(APP)
        for procs in [int(p) for p in args.procs.split(",")]:
            note(f"draining {args.rows} rows with --procs {procs} ...")
            rates[procs] = drain_run(dsn, procs, args.rows, appdir)["rate"]
        if args.steady:
            memory = steady(dsn, args.steady, args.rate, appdir)
    results: dict[str, object] = {f"drain_procs_{p}_msg_per_s": round(r) for p, r in rates.items()}
    if memory is not None:
        results["steady"] = memory
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print()
    print_measures(
        [
            (
                f"drain_procs_{procs}_msg_per_s",
                f"{round(rate):,}",
                f">= {TARGET_DRAIN_2:,.0f}" if procs == 2 else "-",
                verdict(rate >= TARGET_DRAIN_2 if procs == 2 else None),
            )
            for procs, rate in rates.items()
        ],
        widths=(36, 12, 10),
    )
    if memory is not None:
        print(json.dumps(memory, indent=2), "\n  target: < 100 MiB, growth <= 10%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
