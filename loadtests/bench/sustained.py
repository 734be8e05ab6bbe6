"""Steady load into `outbox-farm start --procs 2` for minutes, reported per window: does
the farm keep its throughput and its latency as the table churns (dead tuples, VACUUMs)?

Two spawned producer processes publish batches of 50 at the offered rate; every 4th batch's
first body carries its publish time, which the farm's handler writes with its own start time
to a CSV per worker. Throughput and claim time come from the farm's /metrics, backlog, dead
tuples, size and VACUUM counts from the server, per window.

With --floor, the same load then goes, for the same windows, to the least code that can take
it: two processes, each a LISTEN connection and a claim connection running the latency floor's
statement (`floor.CLAIM`) until a claim comes back short, then `DELETE`; a sampled message
counts as handled when its claim returns. Its p50/p99 per window print beside the farm's.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import psycopg
from psycopg import sql

from loadtests.common import tables
from loadtests.common.harness import free_port
from outbox_farm import Farm

from . import floor
from .common import (
    QUEUE,
    Progress,
    outbox_stats,
    percentiles,
    raise_errors,
    readings,
    reap,
    scratch,
    server_info,
)
from .farm import start_bench_farm, stop_bench_farm
from .report import fmt

KEPT_UP_P99_MS = 1000
VACUUM_EVERY = 10.0  # the farm's default vacuum_interval, for the floor's table
BACKLOG = tables.query("SELECT count(*) FROM {outbox}")
# 256 executors a process, as the drain's app (`farm.APP`): once a backlog forms, each claim
# and flush carries up to four times the rows it would at 64, and at 30,000 msg/s offered
# that decided whether the farm kept up (it did not at 64: its backlog grew by 3,000 rows a
# second for half an hour).
SUSTAINED_APP = """
import os, time
from outbox_farm import Farm
from loadtests.common.tables import DLQ, OUTBOX
farm = Farm(table=OUTBOX, dlq_table=DLQ)
_out = open(os.path.join(os.environ["BENCH_LAT_DIR"], f"lat-{os.getpid()}.csv"), "a",
            buffering=1)

@farm.handler("bench", concurrency=256)
async def handle(msg):
    now = time.time()
    body = msg.body
    if b'"t":' in body:  # a sampled message: it carries its publish time
        _out.write(f"{now},{msg.json()['t']}\\n")
"""


def sustained_producer(
    dsn: str, rate: float, batch: int, seconds: float, sample_every: int, go: Any, out: Any
) -> None:
    """Spawned: publish_batch of `batch` at `rate` msg/s for `seconds`; every `sample_every`th
    batch's first body carries time.time() taken just before the transaction."""
    farm = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)
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


def raw_receiver(dsn: str, folder: str, stop: Any, handled: Any) -> None:
    """Spawned: the floor's receiver (see the module's docstring). Writes the sampled
    messages' latencies as the farm's handler does; adds what it deletes to `handled`."""
    claim, delete = floor.statements()
    path = Path(folder, f"lat-raw-{os.getpid()}.csv")
    with (
        path.open("a", buffering=1) as out,
        psycopg.connect(dsn, autocommit=True) as listen,
        psycopg.connect(dsn, autocommit=True) as work,
    ):
        channel = Farm().names.channel
        listen.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
        while not stop.is_set():
            while True:
                # A row counts as handled when its claim returned.
                rows, now = floor.claim_and_delete(work, claim, delete, floor.BATCH)
                for row in rows:
                    if b'"t":' in row[1]:
                        out.write(f"{now},{orjson.loads(row[1])['t']}\n")
                with handled.get_lock():
                    handled.value += len(rows)
                if len(rows) < floor.BATCH:
                    break
            for _ in listen.notifies(timeout=0.1, stop_after=1):
                pass


Reading = Callable[[], dict[str, float] | None]
"""What the receiver has done so far: `acked` (messages), and the farm's `fetch_sum` and
`fetch_count` (its claims' seconds and number); None while it does not answer."""


def load_windows(
    dsn: str,
    folder: Path,
    rate: float,
    window: float,
    windows: int,
    progress: Progress,
    reading: Reading,
) -> tuple[list[dict[str, Any]], int]:
    """Run the two producers at `rate` for `windows` windows of `window` seconds against the
    receiver already running, reporting each window; the rows and how many were sent."""
    ctx = mp.get_context("spawn")
    go, out = ctx.Event(), ctx.Queue()
    producers = [
        ctx.Process(
            target=sustained_producer,
            args=(dsn, rate / 2, 50, window * windows, 4, go, out),
            daemon=True,
        )
        for _ in range(2)
    ]
    rows: list[dict[str, Any]] = []
    last = reading()
    assert last is not None
    try:
        for p in producers:
            p.start()
        time.sleep(2)  # spawn + connect
        go.set()
        t_last = time.time()
        with psycopg.connect(dsn, autocommit=True) as conn:
            for w in range(windows):
                progress.step(f"sustained window {w + 1}/{windows}")
                end = t_last + window
                while (left := end - time.time()) > 0:
                    time.sleep(min(left, 1.0))
                now = reading()
                if now is None:
                    raise RuntimeError("the receiver stopped answering")
                t_now = time.time()
                backlog = int(conn.execute(BACKLOG).fetchone()[0])
                stats = outbox_stats(conn)
                lags = read_latencies(folder, t_last, t_now)
                p50, p99 = percentiles(lags, 50, 99) or (None, None)
                claims = now["fetch_count"] - last["fetch_count"]
                rows.append(
                    {
                        "window": w + 1,
                        "end_s": round(t_now - (t_last - w * window), 1),
                        "acked_msg_s": (now["acked"] - last["acked"]) / (t_now - t_last),
                        "p50_ms": p50,
                        "p99_ms": p99,
                        "samples": len(lags),
                        "backlog": backlog,
                        "n_dead_tup": stats["n_dead_tup"],
                        "table_mb": stats["size"] / 2**20,
                        "vacuum_count": stats["vacuum_count"],
                        "autovacuum_count": stats["autovacuum_count"],
                        "claims": int(claims),
                        "claim_ms_avg": (now["fetch_sum"] - last["fetch_sum"]) / claims * 1000
                        if claims
                        else None,
                    }
                )
                last, t_last = now, t_now
        reports = [out.get(timeout=30) for _ in producers]
    finally:
        go.set()
        reap(producers)
    raise_errors(reports, "producers")
    return rows, sum(r["sent"] for r in reports)


def sustained(args: argparse.Namespace, admin_dsn: str) -> dict[str, Any]:
    seconds = args.sustained
    window = 60.0 if seconds >= 120 else 10.0
    windows = max(int(seconds // window), 1)
    progress = Progress((windows + 1) * (2 if args.floor else 1))
    farm = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)
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
    url = f"http://127.0.0.1:{port}/metrics"
    with scratch(admin_dsn, farm) as dsn, tempfile.TemporaryDirectory() as folder:
        result["server"] = server_info(dsn)
        appdir = Path(folder)
        (appdir / "sustainedapp.py").write_text(SUSTAINED_APP)
        progress.step("sustained: starting the farm (--procs 2)")
        proc = start_bench_farm(
            dsn,
            2,
            appdir,
            appdir / "sustained.log",
            metrics_bind=f"127.0.0.1:{port}",
            app="sustainedapp:farm",
            env={"BENCH_LAT_DIR": folder} | vacuum_env,
        )
        try:
            deadline = time.monotonic() + 60
            while readings(url) is None:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise SystemExit(f"farm did not start; see {appdir}/sustained.log")
                time.sleep(0.2)
            rows, result["sent"] = load_windows(
                dsn, appdir, args.rate, window, windows, progress, lambda: readings(url)
            )
        finally:
            stop_bench_farm(proc)
        result["windows"] = rows
        first, final = rows[0]["acked_msg_s"], rows[-1]["acked_msg_s"]
        result["last_vs_first"] = final / first if first else None
        result["stable"] = bool(first) and abs(final - first) <= 0.2 * first
        # Throughput alone flatters a farm that fell behind and is catching up: it also has
        # to keep up, i.e. hand messages over within a second in the last window.
        p99 = rows[-1]["p99_ms"]
        result["kept_up"] = p99 is not None and p99 <= KEPT_UP_P99_MS
        if args.floor:
            progress.step("sustained floor: raw LISTEN + claim loops")
            result["floor_windows"] = floor_windows(
                dsn, appdir, args.rate, window, windows, progress
            )
        progress.show("done")
    return result


def floor_windows(
    dsn: str, folder: Path, rate: float, window: float, windows: int, progress: Progress
) -> list[dict[str, Any]]:
    """The same load and windows received by two `raw_receiver` processes, from an empty
    table (the farm's samples set aside), the table vacuumed every `VACUUM_EVERY` seconds as
    the farm's chore does: without it, each claim reads every dead entry its predecessors left
    in the index, and the loops fell from 10,000 msg/s to 51 within a minute."""
    for path in folder.glob("lat-*.csv"):
        path.unlink()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(tables.query("TRUNCATE {outbox}"))
        conn.execute(tables.query("VACUUM ANALYZE {outbox}"))
    ctx = mp.get_context("spawn")
    stop, handled = ctx.Event(), ctx.Value("q", 0)
    receivers = [
        ctx.Process(target=raw_receiver, args=(dsn, str(folder), stop, handled), daemon=True)
        for _ in range(2)
    ]
    for receiver in receivers:
        receiver.start()
    vacuum = threading.Thread(target=vacuum_every, args=(dsn, VACUUM_EVERY, stop), daemon=True)
    vacuum.start()

    def reading() -> dict[str, float] | None:
        if any(r.exitcode not in (None, 0) for r in receivers):
            return None
        return {"acked": float(handled.value), "fetch_sum": 0.0, "fetch_count": 0.0}

    try:
        rows, _ = load_windows(dsn, folder, rate, window, windows, progress, reading)
    finally:
        stop.set()
        reap(receivers)
        vacuum.join(timeout=60)
    return rows


def vacuum_every(dsn: str, seconds: float, stop: Any) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        while not stop.wait(seconds):
            conn.execute(tables.query("VACUUM {outbox}"))


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
    for w in r["windows"]:
        print(
            f"{w['window']:>6} {w['end_s']:>6.0f} {w['acked_msg_s']:>9,.0f} "
            f"{fmt(w['p50_ms'], '.1f'):>8} {fmt(w['p99_ms'], '.1f'):>8} {w['samples']:>7} "
            f"{w['backlog']:>8,} {w['n_dead_tup']:>9,} {w['table_mb']:>5.0f} "
            f"{w['vacuum_count']:>6} {w['autovacuum_count']:>7} "
            f"{w['claims']:>7,} {fmt(w['claim_ms_avg'], '.2f'):>8}"
        )
    ratio = r["last_vs_first"]
    print(
        f"last window throughput = {fmt(ratio, '.0%')} of the first: "
        + ("within 20%" if r["stable"] else "DEGRADED (more than 20% off)")
    )
    p99 = r["windows"][-1]["p99_ms"]
    print(
        f"last window p99 = {fmt(p99, ',.0f')} ms: "
        + ("kept up" if r["kept_up"] else f"FELL BEHIND (over {KEPT_UP_P99_MS:,} ms)")
    )
    raw = r.get("floor_windows")
    if raw:
        print("floor, raw LISTEN + claim loops (2 processes), the same load, per window:")
        for w, f in zip(r["windows"], raw, strict=True):
            print(
                f"{f['window']:>6} {f['end_s']:>6.0f} {f['acked_msg_s']:>9,.0f} "
                f"{fmt(f['p50_ms'], '.1f'):>8} {fmt(f['p99_ms'], '.1f'):>8} {f['samples']:>7}"
                f"   farm / floor p50 {ratio_of(w['p50_ms'], f['p50_ms'])}, "
                f"p99 {ratio_of(w['p99_ms'], f['p99_ms'])}"
            )
    print("latency: publish time (before the transaction) -> handler start, sampled messages")
    print("vacuum / autovac: VACUUMs of the outbox table by the farm / by autovacuum, so far")
    info = r["server"]
    print(
        f"server: PostgreSQL {info['server_version']}, autovacuum={info['autovacuum']}, "
        f"autovacuum_naptime={info['autovacuum_naptime']}s"
    )


def ratio_of(farm: float | None, floor_ms: float | None) -> str:
    return fmt(farm / floor_ms if farm is not None and floor_ms else None, ".2f")
