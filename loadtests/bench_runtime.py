#!/usr/bin/env python
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
            messages one per transaction at --rate msg/s and records time.time() right after
            each commit; the handler records time.time() when it starts. Reports commit ->
            handler-start p50/p95/p99.

Usage:

    python loadtests/bench_runtime.py --dsn "host=127.0.0.1 user=postgres dbname=postgres"
    python loadtests/bench_runtime.py --rows 5000 --json results.json

Without --dsn (and without OUTBOX_FARM_DSN) the embedded Postgres is started. Every phase is
bounded by --phase-timeout; the whole run by --time-limit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson
import psycopg
import uvloop
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from outbox_farm import Farm, Message

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_producer import _time_limit, code_version, resolve_dsn
from bench_producer import scratch_database as producer_scratch_database

from outbox_farm.metrics import metrics

QUEUE = "bench"
MONITOR_APP = "outbox-farm-bench-monitor"
TARGET_DRAIN = 12_000.0  # msg/s
TARGET_P50_MS = 2.0
TARGET_P99_MS = 6.0


# -- database plumbing (kept in each script: loadtests/ is a folder of scripts) -------------


@contextmanager
def scratch_database(admin_dsn: str, farm: Farm) -> Iterator[tuple[str, str]]:
    """bench_producer's migrated scratch database, with its name (for pg_stat_database)."""
    with producer_scratch_database(admin_dsn, farm) as dsn:
        yield dsn, str(conninfo_to_dict(dsn)["dbname"])


def server_info(dsn: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        settings = {
            name: conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()[0]
            for name in ("server_version", "synchronous_commit", "fsync", "max_connections")
        }
    return {
        **settings,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "uvloop": uvloop.__version__,
        "code": code_version(),
    }


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


XACTS = "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s"
BACKENDS = (
    "SELECT count(*) FILTER (WHERE backend_type = 'client backend'"
    "                         AND application_name <> %s),"
    "       count(*) FILTER (WHERE backend_type = 'client backend'),"
    "       count(*) FILTER (WHERE backend_type = 'autovacuum worker')"
    " FROM pg_stat_activity WHERE datname = %s"
)


async def settled_xacts(admin: psycopg.AsyncConnection[Any], dbname: str) -> int:
    """The database's transaction count once no client backend is left to flush its stats.

    Backends report their counts to pg_stat_database at most once a second while connected,
    and for certain when they exit, so this waits for the exits and for two equal readings.
    """
    previous = -1
    deadline = time.monotonic() + 5.0
    while True:
        cur = await admin.execute(BACKENDS, [MONITOR_APP, dbname])
        clients, _, _ = await cur.fetchone()  # our monitor connection aside
        cur = await admin.execute(XACTS, [dbname])
        (value,) = await cur.fetchone()
        if (clients == 0 and value == previous) or time.monotonic() > deadline:
            return int(value)
        previous = int(value)
        await asyncio.sleep(0.1)


async def sample_backends(
    admin: psycopg.AsyncConnection[Any], dbname: str, out: dict[str, int], period: float = 0.02
) -> None:
    """Keep the highest count of the runtime's client connections (ours excluded)."""
    while True:
        cur = await admin.execute(BACKENDS, [MONITOR_APP, dbname])
        runtime, _, autovacuum = await cur.fetchone()
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


async def drain(
    admin_dsn: str, dsn: str, dbname: str, rows: int, concurrency: int, budget: float
) -> Drain:
    result = Drain(rows, concurrency)
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
    monitor = await psycopg.AsyncConnection.connect(
        dsn, autocommit=True, application_name=MONITOR_APP
    )
    count_query = sql.SQL("SELECT count(*) FROM {}").format(farm.names.outbox.identifier())
    sampler: asyncio.Task[None] | None = None
    try:
        xacts_before = await settled_xacts(admin, dbname)
        sampler = asyncio.create_task(sample_backends(admin, dbname, result.backends))
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
                print(f"drain: not empty after {budget:g}s; stopping", file=sys.stderr)
            t_stop = time.perf_counter()
        result.stop_s = time.perf_counter() - t_stop
        sampler.cancel()
        with suppress(asyncio.CancelledError):
            await sampler
        result.own_polls += 1
        cur = await monitor.execute(count_query)
        result.left_in_table = (await cur.fetchone())[0]
        await monitor.close()  # it exits and flushes its own counts too
        xacts_after = await settled_xacts(admin, dbname)
        result.transactions = xacts_after - xacts_before - result.own_polls
    finally:
        if sampler is not None:
            sampler.cancel()
        await monitor.close()
        await admin.close()
    result.handled = count
    after = metric_totals()
    result.metrics = {k: after[k] - before_metrics[k] for k in after}
    if not result.completed:
        result.drained_s = time.perf_counter() - t0
    return result


# -- latency --------------------------------------------------------------------------------


def latency_producer(
    dsn: str, n: int, warmup: int, rate: float, ready: Any, go: Any, results: Any
) -> None:
    """Spawned: publish `warmup` then `n` messages, one per transaction, at `rate` per second.

    Sends back {id: time.time() right after the commit returned}.
    """
    farm = Farm()
    commits: dict[int, float] = {}
    try:
        with psycopg.connect(dsn) as conn:
            ready.set()
            if not go.wait(timeout=60):
                raise TimeoutError("never told to start")
            interval = 1.0 / rate
            start = time.perf_counter()
            for k in range(warmup + n):
                wait = start + k * interval - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                i = k - warmup  # warm-up messages have negative ids
                with conn.transaction():
                    farm.publish(conn, {"i": i}, queue=QUEUE)
                commits[i] = time.time()
        results.put({"commits": commits})
    except Exception as exc:
        results.put({"error": repr(exc)})


@dataclass
class Latency:
    messages: int
    rate: float
    concurrency: int
    received: int = 0
    p50_ms: float = 0.0
    p95_ms: float = 0.0
    p99_ms: float = 0.0
    max_ms: float = 0.0
    mean_ms: float = 0.0
    negative: int = 0  # handler started before the producer saw its commit return
    completed: bool = False


async def latency(dsn: str, n: int, rate: float, concurrency: int, budget: float) -> Latency:
    result = Latency(n, rate, concurrency)
    warmup = 50
    starts: dict[int, float] = {}
    all_in = asyncio.Event()
    farm = Farm()

    @farm.handler(QUEUE, concurrency=concurrency)
    async def handle(msg: Message) -> None:
        now = time.time()  # first thing: the handler started
        starts[orjson.loads(msg.body)["i"]] = now
        if len(starts) >= n + warmup:
            all_in.set()

    ctx = mp.get_context("spawn")
    ready, go, results = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(
        target=latency_producer,
        args=(dsn, n, warmup, rate, ready, go, results),
        name="bench-latency-producer",
        daemon=True,
    )
    proc.start()  # spawning takes a while: overlap it with the runtime's start
    loop = asyncio.get_running_loop()
    report: dict[str, Any] = {}
    try:
        async with farm.running(dsn) as runtime, asyncio.timeout(budget):
            assert runtime.listener is not None
            await runtime.listener.connected.wait()
            await loop.run_in_executor(None, ready.wait, 60)
            await asyncio.sleep(0.5)  # idle: the fetcher went back to sleep after its claims
            go.set()
            await all_in.wait()
            result.completed = True
            report = await loop.run_in_executor(None, results.get, True, 30)
    except TimeoutError:
        print(f"latency: not finished after {budget:g}s; stopping", file=sys.stderr)
    finally:
        go.set()
        await loop.run_in_executor(None, proc.join, 10)
        if proc.is_alive():
            proc.terminate()
            await loop.run_in_executor(None, proc.join, 5)
    if "error" in report:
        raise RuntimeError(f"latency producer failed: {report['error']}")
    commits: dict[int, float] = report.get("commits", {})
    lags = [(starts[i] - commits[i]) * 1000 for i in range(n) if i in starts and i in commits]
    result.received = len(lags)
    if len(lags) >= 2:
        cuts = statistics.quantiles(lags, n=100, method="inclusive")
        result.p50_ms, result.p95_ms, result.p99_ms = cuts[49], cuts[94], cuts[98]
        result.max_ms, result.mean_ms = max(lags), statistics.fmean(lags)
        result.negative = sum(1 for lag in lags if lag < 0)
    return result


# -- report ---------------------------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "yes" if ok else "NO"


def print_report(
    info: dict[str, Any], preload_s: dict[str, float], drains: list[Drain], lat: Latency | None
) -> None:
    print()
    print(
        f"outbox_farm runtime benchmark: PostgreSQL {info['server_version']}, "
        f"synchronous_commit={info['synchronous_commit']}, {info['cpus']} CPUs, "
        f"Python {info['python']}, uvloop {info['uvloop']}"
    )
    code = info["code"]
    if code["commit"]:
        print(
            f"code: {code['commit']}" + (" + local edits in outbox_farm/" if code["dirty"] else "")
        )
    header = f"{'measure':<58} {'result':>14} {'target':>12}  ok"
    print(header)
    print("-" * len(header))

    def row(label: str, value: str, target: str = "-", ok: str = "") -> None:
        print(f"{label:<58} {value:>14} {target:>12}  {ok}")

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
    print("statements per message: pg_stat_database xact_commit+xact_rollback delta of the")
    print("bench database over the run (startup, claims, next_due polls, pool checks, flushes,")
    print("LISTEN/health checks; autovacuum work is counted too).")


def write_json(
    destination: str, info: dict[str, Any], args: Any, drains: list[Drain], lat: Latency | None
) -> None:
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
            {**asdict(d), "rate_msg_s": d.rate, "statements_per_message": d.statements_per_message}
            for d in drains
        ],
        "latency": asdict(lat) if lat is not None else None,
    }
    text = json.dumps(doc, indent=2)
    if destination == "-":
        print(text)
    else:
        with open(destination, "w", encoding="utf-8") as out:
            out.write(text + "\n")
        print(f"JSON written to {destination}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", help="admin DSN (default: $OUTBOX_FARM_DSN, else embedded)")
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
    parser.add_argument(
        "--phase-timeout", type=float, default=60.0, help="seconds after which a phase gives up"
    )
    parser.add_argument(
        "--time-limit", type=float, default=300.0, help="hard limit for the whole run, in seconds"
    )
    parser.add_argument("--skip-latency", action="store_true")
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="also write the results as JSON (to stdout when no PATH)",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _time_limit(args.time_limit)
    admin_dsn, server = resolve_dsn(args.dsn)
    metrics()  # create the Prometheus objects once, before any runtime
    drains: list[Drain] = []
    lat: Latency | None = None
    preload_s: dict[str, float] = {}
    try:
        with scratch_database(admin_dsn, Farm()) as (dsn, dbname):
            info = server_info(dsn)
            for concurrency in (args.concurrency, args.conn_concurrency):
                if concurrency <= 0:
                    continue
                print(
                    f"drain at concurrency {concurrency}: pre-loading {args.rows:,} rows ...",
                    file=sys.stderr,
                    flush=True,
                )
                preload_s[f"concurrency {concurrency}"] = preload(dsn, Farm(), args.rows)
                print("draining ...", file=sys.stderr, flush=True)
                drains.append(
                    uvloop.run(
                        drain(admin_dsn, dsn, dbname, args.rows, concurrency, args.phase_timeout)
                    )
                )
            if not args.skip_latency:
                print(
                    f"latency: {args.latency_messages:,} messages at {args.rate:g}/s ...",
                    file=sys.stderr,
                    flush=True,
                )
                lat = uvloop.run(
                    latency(
                        dsn, args.latency_messages, args.rate, args.concurrency, args.phase_timeout
                    )
                )
    finally:
        signal.alarm(0)
        del server  # the embedded server (if any) stops with its last handle
    print_report(info, preload_s, drains, lat)
    if args.json:
        write_json(args.json, info, args, drains, lat)
    finished = all(d.completed and d.left_in_table == 0 for d in drains)
    return 0 if finished and (lat is None or lat.completed) else 1


if __name__ == "__main__":
    sys.exit(main())
