"""The producer host's program: `python -m loadtests.scale.producer`, run in its namespace.

Publishes the way the load test does (`loadtests.expected.publish`: the outbox row and its
`loadtest_expected` row in one transaction), either at a steady rate for a time or as one
backlog in a single transaction, and writes each message's id with the wall-clock time its
commit returned to `--commits`. The farm hosts note their handler starts on the same kernel
clock, so commit -> handler start is a subtraction, with no clock to synchronise.

The last line on stdout is a JSON summary: {"committed": N, "failed": F, "seconds": S}.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any

import psycopg

from loadtests.common import expected, tables
from outbox_farm import Farm

PRODUCER = Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)
QUEUE = "work"
TXNS_PER_SECOND = 50  # the steady rate is spread over this many transactions a second
BACKLOG_CHUNK = 5_000  # rows per statement batch inside the backlog's one transaction


def _publish(
    conn: psycopg.Connection[Any], count: int, expect: bool, due: datetime | None = None
) -> list[str]:
    """`count` messages in the caller's transaction, due at `due` (default: now); their ids."""
    if expect and due is None:
        bodies = expected.publish(conn, PRODUCER, QUEUE, count=count, expect="success")
        return [b["id"] for b in bodies]
    if expect:
        raise ValueError("a backlog due later is published without expectations")
    bodies = [{"id": uuid.uuid4().hex, "queue": QUEUE} for _ in range(count)]
    PRODUCER.publish_batch(conn, bodies, queue=QUEUE, activate_at=due)
    return [b["id"] for b in bodies]


def steady(
    dsn: str, rate: float, seconds: float, out: IO[str], halt: threading.Event
) -> dict[str, float]:
    """`rate` msg/s for `seconds` (or until `halt`); a failed transaction is retried on a new
    connection, as an application would, and counted."""
    batch = max(1, round(rate / TXNS_PER_SECOND))
    committed = failed = 0
    began = time.monotonic()
    next_at = began
    conn: psycopg.Connection[Any] | None = None
    while not halt.is_set() and time.monotonic() - began < seconds:
        try:
            if conn is None or conn.closed or conn.broken:
                conn = psycopg.connect(dsn, connect_timeout=5, application_name="scale-producer")
            with conn.transaction():
                ids = _publish(conn, batch, expect=True)
            now = time.time()
            out.writelines(f"{i}\t{now:.6f}\n" for i in ids)
            committed += len(ids)
        except psycopg.Error:
            failed += 1
            if conn is not None:
                conn.close()
            conn = None
            halt.wait(0.2)
        next_at += batch / rate
        delay = next_at - time.monotonic()
        if delay > 0:
            halt.wait(delay)
        else:
            next_at = time.monotonic()  # behind: never burst to catch up
    if conn is not None:
        conn.close()
    return {"committed": committed, "failed": failed, "seconds": time.monotonic() - began}


def backlog(dsn: str, rows: int, due: float | None, out: IO[str]) -> dict[str, float]:
    """`rows` messages committed together, due at the epoch `due` if given: the farms see all
    of them at the same instant, and the harness knows that instant beforehand."""
    began = time.monotonic()
    ids: list[str] = []
    at = datetime.fromtimestamp(due, UTC) if due is not None else None
    with psycopg.connect(dsn, connect_timeout=10, application_name="scale-producer") as conn:
        with conn.transaction():
            for start in range(0, rows, BACKLOG_CHUNK):
                ids += _publish(conn, min(BACKLOG_CHUNK, rows - start), at is None, at)
        now = time.time()
    out.writelines(f"{i}\t{now:.6f}\n" for i in ids)
    return {"committed": len(ids), "failed": 0, "seconds": time.monotonic() - began, "at": now}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.scale.producer")
    parser.add_argument("--dsn", required=True)
    parser.add_argument("--commits", required=True, type=Path, help="file: id<TAB>commit time")
    parser.add_argument("--rate", type=float, help="steady: messages per second")
    parser.add_argument("--seconds", type=float, default=10.0, help="steady: for this long")
    parser.add_argument("--backlog", type=int, help="one transaction of this many messages")
    parser.add_argument(
        "--due", type=float, help="backlog: due at this epoch time (no loadtest_expected rows)"
    )
    args = parser.parse_args(argv)
    halt = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: halt.set())
    with args.commits.open("a", encoding="utf-8") as out:
        if args.backlog:
            summary = backlog(args.dsn, args.backlog, args.due, out)
        elif args.rate:
            summary = steady(args.dsn, args.rate, args.seconds, out, halt)
        else:
            parser.error("give --rate or --backlog")
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
