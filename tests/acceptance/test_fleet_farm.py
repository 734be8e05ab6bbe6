"""`outbox-farm start app:fleet` as a subprocess: two worker processes share four databases
(and a fifth that cannot be reached) through leases in the home database; every row of every
database is handled, a worker killed with SIGKILL has its databases served again by the other
processes before its leases would have expired, /healthz names the unreachable database as
degraded, /metrics carries a `database` label, and the fleet commands report the set.

The handler records each row it ran in the home database's `ledger`, which is how lost and
duplicated deliveries are counted. Every wait is a deadline-bounded poll on a condition.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox_farm.names import TableNames
from outbox_farm.testing.databases import Templates
from tests.acceptance.test_cli import run
from tests.acceptance.test_farm import farm_process, scalar
from tests.steps import publish, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.one_server]

Conn = psycopg.Connection[Any]
TENANTS = 4
ROWS = 40  # per tenant, per wave
LEASE = 3.0
TABLES = TableNames.build("outbox", "outbox_dlq")

FLEETAPP = '''\
"""Acceptance-test app: one farm, one queue "q", served in every database of FLEETAPP_SET."""
import os

import psycopg

from outbox_farm import Farm, Message
from outbox_farm.fleet import Fleet

farm = Farm(table="outbox", dlq_table="outbox_dlq")
_box = []


@farm.handler("q")
async def q(msg: Message) -> None:
    if not _box:
        _box.append(
            await psycopg.AsyncConnection.connect(os.environ["FARMAPP_DSN"], autocommit=True)
        )
    await _box[0].execute(
        "INSERT INTO ledger (tenant, n, pid) VALUES (%s, %s, %s)",
        (msg.json()["tenant"], msg.json()["n"], os.getpid()),
    )


fleet = Fleet(
    farm,
    databases=os.environ["FLEETAPP_SET"],
    lease=float(os.environ["FLEETAPP_LEASE"]),
    recheck=1.0,
)
'''


@pytest.fixture
def tenants(outbox_templates: Templates) -> Iterator[dict[str, str]]:
    with contextlib.ExitStack() as stack:
        yield {
            f"tenant_{i}": stack.enter_context(outbox_templates.database(TABLES))
            for i in range(TENANTS)
        }


@pytest.fixture
def fleet_app(tmp_path: Path, conn: Conn, tenants: dict[str, str]) -> Path:
    (tmp_path / "fleetapp.py").write_text(FLEETAPP)
    broken = "host=127.0.0.1 port=1 dbname=nowhere user=nobody connect_timeout=2"
    lines = ["[databases]", *(f'{k} = "{v}"' for k, v in tenants.items()), f'broken = "{broken}"']
    (tmp_path / "databases.toml").write_text("\n".join(lines) + "\n")
    conn.execute("CREATE TABLE ledger (tenant text, n int, pid int)")
    return tmp_path


def publish_wave(tenants: dict[str, str], wave: int) -> None:
    for name, dsn in tenants.items():
        publish(dsn, [{"tenant": name, "n": wave * ROWS + i} for i in range(ROWS)], queue="q")


def handled(conn: Conn) -> int:
    return int(scalar(conn, "SELECT count(DISTINCT (tenant, n)) FROM ledger"))


def holders(conn: Conn) -> dict[str, str]:
    rows = conn.execute(
        "SELECT database, holder FROM outbox_farm_fleet_leases WHERE expires_at > now()"
    ).fetchall()
    return {d: h for d, h in rows}


def test_two_processes_serve_every_database_and_take_over_from_a_killed_one(
    fleet_app: Path, dsn: str, conn: Conn, tenants: dict[str, str]
) -> None:
    env = {"FLEETAPP_SET": str(fleet_app / "databases.toml"), "FLEETAPP_LEASE": str(LEASE)}
    with farm_process(fleet_app, dsn, app="fleetapp:fleet", procs=2, **env) as farm:
        wait_for(lambda: farm.healthy(2), "both workers up", timeout=60, process=farm)
        publish_wave(tenants, 0)
        wait_for(lambda: handled(conn) == TENANTS * ROWS, "first wave", 60, farm)
        wait_for(lambda: len(holders(conn)) == TENANTS + 1, "every database leased")
        served = holders(conn)
        pids = {int(holder.rpartition(":")[2]) for holder in served.values()}
        assert pids == farm.children(), (served, farm.children())

        # /healthz: the unreachable database is degraded, by name; the farm is healthy.
        def broken_named() -> Any:
            got = farm.health()
            degraded = got[1].get("degraded", []) if got else []
            return got if any(line.startswith("database broken:") for line in degraded) else None

        status, detail = wait_for(broken_named, "the broken database named", 30, farm)
        assert status == 200, detail
        assert "problems" not in detail, detail

        victim = int(served["tenant_0"].rpartition(":")[2])
        killed_at = time.monotonic()
        os.kill(victim, signal.SIGKILL)

        def taken_over() -> bool:
            now = holders(conn)
            return len(now) == TENANTS + 1 and all(
                not h.endswith(f":{victim}") for h in now.values()
            )

        wait_for(taken_over, "the killed worker's databases taken", 30, farm)
        takeover = time.monotonic() - killed_at
        print(f"takeover after SIGKILL: {takeover:.2f}s (lease {LEASE}s)")
        publish_wave(tenants, 1)
        wait_for(lambda: handled(conn) == 2 * TENANTS * ROWS, "second wave", 60, farm)

        # The fleet commands see the same.
        home = ["--dsn", dsn]
        status_run = run(
            "fleet", "status", "fleetapp:fleet", *home, "--json", cwd=str(fleet_app), **env
        )
        report = json.loads(status_run.stdout)
        assert status_run.returncode == 0, status_run.stderr
        assert report["unserved"] == []
        assert len(report["processes"]) == 2

        code, _ = farm.stop()
        assert code == 0, farm.log_tail()
    assert conn.execute("SELECT count(*) FROM outbox_farm_fleet_leases").fetchone() == (0,)
    for name, tenant in tenants.items():
        with psycopg.connect(tenant) as tconn:
            assert scalar(tconn, "SELECT count(*) FROM outbox") == 0, name
    duplicates = scalar(conn, "SELECT count(*) - count(DISTINCT (tenant, n)) FROM ledger")
    print(f"duplicates: {duplicates} (rows of the killed worker, redelivered)")
