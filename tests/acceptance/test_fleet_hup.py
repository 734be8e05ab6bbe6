"""`kill -HUP` to a fleet's arbiter (`outbox-farm start app:fleet --procs 2`, real processes,
real databases): with `recheck` an hour long, so that only the HUP explains it, a database
added to the file is served within seconds and one removed is let go, by the same worker
processes, while the databases that stay keep their holder and are never started again. When
the app's code changed on disk, the HUP rolls the workers out as well. A HUP to workers still
booting, and one during a roll, lose nothing and crash nothing.

The handler records each row it ran in the home database's `ledger`. Every wait is a
deadline-bounded poll on a condition.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox_farm.names import TableNames
from outbox_farm.testing.databases import Templates
from tests.acceptance.test_farm import RunningFarm, farm_process, scalar
from tests.acceptance.test_worker_faults import restarts
from tests.steps import publish, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.one_server]

Conn = psycopg.Connection[Any]
ROWS = 30  # per database, per wave
PICKED_UP = 15.0  # seconds a HUP may take to be acted on: a round or two, not the hour
TABLES = TableNames.build("outbox", "outbox_dlq")

HUPAPP = '''\
"""Acceptance-test app: one farm, one queue "q", served in every database of HUPAPP_SET."""
import os

import psycopg

from outbox_farm import Farm, Message
from outbox_farm.fleet import Fleet

VERSION = "{version}"
farm = Farm(table="outbox", dlq_table="outbox_dlq")
_box = []


@farm.handler("q")
async def q(msg: Message) -> None:
    if not _box:
        _box.append(
            await psycopg.AsyncConnection.connect(os.environ["FARMAPP_DSN"], autocommit=True)
        )
    await _box[0].execute(
        "INSERT INTO ledger (tenant, n, pid, version) VALUES (%s, %s, %s, %s)",
        (msg.json()["tenant"], msg.json()["n"], os.getpid(), VERSION),
    )


fleet = Fleet(farm, databases=os.environ["HUPAPP_SET"], lease=3.0, recheck=3600.0)
'''


@pytest.fixture
def tenants(outbox_templates: Templates) -> Iterator[dict[str, str]]:
    with contextlib.ExitStack() as stack:
        yield {
            f"tenant_{i}": stack.enter_context(outbox_templates.database(TABLES)) for i in range(3)
        }


def write_app(folder: Path, version: str) -> None:
    """The app's code, with `version`; its mtime moved on, whatever the clock's resolution."""
    source = folder / "hupapp.py"
    before = source.stat().st_mtime if source.exists() else None
    source.write_text(HUPAPP.format(version=version))
    if before is not None:
        os.utime(source, (before + 2, before + 2))


def write_set(path: Path, databases: dict[str, str]) -> None:
    lines = ["[databases]", *(f'{name} = "{dsn}"' for name, dsn in databases.items())]
    path.write_text("\n".join(lines) + "\n")


def publish_wave(tenants: dict[str, str], wave: int, sent: Counter[str]) -> None:
    """ROWS rows in each database of `tenants`, counted in `sent`."""
    for name, dsn in tenants.items():
        publish(dsn, [{"tenant": name, "n": wave * ROWS + i} for i in range(ROWS)], queue="q")
        sent[name] += ROWS


def handled(conn: Conn, tenant: str) -> int:
    return int(scalar(conn, "SELECT count(DISTINCT n) FROM ledger WHERE tenant = %s", [tenant]))


def all_handled(farm: RunningFarm, conn: Conn, sent: Counter[str], timeout: float = 60) -> None:
    for name, count in sent.items():
        wait_for(lambda n=name, c=count: handled(conn, n) == c, f"{name}'s rows", timeout, farm)


def holders(conn: Conn) -> dict[str, str]:
    rows = conn.execute(
        "SELECT database, holder FROM outbox_farm_fleet_leases WHERE expires_at > now()"
    ).fetchall()
    return {d: h for d, h in rows}


def started(farm: RunningFarm, database: str) -> int:
    """How often a worker began serving `database` (once, unless it was moved or restarted)."""
    return farm.log().count(f"serving database {database}")


def test_hup_rereads_the_set_without_restarting_what_stays_and_rolls_out_new_code(
    tmp_path: Path, dsn: str, conn: Conn, tenants: dict[str, str]
) -> None:
    conn.execute("CREATE TABLE ledger (tenant text, n int, pid int, version text)")
    write_app(tmp_path, "v1")
    set_file = tmp_path / "databases.toml"
    first = {k: tenants[k] for k in ("tenant_0", "tenant_1")}
    write_set(set_file, first)
    with farm_process(tmp_path, dsn, app="hupapp:fleet", HUPAPP_SET=str(set_file)) as farm:
        # A HUP while the workers boot: they read the set at boot anyway; nothing crashes.
        wait_for(lambda: "arbiter_started" in farm.log(), "the arbiter's handlers", 30, farm)
        wait_for(lambda: len(farm.children()) == 2, "two workers forked", 30, farm)
        farm.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: farm.healthy(2), "both workers up", timeout=60, process=farm)
        wait_for(lambda: set(holders(conn)) == set(first), "both databases leased", 30, farm)
        sent: Counter[str] = Counter()
        publish_wave(first, 0, sent)
        all_handled(farm, conn, sent)
        pids = farm.children()
        before = holders(conn)

        # Added to the file, then HUP: served within seconds, by the same processes, while the
        # databases that stay keep their holder and are not started again.
        write_set(set_file, tenants)
        farm.proc.send_signal(signal.SIGHUP)
        publish_wave(tenants, 1, sent)
        wait_for(lambda: handled(conn, "tenant_2") == ROWS, "the added one's rows", PICKED_UP, farm)
        all_handled(farm, conn, sent)
        assert farm.children() == pids
        now = holders(conn)
        assert {k: now[k] for k in first} == before, (before, now)
        assert all(started(farm, name) == 1 for name in tenants), farm.log_tail()
        assert "fleet_reread" in farm.log()
        assert "added tenant_2" in farm.log()

        # Removed from the file, then HUP: let go (its lease given up). The one removed is one
        # of the process holding two, so the share stays one each and nothing else moves.
        by_holder = Counter(now.values())
        gone = next(name for name, holder in sorted(now.items()) if by_holder[holder] == 2)
        stay = {k: v for k, v in tenants.items() if k != gone}
        write_set(set_file, stay)
        farm.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: gone not in holders(conn), "the removed one let go", PICKED_UP, farm)
        assert f"removed {gone}" in farm.log()
        publish_wave(stay, 2, sent)
        all_handled(farm, conn, sent)
        assert farm.children() == pids
        assert {k: holders(conn)[k] for k in stay} == {k: now[k] for k in stay}
        assert all(started(farm, name) == 1 for name in tenants), farm.log_tail()
        assert "rolling_restart" not in farm.log()

        # New code on disk, then HUP: the workers are replaced. A second HUP during that roll
        # (with the removed database added back) reaches every worker there is; none crashes.
        write_app(tmp_path, "v2")
        farm.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: "rolling_restart" in farm.log(), "the roll begun", 30, farm)
        write_set(set_file, tenants)
        farm.proc.send_signal(signal.SIGHUP)
        wait_for(
            lambda: not farm.children() & pids and farm.healthy(2), "two new workers", 60, farm
        )
        wait_for(lambda: set(holders(conn)) == set(tenants), "every database leased", 30, farm)
        publish_wave(tenants, 3, sent)
        all_handled(farm, conn, sent)
        versions = conn.execute("SELECT DISTINCT version FROM ledger WHERE n >= %s", [3 * ROWS])
        assert {v for (v,) in versions} == {"v2"}
        assert restarts(farm) == {"crash": 0, "heartbeat": 0, "boot": 0}
        code, _ = farm.stop()
        assert code == 0, farm.log_tail()
    duplicates = scalar(conn, "SELECT count(*) - count(DISTINCT (tenant, n)) FROM ledger")
    print(f"duplicates: {duplicates} (rows of a drained database, redelivered)")


def test_with_preload_a_hup_rereads_the_set_and_never_restarts_a_worker(
    tmp_path: Path, dsn: str, conn: Conn, tenants: dict[str, str]
) -> None:
    """Preloaded workers run the code the arbiter imported: a roll would restart them on that
    same code and move every database for nothing, so a fleet's HUP only reads the set."""
    conn.execute("CREATE TABLE ledger (tenant text, n int, pid int, version text)")
    write_app(tmp_path, "v1")
    set_file = tmp_path / "databases.toml"
    write_set(set_file, {"tenant_0": tenants["tenant_0"]})
    args = ["--preload"]
    with farm_process(tmp_path, dsn, *args, app="hupapp:fleet", HUPAPP_SET=str(set_file)) as farm:
        wait_for(lambda: farm.healthy(2), "both workers up", timeout=60, process=farm)
        wait_for(lambda: set(holders(conn)) == {"tenant_0"}, "the database leased", 30, farm)
        pids = farm.children()
        write_app(tmp_path, "v2")
        write_set(set_file, tenants)
        farm.proc.send_signal(signal.SIGHUP)
        sent: Counter[str] = Counter()
        publish_wave(tenants, 0, sent)
        all_handled(farm, conn, sent, timeout=PICKED_UP)
        assert farm.children() == pids
        assert "--preload" in farm.log()
        assert "rolling_restart" not in farm.log()
        assert {v for (v,) in conn.execute("SELECT DISTINCT version FROM ledger")} == {"v1"}
        code, _ = farm.stop()
        assert code == 0, farm.log_tail()
