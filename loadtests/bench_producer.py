#!/usr/bin/env python
"""Producer throughput of outbox_farm, next to a raw-psycopg baseline.

Phases, each on an emptied table in a scratch database (created here, dropped at the end):

  baseline    the same one-message-per-transaction loop as raw SQL (no outbox_farm code):
              one statement `INSERT ... RETURNING id` + `pg_notify`, and the two-statement
              form (INSERT, then SELECT pg_notify) most hand-written code would use
  (a) publish one message per transaction, `with conn.transaction(): farm.publish(...)`
  (b) the same from 8 concurrent producer processes (spawned: no shared GIL)
  (c) publish_batch, 100 bodies per transaction

Usage (a scratch database `outbox_farm_bench_<random>` is created on that server):

    python loadtests/bench_producer.py --dsn "host=127.0.0.1 user=postgres dbname=postgres"
    python loadtests/bench_producer.py --messages 5000 --json results.json

Without --dsn (and without OUTBOX_FARM_DSN) the embedded Postgres is started. Every phase
stops after --phase-timeout seconds and reports what it did by then; the whole run is
bounded by --time-limit.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson
import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from outbox_farm import Farm
from outbox_farm.migrate import migrate

QUEUE = "bench"
WARMUP_QUEUE = "warmup"
TARGET_ONE_PER_TXN = 2_000.0  # msg/s, one message per transaction
TARGET_BATCH = 50_000.0  # rows/s, publish_batch of 100


# -- database plumbing (kept in each script: loadtests/ is a folder of scripts) -------------


def with_dbname(dsn: str, dbname: str) -> str:
    params = conninfo_to_dict(dsn)
    params["dbname"] = dbname
    return make_conninfo(**params)


def resolve_dsn(given: str | None) -> tuple[str, Any]:
    """The admin DSN and, when the embedded server had to be started, its handle."""
    dsn = given or os.environ.get("OUTBOX_FARM_DSN")
    if dsn:
        return dsn, None
    from outbox_farm.embedded import start_embedded

    print("no --dsn / OUTBOX_FARM_DSN: starting the embedded Postgres", file=sys.stderr)
    return start_embedded()


@contextmanager
def scratch_database(admin_dsn: str, farm: Farm) -> Iterator[str]:
    """A fresh migrated database, dropped WITH (FORCE) on the way out, whatever happened."""
    name = f"outbox_farm_bench_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(admin_dsn, autocommit=True, connect_timeout=10) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    dsn = with_dbname(admin_dsn, name)
    try:
        with psycopg.connect(dsn, connect_timeout=10) as conn:
            migrate(conn, farm.names)
        yield dsn
    finally:
        with psycopg.connect(admin_dsn, autocommit=True, connect_timeout=10) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def code_version() -> dict[str, Any]:
    """The outbox_farm code measured: git commit, and whether the package had local edits."""
    import subprocess
    from pathlib import Path

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


def server_info(dsn: str) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        settings = {
            name: conn.execute(sql.SQL("SHOW {}").format(sql.Identifier(name))).fetchone()[0]
            for name in ("server_version", "synchronous_commit", "fsync", "wal_sync_method")
        }
    return {
        **settings,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "code": code_version(),
    }


def reset_table(dsn: str, farm: Farm) -> None:
    """Empty the outbox and checkpoint, so every phase starts from the same state."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("TRUNCATE {} RESTART IDENTITY").format(farm.names.outbox.identifier()))
        with suppress(psycopg.Error):  # not a superuser: phases share checkpoint timing
            conn.execute("CHECKPOINT")


def count_rows(dsn: str, farm: Farm, queue: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        query = sql.SQL("SELECT count(*) FROM {} WHERE queue = %s").format(
            farm.names.outbox.identifier()
        )
        return int(conn.execute(query, [queue]).fetchone()[0])


# -- the publish loops (module level: spawned producer processes import them) ---------------


def body(i: int) -> dict[str, Any]:
    return {"i": i, "kind": "bench", "note": "outbox_farm producer benchmark"}


def raw_queries(farm: Farm) -> dict[str, sql.Composed]:
    table = farm.names.outbox.identifier()
    insert = sql.SQL(
        "INSERT INTO {} (queue, payload, headers) VALUES (%s, %s, %s::jsonb) RETURNING id"
    ).format(table)
    one = sql.SQL(
        "WITH ins AS (INSERT INTO {} (queue, payload, headers) VALUES (%s, %s, %s::jsonb) "
        "RETURNING id) SELECT ins.id, pg_notify(%s, %s) FROM ins"
    ).format(table)
    return {"insert": insert, "one": one}


def make_step(mode: str, conn: psycopg.Connection[Any], farm: Farm) -> Callable[[int], None]:
    """One message in one transaction, the `mode` way; returns the callable for message i."""
    channel = farm.names.channel
    raw = raw_queries(farm)

    def headers() -> str:
        return orjson.dumps(
            {"content-type": "application/json", "correlation_id": uuid.uuid4().hex}
        ).decode()

    def publish(i: int) -> None:
        with conn.transaction():
            farm.publish(conn, body(i), queue=QUEUE)

    def raw_one(i: int) -> None:
        with conn.transaction():
            conn.execute(raw["one"], [QUEUE, orjson.dumps(body(i)), headers(), channel, QUEUE])

    def raw_two(i: int) -> None:
        with conn.transaction():
            conn.execute(raw["insert"], [QUEUE, orjson.dumps(body(i)), headers()]).fetchone()
            conn.execute("SELECT pg_notify(%s, %s)", [channel, QUEUE])

    return {"publish": publish, "raw_one": raw_one, "raw_two": raw_two}[mode]


def warm_up(conn: psycopg.Connection[Any], farm: Farm, n: int = 100) -> None:
    """Connect-time costs and psycopg's statement preparation out of the measured loop."""
    for i in range(n):
        with conn.transaction():
            farm.publish(conn, body(-i), queue=WARMUP_QUEUE)


def timed_loop(
    step: Callable[[int], None], start: int, count: int, deadline: float
) -> tuple[int, float, float, list[float]]:
    """Run `step` for ids start.. start+count; (done, t_start, t_end, per-call seconds)."""
    durations: list[float] = []
    t_start = time.perf_counter()
    clock = time.perf_counter
    done = 0
    for i in range(start, start + count):
        began = clock()
        step(i)
        ended = clock()
        durations.append(ended - began)
        done += 1
        if ended > deadline:
            break
    return done, t_start, clock(), durations


def producer_process(
    dsn: str, mode: str, start: int, count: int, barrier: Any, results: Any, budget: float
) -> None:
    """A spawned producer: connect and warm up, meet the others at the barrier, publish."""
    farm = Farm()
    try:
        with psycopg.connect(dsn) as conn:
            warm_up(conn, farm, 50)
            step = make_step(mode, conn, farm)
            barrier.wait(timeout=60)
            # time.perf_counter() is CLOCK_MONOTONIC on Linux: comparable across processes.
            done, t0, t1, durations = timed_loop(step, start, count, time.perf_counter() + budget)
        results.put({"done": done, "t0": t0, "t1": t1, "durations": durations})
    except Exception as exc:
        results.put({"error": repr(exc)})


# -- phases ---------------------------------------------------------------------------------


@dataclass
class Phase:
    name: str
    label: str
    messages: int
    seconds: float
    rate: float
    unit: str = "msg/s"
    target: float | None = None
    p50_ms: float | None = None
    p99_ms: float | None = None
    verified: bool = True
    truncated: bool = False
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def meets_target(self) -> bool | None:
        return None if self.target is None else self.rate >= self.target


def percentiles(durations: list[float]) -> tuple[float | None, float | None]:
    if len(durations) < 2:
        return None, None
    cuts = statistics.quantiles(durations, n=100, method="inclusive")
    return cuts[49] * 1000, cuts[98] * 1000


def run_single(dsn: str, farm: Farm, mode: str, n: int, budget: float) -> tuple[int, float, list]:
    with psycopg.connect(dsn) as conn:
        warm_up(conn, farm)
        step = make_step(mode, conn, farm)
        done, t0, t1, durations = timed_loop(step, 0, n, time.perf_counter() + budget)
    return done, t1 - t0, durations


def single_phase(
    dsn: str,
    farm: Farm,
    mode: str,
    n: int,
    budget: float,
    name: str,
    label: str,
    target: float | None,
) -> Phase:
    reset_table(dsn, farm)
    done, seconds, durations = run_single(dsn, farm, mode, n, budget)
    p50, p99 = percentiles(durations)
    return Phase(
        name,
        label,
        done,
        seconds,
        done / seconds,
        target=target,
        p50_ms=p50,
        p99_ms=p99,
        verified=count_rows(dsn, farm, QUEUE) == done,
        truncated=done < n,
    )


def concurrent_phase(
    dsn: str, farm: Farm, n: int, producers: int, budget: float, name: str, label: str
) -> Phase:
    reset_table(dsn, farm)
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(producers + 1)
    results = ctx.Queue()
    share, extra = divmod(n, producers)
    procs, start = [], 0
    for k in range(producers):
        count = share + (1 if k < extra else 0)
        proc = ctx.Process(
            target=producer_process,
            args=(dsn, "publish", start, count, barrier, results, budget),
            name=f"bench-producer-{k}",
            daemon=True,
        )
        proc.start()
        procs.append(proc)
        start += count
    reports: list[dict[str, Any]] = []
    try:
        barrier.wait(timeout=60)
        for _ in procs:
            reports.append(results.get(timeout=budget + 60))
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
    errors = [r["error"] for r in reports if "error" in r]
    if errors:
        raise RuntimeError(f"producer processes failed: {errors}")
    done = sum(r["done"] for r in reports)
    seconds = max(r["t1"] for r in reports) - min(r["t0"] for r in reports)
    durations = [d for r in reports for d in r["durations"]]
    p50, p99 = percentiles(durations)
    per_process = [r["done"] / (r["t1"] - r["t0"]) for r in reports]
    return Phase(
        name,
        label,
        done,
        seconds,
        done / seconds,
        target=TARGET_ONE_PER_TXN,
        p50_ms=p50,
        p99_ms=p99,
        verified=count_rows(dsn, farm, QUEUE) == done,
        truncated=done < n,
        extra={"producers": producers, "per_process_msg_s": [round(r, 1) for r in per_process]},
    )


def batch_phase(dsn: str, farm: Farm, n: int, size: int, budget: float) -> Phase:
    reset_table(dsn, farm)
    durations: list[float] = []
    done = 0
    with psycopg.connect(dsn) as conn:
        for _ in range(5):  # warm-up
            with conn.transaction():
                farm.publish_batch(conn, [body(-j) for j in range(size)], queue=WARMUP_QUEUE)
        deadline = time.perf_counter() + budget
        t0 = time.perf_counter()
        while done < n and time.perf_counter() < deadline:
            bodies = [body(done + j) for j in range(min(size, n - done))]
            began = time.perf_counter()
            with conn.transaction():
                farm.publish_batch(conn, bodies, queue=QUEUE)
            durations.append(time.perf_counter() - began)
            done += len(bodies)
        seconds = time.perf_counter() - t0
    p50, p99 = percentiles(durations)
    return Phase(
        "c_publish_batch",
        f"(c) publish_batch, {size}/txn",
        done,
        seconds,
        done / seconds,
        unit="rows/s",
        target=TARGET_BATCH,
        p50_ms=p50,
        p99_ms=p99,
        verified=count_rows(dsn, farm, QUEUE) == done,
        truncated=done < n,
        extra={"batch_size": size, "batches_per_s": round(len(durations) / seconds, 1)},
    )


def median_phase(runs: list[Phase]) -> Phase:
    """The round with the median rate (the lower one for an even count), all rates noted."""
    middle = statistics.median_low(p.rate for p in runs)
    chosen = next(p for p in runs if p.rate == middle)
    if len(runs) > 1:
        chosen.extra["rates_by_round"] = [round(p.rate, 1) for p in runs]
    chosen.verified = all(p.verified for p in runs)
    return chosen


# -- report ---------------------------------------------------------------------------------


def fmt(value: float | None, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(phases: list[Phase], info: dict[str, Any], n: int) -> None:
    print()
    print(
        f"outbox_farm producer benchmark: {n:,} messages per phase; PostgreSQL "
        f"{info['server_version']}, synchronous_commit={info['synchronous_commit']}, "
        f"fsync={info['fsync']}, {info['cpus']} CPUs, Python {info['python']}"
    )
    code = info["code"]
    if code["commit"]:
        print(
            f"code: {code['commit']}" + (" + local edits in outbox_farm/" if code["dirty"] else "")
        )
    header = (
        f"{'phase':<44} {'msgs':>7} {'secs':>7} {'rate':>9} {'unit':<6} {'p50 ms':>7} "
        f"{'p99 ms':>7} {'target':>10}  ok"
    )
    print(header)
    print("-" * len(header))
    for p in phases:
        ok = {None: "", True: "yes", False: "NO"}[p.meets_target]
        notes = ("" if p.verified else "  ROW COUNT MISMATCH") + (
            "  (stopped at --phase-timeout)" if p.truncated else ""
        )
        target = f">= {p.target:,.0f}" if p.target is not None else "-"
        print(
            f"{p.label:<44} {p.messages:>7,} {p.seconds:>7.2f} {p.rate:>9,.0f} {p.unit:<6} "
            f"{fmt(p.p50_ms, '.2f'):>7} {fmt(p.p99_ms, '.2f'):>7} {target:>10}  {ok}{notes}"
        )
    by_name = {p.name: p for p in phases}
    print()
    a = by_name.get("a_publish")
    for key, what in (("raw_one", "raw 1-statement"), ("raw_two", "raw 2-statement")):
        base = by_name.get(key)
        if a and base:
            print(
                f"(a) publish / {what} baseline: {a.rate / base.rate:.2f}x the throughput "
                f"({(1 / a.rate - 1 / base.rate) * 1e6:+.0f} us per message)"
            )
    b = by_name.get("b_publish_concurrent")
    if b:
        print(f"(b) per-process msg/s: {b.extra['per_process_msg_s']}")
    c = by_name.get("c_publish_batch")
    if c:
        print(f"(c) {c.extra['batches_per_s']:,} batches/s; p50/p99 are per batch")
    for p in phases:
        if "rates_by_round" in p.extra:
            print(f"{p.name}: {p.unit} by round {p.extra['rates_by_round']} (median shown)")
    print("p50/p99: one transaction (BEGIN, statement(s), COMMIT) as the producer saw it")


def write_json(destination: str, phases: list[Phase], info: dict[str, Any], args: Any) -> None:
    doc = {
        "benchmark": "producer",
        "config": {
            "messages": args.messages,
            "producers": args.producers,
            "batch_size": args.batch_size,
            "rounds": args.rounds,
        },
        "server": info,
        "results": [{**asdict(p), "meets_target": p.meets_target} for p in phases],
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
    parser.add_argument("--messages", type=int, default=20_000, help="messages per phase")
    parser.add_argument("--producers", type=int, default=8, help="processes in phase (b)")
    parser.add_argument("--batch-size", type=int, default=100, help="bodies per batch in (c)")
    parser.add_argument(
        "--phase-timeout",
        type=float,
        default=30.0,
        help="seconds after which a phase stops and reports what it did",
    )
    parser.add_argument(
        "--time-limit", type=float, default=300.0, help="hard limit for the whole run, in seconds"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat every phase (interleaved) and report the median round",
    )
    parser.add_argument("--skip-baseline", action="store_true", help="skip the raw-SQL loops")
    parser.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="also write the results as JSON (to stdout when no PATH)",
    )
    return parser.parse_args(argv)


def _time_limit(seconds: float) -> None:
    def expired(signum: int, frame: Any) -> None:
        raise TimeoutError(f"--time-limit of {seconds:g}s reached")

    signal.signal(signal.SIGALRM, expired)
    signal.alarm(max(int(seconds), 1))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    _time_limit(args.time_limit)
    admin_dsn, server = resolve_dsn(args.dsn)
    farm = Farm()
    n, budget = args.messages, args.phase_timeout
    phases: list[Phase] = []
    try:
        with scratch_database(admin_dsn, farm) as dsn:
            info = server_info(dsn)
            plan: list[tuple[str, Callable[[], Phase]]] = []
            if not args.skip_baseline:
                plan += [
                    (
                        "raw SQL, 1 statement",
                        lambda: single_phase(
                            dsn,
                            farm,
                            "raw_one",
                            n,
                            budget,
                            "raw_one",
                            "baseline: raw INSERT+pg_notify, 1 stmt/txn",
                            None,
                        ),
                    ),
                    (
                        "raw SQL, 2 statements",
                        lambda: single_phase(
                            dsn,
                            farm,
                            "raw_two",
                            n,
                            budget,
                            "raw_two",
                            "baseline: raw INSERT; pg_notify, 2 stmt/txn",
                            None,
                        ),
                    ),
                ]
            plan += [
                (
                    "(a)",
                    lambda: single_phase(
                        dsn,
                        farm,
                        "publish",
                        n,
                        budget,
                        "a_publish",
                        "(a) publish, 1 msg/txn, 1 producer",
                        TARGET_ONE_PER_TXN,
                    ),
                ),
                (
                    "(b)",
                    lambda: concurrent_phase(
                        dsn,
                        farm,
                        n,
                        args.producers,
                        budget,
                        "b_publish_concurrent",
                        f"(b) publish, 1 msg/txn, {args.producers} processes",
                    ),
                ),
                ("(c)", lambda: batch_phase(dsn, farm, n, args.batch_size, budget)),
            ]
            runs: dict[str, list[Phase]] = {}
            for round_no in range(1, args.rounds + 1):
                for what, run in plan:  # interleaved: drift (autovacuum, WAL) hits all alike
                    print(
                        f"round {round_no}/{args.rounds}: {what} ...", file=sys.stderr, flush=True
                    )
                    runs.setdefault(what, []).append(run())
            phases = [median_phase(found) for found in runs.values()]
    finally:
        signal.alarm(0)
        del server  # the embedded server (if any) stops with its last handle
    print_table(phases, info, n)
    if args.json:
        write_json(args.json, phases, info, args)
    return 0 if all(p.verified for p in phases) else 1


if __name__ == "__main__":
    sys.exit(main())
