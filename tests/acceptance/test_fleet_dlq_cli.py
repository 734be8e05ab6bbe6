"""`outbox-farm dlq list|replay|purge --fleet APP --database all` over a set of real databases,
one of which cannot be reached: every database's rows, labelled with their database; one
question for the whole set; each database's line as it is done and a summary naming the one
that failed, with exit status 1; the rows moved in each database, and only there."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import psycopg

from tests.acceptance.test_cli import CLI, run
from tests.acceptance.test_fleet_cli import BROKEN, fleet, fleet_dir, write_set

__all__ = ["fleet_dir"]  # the fixture, used by name


def dead_letter(dsn: str, rows: int, reason: str = "rejected") -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO outbox_dlq (original_id, queue, payload, deliveries_count, created_at,"
            " failure_reason, last_exception) SELECT g, 'q', 'x', 1, now(), %s, 'E(' || g || ')'"
            " FROM generate_series(1, %s) AS g",
            [reason, rows],
        )


def counts(dsn: str) -> tuple[Any, ...]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM outbox_dlq), (SELECT count(*) FROM outbox)"
        ).fetchone()
    assert row is not None
    return tuple(row)


def dlq(folder: Path, home: str, env: dict[str, str], *args: str, stdin: str = "") -> Any:
    """`dlq COMMAND ARGS` over the whole set, as `test_cli.run` runs a command, with `stdin`
    as the answer to any question."""
    picked = ["--dsn", home, "--fleet", "fleetcli:fleet", "--database", "all"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_FARM_")}
    return subprocess.run(
        [CLI, "dlq", *args[:1], *picked, *args[1:]],
        capture_output=True,
        text=True,
        timeout=60,
        env={**clean, **env},
        cwd=str(folder),
        input=stdin,
        check=False,
    )


def test_list_replay_and_purge_over_every_database_of_the_set(
    fleet_dir: tuple[Path, dict[str, str]], dsn: str
) -> None:
    folder, tenants = fleet_dir
    env = write_set(folder, tenants)
    assert fleet(folder, dsn, env, "migrate")[0] == 0
    dead_letter(tenants["tenant_0"], 2)
    dead_letter(tenants["tenant_1"], 3)
    dead_letter(tenants["tenant_1"], 1, reason="max_deliveries")
    env = write_set(folder, {**tenants, "broken": BROKEN})

    done = dlq(folder, dsn, env, "list", "--json")
    assert done.returncode == 1  # one database could not be read; the others are listed
    listed = json.loads(done.stdout)
    assert sorted(r["database"] for r in listed) == ["tenant_0"] * 2 + ["tenant_1"] * 4
    assert "not read: 1 database(s) (broken)" in done.stderr
    done = dlq(folder, dsn, env, "list", "--limit", "3")
    assert done.returncode == 1
    assert done.stdout.splitlines()[0].split()[:2] == ["database", "id"]
    assert "  broken: FAILED: cannot connect to database broken" in done.stderr
    assert "  tenant_1: 3 row(s)" in done.stderr  # each database's own newest 3
    assert len(done.stdout.splitlines()) == 4  # the header and the 3 newest of the set
    done = dlq(folder, dsn, env, "list", "--group", "--json")
    assert {(g["database"], g["rows"]) for g in json.loads(done.stdout)} == {
        ("tenant_0", 2),
        ("tenant_1", 4),
    }

    # A dry run says what each database would do, and changes nothing.
    done = dlq(folder, dsn, env, "replay", "--reason", "rejected", "--dry-run")
    assert done.returncode == 1, done.stderr
    assert "tenant_0: would replay 2 row(s)" in done.stdout
    assert "tenant_1: would replay 3 row(s)" in done.stdout
    assert "5 row(s) in 2 database(s)" in done.stdout
    assert "not counted: 1 database(s) (broken)" in done.stdout
    assert counts(tenants["tenant_0"]) == (2, 0)

    # One question for the whole set; no answer, nothing moves.
    done = dlq(folder, dsn, env, "replay", "--reason", "rejected", stdin="n\n")
    assert "Replay 5 rows in 2 database(s)?" in done.stderr
    assert done.returncode == 1
    assert counts(tenants["tenant_1"]) == (4, 0)

    done = dlq(folder, dsn, env, "replay", "--reason", "rejected", "--yes", "--json")
    assert done.returncode == 1  # broken could not be counted
    report = json.loads(done.stdout)
    assert report["replayed"] == 5
    assert {n: r["replayed"] for n, r in report["databases"].items()} == {
        "tenant_0": 2,
        "tenant_1": 3,
    }
    assert list(report["failed"]) == ["broken"]
    assert counts(tenants["tenant_0"]) == (0, 2)
    assert counts(tenants["tenant_1"]) == (1, 3)  # the max_deliveries row stayed

    # Purge with filters: only the matching rows, only where they are; one question that
    # names the rows and databases, refused; then with --yes.
    env = write_set(folder, tenants)
    dead_letter(tenants["tenant_0"], 2, reason="max_deliveries")
    purge = ["purge", "--reason", "max_deliveries", "--grep", "E(1)"]
    done = dlq(folder, dsn, env, *purge, stdin="n\n")
    assert "Delete 2 rows in 2 database(s)?" in done.stderr
    assert done.returncode == 1
    done = dlq(folder, dsn, env, *purge, "--yes")
    assert done.returncode == 0, done.stderr
    assert "purged 2 row(s) from outbox_dlq in 2 database(s)" in done.stdout
    assert "  tenant_0: purged 1 row(s) in 1 batch(es)" in done.stderr
    assert "  tenant_1: purged 1 row(s) in 1 batch(es)" in done.stderr
    assert counts(tenants["tenant_0"]) == (1, 2)  # E(2) did not match
    assert counts(tenants["tenant_1"]) == (0, 3)
    done = dlq(folder, dsn, env, "purge", "--all", "--yes")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "purged 1 row(s) from outbox_dlq in 1 database(s)"
    done = dlq(folder, dsn, env, "purge", "--all", "--yes")
    assert (done.returncode, done.stdout.strip()) == (0, "no DLQ rows match")


def test_all_is_refused_where_one_row_is_meant(
    fleet_dir: tuple[Path, dict[str, str]], dsn: str
) -> None:
    folder, tenants = fleet_dir
    env = write_set(folder, tenants)
    done = dlq(folder, dsn, env, "show", "1")
    assert done.returncode == 2
    assert "--database all is for `outbox-farm fleet migrate|check|stats`, `fleet doctor` " in (
        done.stderr
    )
    assert "and `dlq list|replay|purge`; this command works on one database" in done.stderr
    done = run("dlq", "replay", "--help")
    assert "--database all" in " ".join(done.stdout.split())
