"""`outbox-farm queue pause|resume|limit|list` as an operator runs them: each says what it did
and what the farms will do, writes the row the farms read, and refuses bad input with advice."""

from __future__ import annotations

import json
from datetime import datetime, timedelta
from typing import Any

import psycopg

from tests.acceptance.test_cli import run

USAGE_ERROR = 2


def queue(dsn: str, *args: str) -> Any:
    return run("queue", *args, OUTBOX_FARM_DSN=dsn)


def stored(dsn: str, name: str) -> tuple[Any, ...] | None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            "SELECT paused, paused_until IS NOT NULL, reason, changed_by, rate_count, "
            "rate_seconds, max_running FROM outbox_farm_queues "
            "WHERE target = 'outbox' AND queue = %s",
            [name],
        ).fetchone()


def test_pause_list_and_resume(dsn: str) -> None:
    paused = queue(dsn, "pause", "emails", "--reason", "smtp down", "--by", "ann")
    assert paused.returncode == 0, paused.stderr
    assert "paused queue emails until resumed (smtp down)" in paused.stdout
    assert "every farm stops claiming it within a second; running handlers finish" in paused.stdout
    assert "outbox-farm queue resume emails" in paused.stdout
    assert stored(dsn, "emails") == (True, False, "smtp down", "ann", None, None, None)

    listed = queue(dsn, "list")
    assert listed.returncode == 0, listed.stderr
    header, line = listed.stdout.splitlines()
    assert header.split()[:4] == ["queue", "paused", "until", "reason"]
    assert line.split()[:3] == ["emails", "PAUSED", "resumed"]
    assert "smtp down" in line
    assert " ann " in line

    resumed = queue(dsn, "resume", "emails")
    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.strip() == (
        "resumed queue emails: every farm claims it again within a second."
    )
    assert stored(dsn, "emails")[0] is False  # type: ignore[index]
    again = queue(dsn, "resume", "emails")
    assert "was not paused" in again.stdout


def test_the_author_defaults_to_the_user_at_this_host(dsn: str) -> None:
    assert queue(dsn, "pause", "emails").returncode == 0
    by = stored(dsn, "emails")[3]  # type: ignore[index]
    assert "@" in by


def test_a_pause_for_a_while_ends_at_its_time(dsn: str) -> None:
    result = queue(dsn, "pause", "emails", "--for", "10m", "--json")
    assert result.returncode == 0, result.stderr
    state = json.loads(result.stdout)
    assert state["paused"] is True
    until = datetime.fromisoformat(state["paused_until"])
    changed = datetime.fromisoformat(state["changed_at"])
    assert timedelta(minutes=9, seconds=59) < until - changed <= timedelta(minutes=10, seconds=1)
    later = queue(dsn, "pause", "emails", "--until", "1h", "--json")
    assert datetime.fromisoformat(json.loads(later.stdout)["paused_until"]) > until


def test_an_end_in_the_past_or_two_ends_are_usage_errors(dsn: str) -> None:
    past = queue(dsn, "pause", "emails", "--until", "2001-01-01T00:00:00+00:00")
    assert past.returncode == USAGE_ERROR
    assert "has passed already" in past.stderr
    assert "give a time in the future" in past.stderr
    both = queue(dsn, "pause", "emails", "--until", "1h", "--for", "1h")
    assert both.returncode == USAGE_ERROR
    assert "--until or --for, not both" in both.stderr
    long = queue(dsn, "pause", "q" * 256)
    assert long.returncode == USAGE_ERROR
    assert "1 to 255 characters" in long.stderr
    assert stored(dsn, "emails") is None


def test_limits_are_set_one_by_one_and_cleared(dsn: str) -> None:
    rate = queue(dsn, "limit", "emails", "--rate", "6000/min")
    assert rate.returncode == 0, rate.stderr
    assert "limited queue emails to rate 6000/min, farm-wide" in rate.stdout
    most = queue(dsn, "limit", "emails", "--max-running", "4")
    assert "rate 6000/min, at most 4 running" in most.stdout
    assert stored(dsn, "emails")[4:] == (6000, 60.0, 4)  # type: ignore[index]

    listed = json.loads(queue(dsn, "list", "--json").stdout)
    assert listed == [
        {
            "queue": "emails",
            "paused": False,
            "paused_until": None,
            "reason": None,
            "changed_by": listed[0]["changed_by"],
            "changed_at": listed[0]["changed_at"],
            "rate": "6000/min",
            "rate_per_second": 100.0,
            "max_running": 4,
            "key_max_running": None,
            "breaker": {
                "open": False,
                "failures": 0,
                "open_since": None,
                "reason": None,
                "probe_at": None,
            },
        }
    ]
    queue(dsn, "limit", "emails", "--rate", "none")
    assert stored(dsn, "emails")[4:] == (None, None, 4)  # type: ignore[index]
    cleared = queue(dsn, "limit", "emails", "--clear")
    assert "has no limits now" in cleared.stdout
    assert stored(dsn, "emails")[4:] == (None, None, None)  # type: ignore[index]


def test_a_bad_limit_is_a_usage_error_naming_the_option(dsn: str) -> None:
    cases = {
        ("--rate", "fast"): "not a rate",
        ("--max-running", "0"): "give 1 or more",
        ("--max-running", "two"): "not a whole number",
    }
    for args, message in cases.items():
        result = queue(dsn, "limit", "emails", *args)
        assert result.returncode == USAGE_ERROR, args
        assert args[0] in result.stderr
        assert message in result.stderr
    nothing = queue(dsn, "limit", "emails")
    assert nothing.returncode == USAGE_ERROR
    assert "--rate, --max-running, or --clear" in nothing.stderr
    assert queue(dsn, "limit", "emails", "--clear", "--rate", "1/s").returncode == USAGE_ERROR
    assert stored(dsn, "emails") is None


def test_an_empty_list_says_how_to_pause(dsn: str) -> None:
    listed = queue(dsn, "list")
    assert listed.returncode == 0, listed.stderr
    assert "no queue of this outbox is paused or limited" in listed.stdout
    assert json.loads(queue(dsn, "list", "--json").stdout) == []


def test_a_database_not_migrated_is_told_to_migrate(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE outbox_farm_queues")
    for args in (("pause", "emails"), ("list",), ("limit", "emails", "--clear")):
        result = queue(dsn, *args)
        assert result.returncode == 1, args
        assert "run `outbox-farm migrate`" in result.stderr
        assert "Traceback" not in result.stderr
