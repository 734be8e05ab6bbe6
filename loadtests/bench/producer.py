"""Producer throughput of outbox_farm, next to a raw-psycopg baseline.

Phases, each on an emptied table in a scratch database (created here, dropped at the end):

  baseline    the same one-message-per-transaction loop as raw SQL (no outbox_farm code):
              one statement `INSERT ... RETURNING id` + `pg_notify`, and the two-statement
              form (INSERT, then SELECT pg_notify) most hand-written code would use
  (a) publish one message per transaction, `with conn.transaction(): farm.publish(...)`
  (b) the same from 8 concurrent producer processes (spawned: no shared GIL)
  (c) publish_batch, 100 bodies per transaction

Usage (a scratch database `outbox_farm_bench_<random>` is created on that server):

    python -m loadtests.bench.producer --dsn "host=127.0.0.1 user=postgres dbname=postgres"
    python -m loadtests.bench.producer --messages 5000 --json results.json

Without --dsn (and without OUTBOX_FARM_DSN) the embedded Postgres is started. Every phase
stops after --phase-timeout seconds and reports what it did by then; the whole run is
bounded by --time-limit.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Any

from loadtests.common.harness import note
from outbox_farm import Farm

from .common import (
    add_dsn,
    add_json_path,
    add_limits,
    scratch,
    server,
    server_info,
    time_limit,
    write_json,
)
from .publish import (
    RAW_BATCH_MODES,
    TARGET_OF_BATCH_FLOOR,
    TARGET_ONE_PER_TXN,
    Phase,
    batch_floor,
    batch_phase,
    concurrent_phase,
    median_phase,
    single_phase,
)
from .report import fmt, print_code, verdict

# -- report ---------------------------------------------------------------------------------


def print_table(phases: list[Phase], info: dict[str, Any], n: int) -> None:
    print()
    print(
        f"outbox_farm producer benchmark: {n:,} messages per phase; PostgreSQL "
        f"{info['server_version']}, synchronous_commit={info['synchronous_commit']}, "
        f"fsync={info['fsync']}, {info['cpus']} CPUs, Python {info['python']}"
    )
    print_code(info)
    header = (
        f"{'phase':<44} {'msgs':>7} {'secs':>7} {'rate':>9} {'unit':<6} {'p50 ms':>7} "
        f"{'p99 ms':>7} {'target':>10}  ok"
    )
    print(header)
    print("-" * len(header))
    for p in phases:
        notes = ("" if p.verified else "  ROW COUNT MISMATCH") + (
            "  (stopped at --phase-timeout)" if p.truncated else ""
        )
        target = f">= {p.target:,.0f}" if p.target is not None else "-"
        print(
            f"{p.label:<44} {p.messages:>7,} {p.seconds:>7.2f} {p.rate:>9,.0f} {p.unit:<6} "
            f"{fmt(p.p50_ms, '.2f'):>7} {fmt(p.p99_ms, '.2f'):>7} {target:>10}  "
            f"{verdict(p.meets_target)}{notes}"
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
        floor = batch_floor(phases)
        if floor:
            print(
                f"(c) publish_batch / raw batch floor ({floor.label.split(': ')[-1]}): "
                f"{c.rate / floor.rate:.2f}x (target >= {TARGET_OF_BATCH_FLOOR:.2f})"
            )
    for p in phases:
        if "rates_by_round" in p.extra:
            print(f"{p.name}: {p.unit} by round {p.extra['rates_by_round']} (median shown)")
    print("p50/p99: one transaction (BEGIN, statement(s), COMMIT) as the producer saw it")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.producer", description=__doc__.split("\n\n")[0]
    )
    add_dsn(parser)
    parser.add_argument("--messages", type=int, default=20_000, help="messages per phase")
    parser.add_argument("--producers", type=int, default=8, help="processes in phase (b)")
    parser.add_argument("--batch-size", type=int, default=100, help="bodies per batch in (c)")
    add_limits(parser, phase_timeout=30.0, time_limit=300.0)
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="repeat every phase (interleaved) and report the median round",
    )
    parser.add_argument("--skip-baseline", action="store_true", help="skip the raw-SQL loops")
    add_json_path(parser)
    return parser.parse_args(argv)


def plan(args: argparse.Namespace, dsn: str, farm: Farm) -> list[tuple[str, Callable[[], Phase]]]:
    """One round's phases in order, each with what stderr calls it."""
    n, budget = args.messages, args.phase_timeout
    single = partial(single_phase, dsn, farm, n=n, budget=budget, target=None)
    baseline = [
        (
            "raw SQL, 1 statement",
            partial(
                single,
                mode="raw_one",
                name="raw_one",
                label="baseline: raw INSERT+pg_notify, 1 stmt/txn",
            ),
        ),
        (
            "raw SQL, 2 statements",
            partial(
                single,
                mode="raw_two",
                name="raw_two",
                label="baseline: raw INSERT; pg_notify, 2 stmt/txn",
            ),
        ),
    ]
    a = partial(
        single,
        mode="publish",
        name="a_publish",
        label="(a) publish, 1 msg/txn, 1 producer",
        target=TARGET_ONE_PER_TXN,
    )
    b = partial(
        concurrent_phase,
        dsn,
        farm,
        n,
        args.producers,
        budget,
        "b_publish_concurrent",
        f"(b) publish, 1 msg/txn, {args.producers} processes",
    )
    c = partial(batch_phase, dsn, farm, n, args.batch_size, budget)
    batch_floor = [(f"raw SQL batches, {mode}", partial(c, mode=mode)) for mode in RAW_BATCH_MODES]
    return [
        *([] if args.skip_baseline else baseline),
        ("(a)", a),
        ("(b)", b),
        *([] if args.skip_baseline else batch_floor),
        ("(c)", c),
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    farm = Farm()
    runs: dict[str, list[Phase]] = {}
    with time_limit(args.time_limit), server(args.dsn) as admin, scratch(admin, farm) as dsn:
        info = server_info(dsn)
        for round_no in range(1, args.rounds + 1):
            for what, run in plan(args, dsn, farm):  # interleaved: drift hits all alike
                note(f"round {round_no}/{args.rounds}: {what} ...")
                runs.setdefault(what, []).append(run())
    phases = [median_phase(found) for found in runs.values()]
    print_table(phases, info, args.messages)
    if args.json:
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
        write_json(args.json, doc)
    return 0 if all(p.verified for p in phases) else 1


if __name__ == "__main__":
    sys.exit(main())
