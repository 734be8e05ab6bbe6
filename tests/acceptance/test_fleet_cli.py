"""`outbox-farm fleet migrate|check|stats|status` against a set of real databases, one of
which cannot be reached: each database's line as it is done, a summary naming the ones that
failed, exit status 1 while any did; one database picked with --database."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from outbox_farm.testing.databases import Templates
from tests.acceptance.test_cli import run
from tests.steps import publish

pytestmark = pytest.mark.one_server

BROKEN = "host=127.0.0.1 port=1 dbname=nowhere user=nobody connect_timeout=2"
APP = """\
import os

from outbox_farm import Farm, Message
from outbox_farm.fleet import Fleet

farm = Farm()
plain = farm


@farm.handler("q")
def q(msg: Message) -> None:
    pass


fleet = Fleet(farm, databases=os.environ["FLEETCLI_SET"])
"""


@pytest.fixture
def fleet_dir(tmp_path: Path, outbox_templates: Templates) -> Iterator[tuple[Path, dict[str, str]]]:
    """The app, and a set of two empty databases and an unreachable one."""
    (tmp_path / "fleetcli.py").write_text(APP)
    with contextlib.ExitStack() as stack:
        tenants = {
            f"tenant_{i}": stack.enter_context(outbox_templates.database(None)) for i in range(2)
        }
        yield tmp_path, tenants


def write_set(folder: Path, databases: dict[str, str]) -> dict[str, str]:
    lines = ["[databases]", *(f'{k} = "{v}"' for k, v in databases.items())]
    (folder / "databases.toml").write_text("\n".join(lines) + "\n")
    return {"FLEETCLI_SET": str(folder / "databases.toml")}


def fleet(folder: Path, home: str, env: dict[str, str], *args: str) -> tuple[int, str, str]:
    done = run(
        "fleet", *args[:1], "fleetcli:fleet", "--dsn", home, *args[1:], cwd=str(folder), **env
    )
    return done.returncode, done.stdout, done.stderr


def test_migrate_and_check_over_the_set_name_the_database_that_failed(
    fleet_dir: tuple[Path, dict[str, str]], dsn: str
) -> None:
    folder, tenants = fleet_dir
    env = write_set(folder, {**tenants, "broken": BROKEN})
    code, out, err = fleet(folder, dsn, env, "check")
    assert code == 1
    assert "fleet check: 3 database(s): 0 OK, 2 with problems (tenant_0, tenant_1)" in out
    assert ", 1 not checked (broken)" in out
    code, out, err = fleet(folder, dsn, env, "migrate")
    assert code == 1, err
    assert "fleet migrate: 3 database(s): 2 migrated, 0 up to date, 1 failed (broken)" in out
    assert "  tenant_0: 15 applied" in err
    assert "  broken: FAILED: cannot connect to database broken" in err
    env = write_set(folder, tenants)
    code, out, err = fleet(folder, dsn, env, "migrate", "--json")
    assert code == 0, err
    assert json.loads(out) == {"applied": {"tenant_0": [], "tenant_1": []}, "failed": {}}
    code, out, err = fleet(folder, dsn, env, "check")
    assert code == 0, out + err
    assert "fleet check: 2 database(s): 2 OK, 0 with problems, 0 not checked" in out


def test_stats_of_one_database_and_status_of_an_unserved_set(
    fleet_dir: tuple[Path, dict[str, str]], dsn: str
) -> None:
    folder, tenants = fleet_dir
    env = write_set(folder, tenants)
    assert fleet(folder, dsn, env, "migrate")[0] == 0
    publish(tenants["tenant_1"], 3, queue="q")
    code, out, err = fleet(folder, dsn, env, "stats", "--database", "tenant_1", "--json")
    assert code == 0, err
    figures = json.loads(out)["databases"]
    assert list(figures) == ["tenant_1"]
    [queue] = figures["tenant_1"]["outbox"]
    assert (queue["queue"], queue["counts"]["ready"]["value"]) == ("q", 3)
    code, out, err = fleet(folder, dsn, env, "stats", "--database", "tenant_7")
    assert code == 2
    assert "no database 'tenant_7' in the fleet's set (2: tenant_0, tenant_1)" in err
    code, out, err = fleet(folder, dsn, env, "status", "--json")
    assert code == 1  # no process serves the set
    assert json.loads(out)["unserved"] == ["tenant_0", "tenant_1"]


def test_a_farm_is_not_a_fleet(fleet_dir: tuple[Path, dict[str, str]], dsn: str) -> None:
    folder, tenants = fleet_dir
    env = write_set(folder, tenants)
    done = run("fleet", "status", "fleetcli:plain", "--dsn", dsn, cwd=str(folder), **env)
    assert done.returncode == 2
    assert "'fleetcli:plain' is a Farm, not a Fleet" in done.stderr


def test_one_database_commands_take_a_database_of_the_fleet_by_name(
    fleet_dir: tuple[Path, dict[str, str]], dsn: str
) -> None:
    folder, tenants = fleet_dir
    env = write_set(folder, tenants)
    assert fleet(folder, dsn, env, "migrate")[0] == 0
    publish(tenants["tenant_0"], 2, queue="q")
    picked = ["--dsn", dsn, "--fleet", "fleetcli:fleet", "--database", "tenant_0"]
    done = run("stats", *picked, "--json", cwd=str(folder), **env)
    assert done.returncode == 0, done.stderr
    [queue] = json.loads(done.stdout)["queues"]
    assert (queue["queue"], queue["counts"]["ready"]["value"]) == ("q", 2)
    done = run("queue", "pause", "q", *picked, cwd=str(folder), **env)
    assert done.returncode == 0, done.stderr
    with psycopg.connect(tenants["tenant_0"]) as conn:
        assert conn.execute("SELECT paused FROM outbox_farm_queues").fetchall() == [(True,)]
    with psycopg.connect(dsn) as conn:  # the home database was not the one paused
        assert conn.execute("SELECT count(*) FROM outbox_farm_queues").fetchone() == (0,)
    done = run("dlq", "list", "--dsn", dsn, "--database", "tenant_0", cwd=str(folder), **env)
    assert done.returncode == 2
    assert "--database picks a database of a fleet's set: name the Fleet with --fleet" in (
        done.stderr
    )
    done = run("doctor", *picked[:4], "--database", "all", cwd=str(folder), **env)
    assert done.returncode == 2
    assert "--database all is for `outbox-farm fleet migrate|check|stats`" in done.stderr


def test_doctor_over_the_set_names_the_failing_and_unreachable_databases(
    fleet_dir: tuple[Path, dict[str, str]], dsn: str
) -> None:
    folder, tenants = fleet_dir
    env = write_set(folder, tenants)
    assert fleet(folder, dsn, env, "migrate", "--database", "tenant_0")[0] == 0
    env = write_set(folder, {**tenants, "broken": BROKEN})
    code, out, err = fleet(folder, dsn, env, "doctor")
    assert code == 1
    # tenant_1 was never migrated: its schema check fails; tenant_0 passes it.
    assert "fleet doctor: 3 database(s): 1 failing (tenant_1), 1 unreachable (broken)" in out
    assert "  tenant_1: " in err
    code, out, err = fleet(folder, dsn, env, "doctor", "--database", "tenant_0", "--json")
    report = json.loads(out)
    assert list(report["checks"]) == ["tenant_0"]
    assert all(check["status"] != "FAIL" for check in report["checks"]["tenant_0"]), report
    assert code == 0, err
