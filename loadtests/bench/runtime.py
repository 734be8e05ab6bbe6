"""Runtime throughput and latency of outbox_farm, under uvloop.

Phases, in a scratch database (created here, dropped WITH (FORCE) at the end):

  drain     pre-load --rows rows with publish_batch, then run `farm.running(dsn)` in this
            process with a no-op async handler (--concurrency executors) until the outbox is
            empty. Reports msg/s, database transactions per message (pg_stat_database
            xact_commit + xact_rollback delta; every autocommit statement is one transaction,
            our own polling is subtracted) and the connections the runtime held.
  drain256  the same with --conn-concurrency executors (default 256), mainly to show that the
            runtime's connection count does not grow with concurrency.
  latency   the runtime running and idle; a spawned producer process publishes --latency-messages
            messages one per transaction at --rate msg/s (`latency.py`). Reports commit ->
            handler-start p50/p95/p99.

Usage:

    python -m loadtests.bench.runtime --dsn "host=127.0.0.1 user=postgres dbname=postgres"
    python -m loadtests.bench.runtime --rows 5000 --json results.json

Without --dsn (and without OUTBOX_FARM_DSN) the embedded Postgres is started. Every phase is
bounded by --phase-timeout; the whole run by --time-limit.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from typing import Any

import psycopg
import uvloop
from psycopg import sql

from loadtests.common.harness import dbname, note
from outbox_farm import Farm, Message
from outbox_farm.metrics import metrics

from .common import (
    QUEUE,
    add_dsn,
    add_json_path,
    add_limits,
    scratch,
    server,
    server_info,
    settled_xacts,
    time_limit,
    write_json,
)
from .latency import Latency, latency
from .report import Row, print_code, print_measures, verdict

MONITOR_APP = "outbox-farm-bench-monitor"
TARGET_DRAIN = 12_000.0  # msg/s
TARGET_P50_MS = 2.0
TARGET_P99_MS = 6.0


def preload(dsn: str, farm: Farm, rows: int, batch: int = 1000) -> float:
    """Fill the outbox with `rows` due rows through publish_batch; seconds it took."""
    started = time.perf_counter()
    with psycopg.connect(dsn) as conn:
        done = 0
        while done < rows:
            bodies = [{"i": done + j} for j in range(min(batch, rows - done))]
            with conn.transaction():
                farm.publish_batch(conn, bodies, queue=QUEUE, notify=False)
            done += len(bodies)
        conn.execute("ANALYZE")  # plans as after autovacuum's analyze, before the clock starts
        conn.commit()
    return time.perf_counter() - started


# -- measuring the server side --------------------------------------------------------------


BACKENDS = (
    "SELECT count(*) FILTER (WHERE backend_type = 'client backend'"
    "                         AND application_name <> %s),"
    "       count(*) FILTER (WHERE backend_type = 'autovacuum worker')"
    " FROM pg_stat_activity WHERE datname = %s"
)


async def sample_backends(
    admin: psycopg.AsyncConnection[Any], name: str, out: dict[str, int], period: float = 0.02
) -> None:
    """Keep the highest count of the runtime's client connections (ours excluded)."""
    while True:
        cur = await admin.execute(BACKENDS, [MONITOR_APP, name])
        runtime, autovacuum = await cur.fetchone()
        out["max_runtime_connections"] = max(out.get("max_runtime_connections", 0), runtime)
        out["max_autovacuum_workers"] = max(out.get("max_autovacuum_workers", 0), autovacuum)
        out["samples"] = out.get("samples", 0) + 1
        await asyncio.sleep(period)


def metric_totals() -> dict[str, float]:
    """Counts from the runtime's own Prometheus metrics (cumulative in this process)."""
    from prometheus_client import REGISTRY

    def value(name: str, labels: dict[str, str] | None = None) -> float:
        return REGISTRY.get_sample_value(name, labels or {}) or 0.0

    queue = {"queue": QUEUE}
    return {
        "claims": value("outbox_farm_fetch_seconds_count", queue),
        "claim_seconds": value("outbox_farm_fetch_seconds_sum", queue),
        "claimed": value("outbox_farm_claimed_total", queue),
        "acked": value("outbox_farm_acked_total", queue),
        "flushes": value("outbox_farm_flush_seconds_count"),
        "flush_seconds": value("outbox_farm_flush_seconds_sum"),
        "flushed_outcomes": value("outbox_farm_flush_batch_size_sum"),
    }


# -- drain ----------------------------------------------------------------------------------


@dataclass
class Drain:
    rows: int
    concurrency: int
    startup_s: float = 0.0
    handled_s: float = 0.0  # runtime started -> last handler finished
    drained_s: float = 0.0  # runtime started -> outbox found empty
    stop_s: float = 0.0
    cpu_s: float = 0.0  # this process's CPU time (user + system) while draining
    handled: int = 0
    left_in_table: int = -1
    transactions: int = 0  # runtime's, our polling subtracted
    own_polls: int = 0
    completed: bool = False
    metrics: dict[str, float] = field(default_factory=dict)
    backends: dict[str, int] = field(default_factory=dict)

    @property
    def rate(self) -> float:
        return self.rows / self.drained_s if self.drained_s else 0.0

    @property
    def statements_per_message(self) -> float:
        return self.transactions / self.rows if self.rows else 0.0


async def drain(admin_dsn: str, dsn: str, rows: int, concurrency: int, budget: float) -> Drain:
    result = Drain(rows, concurrency)
    name = dbname(dsn)
    farm = Farm()
    handled_all = asyncio.Event()
    count = 0

    @farm.handler(QUEUE, concurrency=concurrency)
    async def handle(msg: Message) -> None:
        nonlocal count
        count += 1
        if count >= rows:
            handled_all.set()

    before_metrics = metric_totals()
    admin = await psycopg.AsyncConnection.connect(admin_dsn, autocommit=True)
    counts = await asyncio.to_thread(psycopg.connect, admin_dsn, autocommit=True)
    monitor = await psycopg.AsyncConnection.connect(
        dsn, autocommit=True, application_name=MONITOR_APP
    )
    count_query = sql.SQL("SELECT count(*) FROM {}").format(farm.names.outbox.identifier())
    sampler: asyncio.Task[None] | None = None
    try:
        xacts_before = await asyncio.to_thread(settled_xacts, counts, name, MONITOR_APP)
        sampler = asyncio.create_task(sample_backends(admin, name, result.backends))
        t0 = time.perf_counter()
        async with farm.running(dsn):
            t_started, cpu_started = time.perf_counter(), time.process_time()
            result.startup_s = t_started - t0
            try:
                async with asyncio.timeout(budget):
                    await handled_all.wait()
                    result.handled_s = time.perf_counter() - t_started
                    while True:  # the completer's last flush: poll until the table is empty
                        result.own_polls += 1
                        left = (await (await monitor.execute(count_query)).fetchone())[0]
                        if left == 0:
                            result.drained_s = time.perf_counter() - t_started
                            result.cpu_s = time.process_time() - cpu_started
                            result.completed = True
                            break
                        await asyncio.sleep(0.005)
            except TimeoutError:
                note(f"drain: not empty after {budget:g}s; stopping")
            t_stop = time.perf_counter()
        result.stop_s = time.perf_counter() - t_stop
        sampler.cancel()
        with suppress(asyncio.CancelledError):
            await sampler
        result.own_polls += 1
        cur = await monitor.execute(count_query)
        result.left_in_table = (await cur.fetchone())[0]
        await monitor.close()  # it exits and flushes its own counts too
        xacts_after = await asyncio.to_thread(settled_xacts, counts, name, MONITOR_APP)
        result.transactions = xacts_after - xacts_before - result.own_polls
    finally:
        if sampler is not None:
            sampler.cancel()
        await monitor.close()
        await admin.close()
        counts.close()
    result.handled = count
    after = metric_totals()
    result.metrics = {k: after[k] - before_metrics[k] for k in after}
    if not result.completed:
        result.drained_s = time.perf_counter() - t0
    return result


# -- report ---------------------------------------------------------------------------------


def report_rows(preload_s: dict[str, float], drains: list[Drain], lat: Latency | None) -> list[Row]:
    rows: list[Row] = []

    def row(label: str, value: str, target: str = "-", ok: str = "") -> None:
        rows.append((label, value, target, ok))

    for d in drains:
        tag = f"drain, {d.rows:,} rows, concurrency {d.concurrency}"
        if not d.completed:
            row(f"{tag}: DID NOT FINISH", f"{d.handled:,} handled", "", "NO")
        row(
            f"{tag}: msg/s until empty",
            f"{d.rate:,.0f}",
            f">= {TARGET_DRAIN:,.0f}",
            verdict(d.completed and d.rate >= TARGET_DRAIN),
        )
        row(
            "  msg/s until the last handler finished",
            f"{d.rows / d.handled_s:,.0f}" if d.handled_s else "-",
        )
        row("  runtime startup / stop (ms)", f"{d.startup_s * 1e3:,.0f} / {d.stop_s * 1e3:,.0f}")
        if d.drained_s:
            row(
                "  runtime process CPU: % of one core / us per message",
                f"{d.cpu_s / d.drained_s:.0%} / {d.cpu_s / d.rows * 1e6:,.0f}",
            )
        row("  db transactions (= statements) per message", f"{d.statements_per_message:.3f}")
        row(f"  db transactions total (our {d.own_polls} polls subtracted)", f"{d.transactions:,}")
        m = d.metrics
        claims, flushes = m.get("claims", 0), m.get("flushes", 0)
        row(
            "  claims / avg rows per claim",
            f"{claims:,.0f} / {m['claimed'] / claims:,.1f}" if claims else "-",
        )
        row(
            "  claim time: avg ms (incl. pool check) / share of the drain",
            f"{m['claim_seconds'] / claims * 1e3:.2f} / {m['claim_seconds'] / d.drained_s:.0%}"
            if claims and d.drained_s
            else "-",
        )
        row(
            "  completer flushes / avg outcomes per flush",
            f"{flushes:,.0f} / {m['flushed_outcomes'] / flushes:,.1f}" if flushes else "-",
        )
        row(
            "  flush time: avg ms (incl. pool check)",
            f"{m['flush_seconds'] / flushes * 1e3:.2f}" if flushes else "-",
        )
        row(
            "  max runtime connections (pg_stat_activity)",
            f"{d.backends.get('max_runtime_connections', 0)}",
        )
        row("  rows left in the table", f"{d.left_in_table:,}", "0", verdict(d.left_in_table == 0))
    if lat is not None:
        tag = f"latency, {lat.messages:,} msgs at {lat.rate:g}/s, commit->handler start"
        if not lat.completed:
            row(f"{tag}: DID NOT FINISH", f"{lat.received:,} seen", "", "NO")
        row(
            f"{tag} p50 ms",
            f"{lat.p50_ms:.2f}",
            f"<= {TARGET_P50_MS:g}",
            verdict(lat.completed and lat.p50_ms <= TARGET_P50_MS),
        )
        row("  p95 ms", f"{lat.p95_ms:.2f}")
        row(
            "  p99 ms",
            f"{lat.p99_ms:.2f}",
            f"<= {TARGET_P99_MS:g}",
            verdict(lat.completed and lat.p99_ms <= TARGET_P99_MS),
        )
        row("  mean / max ms", f"{lat.mean_ms:.2f} / {lat.max_ms:.1f}")
        row("  handler started before the producer saw its commit", f"{lat.negative}")
    for what, seconds in preload_s.items():
        row(f"preload for {what} (publish_batch x1000, not timed above) s", f"{seconds:.2f}")
    return rows


def print_report(
    info: dict[str, Any], preload_s: dict[str, float], drains: list[Drain], lat: Latency | None
) -> None:
    print()
    print(
        f"outbox_farm runtime benchmark: PostgreSQL {info['server_version']}, "
        f"synchronous_commit={info['synchronous_commit']}, {info['cpus']} CPUs, "
        f"Python {info['python']}, uvloop {info['uvloop']}"
    )
    print_code(info)
    print_measures(report_rows(preload_s, drains, lat), widths=(58, 14, 12), value="result")
    print("statements per message: pg_stat_database xact_commit+xact_rollback delta of the")
    print("bench database over the run (startup, claims, next_due polls, pool checks, flushes,")
    print("LISTEN/health checks; autovacuum work is counted too).")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.runtime", description=__doc__.split("\n\n")[0]
    )
    add_dsn(parser)
    parser.add_argument("--rows", type=int, default=20_000, help="rows pre-loaded per drain")
    parser.add_argument("--concurrency", type=int, default=64, help="executors for the drain")
    parser.add_argument(
        "--conn-concurrency",
        type=int,
        default=256,
        help="executors for the second drain (connection count); 0 skips it",
    )
    parser.add_argument("--latency-messages", type=int, default=1_000)
    parser.add_argument("--rate", type=float, default=200.0, help="latency publish rate, msg/s")
    add_limits(parser, phase_timeout=60.0, time_limit=300.0)
    parser.add_argument("--skip-latency", action="store_true")
    add_json_path(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    metrics()  # create the Prometheus objects once, before any runtime
    drains: list[Drain] = []
    lat: Latency | None = None
    preload_s: dict[str, float] = {}
    with time_limit(args.time_limit), server(args.dsn) as admin, scratch(admin, Farm()) as dsn:
        info = server_info(dsn)
        for concurrency in (args.concurrency, args.conn_concurrency):
            if concurrency <= 0:
                continue
            note(f"drain at concurrency {concurrency}: pre-loading {args.rows:,} rows ...")
            preload_s[f"concurrency {concurrency}"] = preload(dsn, Farm(), args.rows)
            note("draining ...")
            drains.append(uvloop.run(drain(admin, dsn, args.rows, concurrency, args.phase_timeout)))
        if not args.skip_latency:
            note(f"latency: {args.latency_messages:,} messages at {args.rate:g}/s ...")
            lat = uvloop.run(
                latency(dsn, args.latency_messages, args.rate, args.concurrency, args.phase_timeout)
            )
    print_report(info, preload_s, drains, lat)
    if args.json:
        doc = {
            "benchmark": "runtime",
            "config": vars(args) | {"dsn": None},
            "server": info,
            "targets": {
                "drain_msg_s": TARGET_DRAIN,
                "latency_p50_ms": TARGET_P50_MS,
                "latency_p99_ms": TARGET_P99_MS,
            },
            "drains": [
                {
                    **asdict(d),
                    "rate_msg_s": d.rate,
                    "statements_per_message": d.statements_per_message,
                }
                for d in drains
            ],
            "latency": asdict(lat) if lat is not None else None,
        }
        write_json(args.json, doc)
    finished = all(d.completed and d.left_in_table == 0 for d in drains)
    return 0 if finished and (lat is None or lat.completed) else 1


if __name__ == "__main__":
    sys.exit(main())
