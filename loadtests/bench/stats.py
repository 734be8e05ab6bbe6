"""How fast `outbox-farm stats` answers on a large outbox: 10 million rows by default.

A scratch database (created here, dropped at the end) gets --rows outbox rows over --queues
queues, in the mix a farm that has fallen behind shows: 80% ready, 10% scheduled (half of them
retries), 5% leased, 5% leased with an expired lease; and --dlq-rows DLQ rows spread over the
last 30 days and the three failure reasons. Then `queue_stats` (what `stats` runs) is timed
--runs times, twice: after ANALYZE only (no visibility map: index scans visit the heap), and
after VACUUM (index-only scans), and the EXPLAIN of each count is checked to be an index scan.

    python -m loadtests.bench.stats --dsn "host=127.0.0.1 user=postgres dbname=postgres"
    python -m loadtests.bench.stats --rows 1000000 --runs 3

Without --dsn (and without OUTBOX_FARM_DSN) the embedded Postgres is started.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import psycopg

from loadtests.common import tables
from outbox_farm import Farm
from outbox_farm.admin import queue_stats
from outbox_farm.db.operator import OUTBOX_CONDITIONS, AdminSql

from .common import add_dsn, scratch, server

CHUNK = 1_000_000

LOAD = tables.query("""
INSERT INTO {outbox} (queue, payload, headers, attempts_count, deliveries_count, next_attempt_at,
                    acquired_at, acquired_token, lease_expires_at)
SELECT 'queue_' || (g %% %(queues)s),
       convert_to('{"order_id": ' || g || '}', 'UTF8'),
       '{"content-type": "application/json"}'::jsonb,
       CASE WHEN g %% 100 BETWEEN 80 AND 84 THEN 2 ELSE 0 END,
       CASE WHEN g %% 100 >= 80 THEN 1 ELSE 0 END,
       now() + CASE WHEN g %% 100 BETWEEN 80 AND 89 THEN interval '1 hour'
                    ELSE -interval '1 min' END,
       CASE WHEN g %% 100 >= 90 THEN now() END,
       CASE WHEN g %% 100 >= 90 THEN gen_random_uuid() END,
       CASE WHEN g %% 100 >= 95 THEN now() - interval '1 min'
            WHEN g %% 100 >= 90 THEN now() + interval '1 min' END
FROM generate_series(%(first)s::int, %(last)s::int) AS g
""")

LOAD_DLQ = tables.query("""
INSERT INTO {dlq} (original_id, queue, payload, headers, deliveries_count, created_at,
                        failed_at, failure_reason, last_exception)
SELECT g, 'queue_' || (g %% %(queues)s), '\\x00'::bytea, NULL, 3, now(),
       now() - make_interval(secs => (g %% 2592000)::float8),
       (ARRAY['max_deliveries', 'retry_terminal', 'rejected'])[1 + g %% 3],
       'RuntimeError(''boom'')'
FROM generate_series(1, %(rows)s::int) AS g
""")


def load(dsn: str, rows: int, queues: int, dlq_rows: int) -> None:
    started = time.monotonic()
    with psycopg.connect(dsn, autocommit=True) as conn:
        for first in range(1, rows + 1, CHUNK):
            last = min(first + CHUNK - 1, rows)
            conn.execute(LOAD, {"queues": queues, "first": first, "last": last})
            print(f"  loaded {last:,} rows ({time.monotonic() - started:.0f} s)", flush=True)
        conn.execute(LOAD_DLQ, {"queues": queues, "rows": dlq_rows})
        print(f"  loaded {dlq_rows:,} DLQ rows ({time.monotonic() - started:.0f} s)", flush=True)


def time_stats(dsn: str, farm: Farm, runs: int) -> dict[str, Any]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        seconds = []
        for _ in range(runs):
            began = time.perf_counter()
            result = queue_stats(conn, farm.names)
            seconds.append(time.perf_counter() - began)
    exact = sum(c.exact for q in result for c in q.counts.values())
    total = sum(len(q.counts) for q in result)
    return {
        "median_s": statistics.median(seconds),
        "max_s": max(seconds),
        "queues": len(result),
        "exact_counts": f"{exact}/{total}",
        "sample": {k: (v.value, v.exact) for k, v in result[0].counts.items()},
    }


def plans(dsn: str, farm: Farm) -> dict[str, str]:
    """The scan each outbox count would use on queue_0."""
    sql = AdminSql(farm.names)
    found = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for name, condition in OUTBOX_CONDITIONS.items():
            statement = sql.render(
                "admin_explain", statement="admin_count", table="outbox", condition=condition
            )
            row = conn.execute(statement, {"queue": "queue_0", "cap": 10_001}).fetchone()
            assert row is not None
            node = row[0][0]["Plan"]
            while node.get("Plans"):
                node = node["Plans"][0]
            found[name] = f"{node['Node Type']} {node.get('Index Name', '')}".strip()
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.stats", description=__doc__.split("\n")[0]
    )
    add_dsn(parser)
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--queues", type=int, default=4)
    parser.add_argument("--dlq-rows", type=int, default=200_000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    farm = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)
    with server(args.dsn) as admin, scratch(admin, farm) as dsn:
        print(f"loading {args.rows:,} rows over {args.queues} queues")
        load(dsn, args.rows, args.queues, args.dlq_rows)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(tables.query("ANALYZE {outbox}"))
            conn.execute(tables.query("ANALYZE {dlq}"))
            size = conn.execute(
                "SELECT pg_size_pretty(pg_total_relation_size(%s))", [tables.OUTBOX]
            )
            print(f"outbox table with indexes: {(size.fetchone() or ('?',))[0]}")
        print("plans:", plans(dsn, farm))
        print("after ANALYZE only:", time_stats(dsn, farm, args.runs))
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(tables.query("VACUUM {outbox}"))
            conn.execute(tables.query("VACUUM {dlq}"))
        print("after VACUUM:      ", time_stats(dsn, farm, args.runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
