"""`outbox-farm queue list` and `queue close-breaker` as an operator runs them, on breakers the
farms' own statement opened: the list shows each breaker open or counting (since when, why, the
next probe), and closing one says what every farm does next, or that there was nothing to close."""

from __future__ import annotations

import json
from typing import Any

import psycopg

from tests.acceptance.test_cli import run
from tests.integration.test_breaker_admin import fail


def queue(dsn: str, *args: str) -> Any:
    return run("queue", *args, OUTBOX_FARM_DSN=dsn)


def opened(dsn: str, queue: str, reason: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        assert fail(conn, queue, reason, down=True)


def stored(dsn: str, name: str) -> tuple[Any, ...] | None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return conn.execute(
            "SELECT breaker_failures, breaker_open_since IS NOT NULL, breaker_reason, changed_by "
            "FROM outbox_farm_queues WHERE target = 'outbox' AND queue = %s",
            [name],
        ).fetchone()


def test_list_shows_open_and_counting_breakers(dsn: str) -> None:
    opened(dsn, "emails", "smtp refused")
    with psycopg.connect(dsn, autocommit=True) as conn:
        fail(conn, "sms", "timeout")
        fail(conn, "sms", "timeout")

    listed = queue(dsn, "list")
    assert listed.returncode == 0, listed.stderr
    _, breakers = listed.stdout.split("\n\n")
    title, header, *lines = breakers.splitlines()
    assert "outbox-farm queue close-breaker QUEUE" in title
    assert header.split() == ["queue", "breaker", "open", "since", "next", "probe", "why"]
    emails, sms = lines
    assert emails.split()[:2] == ["emails", "OPEN"]
    assert emails.endswith("smtp refused")
    assert sms.split() == ["sms", "2", "failed", "-", "-", "-"]

    as_json = {q["queue"]: q for q in json.loads(queue(dsn, "list", "--json").stdout)}
    breaker = as_json["emails"]["breaker"]
    assert breaker["open"] is True
    assert breaker["reason"] == "smtp refused"
    assert breaker["open_since"] < breaker["probe_at"]
    assert as_json["sms"]["breaker"] == {
        "open": False,
        "failures": 2,
        "open_since": None,
        "reason": None,
        "probe_at": None,
    }


def test_close_breaker_closes_it_and_says_what_the_farms_do(dsn: str) -> None:
    opened(dsn, "emails", "smtp refused")
    closed = queue(dsn, "close-breaker", "emails", "--by", "ann")
    assert closed.returncode == 0, closed.stderr
    assert closed.stdout.startswith("closed the breaker of queue emails (open since ")
    assert ": smtp refused)" in closed.stdout
    assert "every farm claims it again within a second" in closed.stdout
    assert stored(dsn, "emails") == (0, False, None, "ann")

    again = queue(dsn, "close-breaker", "emails")
    assert again.returncode == 0, again.stderr
    assert "the breaker of queue emails is not open; nothing was changed" in again.stdout
    assert stored(dsn, "emails") == (0, False, None, "ann")  # not even its author

    listed = queue(dsn, "list")
    assert "Breakers" not in listed.stdout


def test_close_breaker_json_says_whether_it_closed_one(dsn: str) -> None:
    opened(dsn, "emails", "down")
    first = json.loads(queue(dsn, "close-breaker", "emails", "--json").stdout)
    assert first["closed"] is True
    assert first["was_reason"] == "down"
    assert first["was_open_since"] is not None
    assert first["breaker"]["open"] is False
    second = json.loads(queue(dsn, "close-breaker", "emails", "--json").stdout)
    assert second["closed"] is False
    assert second["was_open_since"] is None


def test_close_breaker_refuses_a_bad_queue_name_with_advice(dsn: str) -> None:
    result = queue(dsn, "close-breaker", "x" * 300)
    assert result.returncode != 0
    assert "1 to 255 characters" in result.stderr
