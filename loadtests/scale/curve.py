"""Scale curve: 1, 2 and 3 farm hosts (--procs 2 each) draining the same backlog with a
no-op handler, and what that cost the database server.

The backlog is published in one transaction, due a few seconds later, while the farms stand
ready: every host sees it at the same instant, and the farms' start-up is not timed. Measured
from the first row taken to the table empty: messages per second, the database server's CPU
seconds (its whole process tree, from /proc: `dbserver.Server.cpu`) and the farms'.

Every host, the database and the harness share this machine's cores: the curve shows where
adding hosts stops helping on *this* server, and that the harness measures it, not what a real
server on its own machine would reach.
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg

from .bed import Bed, database, farms, machine_busy, say, timed_drain
from .hosts import FarmHost, produce


def drain(
    bed: Bed, dsn: str, conn: psycopg.Connection[Any], rows: int, runs: list[FarmHost], tag: str
) -> dict[str, float]:
    """Publish `rows` due in a few seconds, time their drain, and sample the CPU counters of
    the database server, the farms and the machine when the clock starts and stops."""
    due = time.time() + 2.0 + rows / 10_000
    args = ("--backlog", str(rows), "--due", str(due))
    produce(bed.producer, dsn, bed.work / f"curve-{tag}.tsv", *args, timeout=180)
    before: list[float] = []

    def sample() -> list[float]:
        return [bed.server.cpu(), sum(r.cpu() for r in runs), machine_busy()]

    seconds, handled = timed_drain(conn, rows, due, 120.0, lambda: before.extend(sample()))
    after = sample()
    used = [a - b for a, b in zip(after, before, strict=True)] if before else [0.0] * 3
    return {
        "msg_per_s": handled / seconds if seconds else 0.0,
        "seconds": seconds,
        "handled": handled,
        "db_cpu_s": used[0],
        "farm_cpu_s": used[1],
        "machine_busy_s": used[2],
    }


def run(bed: Bed, smoke: bool) -> dict[str, Any]:
    rows = 10_000 if smoke else 50_000
    counts = (1, 2) if smoke else (1, 2, 3)
    out: list[dict[str, Any]] = []
    for n in counts:
        # A database of its own per step, so that each drains the same table from the same
        # state: a second backlog in one database, right after a drain, cost the server 5-15x
        # the CPU per message here, even after a VACUUM ANALYZE of the emptied table.
        with (
            database(bed) as dsn,
            psycopg.connect(dsn, autocommit=True, connect_timeout=10) as conn,
            farms(bed, dsn, n, 2, {"SCALE_JOURNAL": ""}, name=f"curve-{n}") as runs,
        ):
            got = drain(bed, dsn, conn, rows, runs, str(n))
            for run in runs:
                run.stop()
            row = {
                "hosts": n,
                "procs": 2 * n,
                "msg_per_s": round(got["msg_per_s"]),
                "drain_s": round(got["seconds"], 2),
                "db_cpu_s": round(got["db_cpu_s"], 2),
                "db_cores": round(got["db_cpu_s"] / got["seconds"], 2) if got["seconds"] else 0.0,
                "db_cpu_us_per_msg": round(got["db_cpu_s"] / rows * 1e6, 1),
                "farm_cpu_s": round(got["farm_cpu_s"], 2),
                "machine_busy_cores": round(got["machine_busy_s"] / got["seconds"], 2)
                if got["seconds"]
                else 0.0,
            }
            say(f"scale: {row}")
            out.append(row)
    return {
        "scenario": "scale",
        "ok": all(r["msg_per_s"] > 0 for r in out),
        "rows": rows,
        "cpus": os.cpu_count(),
        "note": f"this machine has {os.cpu_count()} CPU(s), shared by the database, every farm "
        "host and the harness: the curve shows the harness working and its shape, not what a "
        "server of its own would reach",
        "curve": out,
    }
