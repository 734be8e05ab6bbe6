"""What grouping dead letters by cause costs on a large DLQ: 1 million rows by default.

A scratch database (created here, dropped at the end) gets --rows DLQ rows over --queues
queues, their exceptions drawn from a dozen kinds with volatile parts (ids, amounts, uuids,
addresses) and the innermost frames the farm appends, some NULL. Then, --runs times each:

- `dlq_causes` unfiltered, by queue and by reason (the counts migration 0009 keeps);
- `dlq_list --cause` (the first page of one cause, newest first: the cause index);
- `dlq_causes` with a time window of the last hour (what the counts cannot answer: the rows of
  the window are read and grouped);
- for comparison, a plain GROUP BY of the normalised exception over the whole table, which is
  what grouping costs without kept counts (run fewer times: it takes seconds).

"cold" is the first run on a new connection (no statement or catalog cache; the table's pages
may still be in the server's cache), "warm" the median of the runs after it. Last, the write
side: an INSERT of a batch of dead letters (the farm's DLQ move writes up to a flush's worth
in one statement) timed with the counting trigger and without it.

    python -m loadtests.bench.dlq_groups --dsn "host=127.0.0.1 user=postgres dbname=postgres"
    python -m loadtests.bench.dlq_groups --rows 200000 --runs 5

Without --dsn (and without OUTBOX_FARM_DSN) the embedded Postgres is started.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import psycopg

from loadtests.common import tables
from outbox_farm import Farm
from outbox_farm.admin.dlq import DlqFilter, dlq_causes, dlq_list
from outbox_farm.admin.durations import When

from .common import add_dsn, scratch, server

CHUNK = 100_000
# One statement per chunk of ids: a dozen kinds of exception, each with the volatile parts
# the cause normalises away, the frames the farm appends after the repr, and one row in 50
# with no exception at all (another writer's).
LOAD = tables.query("""
INSERT INTO {dlq} (original_id, queue, payload, headers, deliveries_count, created_at,
                        failed_at, failure_reason, last_exception)
SELECT g, 'queue_' || (g %% %(queues)s), '\\x7b7d'::bytea, '{"content-type": "application/json"}',
       3, now(), now() - make_interval(secs => (%(rows)s - g)::float8 / 10),
       (ARRAY['max_deliveries', 'retry_terminal', 'rejected'])[1 + g %% 3],
       CASE WHEN g %% 50 = 0 THEN NULL ELSE (ARRAY[
           format('KeyError(%%L)', 'sku'),
           format('KeyError(%%L)', 'customer-' || g),
           format('TimeoutError(%%L)', 'read timed out after ' || (g %% 30) || '.5s'),
           format('ValueError(%%L)', 'order ' || g || ' has no lines'),
           format('LookupError(%%L)', 'tenant ' || md5(g::text)::uuid || ' unknown'),
           format('ConnectionError(%%L)',
                  'pool <Pool at 0x' || to_hex(g::bigint * 7919) || '> closed'),
           format('PermissionError(%%L)', 'token ' || md5(g::text) || ' expired'),
           format('RuntimeError(%%L)', 'payload ' || repeat('x', 40 + g %% 10)),
           'asyncio.CancelledError()',
           format('HTTPError(%%L)', '503 Service Unavailable from billing'),
           format('ZeroDivisionError(%%L)', 'division by zero'),
           format('DeadLetter(%%L)', 'schema v' || (g %% 4) || ' is not supported')
       ])[1 + (g / 7) %% 12] || E'\\nTraceback (innermost frames last):\\n'
           || '  File "/srv/app/handlers.py", line ' || (g %% 400) || E', in on_order\\n'
           || E'    order = await load(msg.json()["order_id"])\\n' END
FROM generate_series(%(first)s::int, %(last)s::int) AS g
""")
BATCH = tables.query("""
INSERT INTO {dlq} (original_id, queue, payload, deliveries_count, created_at,
                        failure_reason, last_exception)
SELECT g, 'queue_0', 'x', 3, now(), 'retry_terminal', format('KeyError(%%L)', 'k' || g)
FROM generate_series(1, %(batch)s::int) AS g
""")


def timed(dsn: str, runs: int, call: Callable[[psycopg.Connection[Any]], Any]) -> str:
    """The first run on a new connection (cold), and the median and max of the others."""
    took = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(runs):
            began = time.perf_counter()
            call(conn)
            took.append((time.perf_counter() - began) * 1000)
    cold, warm = took[0], took[1:] or took
    return (
        f"cold {cold:8.1f} ms   warm median {statistics.median(warm):8.1f} ms, "
        f"max {max(warm):8.1f} ms"
    )


def load(dsn: str, rows: int, queues: int) -> None:
    began = time.monotonic()
    with psycopg.connect(dsn, autocommit=True) as conn:
        for first in range(1, rows + 1, CHUNK):
            last = min(first + CHUNK - 1, rows)
            conn.execute(LOAD, {"queues": queues, "rows": rows, "first": first, "last": last})
            print(f"  {last:,} rows ({time.monotonic() - began:.0f} s)", file=sys.stderr)
        conn.execute(tables.query("VACUUM ANALYZE {dlq}"))
        conn.execute(tables.query("VACUUM ANALYZE {dlq_causes}"))
    print(f"loaded {rows:,} DLQ rows in {time.monotonic() - began:.0f} s (with the triggers)")


def write_cost(dsn: str, batch: int, runs: int) -> dict[str, str]:
    """An INSERT of `batch` dead letters, with and without the counting trigger; each in a
    transaction rolled back, so the DLQ stays as loaded."""
    results = {}
    with psycopg.connect(dsn) as conn:
        for label, trigger in (("with the trigger", True), ("without it", False)):
            took = []
            for _ in range(runs):
                with conn.transaction(force_rollback=True):
                    if not trigger:
                        conn.execute(tables.query("ALTER TABLE {dlq} DISABLE TRIGGER USER"))
                    began = time.perf_counter()
                    conn.execute(BATCH, {"batch": batch})
                    took.append((time.perf_counter() - began) * 1000)
            results[f"insert {batch} rows, {label}"] = (
                f"median {statistics.median(took):8.2f} ms, max {max(took):8.2f} ms"
            )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.dlq_groups", description=__doc__.split("\n")[0]
    )
    add_dsn(parser)
    parser.add_argument("--rows", type=int, default=1_000_000, help="DLQ rows loaded")
    parser.add_argument("--queues", type=int, default=8)
    parser.add_argument("--runs", type=int, default=7, help="timed runs of each grouping")
    parser.add_argument("--scan-runs", type=int, default=3, help="timed runs of the full scan")
    parser.add_argument("--batch", type=int, default=500, help="rows per timed DLQ insert")
    args = parser.parse_args(argv)
    farm = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)
    names = farm.names
    with server(args.dsn) as admin, scratch(admin, farm) as dsn:
        load(dsn, args.rows, args.queues)
        with psycopg.connect(dsn, autocommit=True) as conn:
            top = dlq_causes(conn, names, DlqFilter())
        print(f"{len(top)} causes shown of the most frequent; the first three:")
        for group in top[:3]:
            print(f"  {group.rows:>9,} x {group.cause}")
        print(f"{args.rows:,} dead letters, {args.runs} runs each:")
        cases: dict[str, Callable[[psycopg.Connection[Any]], Any]] = {
            "causes, unfiltered": lambda c: dlq_causes(c, names, DlqFilter()),
            "causes of one queue": lambda c: dlq_causes(c, names, DlqFilter(queue="queue_3")),
            "causes of one reason": lambda c: dlq_causes(c, names, DlqFilter(reason="rejected")),
            "list --cause, first page": lambda c: dlq_list(c, names, DlqFilter(cause=top[0].cause)),
            "causes, failed in the last hour": lambda c: dlq_causes(
                c, names, DlqFilter(since=When(ago=3600))
            ),
        }
        for label, call in cases.items():
            print(f"  {label:<34} {timed(dsn, args.runs, call)}")
        scan = tables.query(
            "SELECT {dlq_cause_fn}(last_exception), count(*) FROM {dlq} "
            "GROUP BY 1 ORDER BY 2 DESC LIMIT 20"
        )
        result = timed(dsn, args.scan_runs, lambda c: c.execute(scan).fetchall())
        print(f"  {'without kept counts: GROUP BY':<34} {result}")
        for label, result in write_cost(dsn, args.batch, args.runs).items():
            print(f"  {label:<34} {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
