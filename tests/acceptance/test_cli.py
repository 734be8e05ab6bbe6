"""The `outbox-farm` command as a user runs it: a real process against a real database.

The tests run the installed console script next to the interpreter, as an operator would
(`python -m outbox_farm.cli` is the same command).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox_farm.names import TableNames
from outbox_farm.ops.migrate import selected


def _script() -> str:
    beside = Path(sys.executable).parent / "outbox-farm"
    if beside.exists():
        return str(beside)
    found = shutil.which("outbox-farm")
    assert found, "the outbox-farm console script is not installed"
    return found


CLI = _script()


def run(
    *args: str, timeout: float = 30, cwd: str | None = None, **extra_env: str
) -> subprocess.CompletedProcess[str]:
    """The command with none of the caller's OUTBOX_FARM_* settings, plus `extra_env`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_FARM_")}
    env.update(extra_env)
    return subprocess.run(
        [CLI, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=cwd,
        check=False,
    )


def regclass(dsn: str, name: str) -> Any:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT to_regclass(%s)::text", [name]).fetchone()
    assert row is not None
    return row[0]


def migration_labels(names: TableNames) -> list[str]:
    """What `migrate` says it applies, from the migrations folder (which grows over time)."""
    return [
        f"{m.version:04d}_{m.name} on {names.outbox if m.target == 'outbox' else names.dlq}"
        for m in selected(names)
    ]


def test_migrate_then_migrate_again(empty_dsn: str) -> None:
    labels = migration_labels(TableNames.build("outbox", "outbox_dlq"))
    assert "0001_outbox on outbox" in labels
    assert "0002_dlq on outbox_dlq" in labels
    first = run("migrate", "--dsn", empty_dsn)
    assert first.returncode == 0, first.stderr
    for label in labels:
        assert f"  applying {label}" in first.stdout
    assert (
        f"migrate: {len(labels)} applied, 0 already up to date (outbox, outbox_dlq)" in first.stdout
    )
    assert regclass(empty_dsn, "outbox") == "outbox"
    assert regclass(empty_dsn, "outbox_dlq") == "outbox_dlq"

    second = run("migrate", "--dsn", empty_dsn)
    assert second.returncode == 0, second.stderr
    assert "applying" not in second.stdout
    assert f"migrate: 0 applied, {len(labels)} already up to date" in second.stdout


def test_check_ok(dsn: str) -> None:
    result = run("check", "--dsn", dsn)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "check: schema OK (outbox, outbox_dlq)"


def test_check_reports_a_dropped_index(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP INDEX outbox_pending_idx")
    result = run("check", "--dsn", dsn)
    assert result.returncode == 1
    assert "check: 1 problem(s) found (outbox, outbox_dlq):" in result.stdout
    assert "  - outbox: pending index on (queue, next_attempt_at) is missing" in result.stdout


def test_check_on_an_empty_database_names_both_tables(empty_dsn: str) -> None:
    result = run("check", "--dsn", empty_dsn)
    assert result.returncode == 1
    assert "outbox: table does not exist" in result.stdout
    assert "outbox_dlq: table does not exist" in result.stdout


def test_no_dlq(empty_dsn: str) -> None:
    migrated = run("migrate", "--dsn", empty_dsn, "--no-dlq")
    assert migrated.returncode == 0, migrated.stderr
    outbox_only = len(migration_labels(TableNames.build("outbox", None)))
    assert f"migrate: {outbox_only} applied, 0 already up to date (outbox)" in migrated.stdout
    assert "dlq" not in migrated.stdout
    assert regclass(empty_dsn, "outbox_dlq") is None

    ok = run("check", "--dsn", empty_dsn, "--no-dlq")
    assert ok.returncode == 0, ok.stdout
    assert "check: schema OK (outbox)" in ok.stdout

    with_dlq = run("check", "--dsn", empty_dsn)
    assert with_dlq.returncode == 1
    assert "outbox_dlq: table does not exist" in with_dlq.stdout


def test_renamed_tables_from_the_command_line(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA app")
    names = ["--table", "app.jobs", "--dlq-table", "app.jobs_dlq"]
    migrated = run("migrate", "--dsn", empty_dsn, *names)
    assert migrated.returncode == 0, migrated.stderr
    assert "(app.jobs, app.jobs_dlq)" in migrated.stdout
    assert regclass(empty_dsn, "app.jobs") == "app.jobs"
    checked = run("check", "--dsn", empty_dsn, *names)
    assert checked.returncode == 0, checked.stdout
    assert "check: schema OK (app.jobs, app.jobs_dlq)" in checked.stdout


def test_sql_prints_the_ddl() -> None:
    result = run("sql")
    assert result.returncode == 0, result.stderr
    assert 'CREATE TABLE IF NOT EXISTS "outbox" (' in result.stdout
    assert 'CREATE TABLE IF NOT EXISTS "outbox_dlq" (' in result.stdout
    assert 'CREATE INDEX IF NOT EXISTS "outbox_pending_idx"' in result.stdout
    assert "{outbox}" not in result.stdout


def test_sql_honours_table_options() -> None:
    result = run("sql", "--table", "app.jobs", "--no-dlq")
    assert result.returncode == 0, result.stderr
    assert 'CREATE TABLE IF NOT EXISTS "app"."jobs" (' in result.stdout
    assert '"jobs_pending_idx"' in result.stdout
    # The outbox's own table, and no DLQ (the farm-wide tables of 0010 and 0011 stand beside it).
    assert result.stdout.count('CREATE TABLE IF NOT EXISTS "app".') == 1
    assert "0002_dlq" not in result.stdout


def test_python_dash_m_is_the_same_command() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_FARM_")}
    result = subprocess.run(
        [sys.executable, "-m", "outbox_farm.cli", "sql", "--no-dlq"],
        capture_output=True,
        text=True,
        timeout=30,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == run("sql", "--no-dlq").stdout


def test_sql_output_applies_cleanly(empty_dsn: str) -> None:
    printed = run("sql")
    assert printed.returncode == 0
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute(printed.stdout)
    checked = run("check", "--dsn", empty_dsn)
    assert checked.returncode == 0, checked.stdout


@pytest.mark.parametrize(
    "bad_dsn",
    [
        "host=127.0.0.1 port=1 user=postgres password=secret dbname=nowhere",
        "postgresql://postgres:secret@127.0.0.1:1/nowhere",
    ],
    ids=["keywords", "url"],
)
@pytest.mark.parametrize("command", ["migrate", "check"])
def test_unreachable_server_fails_fast_without_the_password(command: str, bad_dsn: str) -> None:
    started = time.monotonic()
    result = run(command, "--dsn", bad_dsn, timeout=20)
    elapsed = time.monotonic() - started
    output = result.stdout + result.stderr
    assert result.returncode == 1  # a ClickException, not a traceback
    assert "cannot connect" in result.stderr
    assert "Traceback" not in output
    assert "secret" not in output
    assert "***" in result.stderr
    assert elapsed < 10


@pytest.mark.parametrize(
    "bad_dsn",
    [
        "postgresql://postgres:secret@127.0.0.1/db?bogus=1",
        "host=127.0.0.1 password=secret bogus=1",
        "host=127.0.0.1 password=secret nonsense",
        "host=127.0.0.1 password='secret",
        "postgresql://127.0.0.1/db?password=secret&bogus=1",
    ],
    ids=["url-userinfo", "unknown-keyword", "missing-equals", "unterminated-quote", "url-query"],
)
def test_unparseable_dsn_is_refused_without_the_password(bad_dsn: str) -> None:
    result = run("check", "--dsn", bad_dsn)
    assert result.returncode == 1
    assert "invalid DSN" in result.stderr
    assert "Traceback" not in result.stderr
    assert "secret" not in result.stdout + result.stderr


@pytest.mark.parametrize("command", ["sql", "migrate", "check"])
def test_too_long_table_is_a_usage_error(command: str, tmp_path: Path) -> None:
    # The name is refused before anything connects: even the embedded server is not started.
    args = [command] if command == "sql" else [command, "--embedded"]
    result = run(*args, "--table", "t" * 64, cwd=str(tmp_path))
    assert result.returncode == 2
    assert "is 64 bytes; Postgres keeps at most 63" in result.stderr
    assert "embedded" not in result.stderr
    assert not (tmp_path / ".outbox-farm").exists()


def test_too_long_derived_name_is_a_usage_error() -> None:
    result = run("sql", "--table", "t" * 52)
    assert result.returncode == 2
    assert "pending index name" in result.stderr
    assert result.stdout == ""


def test_same_dlq_and_outbox_is_a_usage_error() -> None:
    result = run("sql", "--table", "jobs", "--dlq-table", "jobs")
    assert result.returncode == 2
    assert "the DLQ table must differ from the outbox table" in result.stderr


# --- the DSN from a file ----------------------------------------------------------------------


def test_migrate_and_check_read_the_dsn_from_a_file(empty_dsn: str, tmp_path: Path) -> None:
    secret = tmp_path / "dsn"
    secret.write_text(f"  {empty_dsn}\n\n")
    migrated = run("migrate", "--dsn-file", str(secret))
    assert migrated.returncode == 0, migrated.stderr
    assert "applied, 0 already up to date (outbox, outbox_dlq)" in migrated.stdout
    assert "embedded" not in migrated.stderr
    checked = run("check", OUTBOX_FARM_DSN_FILE=str(secret))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.strip() == "check: schema OK (outbox, outbox_dlq)"


@pytest.mark.parametrize("command", ["migrate", "check", "start"])
def test_an_empty_dsn_file_is_refused(command: str, tmp_path: Path) -> None:
    secret = tmp_path / "dsn"
    secret.write_text(" \n")
    args = [command, "app:farm"] if command == "start" else [command]
    result = run(*args, "--dsn-file", str(secret))
    assert result.returncode == 2, result.stderr
    assert "'--dsn-file' / OUTBOX_FARM_DSN_FILE" in result.stderr
    assert f"{secret} is empty; write the connection string into it" in result.stderr
    assert "embedded" not in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("what", ["missing", "directory"])
@pytest.mark.parametrize("command", ["migrate", "check", "start"])
def test_an_unreadable_dsn_file_is_refused(command: str, what: str, tmp_path: Path) -> None:
    path = tmp_path / "nope" if what == "missing" else tmp_path
    args = [command, "app:farm"] if command == "start" else [command]
    result = run(*args, OUTBOX_FARM_DSN_FILE=str(path))
    assert result.returncode == 2, result.stderr
    assert f"cannot read {path}:" in result.stderr
    assert "point it at a readable file holding the connection string" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("command", ["migrate", "check", "start"])
def test_dsn_and_dsn_file_together_are_refused(command: str, dsn: str, tmp_path: Path) -> None:
    secret = tmp_path / "dsn"
    secret.write_text(dsn)
    args = [command, "app:farm"] if command == "start" else [command]
    result = run(*args, "--dsn-file", str(secret), OUTBOX_FARM_DSN=dsn)
    assert result.returncode == 2, result.stderr
    assert "--dsn (OUTBOX_FARM_DSN) and --dsn-file (OUTBOX_FARM_DSN_FILE) are both set" in (
        result.stderr
    )


def test_a_bad_dsn_in_the_file_is_reported_without_its_password(tmp_path: Path) -> None:
    secret = tmp_path / "dsn"
    secret.write_text("host=127.0.0.1 port=1 password=hunter2 dbname=nowhere connect_timeout=5\n")
    result = run("check", "--dsn-file", str(secret))
    assert result.returncode == 1
    assert "cannot connect" in result.stderr
    assert "hunter2" not in result.stdout + result.stderr


# --- migrate after a table was dropped: check, migrate, check is not a circle -----------------


@pytest.mark.parametrize("dropped", ["outbox_dlq", "outbox"])
def test_migrate_brings_back_a_dropped_table(dsn: str, dropped: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE {dropped}")
    before = run("check", "--dsn", dsn)
    assert before.returncode == 1
    assert f"{dropped}: table does not exist; run `outbox-farm migrate`" in before.stdout
    migrated = run("migrate", "--dsn", dsn)
    assert migrated.returncode == 0, migrated.stderr
    assert f"  {dropped} does not exist although its migrations were recorded" in migrated.stdout
    after = run("check", "--dsn", dsn)
    assert after.returncode == 0, after.stdout
    assert after.stdout.strip() == "check: schema OK (outbox, outbox_dlq)"


def test_migrate_repair_brings_back_a_dropped_index(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP INDEX outbox_pending_idx")
    repaired = run("migrate", "--dsn", dsn, "--repair")
    assert repaired.returncode == 0, repaired.stderr
    count = len(migration_labels(TableNames.build("outbox", "outbox_dlq")))
    assert f"migrate: 0 applied, 0 already up to date, {count} repaired" in repaired.stdout
    after = run("check", "--dsn", dsn)
    assert after.returncode == 0, after.stdout
