"""A queue's farm-wide limits across the processes of `outbox-farm start`, measured from what
the handlers recorded (`loadtests.common.limitsapp`): a rate held within 5 % over a minute by
three processes claiming against one database, a most running at once never passed and still
reached, and a process killed while holding part of that most gives it back once its leases
expire."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from loadtests.bench.limits import APP, RUNS, measure, overlap, set_limits
from loadtests.common.farmproc import farm_process
from outbox_farm import Farm
from outbox_farm.limits import Limits, Rate
from tests.steps import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.one_server]


def test_a_rate_and_a_most_running_hold_across_three_processes_for_a_minute(
    server_dsn: str,
) -> None:
    found = measure(
        server_dsn, procs=3, seconds=60.0, rate=Rate(100, 1.0), max_running=5, sleep=0.05
    )
    print(found)  # the numbers, for the log of a run
    assert abs(found.rate_error) <= 0.05, found
    assert found.most_overlapping == 5, found  # never more, and the limit was what held it


def running_by_pid(conn: psycopg.Connection[Any]) -> dict[int, int]:
    rows = conn.execute(
        "SELECT pid, count(*) FROM limit_runs WHERE queue = 'narrow' AND ended IS NULL GROUP BY pid"
    ).fetchall()
    return {pid: n for pid, n in rows}


def test_a_killed_process_gives_its_part_of_max_running_back(dsn: str, tmp_path: Path) -> None:
    farm = Farm(table="outbox", dlq_table="outbox_dlq")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(RUNS)
        set_limits(conn, "narrow", Limits(max_running=4))
        farm.publish_batch(conn, [{"n": n} for n in range(200)], queue="narrow")
        env = {"LIMITS_SLEEP": "1.5", "LIMITS_LEASE_TTL": "3", "LIMITS_CONCURRENCY": "4"}
        with farm_process(dsn, 2, tmp_path, APP, **env) as running:
            running.wait_healthy(60)
            wait_for(lambda: sum(running_by_pid(conn).values()) == 4, "four running", 30)
            # The process holding the most of the four: killed mid-run, its rows leased.
            victim, held = max(running_by_pid(conn).items(), key=lambda item: item[1])
            os.kill(victim, signal.SIGKILL)
            killed_at = time.time()

            def reached_again() -> bool:
                row = conn.execute(
                    "SELECT count(*) FROM limit_runs WHERE queue = 'narrow' AND ended IS NULL"
                    " AND started > %s AND pid <> %s",
                    [killed_at, victim],
                ).fetchone()
                return row is not None and row[0] == 4

            wait_for(reached_again, "four running again after the kill", 60)
            running.stop()
        runs = conn.execute(
            "SELECT started, CASE WHEN pid = %s THEN coalesce(ended, %s) ELSE ended END"
            " FROM limit_runs WHERE queue = 'narrow'",
            [victim, killed_at],
        ).fetchall()
    most, _ = overlap(runs, time.time(), 0.0)
    assert held >= 1
    assert most == 4  # never more than the limit, the killed runs counted until the kill
