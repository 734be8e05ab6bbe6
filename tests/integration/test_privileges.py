"""A role without the privileges the farm needs is told so, with the GRANTs to run, by
`check_privileges`, `outbox-farm check` and `outbox-farm start` (which refuses to begin).

Each test makes its own LOGIN role (roles are server-wide: unique names) and drops it after.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from outbox_farm.names import TableNames
from outbox_farm.ops.migrate import migrate
from outbox_farm.ops.privileges import check_privileges
from tests.acceptance.test_cli import run
from tests.acceptance.test_farm import FARMAPP

NAMES = TableNames.build("outbox", "outbox_dlq")
GRANT = re.compile(r"run (GRANT .*;)$")


@pytest.fixture
def role(server_dsn: str, dsn: str) -> Iterator[str]:
    """A fresh LOGIN role with no privileges on the test database's tables."""
    name = f"outbox_farm_r_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
    try:
        yield name
    finally:
        with psycopg.connect(dsn, autocommit=True) as owner:
            owner.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def as_role(dsn: str, role: str) -> str:
    params = conninfo_to_dict(dsn)
    params["user"] = role
    params.pop("password", None)
    return make_conninfo(**params)


def grants(problems: list[str]) -> list[str]:
    found = [match[1] for p in problems if (match := GRANT.search(p))]
    assert len(found) == len(problems), problems
    return found


def test_a_role_without_privileges_is_told_every_grant(dsn: str, role: str) -> None:
    with psycopg.connect(as_role(dsn, role), autocommit=True) as conn:
        report = check_privileges(conn, NAMES)
    who = f'"{role}"'
    assert sorted(grants(report.problems)) == sorted(
        [
            f'GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE "outbox" TO {who};',
            f'GRANT USAGE ON SEQUENCE "public"."outbox_id_seq" TO {who};',
            f'GRANT SELECT, INSERT ON TABLE "outbox_dlq" TO {who};',
            f'GRANT USAGE ON SEQUENCE "public"."outbox_dlq_id_seq" TO {who};',
        ]
    )
    assert len(report.notes) == 2
    assert "the farm's own VACUUM will be skipped" in report.notes[0]
    assert report.notes[1].startswith("the farms cannot tell when they run different code: ")
    code_grant = f'GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE "outbox_farm_code" TO {who};'
    assert report.notes[1].endswith(f"run {code_grant}")

    with psycopg.connect(dsn, autocommit=True) as owner:
        for statement in grants([*report.problems, report.notes[1]]):
            owner.execute(statement)
    with psycopg.connect(as_role(dsn, role), autocommit=True) as conn:
        after = check_privileges(conn, NAMES)
        assert after.problems == []
        assert len(after.notes) == 1
        conn.execute("INSERT INTO outbox (queue, payload) VALUES ('q', 'x')")  # really enough


def test_the_owner_has_no_problems_and_no_notes(conn: psycopg.Connection[Any]) -> None:
    report = check_privileges(conn, NAMES)
    assert report.problems == []
    assert report.notes == []


def test_a_schema_without_usage_is_named_not_a_crash(server_dsn: str, dsn: str, role: str) -> None:
    names = TableNames.build("app.jobs", "app.jobs_dlq")
    with psycopg.connect(dsn, autocommit=True) as owner:
        owner.execute("CREATE SCHEMA app")
        migrate(owner, names)
    with psycopg.connect(as_role(dsn, role), autocommit=True) as conn:
        report = check_privileges(conn, names)
    assert f'run GRANT USAGE ON SCHEMA "app" TO "{role}";' in report.problems[0]
    assert report.schema_usage_missing
    result = run(
        "check", "--dsn", as_role(dsn, role), "--table", "app.jobs", "--dlq-table", "app.jobs_dlq"
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert f'GRANT USAGE ON SCHEMA "app" TO "{role}";' in result.stdout


def test_check_reports_missing_privileges_and_passes_once_granted(dsn: str, role: str) -> None:
    before = run("check", "--dsn", as_role(dsn, role))
    assert before.returncode == 1, before.stdout + before.stderr
    assert "schema OK" not in before.stdout
    assert (
        f"  - outbox: role {role} lacks SELECT, INSERT, UPDATE, DELETE on the table; run "
        f'GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE "outbox" TO "{role}";'
    ) in before.stdout
    assert f'ON TABLE "outbox_dlq" TO "{role}";' in before.stdout

    with psycopg.connect(dsn, autocommit=True) as owner:
        for line in before.stdout.splitlines():
            if match := GRANT.search(line):
                owner.execute(match[1])
    after = run("check", "--dsn", as_role(dsn, role))
    assert after.returncode == 0, after.stdout
    assert after.stdout.splitlines()[-1] == "check: schema OK (outbox, outbox_dlq)"
    assert "note: outbox: role" in after.stdout
    assert "VACUUM will be skipped" in after.stdout


def test_start_refuses_a_role_without_privileges(dsn: str, role: str, tmp_path: Path) -> None:
    (tmp_path / "farmapp.py").write_text(FARMAPP)
    result = run(
        "start",
        "farmapp:farm",
        "--dsn",
        as_role(dsn, role),
        "--procs",
        "1",
        "--metrics-bind",
        "",
        cwd=str(tmp_path),
        TMPDIR=str(tmp_path),
    )
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr
    assert "the database role lacks privileges the farm needs:" in result.stderr
    assert f'GRANT SELECT, INSERT, UPDATE, DELETE ON TABLE "outbox" TO "{role}";' in result.stderr
