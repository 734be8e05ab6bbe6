#!/usr/bin/env python
"""The standard outbox_farm performance report (producer, drain, latency, database cost).

    python loadtests/bench.py --dsn "host=127.0.0.1 user=postgres dbname=postgres"
    python loadtests/bench.py --dsn ... --json            # the same as JSON on stdout
    python loadtests/bench.py --dsn ... --sustained 120   # steady load, per-window report

Reuses bench_producer.py (publish phases), bench_farm.py (the `outbox-farm start` drain) and
bench_runtime.py (commit->handler latency). Everything runs in a scratch database
`outbox_farm_bench_<random>` dropped WITH (FORCE) at the end; loopback only; every wait is
bounded, and the whole run by --time-limit. Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import signal
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # sibling scripts, not a package

import bench_farm
import bench_producer
import bench_runtime
import psycopg
import uvloop

from outbox_farm import Farm
from outbox_farm.metrics import metrics

TARGET_DRAIN_2 = 20_000.0
TARGET_STATEMENTS = 0.05
TARGET_P99_MS = 10.0
TARGET_ONE_PER_TXN = bench_producer.TARGET_ONE_PER_TXN
TARGET_BATCH = bench_producer.TARGET_BATCH
QUEUE = "bench"

SUSTAINED_APP = """
import os, time
from outbox_farm import Farm
farm = Farm(dlq_table="outbox_dlq")
_out = open(os.path.join(os.environ["BENCH_LAT_DIR"], f"lat-{os.getpid()}.csv"), "a",
            buffering=1)

@farm.handler("bench", concurrency=64)
async def handle(msg):
    now = time.time()
    body = msg.body
    if b'"t":' in body:  # a sampled message: it carries its publish time
        _out.write(f"{now},{msg.json()['t']}\\n")
"""


# -- progress -------------------------------------------------------------------------------


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
        print(f"[{bar:.<10}] {frac:4.0%} {label}", file=sys.stderr, flush=True)


# -- database readings ----------------------------------------------------------------------

XACTS = "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s"
CLIENTS = (
    "SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
    "AND backend_type = 'client backend' AND pid <> pg_backend_pid()"
)
# n_tup_upd + n_tup_del: dead row versions made (each UPDATE and DELETE leaves one), which a
# VACUUM during the run does not reset the way it resets n_dead_tup.
DEAD = (
    "SELECT n_tup_upd + n_tup_del, n_dead_tup, vacuum_count, autovacuum_count "
    "FROM pg_stat_user_tables WHERE relname = 'outbox'"
)


def wait_no_clients(admin: psycopg.Connection[Any], dbname: str, timeout: float = 15.0) -> None:
    """Backends flush their statistics at exit: wait until none is left in `dbname`."""
    deadline = time.monotonic() + timeout
    while admin.execute(CLIENTS, [dbname]).fetchone()[0] and time.monotonic() < deadline:
        time.sleep(0.05)
    admin.execute("SELECT pg_stat_force_next_flush()")  # PG15+: our own counts, if any
    time.sleep(0.1)


def settled_xacts(admin: psycopg.Connection[Any], dbname: str) -> int:
    """pg_stat_database's transaction count for dbname once no client is connected to it."""
    wait_no_clients(admin, dbname)
    previous, deadline = -1, time.monotonic() + 5.0
    while time.monotonic() < deadline:
        admin.execute("SELECT pg_stat_clear_snapshot()")
        value = int(admin.execute(XACTS, [dbname]).fetchone()[0])
        if value == previous:
            break
        previous = value
        time.sleep(0.2)
    return previous


def server_extra(dsn: str) -> dict[str, str]:
    """Settings that decide the dead-tuple story: is autovacuum on at all, how often."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT name, setting FROM pg_settings WHERE name IN "
            "('autovacuum', 'autovacuum_naptime', 'track_counts', 'max_connections')"
        ).fetchall()
    return dict(rows)


def table_stats(dsn: str) -> dict[str, int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(DEAD).fetchone()
    keys = ("dead_made", "n_dead_tup", "vacuum_count", "autovacuum_count")
    return dict(zip(keys, (int(v) for v in row), strict=True))


# -- standard report ------------------------------------------------------------------------


def producer_section(dsn: str, farm: Farm, n: int, budget: float, progress: Progress) -> list:
    p = bench_producer
    progress.step("producer raw-SQL baseline (1 msg/txn)")
    raw = p.single_phase(
        dsn, farm, "raw_one", n, budget, "raw_one", "raw INSERT+pg_notify, 1 msg/txn", None
    )
    progress.step("producer publish, 1 producer")
    one = p.single_phase(
        dsn, farm, "publish", n, budget, "a_publish", "publish 1 msg/txn, 1 producer", None
    )
    progress.step("producer publish, 8 producers")
    eight = p.concurrent_phase(
        dsn, farm, n, 8, budget, "b_publish_concurrent", "publish 1 msg/txn, 8 producers"
    )
    progress.step("producer publish_batch of 100")
    batch = p.batch_phase(dsn, farm, n * 2, 100, budget)
    for phase in (one, eight):
        phase.extra["raw_baseline_msg_s"] = round(raw.rate, 1)
    return [raw, one, eight, batch]


def drain_section(
    admin_dsn: str, dsn: str, dbname: str, procs: int, rows: int, appdir: Path
) -> dict[str, Any]:
    before: dict[str, Any] = {}
    with psycopg.connect(admin_dsn, autocommit=True) as admin:

        def readings() -> None:
            before["stats"] = table_stats(dsn)  # first: its transaction is inside "before"
            before["xacts"] = settled_xacts(admin, dbname)
            before["lsn"] = admin.execute("SELECT pg_current_wal_lsn()").fetchone()[0]

        run = bench_farm.drain_run(dsn, procs, rows, appdir, on_loaded=readings)
        # drain_run returns after the arbiter exited; its workers have closed their sessions.
        wal = admin.execute(
            "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)", [before["lsn"]]
        ).fetchone()[0]
        xacts = settled_xacts(admin, dbname) - before["xacts"]
        stats = table_stats(dsn)  # after the count: its own transaction is not in it
    statements = xacts - run["polls"]
    drained = run["rows_at_start"]
    made = stats["dead_made"] - before["stats"]["dead_made"]
    return {
        "procs": procs,
        "rows": rows,
        "rate_msg_s": run["rate"],
        "seconds": run["seconds"],
        "worker_cpu_us_per_message": round(run["worker_cpu_us_per_message"], 1),
        "machine_cpu_us_per_message": round(run["machine_cpu_us_per_message"], 1),
        "statements": statements,
        "statements_per_message": statements / rows,
        "wal_bytes": int(wal),
        "wal_bytes_per_message": float(wal) / rows,
        "dead_tuples_made": made,
        "dead_tuples_per_message": made / rows,
        "dead_tuples_left": stats["n_dead_tup"],
        "farm_vacuums": stats["vacuum_count"] - before["stats"]["vacuum_count"],
        "autovacuums": stats["autovacuum_count"] - before["stats"]["autovacuum_count"],
        "rows_counted_at_start": drained,
    }


def standard(args: argparse.Namespace, admin_dsn: str) -> dict[str, Any]:
    farm = Farm(dlq_table="outbox_dlq")
    progress = Progress(4 + 2 * 3 + 2)
    metrics()  # Prometheus objects once, before the in-process runtime
    result: dict[str, Any] = {}
    with bench_producer.scratch_database(admin_dsn, farm) as dsn:
        dbname = str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])
        result["server"] = bench_producer.server_info(dsn) | server_extra(dsn)
        phases = producer_section(dsn, farm, args.messages, args.phase_timeout, progress)
        result["producer"] = [
            {
                "name": ph.name,
                "label": ph.label,
                "messages": ph.messages,
                "seconds": round(ph.seconds, 3),
                "rate": round(ph.rate, 1),
                "unit": ph.unit,
                "p50_ms": ph.p50_ms,
                "p99_ms": ph.p99_ms,
                "verified": ph.verified,
                "truncated": ph.truncated,
                "extra": ph.extra,
            }
            for ph in phases
        ]
        bench_producer.reset_table(dsn, farm)
        result["drain"] = []
        with tempfile.TemporaryDirectory() as folder:
            appdir = Path(folder)
            (appdir / "benchapp.py").write_text(bench_farm.APP)
            for procs in (1, 2):
                progress.step(f"drain procs {procs}", 3)
                result["drain"].append(
                    drain_section(admin_dsn, dsn, dbname, procs, args.rows, appdir)
                )
        progress.step(f"latency at {args.latency_rate:g} msg/s", 2)
        lat = uvloop.run(
            bench_runtime.latency(
                dsn, args.latency_messages, args.latency_rate, 64, args.phase_timeout
            )
        )
        result["latency"] = {
            "messages": lat.messages,
            "rate": lat.rate,
            "received": lat.received,
            "completed": lat.completed,
            "p50_ms": lat.p50_ms,
            "p95_ms": lat.p95_ms,
            "p99_ms": lat.p99_ms,
            "max_ms": lat.max_ms,
            "runner": "in-process runtime (farm.running), spawned producer process",
        }
        progress.show("done")
    return result


def verdict(ok: bool | None) -> str:
    return {None: "", True: "yes", False: "NO"}[ok]


def standard_rows(r: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    rows: list[tuple[str, str, str, str]] = []
    prod = {p["name"]: p for p in r["producer"]}
    raw = prod["raw_one"]["rate"]
    rows.append(("producer: raw SQL baseline, 1 msg/txn", f"{raw:,.0f} msg/s", "-", ""))
    for key in ("a_publish", "b_publish_concurrent"):
        p = prod[key]
        rows.append(
            (
                f"producer: {p['label']} (raw {raw:,.0f})",
                f"{p['rate']:,.0f} msg/s",
                f">= {TARGET_ONE_PER_TXN:,.0f}",
                verdict(p["rate"] >= TARGET_ONE_PER_TXN),
            )
        )
    b = prod["c_publish_batch"]
    rows.append(
        (
            "producer: publish_batch of 100, 1 producer",
            f"{b['rate']:,.0f} rows/s",
            f">= {TARGET_BATCH:,.0f}",
            verdict(b["rate"] >= TARGET_BATCH),
        )
    )
    for d in r["drain"]:
        target = TARGET_DRAIN_2 if d["procs"] == 2 else None
        rows.append(
            (
                f"drain: start --procs {d['procs']}, {d['rows']:,} rows, no-op",
                f"{d['rate_msg_s']:,.0f} msg/s",
                f">= {target:,.0f}" if target else "-",
                verdict(None if target is None else d["rate_msg_s"] >= target),
            )
        )
        rows.append(
            (
                "  CPU µs / message: workers / whole machine (database included)",
                f"{d['worker_cpu_us_per_message']:.1f} / {d['machine_cpu_us_per_message']:.1f}",
                "-",
                "",
            )
        )
        rows.append(
            (
                "  statements / message",
                f"{d['statements_per_message']:.4f}",
                f"<= {TARGET_STATEMENTS}",
                verdict(d["statements_per_message"] <= TARGET_STATEMENTS),
            )
        )
        rows.append(("  WAL bytes / message", f"{d['wal_bytes_per_message']:,.0f}", "-", ""))
        rows.append(
            (
                "  dead tuples made / message (updates + deletes)",
                f"{d['dead_tuples_per_message']:.3f}",
                "-",
                "",
            )
        )
        rows.append(
            (
                "  dead tuples left / VACUUMs by farm / autovacuums",
                f"{d['dead_tuples_left']:,} / {d['farm_vacuums']} / {d['autovacuums']}",
                "-",
                "",
            )
        )
    lat = r["latency"]
    tag = f"latency commit->handler at {lat['rate']:g} msg/s"
    rows.append((f"{tag} p50 ms", f"{lat['p50_ms']:.2f}", "-", ""))
    rows.append(("  p95 ms", f"{lat['p95_ms']:.2f}", "-", ""))
    rows.append(
        (
            "  p99 ms",
            f"{lat['p99_ms']:.2f}",
            f"<= {TARGET_P99_MS:g}",
            verdict(lat["completed"] and lat["p99_ms"] <= TARGET_P99_MS),
        )
    )
    return rows


def print_table(rows: list[tuple[str, str, str, str]], title: str) -> None:
    print(title)
    header = f"{'measure':<56} {'value':>16} {'target':>10}  ok"
    print(header)
    print("-" * len(header))
    for measure, value, target, ok in rows:
        print(f"{measure:<56} {value:>16} {target:>10}  {ok}")


KEPT_UP_P99_MS = 1000


# -- sustained ------------------------------------------------------------------------------


def sustained_producer(
    dsn: str, rate: float, batch: int, seconds: float, sample_every: int, go: Any, out: Any
) -> None:
    """Spawned: publish_batch of `batch` at `rate` msg/s for `seconds`; every `sample_every`th
    batch's first body carries time.time() taken just before the transaction."""
    farm = Farm(dlq_table="outbox_dlq")
    sent = 0
    try:
        with psycopg.connect(dsn) as conn:
            if not go.wait(timeout=60):
                raise TimeoutError("never told to start")
            interval = batch / rate
            start = time.perf_counter()
            end = start + seconds
            k = 0
            while (now := time.perf_counter()) < end:
                wait = start + k * interval - now
                if wait > 0:
                    time.sleep(min(wait, end - now))
                    continue
                bodies: list[dict[str, Any]] = [{"n": sent + j} for j in range(batch)]
                if k % sample_every == 0:
                    bodies[0]["t"] = time.time()
                with conn.transaction():
                    farm.publish_batch(conn, bodies, queue=QUEUE)
                sent += batch
                k += 1
        out.put({"sent": sent})
    except Exception as exc:
        out.put({"error": repr(exc), "sent": sent})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[str, float]:
    wanted = {
        f'outbox_farm_acked_total{{queue="{QUEUE}"}}': "acked",
        f'outbox_farm_fetch_seconds_sum{{queue="{QUEUE}"}}': "fetch_sum",
        f'outbox_farm_fetch_seconds_count{{queue="{QUEUE}"}}': "fetch_count",
    }
    found = dict.fromkeys(wanted.values(), 0.0)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        for line in resp.read().decode().splitlines():
            name, _, value = line.rpartition(" ")
            if name in wanted:
                found[wanted[name]] = float(value)
    return found


def read_latencies(folder: Path, since: float, until: float) -> list[float]:
    lags = []
    for path in folder.glob("lat-*.csv"):
        for line in path.read_text().splitlines():
            try:
                now, t = (float(x) for x in line.split(","))
            except ValueError:
                continue  # a line being written
            if since <= now < until:
                lags.append((now - t) * 1000)
    return lags


def sustained(args: argparse.Namespace, admin_dsn: str) -> dict[str, Any]:
    seconds = args.sustained
    window = 60.0 if seconds >= 120 else 10.0
    windows = max(int(seconds // window), 1)
    progress = Progress(windows + 1)
    farm = Farm(dlq_table="outbox_dlq")
    result: dict[str, Any] = {
        "seconds": seconds,
        "rate": args.rate,
        "window_s": window,
        "vacuum_interval": args.vacuum_interval,
    }
    vacuum_env: dict[str, str] = {}
    if args.vacuum_interval is not None:
        vacuum_env["OUTBOX_FARM_VACUUM_INTERVAL"] = str(args.vacuum_interval)
    port = free_port()
    with (
        bench_producer.scratch_database(admin_dsn, farm) as dsn,
        tempfile.TemporaryDirectory() as folder,
    ):
        result["server"] = bench_producer.server_info(dsn) | server_extra(dsn)
        appdir = Path(folder)
        (appdir / "sustainedapp.py").write_text(SUSTAINED_APP)
        progress.step("sustained: starting the farm (--procs 2)")
        proc = bench_farm.start_farm(
            dsn,
            2,
            appdir,
            appdir / "sustained.log",
            metrics_bind=f"127.0.0.1:{port}",
            app="sustainedapp:farm",
            env={"BENCH_LAT_DIR": folder} | vacuum_env,
        )
        ctx = mp.get_context("spawn")
        go, out = ctx.Event(), ctx.Queue()
        producers = [
            ctx.Process(
                target=sustained_producer,
                args=(dsn, args.rate / 2, 50, window * windows, 4, go, out),
                daemon=True,
            )
            for _ in range(2)
        ]
        rows: list[dict[str, Any]] = []
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    last = scrape(port)
                    break
                except OSError as exc:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise SystemExit(f"farm did not start; see {appdir}/sustained.log") from exc
                    time.sleep(0.2)
            for p in producers:
                p.start()
            time.sleep(2)  # spawn + connect
            go.set()
            t_last = time.time()
            conn = psycopg.connect(dsn, autocommit=True)
            for w in range(windows):
                progress.step(f"sustained window {w + 1}/{windows}")
                end = t_last + window
                while (left := end - time.time()) > 0:
                    time.sleep(min(left, 1.0))
                now = scrape(port)
                t_now = time.time()
                backlog = int(conn.execute("SELECT count(*) FROM outbox").fetchone()[0])
                stats = dict(
                    zip(
                        ("dead", "size", "vacuums", "autovacuums"),
                        conn.execute(
                            "SELECT n_dead_tup, pg_table_size(relid), vacuum_count, "
                            "autovacuum_count FROM pg_stat_user_tables WHERE relname = 'outbox'"
                        ).fetchone(),
                        strict=True,
                    )
                )
                lags = read_latencies(appdir, t_last, t_now)
                cuts = (
                    statistics.quantiles(lags, n=100, method="inclusive")
                    if len(lags) >= 2
                    else None
                )
                claims = now["fetch_count"] - last["fetch_count"]
                rows.append(
                    {
                        "window": w + 1,
                        "end_s": round(t_now - (t_last - w * window), 1),
                        "acked_msg_s": (now["acked"] - last["acked"]) / (t_now - t_last),
                        "p50_ms": cuts[49] if cuts else None,
                        "p99_ms": cuts[98] if cuts else None,
                        "samples": len(lags),
                        "backlog": backlog,
                        "n_dead_tup": int(stats["dead"]),
                        "table_mb": int(stats["size"]) / 2**20,
                        "vacuum_count": int(stats["vacuums"]),
                        "autovacuum_count": int(stats["autovacuums"]),
                        "claims": int(claims),
                        "claim_ms_avg": (now["fetch_sum"] - last["fetch_sum"]) / claims * 1000
                        if claims
                        else None,
                    }
                )
                last, t_last = now, t_now
            conn.close()
            reports = [out.get(timeout=30) for _ in producers]
        finally:
            go.set()
            for p in producers:
                p.join(timeout=10)
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=5)
            bench_farm.stop_farm(proc)
        errors = [r["error"] for r in reports if "error" in r]
        if errors:
            raise RuntimeError(f"producers failed: {errors}")
        result["sent"] = sum(r["sent"] for r in reports)
        result["windows"] = rows
        first, final = rows[0]["acked_msg_s"], rows[-1]["acked_msg_s"]
        result["last_vs_first"] = final / first if first else None
        result["stable"] = bool(first) and abs(final - first) <= 0.2 * first
        # Throughput alone flatters a farm that fell behind and is catching up: it also has
        # to keep up, i.e. hand messages over within a second in the last window.
        p99 = rows[-1]["p99_ms"]
        result["kept_up"] = p99 is not None and p99 <= KEPT_UP_P99_MS
        progress.show("done")
    return result


def print_sustained(r: dict[str, Any]) -> None:
    print(
        f"sustained: {r['seconds']:g} s at {r['rate']:,.0f} msg/s offered (publish_batch of 50, "
        f"2 producer processes) against `outbox-farm start --procs 2"
        + ("" if r["vacuum_interval"] is None else f" --vacuum-interval {r['vacuum_interval']:g}")
        + f"`; {r['sent']:,} sent"
    )
    header = (
        f"{'window':>6} {'end s':>6} {'acked/s':>9} {'p50 ms':>8} {'p99 ms':>8} {'samples':>7} "
        f"{'backlog':>8} {'dead tup':>9} {'MB':>5} {'vacuum':>6} {'autovac':>7} {'claims':>7} "
        f"{'claim ms':>8}"
    )
    print(header)
    print("-" * len(header))

    def f(v: float | None, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    for w in r["windows"]:
        print(
            f"{w['window']:>6} {w['end_s']:>6.0f} {w['acked_msg_s']:>9,.0f} "
            f"{f(w['p50_ms'], '.1f'):>8} {f(w['p99_ms'], '.1f'):>8} {w['samples']:>7} "
            f"{w['backlog']:>8,} {w['n_dead_tup']:>9,} {w['table_mb']:>5.0f} "
            f"{w['vacuum_count']:>6} {w['autovacuum_count']:>7} "
            f"{w['claims']:>7,} {f(w['claim_ms_avg'], '.2f'):>8}"
        )
    ratio = r["last_vs_first"]
    print(
        f"last window throughput = {f(ratio, '.0%') if ratio is not None else '-'} of the first: "
        + ("within 20%" if r["stable"] else "DEGRADED (more than 20% off)")
    )
    p99 = r["windows"][-1]["p99_ms"]
    print(
        f"last window p99 = {f(p99, ',.0f')} ms: "
        + ("kept up" if r["kept_up"] else f"FELL BEHIND (over {KEPT_UP_P99_MS:,} ms)")
    )
    print("latency: publish time (before the transaction) -> handler start, sampled messages")
    print("vacuum / autovac: VACUUMs of the outbox table by the farm / by autovacuum, so far")
    info = r["server"]
    print(
        f"server: PostgreSQL {info['server_version']}, autovacuum={info['autovacuum']}, "
        f"autovacuum_naptime={info['autovacuum_naptime']}s"
    )


# -- main -----------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", help="admin DSN (default: $OUTBOX_FARM_DSN, else embedded)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--messages", type=int, default=10_000, help="per producer phase")
    parser.add_argument("--rows", type=int, default=50_000, help="pre-loaded rows per drain")
    parser.add_argument("--latency-messages", type=int, default=2_500)
    parser.add_argument("--latency-rate", type=float, default=500.0)
    parser.add_argument("--phase-timeout", type=float, default=30.0)
    parser.add_argument("--time-limit", type=float, default=0, help="0: 280 s, or sustained+90")
    parser.add_argument("--sustained", type=float, default=0, metavar="SECONDS")
    parser.add_argument(
        "--rate", type=float, default=5_000.0, help="--sustained offered load, msg/s"
    )
    parser.add_argument(
        "--vacuum-interval",
        type=float,
        default=None,
        help="--sustained: the farm's --vacuum-interval (default: the farm's own; 0: autovacuum "
        "alone, to see what the farm's VACUUM buys)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    limit = args.time_limit or (args.sustained + 90 if args.sustained else 280)

    def expired(signum: int, frame: Any) -> None:
        raise TimeoutError(f"time limit of {limit:g}s reached")

    signal.signal(signal.SIGALRM, expired)
    signal.alarm(int(limit))
    admin_dsn, server = bench_producer.resolve_dsn(args.dsn)
    started = time.perf_counter()
    try:
        result = (sustained if args.sustained else standard)(args, admin_dsn)
    finally:
        signal.alarm(0)
        del server
    result["total_seconds"] = round(time.perf_counter() - started, 1)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    elif args.sustained:
        print_sustained(result)
    else:
        info = result["server"]
        print_table(
            standard_rows(result),
            f"outbox_farm standard report: PostgreSQL {info['server_version']}, "
            f"synchronous_commit={info['synchronous_commit']}, autovacuum={info['autovacuum']}, "
            f"{info['cpus']} CPUs; "
            f"{result['total_seconds']:.0f} s",
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
