"""Transactional handlers benchmark: what completing the row inside the handler's transaction
costs against a plain handler doing the same insert.

    python -m loadtests.bench.transactional --dsn "host=127.0.0.1 user=postgres dbname=postgres"

In one run, on one scratch database, `outbox-farm start --procs 2` drains --rows rows twice:
with a plain handler that inserts one row into `effects` on a pooled connection of its own
(autocommit: one commit per message, its ack batched by the completer), then with
`transactional=True` inserting the same row on the connection it is given (one commit per
message covering the insert and the row's deletion). Both check every effect was written once.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import psycopg

from loadtests.common import tables
from loadtests.common.harness import note
from outbox_farm import Farm

from .common import add_dsn, scratch, server
from .farm import drain_run
from .report import print_measures, verdict

CONCURRENCY = 16
APP = f"""
import os
from psycopg_pool import AsyncConnectionPool
from outbox_farm import Farm
from loadtests.common.tables import DLQ, OUTBOX
farm = Farm(table=OUTBOX, dlq_table=DLQ)
_pool = []

@farm.handler("bench", concurrency={CONCURRENCY})
async def plain(msg):
    if not _pool:
        _pool.append(AsyncConnectionPool(
            os.environ["BENCH_DSN"], min_size={CONCURRENCY}, max_size={CONCURRENCY},
            kwargs={{"autocommit": True}}, open=False))
        await _pool[0].open()
    async with _pool[0].connection() as conn:
        await conn.execute("INSERT INTO effects VALUES (%s)", (msg.id,))

tx = Farm(table=OUTBOX, dlq_table=DLQ)

@tx.handler("bench", concurrency={CONCURRENCY}, transactional=True)
async def in_transaction(msg, conn):
    await conn.execute("INSERT INTO effects VALUES (%s)", (msg.id,))
"""


def run(dsn: str, rows: int, appdir: Path, app: str) -> tuple[float, bool]:
    """The drain's rate, and whether `effects` holds exactly one row per message."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS effects")
        conn.execute("CREATE TABLE effects (msg_id bigint PRIMARY KEY)")
    rate = drain_run(dsn, 2, rows, appdir, app=app, env={"BENCH_DSN": dsn})["rate"]
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM effects").fetchone()
    return rate, row is not None and row[0] == rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.transactional", description=__doc__.split("\n\n")[0]
    )
    add_dsn(parser)
    parser.add_argument("--rows", type=int, default=20_000)
    args = parser.parse_args(argv)
    with (
        server(args.dsn) as admin,
        scratch(admin, Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)) as dsn,
        tempfile.TemporaryDirectory() as folder,
    ):
        appdir = Path(folder)
        (appdir / "txapp.py").write_text(APP)
        note(f"draining {args.rows:,} rows with a plain handler that inserts, --procs 2 ...")
        plain, plain_ok = run(dsn, args.rows, appdir, "txapp:farm")
        note(f"draining {args.rows:,} rows with a transactional handler, --procs 2 ...")
        tx, tx_ok = run(dsn, args.rows, appdir, "txapp:tx")
    print()
    print_measures(
        [
            ("plain handler + insert (msg/s)", f"{plain:,.0f}", "-", verdict(plain_ok)),
            ("transactional handler + insert (msg/s)", f"{tx:,.0f}", "-", verdict(tx_ok)),
            ("  transactional / plain", f"{tx / plain:.2f}", "-", verdict(None)),
        ],
        widths=(44, 12, 4),
    )
    return 0 if plain_ok and tx_ok else 1


if __name__ == "__main__":
    sys.exit(main())
