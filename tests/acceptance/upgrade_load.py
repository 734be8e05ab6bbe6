"""A producer for the upgrade test, run by whichever release is on the import path.

    python upgrade_load.py DSN FIRST RECORD STOP

Publishes numbered bodies from FIRST on, one transaction at a time (a keyed `publish`, an
unkeyed one and a keyed `publish_batch` of three), until the file STOP exists, pausing
PACE between transactions. After each
commit it appends the numbers it committed to RECORD; a failed publish is printed and makes
the exit status 1. Only calls the previous release has too.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import psycopg

from outbox_farm import Farm

KEYS = 5  # keys shared by every producer, so each key's line spans the switch
PACE = 0.01  # seconds between transactions: a steady load, not a saturating one


def main(dsn: str, first: int, record: Path, stop: Path) -> int:
    farm = Farm("outbox", "outbox_dlq")
    failed = 0
    n = first
    with psycopg.connect(dsn) as conn, record.open("a") as out:
        while not stop.exists():
            try:
                with conn.transaction():
                    farm.publish(conn, {"n": n}, queue="up", ordering_key=f"k{n % KEYS}")
                    farm.publish(conn, {"n": n + 1}, queue="up")
                    bodies = [{"n": n + i} for i in range(2, 5)]
                    farm.publish_batch(conn, bodies, queue="up", ordering_key=f"k{n % KEYS}")
            except psycopg.Error as exc:
                failed += 1
                print(f"publish failed: {exc}", file=sys.stderr, flush=True)
            else:
                out.write("".join(f"{n + i}\n" for i in range(5)))
                out.flush()
            n += 5
            time.sleep(PACE)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])))
