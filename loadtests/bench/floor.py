"""The database's floor for a drain: the same pre-loaded rows claimed and deleted by the least
SQL that can do it, from raw psycopg connections, with no outbox_farm code in the loop.

Each of --clients processes repeats, on its own autocommit connection, two statements: a claim
of --batch due rows (`FOR UPDATE SKIP LOCKED`, a fresh token, the delivery counted, as the
farm's claim does without its expired-lease, ordering and unloadable-value branches) and a
`DELETE ... WHERE id = ANY(...) AND acquired_token = ...` of what it claimed, until a claim
comes back empty. The claim reads the same partial index as the farm's (hence `NOT
key_blocked`: without it the index does not apply, and each claim read the dead entries of
every row claimed before it, so the floor fell as the rows grew: 33,000 msg/s for 100,000
rows where 95,000 is right), and commits without waiting for its WAL flush, as the farm's
claim of rows without an ordering key does. What the farm adds on top of that (handlers,
verdicts, metrics, leases kept alive) is the gap between this rate and the farm's drain of the
same rows.

    python -m loadtests.bench.floor --dsn "host=127.0.0.1 user=postgres dbname=postgres"
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
import uuid
from typing import Any

import psycopg
from psycopg import sql

from loadtests.common import tables
from outbox_farm import Farm

from .common import QUEUE, add_dsn, scratch, server
from .farm import preload

CLAIM = """
WITH quick AS MATERIALIZED (
    SELECT set_config('synchronous_commit', 'off', true)
), c AS (
    SELECT id FROM {outbox}
    WHERE queue = %(queue)s AND acquired_token IS NULL AND NOT key_blocked
      AND next_attempt_at <= now()
    ORDER BY next_attempt_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE {outbox} AS o
SET acquired_token = %(token)s, acquired_at = now(),
    lease_expires_at = now() + interval '30 seconds', deliveries_count = o.deliveries_count + 1
FROM c LEFT JOIN quick ON true WHERE o.id = c.id
RETURNING o.id, o.payload, o.headers
"""
DELETE = "DELETE FROM {outbox} WHERE id = ANY(%(ids)s) AND acquired_token = %(token)s"
CLIENTS = 4
BATCH = 256


def statements() -> tuple[sql.Composed, sql.Composed]:
    """`CLAIM` and `DELETE` for the default tables."""
    outbox = Farm().names.outbox.identifier()
    return sql.SQL(CLAIM).format(outbox=outbox), sql.SQL(DELETE).format(outbox=outbox)


def claim_and_delete(
    conn: psycopg.Connection[Any], claim: sql.Composed, delete: sql.Composed, limit: int
) -> tuple[list[Any], float]:
    """One claim of up to `limit` rows under a fresh token, then the DELETE of what it took;
    the rows (id, payload, headers) and `time.time()` as the claim returned them."""
    token = uuid.uuid4()
    rows = conn.execute(claim, {"queue": QUEUE, "limit": limit, "token": token}).fetchall()
    claimed = time.time()
    if rows:
        conn.execute(delete, {"ids": [row[0] for row in rows], "token": token})
    return rows, claimed


def _client(dsn: str, batch: int, start: multiprocessing.synchronize.Event) -> None:
    claim, delete = statements()
    with psycopg.connect(dsn, autocommit=True) as conn:
        start.wait()
        while claim_and_delete(conn, claim, delete, batch)[0]:
            pass


def floor_run(dsn: str, rows: int, clients: int = CLIENTS, batch: int = BATCH) -> dict[str, float]:
    """Pre-load `rows`, drain them with `clients` raw loops; the rate, first claim to last."""
    preload(dsn, rows)
    context = multiprocessing.get_context("spawn")
    start = context.Event()
    procs = [context.Process(target=_client, args=(dsn, batch, start)) for _ in range(clients)]
    for proc in procs:
        proc.start()
    time.sleep(1.0)  # every client connected and waiting (a spawned interpreter starts slowly)
    began = time.perf_counter()
    start.set()
    for proc in procs:
        proc.join(timeout=300)
    elapsed = time.perf_counter() - began
    failed = [proc.exitcode for proc in procs if proc.exitcode != 0]
    if failed:
        raise SystemExit(f"a floor client failed (exit codes {failed})")
    with psycopg.connect(dsn) as conn:
        left = conn.execute(
            sql.SQL("SELECT count(*) FROM {}").format(Farm().names.outbox.identifier())
        ).fetchone()
    if left != (0,):
        raise SystemExit(f"the floor clients left {left} rows")
    return {"rate": rows / elapsed, "seconds": elapsed, "clients": clients, "batch": batch}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.floor", description=__doc__.split("\n\n")[0]
    )
    add_dsn(parser)
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--clients", type=int, default=CLIENTS)
    parser.add_argument("--batch", type=int, default=BATCH)
    args = parser.parse_args(argv)
    farm = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)
    with server(args.dsn) as admin, scratch(admin, farm) as dsn:
        result = floor_run(dsn, args.rows, args.clients, args.batch)
    print(
        f"floor: {args.rows:,} rows claimed and deleted by {args.clients} raw connections, "
        f"{args.batch} per claim: {result['rate']:,.0f} msg/s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
