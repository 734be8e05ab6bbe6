"""`outbox-farm queue limit QUEUE --per-key-running N` as an operator runs it: the limit is
said, written, shown by `queue list` (its table and `--json`) though it is the queue's only
control, cleared by `--clear`, refused below 1, and refused saying to migrate on a database
before migration 0014, where the other limits are still set."""

from __future__ import annotations

import json
from typing import Any

import psycopg

from tests.acceptance.test_cli import run

USAGE_ERROR = 2
FAILED = 1


def queue(dsn: str, *args: str) -> Any:
    return run("queue", *args, OUTBOX_FARM_DSN=dsn)


def stored(dsn: str, name: str) -> tuple[Any, ...] | None:
    """The queue's limits as the farms read them: rate_count, max_running, key_max_running."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            "SELECT rate_count, max_running, to_jsonb(q) ->> 'key_max_running' "
            "FROM outbox_farm_queues AS q WHERE target = 'outbox' AND queue = %s",
            [name],
        ).fetchone()


def listed_json(dsn: str) -> list[dict[str, Any]]:
    result = queue(dsn, "list", "--json")
    assert result.returncode == 0, result.stderr
    found: list[dict[str, Any]] = json.loads(result.stdout)
    return found


def test_a_per_key_limit_is_said_listed_and_cleared(dsn: str) -> None:
    limited = queue(dsn, "limit", "invoices", "--per-key-running", "3", "--by", "ann")
    assert limited.returncode == 0, limited.stderr
    assert limited.stdout.strip() == (
        "limited queue invoices to at most 3 running per fair key, farm-wide: every farm "
        "applies it within a second."
    )
    assert stored(dsn, "invoices") == (None, None, "3")

    # The queue's only control is the per-key limit: it is listed all the same.
    (state,) = listed_json(dsn)
    assert (state["queue"], state["paused"], state["changed_by"]) == ("invoices", False, "ann")
    assert (state["rate"], state["max_running"], state["key_max_running"]) == (None, None, 3)

    table = queue(dsn, "list")
    assert table.returncode == 0, table.stderr
    header, line = table.stdout.splitlines()
    assert header.endswith("rate  max running  per key")
    assert line.startswith("invoices ")
    assert line.split()[-3:] == ["-", "-", "3"]  # rate, max running, per key

    # Beside the other limits, and left by a change of another.
    both = queue(dsn, "limit", "invoices", "--max-running", "8")
    assert "at most 8 running, at most 3 running per fair key" in both.stdout
    assert listed_json(dsn)[0]["key_max_running"] == 3
    assert queue(dsn, "list").stdout.splitlines()[1].split()[-2:] == ["8", "3"]

    cleared = queue(dsn, "limit", "invoices", "--clear")
    assert cleared.returncode == 0, cleared.stderr
    assert "queue invoices has no limits now" in cleared.stdout
    assert stored(dsn, "invoices") == (None, None, None)
    assert listed_json(dsn)[0]["key_max_running"] is None
    assert queue(dsn, "list").stdout.splitlines()[1].split()[-3:] == ["-", "-", "-"]


def test_none_clears_the_per_key_limit_alone(dsn: str) -> None:
    both = queue(dsn, "limit", "invoices", "--rate", "5/s", "--per-key-running", "2")
    assert both.returncode == 0, both.stderr
    assert stored(dsn, "invoices") == (5, None, "2")
    cleared = queue(dsn, "limit", "invoices", "--per-key-running", "none", "--json")
    assert cleared.returncode == 0, cleared.stderr
    assert json.loads(cleared.stdout)["key_max_running"] is None
    assert stored(dsn, "invoices") == (5, None, None)


def test_a_per_key_limit_below_one_is_refused_naming_the_option(dsn: str) -> None:
    assert queue(dsn, "limit", "invoices", "--per-key-running", "3").returncode == 0
    for wrong, said in (("0", "0 would run nothing; give 1 or more"), ("-2", "give 1 or more")):
        refused = queue(dsn, "limit", "invoices", "--per-key-running", wrong)
        assert refused.returncode == USAGE_ERROR, wrong
        assert "--per-key-running" in refused.stderr
        assert said in refused.stderr
        assert "Traceback" not in refused.stderr
    assert stored(dsn, "invoices") == (None, None, "3")  # left as it was


def test_before_migration_0014_a_per_key_limit_is_refused_saying_to_migrate(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DELETE FROM outbox_farm_migrations WHERE version = 14")
        conn.execute("ALTER TABLE outbox DROP COLUMN fair_key")
        conn.execute("ALTER TABLE outbox_farm_queues DROP COLUMN key_max_running")
    refused = queue(dsn, "limit", "invoices", "--max-running", "4", "--per-key-running", "2")
    assert refused.returncode == FAILED
    assert "migration 0014" in refused.stderr
    assert "run `outbox-farm migrate`" in refused.stderr
    assert "Traceback" not in refused.stderr
    assert stored(dsn, "invoices") is None  # refused whole: not even the most running
    # The positive control: the other limits are set, listed, and cleared, as before 0014.
    assert queue(dsn, "limit", "invoices", "--max-running", "4").returncode == 0
    (state,) = listed_json(dsn)
    assert (state["max_running"], state["key_max_running"]) == (4, None)
    assert queue(dsn, "list").stdout.splitlines()[1].split()[-2:] == ["4", "-"]
    assert queue(dsn, "limit", "invoices", "--clear").returncode == 0
    assert stored(dsn, "invoices") == (None, None, None)
