"""`doctor` and `stats` find stalled queues from the database alone (issue 25, item 3).

Two kinds: a queue whose claim statement fails (doctor runs the fetcher's claim in a
transaction it rolls back, and changes nothing), and a queue whose oldest claimable row has
waited past the threshold while none of its rows is leased (nobody works on it). Every test
has a healthy queue beside the stalled one, which must not be reported.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import sql

from outbox_farm.admin import queue_stats
from outbox_farm.admin.doctor import Check, Limits, Status, doctor
from outbox_farm.cli import main
from outbox_farm.names import TableNames
from tests.integration.roles import acting_as
from tests.steps import publish

NAMES = TableNames.build("outbox", "outbox_dlq")
Conn = psycopg.Connection[Any]

REFUSE = """
CREATE FUNCTION refuse_claims() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN
    IF NEW.queue = TG_ARGV[0] AND NEW.acquired_token IS NOT NULL THEN
        RAISE EXCEPTION 'claims of this queue are refused here';
    END IF;
    RETURN NEW;
END $$
"""


def by_name(checks: list[Check]) -> dict[str, list[Check]]:
    found: dict[str, list[Check]] = {}
    for check in checks:
        found.setdefault(check.name, []).append(check)
    return found


def snapshot(conn: Conn) -> list[Any]:
    return conn.execute("SELECT o::text FROM outbox AS o ORDER BY id").fetchall()


def invoke(dsn: str, *args: str) -> Any:
    return CliRunner().invoke(main, [*args, "--dsn", dsn], catch_exceptions=False)


# -- a queue whose claims fail ---------------------------------------------------------------


def test_doctor_names_a_queue_whose_claims_fail_and_changes_nothing(dsn: str, conn: Conn) -> None:
    conn.execute(REFUSE)
    conn.execute(
        "CREATE TRIGGER refuse BEFORE UPDATE ON outbox FOR EACH ROW "
        "EXECUTE FUNCTION refuse_claims('stuck')"
    )
    publish(conn, 3, queue="stuck")
    publish(conn, 3, queue="healthy")
    before = snapshot(conn)

    found = by_name(doctor(conn, NAMES))

    (stuck,) = found["queue stuck"]
    assert stuck.status is Status.FAIL
    assert "its claim fails" in stuck.detail
    assert "claims of this queue are refused here" in stuck.detail
    assert "trigger" in stuck.hint
    assert "queue healthy" not in found  # the positive control: the same probe, no trigger
    assert snapshot(conn) == before  # the probe was rolled back: no lease, no delivery counted
    assert conn.info.transaction_status is psycopg.pq.TransactionStatus.IDLE

    result = invoke(dsn, "doctor")
    assert result.exit_code == 1, result.output
    assert "FAIL queue stuck: stalled: its claim fails" in result.output
    conn.execute("DROP TRIGGER refuse ON outbox")
    result = invoke(dsn, "doctor")
    assert result.exit_code == 0, result.output
    assert "OK   queues: 2 queue(s): every claim runs, none stalled" in result.output
    assert snapshot(conn) == before


@pytest.fixture
def farm_role(conn: Conn) -> Iterator[str]:
    """A role with every privilege on the outbox but UPDATE; the connection acts as it."""
    with acting_as(
        conn,
        "farm",
        "GRANT SELECT, INSERT, DELETE ON outbox TO {}",
        "GRANT SELECT, INSERT, DELETE ON outbox_dlq TO {}",
    ) as role:
        yield role


def test_a_claim_refused_for_a_missing_privilege_names_the_queue(
    conn: Conn, farm_role: str
) -> None:
    conn.execute("RESET ROLE")
    publish(conn, 3, queue="orders")
    conn.execute(sql.SQL("SET ROLE {}").format(sql.Identifier(farm_role)))
    (orders,) = by_name(doctor(conn, NAMES))["queue orders"]
    assert orders.status is Status.FAIL
    assert "permission denied" in orders.detail


def test_the_probe_passes_rows_a_farm_holds_and_does_not_wait_for_a_table_lock(
    dsn: str, conn: Conn
) -> None:
    publish(conn, 3, queue="held")
    with psycopg.connect(dsn) as farm:
        # A farm's claim in flight: its row locks are skipped, not waited for.
        farm.execute("SELECT id FROM outbox FOR UPDATE").fetchall()
        found = by_name(doctor(conn, NAMES))
        assert "queue held" not in found
        assert found["queues"][0].status is Status.OK
        farm.rollback()

        # A table lock that blocks every UPDATE (a migration's, say): the probe gives up after
        # its lock timeout with a warning, and says nothing of the queue's health.
        farm.execute("LOCK TABLE outbox IN SHARE MODE")
        began = time.monotonic()
        (held,) = by_name(doctor(conn, NAMES))["queue held"]
        assert time.monotonic() - began < 30
        assert held.status is Status.WARN
        assert "cut short" in held.detail
        assert "lock timeout" in held.detail
        farm.rollback()


# -- a queue nobody works on -------------------------------------------------------------------


def lease(conn: Conn, queue: str, token: str, expires_in: str) -> None:
    conn.execute(
        "INSERT INTO outbox (queue, payload, acquired_token, acquired_at, lease_expires_at) "
        "VALUES (%s, 'x', %s::uuid, now(), now() + %s::interval)",
        (queue, token, expires_in),
    )


AGED_QUEUES = """
INSERT INTO outbox (queue, payload, next_attempt_at, ordering_key)
VALUES ('idle', 'x', now() - interval '5 minutes', NULL),
       ('fresh', 'x', now() - interval '5 seconds', NULL),
       ('busy', 'x', now() - interval '5 minutes', NULL),
       ('lapsed', 'x', now() - interval '5 minutes', NULL),
       ('parked', 'x', now() - interval '5 minutes', NULL),
       ('keyed', 'x', now() + interval '1 hour', 'k'),
       ('keyed', 'x', now() - interval '5 minutes', 'k'),
       ('infinite', 'x', '-infinity', NULL)
"""


def test_old_ready_rows_with_nothing_leased_are_a_stall(dsn: str, conn: Conn) -> None:
    conn.execute("ALTER TABLE outbox DROP CONSTRAINT IF EXISTS outbox_values_ck")
    conn.execute(AGED_QUEUES)
    lease(conn, "busy", str(uuid.uuid4()), "1 minute")  # a farm works on it
    lease(conn, "lapsed", str(uuid.uuid4()), "-1 minute")  # its worker died: nobody does
    lease(conn, "parked", str(uuid.UUID(int=0)), "1 hour")  # a set-aside row is nobody's work
    stalled = {"idle", "lapsed", "parked", "infinite"}
    before = snapshot(conn)

    checks = by_name(doctor(conn, NAMES, Limits(max_stall=60)))
    reported = {name.removeprefix("queue ") for name in checks if name.startswith("queue ")}
    assert reported == stalled  # not "fresh" (young), "busy" (leased), "keyed" (held back)
    (idle,) = checks["queue idle"]
    assert idle.status is Status.FAIL
    assert idle.detail.startswith("stalled: oldest ready row 30")
    assert "none of its rows leased: is a farm running for this queue?" in idle.detail
    # A row due at -infinity has waited longer than any threshold.
    lenient = by_name(doctor(conn, NAMES, Limits(max_stall=3600)))
    assert [name for name in lenient if name.startswith("queue ")] == ["queue infinite"]

    stats = {s.queue: s for s in queue_stats(conn, NAMES)}
    assert {q for q, s in stats.items() if s.stalled} == stalled
    assert stats["idle"].stalled == idle.detail
    assert {s.queue for s in queue_stats(conn, NAMES, stall_after=3600) if s.stalled} == {
        "infinite"
    }
    assert snapshot(conn) == before


def test_the_commands_report_an_idle_stall(dsn: str, conn: Conn) -> None:
    publish(conn, 3, queue="idle", activate_at=datetime.now(UTC) - timedelta(minutes=5))
    publish(conn, 3, queue="fresh")

    result = invoke(dsn, "stats", "--metrics-url", "")
    assert result.exit_code == 0, result.output
    lines = {line.split()[0]: line.split() for line in result.output.splitlines() if line}
    assert lines["queue"][-1] == "stalled"
    assert lines["idle"][-1] == "STALLED"
    assert lines["fresh"][-1] == "-"
    assert "idle: stalled: oldest ready row" in result.output
    result = invoke(dsn, "stats", "--metrics-url", "", "--json")
    assert '"stalled": "stalled: oldest ready row' in result.output
    assert '"stalled": null' in result.output

    result = invoke(dsn, "doctor")
    assert result.exit_code == 1, result.output
    assert "FAIL queue idle: stalled: oldest ready row" in result.output
    assert "queue fresh" not in result.output
    result = invoke(dsn, "doctor", "--max-stall", "10m")
    assert result.exit_code == 0, result.output
    assert "FAIL queue idle" not in result.output
    assert "OK   queues: 2 queue(s): every claim runs, none stalled" in result.output
