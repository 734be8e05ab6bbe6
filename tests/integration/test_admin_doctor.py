"""`doctor` finds what degrades a farm, on a real server: a held-back xmin, a missing grant,
autovacuum off, a missing table, a waiting backlog."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from outbox_farm.admin.doctor import Check, Limits, Status, doctor
from outbox_farm.names import TableNames
from tests.integration.roles import acting_as

NAMES = TableNames.build("outbox", "outbox_dlq")
Conn = psycopg.Connection[Any]


def named(checks: list[Check], name: str) -> list[Check]:
    return [c for c in checks if c.name == name]


def statuses(checks: list[Check]) -> dict[str, set[Status]]:
    found: dict[str, set[Status]] = {}
    for check in checks:
        found.setdefault(check.name, set()).add(check.status)
    return found


def test_a_fresh_database_has_no_failure(conn: Conn) -> None:
    checks = doctor(conn, NAMES)
    assert [c for c in checks if c.status is Status.FAIL] == []
    assert {
        "connection",
        "server version",
        "track_counts",
        "autovacuum",
        "notify queue",
        "privileges",
        "schema",
        "table outbox",
        "table outbox_dlq",
        "xmin horizon",
        "oldest ready row",
    } <= set(statuses(checks))
    assert all(c.hint for c in checks if c.status is not Status.OK)


def test_a_transaction_holding_back_xmin_fails(dsn: str, conn: Conn) -> None:
    with psycopg.connect(dsn, application_name="report-job") as other:
        other.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        other.execute("SELECT count(*) FROM outbox")  # takes the snapshot
        pid = other.info.backend_pid
        time.sleep(1.2)  # the snapshot outlives the 1 s limit: time passes on purpose
        (check,) = named(doctor(conn, NAMES, Limits(max_xmin_age=1.0)), "xmin horizon")
        assert check.status is Status.FAIL
        assert f"pid {pid} (postgres, report-job, idle in transaction)" in check.detail
        assert "pg_terminate_backend" in check.hint
        (lenient,) = named(doctor(conn, NAMES, Limits(max_xmin_age=600)), "xmin horizon")
        assert lenient.status is Status.OK
    (after,) = named(doctor(conn, NAMES, Limits(max_xmin_age=1.0)), "xmin horizon")
    assert after.status is Status.OK


@pytest.fixture
def limited_role(conn: Conn) -> Iterator[str]:
    """A role that may read the outbox but not write it; the connection acts as it."""
    with acting_as(conn, "doctor", "GRANT SELECT ON outbox, outbox_dlq TO {}") as role:
        yield role


def test_a_missing_grant_fails_with_the_grant_to_run(conn: Conn, limited_role: str) -> None:
    checks = named(doctor(conn, NAMES), "privileges")
    failures = [c.detail for c in checks if c.status is Status.FAIL]
    assert any(
        f'GRANT INSERT, UPDATE, DELETE ON TABLE "outbox" TO "{limited_role}"' in f for f in failures
    )
    assert any(f'GRANT INSERT ON TABLE "outbox_dlq" TO "{limited_role}"' in f for f in failures)


def test_autovacuum_off_is_a_warning(conn: Conn) -> None:
    conn.execute("ALTER TABLE outbox SET (autovacuum_enabled = false)")
    checks = doctor(conn, NAMES)
    table = [c for c in named(checks, "table outbox") if c.status is Status.WARN]
    assert [c.detail for c in table] == ["autovacuum_enabled = false"]
    assert "RESET (autovacuum_enabled)" in table[0].hint
    server = conn.execute("SELECT current_setting('autovacuum')::bool").fetchone()
    (setting,) = named(checks, "autovacuum")
    assert setting.status is (Status.OK if server == (True,) else Status.WARN)


def test_a_missing_table_fails_and_says_to_migrate(conn: Conn) -> None:
    conn.execute("DROP TABLE outbox_dlq")
    failures = [c for c in named(doctor(conn, NAMES), "schema") if c.status is Status.FAIL]
    assert [c.detail.split(";")[0] for c in failures] == ["outbox_dlq: table does not exist"]
    assert "outbox-farm migrate" in failures[0].hint


def test_a_waiting_backlog_is_a_warning(conn: Conn) -> None:
    conn.execute(
        "INSERT INTO outbox (queue, payload, next_attempt_at) "
        "VALUES ('orders', 'x', now() - interval '5 minutes')"
    )
    (check,) = named(doctor(conn, NAMES, Limits(max_lag=60)), "oldest ready row")
    assert check.status is Status.WARN
    assert "on queue orders" in check.detail


def test_a_paused_queue_or_an_open_breaker_is_no_stall(conn: Conn) -> None:
    from outbox_farm.admin.queues import pause_queue
    from tests.integration.test_breaker_admin import fail

    conn.execute(
        "INSERT INTO outbox (queue, payload, next_attempt_at) VALUES "
        "('paused', 'x', now() - interval '5 minutes'), "
        "('tripped', 'x', now() - interval '5 minutes'), "
        "('idle', 'x', now() - interval '5 minutes')"
    )
    stalled = {c.name for c in doctor(conn, NAMES, Limits(max_stall=60)) if "stalled" in c.detail}
    assert stalled == {"queue paused", "queue tripped", "queue idle"}  # the positive control

    pause_queue(conn, NAMES, "paused", reason="maintenance")
    fail(conn, "tripped", "smtp refused", down=True)
    checks = doctor(conn, NAMES, Limits(max_stall=60))
    assert [c.name for c in checks if c.name.startswith("queue ")] == ["queue idle"]
    assert named(checks, "queue idle")[0].status is Status.FAIL

    conn.execute("DELETE FROM outbox WHERE queue = 'idle'")
    (ok,) = named(doctor(conn, NAMES, Limits(max_stall=60)), "queues")
    assert ok.status is Status.OK
    assert "paused paused" in ok.detail
    assert "tripped breaker open" in ok.detail
