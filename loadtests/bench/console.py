"""What the web console's pages cost on a large DLQ: 1,000,000 rows by default.

A scratch database (created beside the one named, dropped at the end) gets --rows DLQ rows in
one INSERT ... SELECT over generate_series: 10 queues and a rare one (its 500 rows the oldest),
the four failure reasons, failure times spread over 30 days, a JSON payload, headers with a
correlation id and an exception with frames, as the farm writes them. Then `outbox-farm
console` is started as a subprocess (as an operator runs it) and each page is fetched --runs
times over HTTP, after one warm-up fetch; the median, the 95th percentile and the slowest are
printed in milliseconds.

    python -m loadtests.bench.console --dsn "host=127.0.0.1 user=postgres dbname=postgres"
    python -m loadtests.bench.console --rows 200000 --runs 10

Without --dsn (and without OUTBOX_FARM_DSN) the embedded Postgres is started. The budget the
console is held to is 200 ms for the DLQ list (unfiltered and by queue, reason or time, any
page) and for a row's page; a text search reads every row it cannot rule out, so it is timed
and shown but is not held to it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psycopg

from loadtests.common import tables
from loadtests.common.harness import free_port
from outbox_farm import Farm

from .common import add_dsn, scratch, server

BUDGET_MS = 200.0
FILL = tables.query("""
INSERT INTO {dlq} (original_id, queue, payload, headers, deliveries_count, created_at,
                        failed_at, failure_reason, last_exception)
SELECT g, CASE WHEN g <= 500 THEN 'queue_rare' ELSE 'queue_' || (g % 10) END,
       convert_to('{"order_id": ' || g || ', "sku": "SKU-' || (g % 977) || '", "lines": 3}',
                  'UTF8'),
       jsonb_build_object('content-type', 'application/json',
                          'correlation_id', md5(g::text), 'tenant', 'acme'),
       1 + g % 10, now() - make_interval(secs => (%(rows)s - g)::float8 * 2.6),
       now() - make_interval(secs => (%(rows)s - g)::float8 * 2.5),
       (ARRAY['max_deliveries', 'retry_terminal', 'rejected', 'invalid_row'])[1 + g % 4],
       'KeyError(''sku-' || (g % 977) || ''')' || E'\\nTraceback (innermost frames last):\\n'
       || E'  File "/srv/app/orders.py", line 41, in handle\\n    price = PRICES[order.sku]'
FROM generate_series(1, %(rows)s) AS g
""")


# One row with a 10 MB payload: its page shows the first 64 KiB and offers the rest.
BIG = tables.query("""
INSERT INTO {dlq} (original_id, queue, payload, headers, deliveries_count, created_at,
                        failed_at, failure_reason, last_exception)
VALUES (0, 'queue_big', convert_to(repeat('x', 10000000), 'UTF8'),
        '{"content-type": "text/plain"}', 1, now(), now(), 'rejected', 'TooBig()')
""")


def fill(dsn: str, rows: int) -> None:
    began = time.monotonic()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(FILL.replace("%(rows)s", str(int(rows))))
        conn.execute(BIG)
        conn.execute(tables.query("VACUUM (ANALYZE) {dlq}"))
    print(f"filled {rows:,} DLQ rows in {time.monotonic() - began:.1f} s", flush=True)


def fetch(url: str) -> float:
    began = time.perf_counter()
    with urllib.request.urlopen(url, timeout=60) as reply:
        reply.read()
        if reply.status != 200:
            raise RuntimeError(f"{url} answered {reply.status}")
    return (time.perf_counter() - began) * 1000


def pages(dsn: str, rows: int) -> list[tuple[str, str, bool]]:
    """(label, path, held to the budget) of every page timed."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            tables.query(
                "SELECT min(id), max(id) FILTER (WHERE queue <> 'queue_big'), "
                "max(id) FILTER (WHERE queue = 'queue_big') FROM {dlq}"
            )
        ).fetchone()
    assert row is not None
    low, high, big = int(row[0]), int(row[1]), int(row[2])
    middle = (low + high) // 2
    return [
        ("DLQ list, newest page", "/dlq", True),
        ("DLQ list, a page in the middle", f"/dlq?before={middle}&page=10000", True),
        ("DLQ list, oldest pages", f"/dlq?before={low + 60}&page=19999", True),
        ("DLQ list, one queue", "/dlq?queue=queue_3", True),
        ("DLQ list, one queue, middle", f"/dlq?queue=queue_3&before={middle}&page=1000", True),
        ("DLQ list, one reason", "/dlq?reason=rejected", True),
        ("DLQ list, queue and reason", "/dlq?queue=queue_3&reason=retry_terminal", True),
        ("DLQ list, queue and reason, none match", "/dlq?queue=queue_5&reason=rejected", True),
        ("DLQ list, one reason, middle", f"/dlq?reason=rejected&before={middle}&page=100", True),
        ("DLQ list, failed in the last hour", "/dlq?since=1h", True),
        ("DLQ list, failed 10 to 20 days ago", "/dlq?since=20d&until=10d", True),
        ("DLQ list, a queue nobody has", "/dlq?queue=nobody", True),
        ("DLQ list, a rare queue (oldest rows)", "/dlq?queue=queue_rare", True),
        ("DLQ list, a rare queue, second page", "/dlq?queue=queue_rare&before=450&page=2", True),
        ("DLQ row page, newest", f"/dlq/{high}", True),
        ("DLQ row page, oldest", f"/dlq/{low}", True),
        ("DLQ row page, 10 MB payload", f"/dlq/{big}", True),
        ("DLQ list, text in the newest rows", "/dlq?text=SKU-5", False),
        ("DLQ list, text nowhere (reads every row)", "/dlq?text=no-such-text", False),
        ("overview", "/", False),
        ("farm", "/farm", False),
    ]


def run(admin: str, rows: int, runs: int) -> int:
    farm = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)
    with scratch(admin, farm) as dsn:
        fill(dsn, rows)
        port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_FARM_")}
        command = [
            str(Path(sys.executable).parent / "outbox-farm"),
            "console",
            "--dsn",
            dsn,
            "--bind",
            f"127.0.0.1:{port}",
            "--metrics-url",
            "",
            "--log-level",
            "WARNING",
        ]
        proc = subprocess.Popen(command, env=env)
        try:
            base = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while True:
                try:
                    fetch(base + "/farm")
                    break
                except OSError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise RuntimeError("the console did not start") from None
                    time.sleep(0.2)
            over = 0
            print(f"{'page':44} {'median':>9} {'p95':>9} {'max':>9}   (ms, {runs} runs each)")
            for label, path, held in pages(dsn, rows):
                fetch(base + path)  # warm-up: the connection, the plan, the cache
                took = sorted(fetch(base + path) for _ in range(runs))
                p95 = took[min(len(took) - 1, round(0.95 * (len(took) - 1)))]
                mark = ""
                if held and p95 > BUDGET_MS:
                    over += 1
                    mark = f"  OVER the {BUDGET_MS:.0f} ms budget"
                elif not held:
                    mark = "  (not held to the budget)"
                median = statistics.median(took)
                print(f"{label:44} {median:9.1f} {p95:9.1f} {took[-1]:9.1f}{mark}", flush=True)
            return 1 if over else 0
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_dsn(parser)
    parser.add_argument("--rows", type=int, default=1_000_000, help="DLQ rows to fill in")
    parser.add_argument("--runs", type=int, default=20, help="fetches of each page")
    args = parser.parse_args()
    with server(args.dsn) as admin:
        sys.exit(run(admin, args.rows, args.runs))


if __name__ == "__main__":
    main()
