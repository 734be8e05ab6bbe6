"""The DLQ API on a real database: every filter, replay's contract, purge on the database clock."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner

from outbox_farm.admin import (
    DlqFilter,
    When,
    dlq_list,
    dlq_purge,
    dlq_replay,
    dlq_show,
    dlq_summary,
    parse_duration,
)
from outbox_farm.admin.dlq import dlq_unfit
from outbox_farm.cli import main
from outbox_farm.errors import ConfigurationError
from outbox_farm.names import TableNames

NAMES = TableNames.build("outbox", "outbox_dlq")

Conn = psycopg.Connection[Any]


def dead(
    conn: Conn,
    queue: str = "orders",
    reason: str = "retry_terminal",
    age: str = "0 seconds",
    payload: bytes = b'{"n": 1}',
    headers: str | None = '{"content-type": "application/json", "tenant": "acme"}',
    exception: str | None = "ValueError('bad sku')\nTraceback (innermost frames last):\n  x",
    timer_id: str | None = None,
) -> int:
    row = conn.execute(
        "INSERT INTO outbox_dlq (original_id, queue, payload, headers, deliveries_count, "
        "created_at, failed_at, failure_reason, last_exception, timer_id) "
        "VALUES (42, %s, %s, %s::jsonb, 3, now() - interval '1 day', now() - %s::interval, %s, "
        "%s, %s) RETURNING id",
        [queue, payload, headers, age, reason, exception, timer_id],
    ).fetchone()
    assert row is not None
    return int(row[0])


def ids(rows: list[Any]) -> set[int]:
    return {r.id for r in rows}


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("45s", 45), ("15m", 900), ("12h", 43200), ("30d", 2592000), ("2w", 1209600), ("7", 7)],
)
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "ten days", "5y", "-3d", "3 d s"])
def test_a_bad_duration_says_what_is_accepted(text: str) -> None:
    with pytest.raises(ConfigurationError, match=r"e\.g\. 45s, 15m, 12h, 30d"):
        parse_duration(text)


def test_when_takes_a_duration_or_a_time() -> None:
    assert When.parse("2h") == When(ago=7200.0)
    at = When.parse("2024-05-01T12:00:00+00:00").at
    assert at is not None
    assert at.utcoffset() == timedelta(0)
    with pytest.raises(ConfigurationError, match="neither a duration"):
        When.parse("yesterday")


def test_list_filters_by_queue_reason_time_and_text(conn: Conn) -> None:
    a = dead(conn, queue="orders", reason="retry_terminal", age="2 hours")
    b = dead(conn, queue="orders", reason="rejected", age="10 minutes")
    c = dead(conn, queue="mail", reason="max_deliveries", age="3 days", exception=None)
    d = dead(conn, queue="mail", payload=b"\xff\x00needle\xfe", headers=None, exception="E()")
    every = dlq_list(conn, NAMES, DlqFilter())
    assert [r.id for r in every] == [d, c, b, a]  # newest first
    assert ids(dlq_list(conn, NAMES, DlqFilter(queue="orders"))) == {a, b}
    assert ids(dlq_list(conn, NAMES, DlqFilter(reason="rejected"))) == {b}
    assert ids(dlq_list(conn, NAMES, DlqFilter(since=When.parse("1h")))) == {b, d}
    assert ids(dlq_list(conn, NAMES, DlqFilter(until=When.parse("1h")))) == {a, c}
    assert ids(dlq_list(conn, NAMES, DlqFilter(ids=(a, c)))) == {a, c}
    assert ids(dlq_list(conn, NAMES, DlqFilter(grep="BAD SKU"))) == {a, b}  # exception
    assert ids(dlq_list(conn, NAMES, DlqFilter(grep="acme"))) == {a, b, c}  # headers
    assert ids(dlq_list(conn, NAMES, DlqFilter(grep="needle"))) == {d}  # payload bytes
    assert ids(dlq_list(conn, NAMES, DlqFilter(grep="50%_"))) == set()  # no wildcards
    assert len(dlq_list(conn, NAMES, DlqFilter(), limit=2)) == 2
    row = dlq_list(conn, NAMES, DlqFilter(ids=(a,)))[0]
    assert row.exception == "ValueError('bad sku')"  # the first line only
    assert row.payload_bytes == len(b'{"n": 1}')


def test_since_and_until_as_times(conn: Conn) -> None:
    old = dead(conn, age="3 days")
    now = conn.execute("SELECT now() - interval '1 day'").fetchone()
    assert now is not None
    assert ids(dlq_list(conn, NAMES, DlqFilter(until=When(at=now[0])))) == {old}
    assert ids(dlq_list(conn, NAMES, DlqFilter(since=When(at=now[0])))) == set()


def test_show_decodes_the_payload_by_content_type(conn: Conn) -> None:
    as_json = dead(conn)
    text = dead(conn, payload=b"hello", headers='{"content-type": "text/plain; charset=utf-8"}')
    raw = dead(conn, payload=b"\x00\xff", headers='{"content-type": "application/octet-stream"}')
    shown = dlq_show(conn, NAMES, as_json)
    assert shown is not None
    assert (shown.payload.encoding, shown.payload.value) == ("json", {"n": 1})
    assert shown.headers["tenant"] == "acme"
    assert shown.last_exception is not None
    assert "Traceback" in shown.last_exception
    assert (shown.reason, shown.deliveries_count, shown.original_id) == ("retry_terminal", 3, 42)
    assert shown.created_at < shown.failed_at
    text_entry, raw_entry = dlq_show(conn, NAMES, text), dlq_show(conn, NAMES, raw)
    assert text_entry is not None
    assert text_entry.payload.value == "hello"
    assert raw_entry is not None
    assert (raw_entry.payload.encoding, raw_entry.payload.value) == (
        "base64",
        "AP8=",
    )
    assert dlq_show(conn, NAMES, 999_999) is None


def test_replay_moves_rows_back_with_their_payload_and_headers(conn: Conn) -> None:
    first = dead(conn, headers='{"content-type": "application/json", "replay_count": 2}')
    second = dead(conn, queue="mail")
    conn.execute("LISTEN outbox_outbox")
    done = dlq_replay(conn, NAMES, DlqFilter(), batch=1)
    assert (done.rows, done.batches) == (2, 2)
    rows = conn.execute(
        "SELECT queue, payload, headers, attempts_count, deliveries_count, next_attempt_at <= "
        "now(), created_at < now() - interval '23 hours' FROM outbox ORDER BY id"
    ).fetchall()
    assert rows[0][0] == "orders"
    assert bytes(rows[0][1]) == b'{"n": 1}'
    assert rows[0][2]["replayed_from"] == first
    assert rows[0][2]["replay_count"] == 3
    assert rows[1][2] == {
        "content-type": "application/json",
        "tenant": "acme",
        "replayed_from": second,
        "replay_count": 1,
    }
    assert all(r[3:] == (0, 0, True, True) for r in rows)  # fresh counters, created_at kept
    assert dlq_list(conn, NAMES, DlqFilter()) == []
    woke = {n.payload for n in conn.notifies(timeout=1, stop_after=2)}
    assert woke == {"orders", "mail"}


def test_replay_to_another_queue_with_a_delay_sends_no_notify(conn: Conn) -> None:
    dead(conn)
    conn.execute("LISTEN outbox_outbox")
    done = dlq_replay(conn, NAMES, DlqFilter(), to_queue="orders_v2", delay=3600)
    assert done.notified == 0
    row = conn.execute(
        "SELECT queue, next_attempt_at - now() > interval '59 minutes' FROM outbox"
    ).fetchone()
    assert row == ("orders_v2", True)
    assert list(conn.notifies(timeout=0.3)) == []


def test_replay_keeps_a_timer_id_unless_a_live_timer_holds_it(conn: Conn) -> None:
    dead(conn, timer_id="t1")
    dead(conn, timer_id="t1")
    dead(conn, timer_id="t2")
    conn.execute("INSERT INTO outbox (queue, payload, timer_id) VALUES ('orders', 'x', 't2')")
    assert dlq_replay(conn, NAMES, DlqFilter()).rows == 3
    timers = [r[0] for r in conn.execute("SELECT timer_id FROM outbox ORDER BY id")]
    assert timers == ["t2", "t1", None, None]


def test_replay_only_touches_what_matches_and_what_was_counted(conn: Conn) -> None:
    keep = dead(conn, queue="mail")
    moved = dead(conn, queue="orders")
    summary = dlq_summary(conn, NAMES, DlqFilter(queue="orders"))
    later = dead(conn, queue="orders")  # failed after the operator saw the count
    assert summary.rows == 1
    assert summary.upto == moved
    done = dlq_replay(conn, NAMES, DlqFilter(queue="orders"), upto=summary.upto)
    assert done.rows == 1
    assert ids(dlq_list(conn, NAMES, DlqFilter())) == {keep, later}


def test_replay_twice_moves_nothing_the_second_time(conn: Conn) -> None:
    for _ in range(5):
        dead(conn)
    assert dlq_replay(conn, NAMES, DlqFilter(), batch=2).rows == 5
    assert dlq_replay(conn, NAMES, DlqFilter(), batch=2).rows == 0
    assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (5,)


def test_a_failing_batch_leaves_earlier_batches_and_changes_nothing_else(conn: Conn) -> None:
    for _ in range(4):
        dead(conn)
    conn.execute(
        "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "IF (SELECT count(*) FROM outbox) >= 2 THEN RAISE EXCEPTION 'full'; END IF; "
        "RETURN NEW; END $$; CREATE TRIGGER refuse BEFORE INSERT ON outbox FOR EACH ROW "
        "EXECUTE FUNCTION refuse()"
    )
    with pytest.raises(psycopg.Error, match="after 2 row"):
        dlq_replay(conn, NAMES, DlqFilter(), batch=2)
    counts = conn.execute(
        "SELECT (SELECT count(*) FROM outbox), (SELECT count(*) FROM outbox_dlq)"
    ).fetchone()
    assert counts == (2, 2)


def test_purge_older_than_uses_the_database_clock(conn: Conn) -> None:
    old = dead(conn, age="91 days")
    young = dead(conn, age="89 days")
    summary = dlq_summary(conn, NAMES, DlqFilter(until=When.parse("90d")))
    assert summary.rows == 1
    done = dlq_purge(conn, NAMES, DlqFilter(until=When.parse("90d")))
    assert done.rows == 1
    assert ids(dlq_list(conn, NAMES, DlqFilter())) == {young}
    assert dlq_show(conn, NAMES, old) is None


def test_purge_by_filter_in_batches(conn: Conn) -> None:
    for _ in range(7):
        dead(conn, queue="mail")
    keep = dead(conn, queue="orders")
    seen: list[int] = []
    done = dlq_purge(conn, NAMES, DlqFilter(queue="mail"), batch=3, progress=seen.append)
    assert (done.rows, done.batches, seen) == (7, 3, [3, 3, 1])
    assert ids(dlq_list(conn, NAMES, DlqFilter())) == {keep}


def test_no_dlq_table_is_a_clear_error(conn: Conn) -> None:
    with pytest.raises(ConfigurationError, match="no DLQ table"):
        dlq_list(conn, TableNames.build("outbox", None), DlqFilter())


def test_a_nul_in_a_filter_is_refused_before_any_sql(conn: Conn) -> None:
    with pytest.raises(ConfigurationError, match="NUL"):
        dlq_list(conn, NAMES, DlqFilter(grep="a\x00b"))


def test_replay_normalises_the_values_the_outbox_refuses_and_moves_every_row(
    dsn: str, conn: Conn
) -> None:
    """An `invalid_row` dead letter may hold what migration 0006's check refuses in the outbox:
    copied as it is, it failed its whole batch. Each is replayed normalised, and named first."""
    good = dead(conn)
    array = dead(conn, reason="invalid_row", headers='["content-type", "text/plain"]')
    text = dead(conn, reason="invalid_row", headers='"just a string"')
    infinite = dead(conn, reason="invalid_row")
    conn.execute("UPDATE outbox_dlq SET created_at = 'infinity' WHERE id = %s", [infinite])
    after = dead(conn, headers=None)
    summary = dlq_summary(conn, NAMES, DlqFilter())

    unfit = dlq_unfit(conn, NAMES, DlqFilter(), upto=summary.upto)
    assert unfit.rows == 3
    assert {row.id: row.what for row in unfit.first} == {
        array: "headers a JSON array, kept under original_headers",
        text: "headers a JSON string, kept under original_headers",
        infinite: "created_at infinity replaced by the time of the replay",
    }
    assert dlq_unfit(conn, NAMES, DlqFilter(ids=(good, after)), upto=summary.upto).rows == 0

    result = CliRunner().invoke(main, ["dlq", "replay", "--all", "--yes", "--dsn", dsn])
    assert result.exit_code == 0, result.output
    assert "replayed 5 row(s)" in result.stdout
    assert "3 row(s) hold values the outbox refuses; replayed normalised:" in result.stderr
    assert f"  {infinite}: created_at infinity replaced by the time of the replay" in result.stderr

    rows = {
        r[0]["replayed_from"]: r
        for r in conn.execute(
            "SELECT headers, created_at > now() - interval '1 minute' FROM outbox"
        ).fetchall()
    }
    assert set(rows) == {good, array, text, infinite, after}
    assert rows[good] == (
        {
            "content-type": "application/json",
            "tenant": "acme",
            "replayed_from": good,
            "replay_count": 1,
        },
        False,
    )
    assert rows[after] == ({"replayed_from": after, "replay_count": 1}, False)
    assert rows[array][0] == {
        "original_headers": ["content-type", "text/plain"],
        "replayed_from": array,
        "replay_count": 1,
        "replay_normalised": "headers a JSON array, kept under original_headers",
    }
    assert rows[text][0]["original_headers"] == "just a string"
    assert rows[infinite] == (
        {
            "content-type": "application/json",
            "tenant": "acme",
            "replayed_from": infinite,
            "replay_count": 1,
            "replay_normalised": "created_at infinity replaced by the time of the replay",
        },
        True,
    )
    assert dlq_list(conn, NAMES, DlqFilter()) == []


def test_purge_takes_invalid_row_as_a_reason(dsn: str, conn: Conn) -> None:
    """Rows the farm could not load are dead-lettered as `invalid_row`: the filters must name
    that reason, or an operator cannot clear them without touching the others."""
    keep = dead(conn, reason="retry_terminal")
    gone = dead(conn, reason="invalid_row", headers='["not", "an object"]')
    result = CliRunner().invoke(
        main, ["dlq", "purge", "--reason", "invalid_row", "--yes", "--dsn", dsn]
    )
    assert result.exit_code == 0, result.output
    left = {r[0] for r in conn.execute("SELECT id FROM outbox_dlq").fetchall()}
    assert left == {keep}
    assert gone not in left


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["--grep", ""], {}),
        (["--grep", "  "], {}),
        (["--queue", ""], {}),
        (["--reason", ""], {}),
        (["--cause", ""], {}),
        (["--since", ""], {}),
        (["--queue", "orders"], {"OUTBOX_FARM_GREP": ""}),
        (["--queue", "orders"], {"OUTBOX_FARM_CAUSE": " "}),
        (["--queue", "orders"], {"OUTBOX_FARM_UNTIL": ""}),
    ],
)
def test_an_empty_filter_purges_nothing(
    dsn: str, conn: Conn, args: list[str], env: dict[str, str]
) -> None:
    """`dlq purge --grep "" -y` (a script's unset $PATTERN) deleted every row: an empty text
    is in every row. Each filter, typed or from its variable, is refused the same way."""
    for _ in range(3):
        dead(conn)
    result = CliRunner().invoke(main, ["dlq", "purge", *args, "-y", "--dsn", dsn], env=env)
    assert result.exit_code == 2, result.output
    assert "an empty filter would select every row (or none)" in result.output
    assert conn.execute("SELECT count(*) FROM outbox_dlq").fetchone() == (3,)
    typed = CliRunner().invoke(main, ["dlq", "purge", "--grep", "bad sku", "-y", "--dsn", dsn])
    assert typed.exit_code == 0, typed.output
    assert conn.execute("SELECT count(*) FROM outbox_dlq").fetchone() == (0,)


def test_list_group_counts_rows_by_cause_and_cause_selects_them(dsn: str, conn: Conn) -> None:
    for n in range(3):
        dead(conn, queue="orders", exception=f"KeyError('sku-{n}')")
    dead(conn, queue="mail", exception="TimeoutError()")
    grouped = CliRunner().invoke(main, ["dlq", "list", "--group", "--dsn", dsn])
    assert grouped.exit_code == 0, grouped.output
    lines = grouped.stdout.splitlines()
    assert lines[0].split() == ["rows", "cause", "queues", "reasons", "last", "failed"]
    assert lines[1].split()[:4] == ["3", "KeyError('sku-<n>')", "orders", "retry_terminal"]
    assert lines[2].split()[:4] == ["1", "TimeoutError()", "mail", "retry_terminal"]
    assert "dlq list --cause \"KeyError('sku-<n>')\"" in grouped.stdout
    as_json = CliRunner().invoke(main, ["dlq", "list", "--group", "--json", "--dsn", dsn])
    assert [(g["cause"], g["rows"]) for g in json.loads(as_json.stdout)] == [
        ("KeyError('sku-<n>')", 3),
        ("TimeoutError()", 1),
    ]
    replayed = CliRunner().invoke(
        main, ["dlq", "replay", "--cause", "KeyError('sku-<n>')", "-y", "--dsn", dsn]
    )
    assert replayed.exit_code == 0, replayed.output
    assert "replayed 3 row(s)" in replayed.stdout
    left = CliRunner().invoke(main, ["dlq", "list", "--json", "--dsn", dsn])
    assert [r["exception"] for r in json.loads(left.stdout)] == ["TimeoutError()"]
