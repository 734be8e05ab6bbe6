"""Priority claim benchmark: what one claim costs the database with priorities unused and in
use, beside the claim of the release before priorities (migration 0013).

    python -m loadtests.bench.priority_claim --dsn "host=127.0.0.1 user=postgres dbname=postgres"

On one scratch database, three queues of --rows due rows each (published by `publish_batch`):
`plain` and `unused` have no priority, `ranked` has one row in --ranked-every at a priority
from 1 to 5. Each measure times --claims claims of --limit rows, each claim's rows released
by a rollback (untimed), so the queue keeps its depth and the indexes the claims walk stay as
loaded (a claim's rows leave the pending and priority indexes: released or deleted, they would
leave dead entries at the head of the very walk measured, which vacuum clears in a farm):

  before   the claim of the release before (no ranking fragments) on `plain`
  unused   the claim this release sends for `unused` (`db.claims.claim_statement` picks it:
           with no row above 0 in the queue, the claim of the release before), and beside
           it the probe that picks it, sent once a second per queue and process
  used     the claim this release sends for `ranked`: three quarters of each claim by priority

The three take turns claim by claim, --rounds times; the figure is the median over rounds of
each measure's median claim time, and the ratios unused/before (target:
within 3%, what "costs nothing measurable" means here) and used/before (no target: the price
of using priorities, printed to be read).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from typing import Any

import psycopg
from psycopg import sql

from loadtests.common import tables
from loadtests.common.harness import note
from outbox_farm import Farm
from outbox_farm.db.claims import claim_statement, unranked
from outbox_farm.queries import Queries

from .common import add_dsn, scratch, server, time_limit
from .report import print_measures, verdict

TARGET_UNUSED = 1.03  # unused / before: within 3%
CHUNK = 5_000  # rows per publish_batch while loading
MEASURES = (("before", "plain"), ("unused", "unused"), ("used", "ranked"))


def load(dsn: str, farm: Farm, rows: int, ranked_every: int) -> None:
    """The three queues of `rows` due rows each; every `ranked_every`-th row of `ranked` has
    a priority from 1 to 5."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for queue in ("plain", "unused", "ranked"):
            note(f"publishing {rows:,} rows to {queue} ...")
            for start in range(0, rows, CHUNK):
                count = min(CHUNK, rows - start)
                if queue != "ranked":
                    farm.publish_batch(conn, [b"x"] * count, queue=queue)
                    continue
                plain = count - count // ranked_every
                farm.publish_batch(conn, [b"x"] * plain, queue=queue)
                for priority in range(1, 6):
                    share = count // ranked_every // 5 + (priority <= count // ranked_every % 5)
                    if share:
                        farm.publish_batch(conn, [b"x"] * share, queue=queue, priority=priority)
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(farm.names.outbox.identifier()))


def claim_time(conn: psycopg.Connection[Any], statement: str, queue: str, limit: int) -> float:
    """Seconds of one claim of `limit` rows of `queue` (prepared, binary, as the farm sends
    it), in a transaction rolled back after it, untimed."""
    args = {
        "queue": queue,
        "limit": limit,
        "lease_ttl": 30.0,
        "token": uuid.uuid4(),
        "held": [],
    }
    began = time.perf_counter()
    taken = conn.execute(statement, args, binary=True, prepare=True).fetchall()
    spent = time.perf_counter() - began
    conn.rollback()
    if len(taken) != limit:
        raise RuntimeError(f"a claim of {queue} took {len(taken)} rows, not {limit}")
    return spent


async def chosen(dsn: str, queries: Queries) -> dict[str, str]:
    """The claim statement this release sends for each measure's queue."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
        picked = {"before": unranked(queries)}
        for name, queue in MEASURES[1:]:
            picked[name] = await claim_statement(conn, queries, queue)
    return picked


def probe_time(dsn: str, queries: Queries, count: int) -> float:
    """The median seconds of the probe that picks a queue's claim (`claim_ranks`)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        times = []
        for _ in range(count):
            began = time.perf_counter()
            conn.execute(queries["claim_ranks"], {"queue": "unused"}, prepare=True).fetchone()
            times.append(time.perf_counter() - began)
    return statistics.median(times)


def rounds(dsn: str, farm: Farm, count: int, claims: int, limit: int) -> dict[str, list[float]]:
    """Per measure, the median claim time (seconds) of each of `count` rounds. Within a round
    the measures take turns claim by claim (their order rotating), so a moment of a busy
    machine weighs on the three alike."""
    queries = Queries(farm.names)
    statements = asyncio.run(chosen(dsn, queries))
    note(
        "statements: unused is the claim of the release before: "
        f"{statements['unused'] == statements['before']}; used ranks: "
        f"{statements['used'] == queries['claim']}"
    )
    medians: dict[str, list[float]] = {name: [] for name, _ in MEASURES}
    with psycopg.connect(dsn) as conn:
        for n in range(1, count + 1):
            note(f"round {n} of {count}: {claims} claims of {limit} rows per measure ...")
            times: dict[str, list[float]] = {name: [] for name, _ in MEASURES}
            for turn in range(claims):
                shift = turn % len(MEASURES)
                for name, queue in MEASURES[shift:] + MEASURES[:shift]:
                    times[name].append(claim_time(conn, statements[name], queue, limit))
            for name, spent in times.items():
                medians[name].append(statistics.median(spent))
    return medians


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.priority_claim", description=__doc__.split("\n\n")[0]
    )
    add_dsn(parser)
    parser.add_argument("--rows", type=int, default=100_000, help="due rows in each queue")
    parser.add_argument("--limit", type=int, default=50, help="rows each claim takes")
    parser.add_argument("--claims", type=int, default=200, help="claims per measure per round")
    parser.add_argument(
        "--rounds", type=int, default=5, help="rounds of --claims claims per measure"
    )
    parser.add_argument(
        "--ranked-every", type=int, default=10, help="one row in this many of `ranked` above 0"
    )
    parser.add_argument("--time-limit", type=float, default=900.0, help="seconds, the whole run")
    args = parser.parse_args(argv)
    if min(args.rows, args.limit, args.claims, args.rounds, args.ranked_every) < 1:
        parser.error("--rows, --limit, --claims, --rounds and --ranked-every must be at least 1")
    farm = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)
    with (
        time_limit(args.time_limit),
        server(args.dsn) as admin,
        scratch(admin, farm) as dsn,
    ):
        load(dsn, farm, args.rows, args.ranked_every)
        medians = rounds(dsn, farm, args.rounds, args.claims, args.limit)
        probe = probe_time(dsn, Queries(farm.names), args.claims)
    figure = {name: statistics.median(values) for name, values in medians.items()}
    unused = figure["unused"] / figure["before"]
    used = figure["used"] / figure["before"]
    print()
    print(f"median claim time per round, {args.limit} rows from {args.rows:,} due (µs)")
    print(f"  {'round':>5} {'before':>9} {'unused':>9} {'used':>9}")
    for n in range(args.rounds):
        cells = " ".join(f"{medians[name][n] * 1e6:>9.0f}" for name, _ in MEASURES)
        print(f"  {n + 1:>5} {cells}")
    print()
    print_measures(
        [
            ("claim, release before (µs, median)", f"{figure['before'] * 1e6:,.0f}", "-", ""),
            ("claim, priorities unused (µs, median)", f"{figure['unused'] * 1e6:,.0f}", "-", ""),
            ("  its probe, once a second (µs, median)", f"{probe * 1e6:,.0f}", "-", ""),
            (
                f"claim, 1 row in {args.ranked_every} ranked (µs, median)",
                f"{figure['used'] * 1e6:,.0f}",
                "-",
                "",
            ),
            (
                "  unused / before",
                f"{unused:.3f}",
                f"<= {TARGET_UNUSED}",
                verdict(unused <= TARGET_UNUSED),
            ),
            ("  used / before", f"{used:.3f}", "-", verdict(None)),
        ],
        widths=(56, 12, 8),
    )
    return 0 if unused <= TARGET_UNUSED else 1


if __name__ == "__main__":
    sys.exit(main())
