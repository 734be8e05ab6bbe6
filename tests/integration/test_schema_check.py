"""check_schema against real drift: each case is made in a migrated database, then reported."""

from __future__ import annotations

import logging
from typing import Any

import psycopg
import pytest
from psycopg import sql

from outbox_farm import Farm
from outbox_farm.errors import DatabaseError
from outbox_farm.names import TableNames
from outbox_farm.ops.migrate import migrate
from outbox_farm.ops.schema_check import FIX_HINT, Problem, assess_schema, check_schema

Conn = psycopg.Connection[Any]
NAMES = TableNames.build("outbox", "outbox_dlq")


def problems(conn: Conn, dlq: str | None = "outbox_dlq") -> list[str]:
    return [str(p) for p in check_schema(conn, TableNames.build("outbox", dlq))]


def only(conn: Conn, dlq: str | None = "outbox_dlq") -> str:
    found = problems(conn, dlq)
    assert len(found) == 1, found
    return found[0]


def test_migrated_schema_is_clean(conn: Conn) -> None:
    assert check_schema(conn, NAMES) == []
    assert check_schema(conn, TableNames.build("outbox")) == []


def test_missing_table(conn: Conn) -> None:
    conn.execute("DROP TABLE outbox")
    result = check_schema(conn, NAMES)
    assert result == [Problem("outbox", "table does not exist; run `outbox-farm migrate`")]


def test_missing_column(conn: Conn) -> None:
    conn.execute("ALTER TABLE outbox DROP COLUMN last_attempt_at")
    assert only(conn) == (
        "outbox: column last_attempt_at is missing (expected timestamp with time zone)"
    )


def test_missing_indexed_column_reports_column_and_index(conn: Conn) -> None:
    conn.execute("ALTER TABLE outbox DROP COLUMN timer_id")  # drops the timer index with it
    found = problems(conn)
    assert "outbox: column timer_id is missing (expected character varying(255))" in found
    assert any("timer index on (queue, timer_id) is missing" in p for p in found)
    assert len(found) == 2


def test_wrong_type(conn: Conn) -> None:
    conn.execute("ALTER TABLE outbox DROP CONSTRAINT outbox_values_ck")  # jsonb_typeof(headers)
    conn.execute("ALTER TABLE outbox ALTER COLUMN headers TYPE json")
    assert only(conn) == "outbox: column headers is json, expected jsonb"


def test_wrong_varchar_length(conn: Conn) -> None:
    conn.execute("ALTER TABLE outbox ALTER COLUMN queue TYPE varchar(100)")
    assert only(conn) == (
        "outbox: column queue is character varying(100), expected character varying(255)"
    )


def test_nullable_column_that_must_be_not_null(conn: Conn) -> None:
    conn.execute("ALTER TABLE outbox ALTER COLUMN created_at DROP NOT NULL")
    assert only(conn) == "outbox: column created_at should be NOT NULL"


def test_not_null_column_that_must_be_nullable(conn: Conn) -> None:
    conn.execute("ALTER TABLE outbox ALTER COLUMN headers SET NOT NULL")
    assert only(conn) == "outbox: column headers should be nullable"


def test_lost_default_on_next_attempt_at(conn: Conn) -> None:
    conn.execute("ALTER TABLE outbox ALTER COLUMN next_attempt_at DROP DEFAULT")
    assert only(conn) == "outbox: column next_attempt_at has lost its default"


def test_missing_primary_key(conn: Conn) -> None:
    conn.execute("ALTER TABLE outbox DROP CONSTRAINT outbox_pkey")
    assert only(conn) == "outbox: primary key on id is missing"


def test_missing_pending_index(conn: Conn) -> None:
    conn.execute("DROP INDEX outbox_pending_idx")
    message = only(conn)
    assert message.startswith("outbox: pending index on (queue, next_attempt_at) is missing")
    assert FIX_HINT in message


def test_pending_index_not_partial(conn: Conn) -> None:
    conn.execute("DROP INDEX outbox_pending_idx")
    conn.execute("CREATE INDEX outbox_pending_idx ON outbox (queue, next_attempt_at)")
    assert only(conn).startswith(
        "outbox: pending index outbox_pending_idx on (queue, next_attempt_at) is not partial "
        "(expected WHERE acquired_token IS NULL AND NOT key_blocked)"
    )


def test_pending_index_must_not_be_unique(conn: Conn) -> None:
    conn.execute("DROP INDEX outbox_pending_idx")
    conn.execute(
        "CREATE UNIQUE INDEX outbox_pending_idx ON outbox (queue, next_attempt_at)"
        " WHERE acquired_token IS NULL AND NOT key_blocked"
    )
    assert "pending index outbox_pending_idx on (queue, next_attempt_at) must not be UNIQUE" in (
        only(conn)
    )


def test_wrong_predicate_on_lease_index(conn: Conn) -> None:
    conn.execute("DROP INDEX outbox_lease_idx")
    conn.execute(
        "CREATE INDEX outbox_lease_idx ON outbox (queue, lease_expires_at)"
        " WHERE acquired_token IS NULL"
    )
    assert only(conn).startswith(
        "outbox: lease index outbox_lease_idx on (queue, lease_expires_at) has predicate "
        "WHERE acquired_token is null, expected WHERE acquired_token IS NOT NULL"
    )


def test_lease_index_from_before_migration_0004_is_reported(conn: Conn) -> None:
    """The lease index used to be keyed by acquired_at, which no claim orders by any more."""
    conn.execute("DROP INDEX outbox_lease_idx")
    conn.execute(
        "CREATE INDEX outbox_lease_idx ON outbox (queue, acquired_at)"
        " WHERE acquired_token IS NOT NULL"
    )
    assert only(conn).startswith("outbox: lease index on (queue, lease_expires_at) is missing")


def test_missing_lease_expiry_column(conn: Conn) -> None:
    conn.execute("ALTER TABLE outbox DROP COLUMN lease_expires_at")  # drops its index too
    found = problems(conn)
    assert found[0] == (
        "outbox: column lease_expires_at is missing (expected timestamp with time zone)"
    )
    assert found[1].startswith("outbox: lease index on (queue, lease_expires_at) is missing")
    assert len(found) == 2


def test_non_unique_timer_index(conn: Conn) -> None:
    conn.execute("DROP INDEX outbox_timer_id_uq")
    conn.execute(
        "CREATE INDEX outbox_timer_id_uq ON outbox (queue, timer_id) WHERE timer_id IS NOT NULL"
    )
    assert only(conn).startswith(
        "outbox: timer index outbox_timer_id_uq on (queue, timer_id) must be UNIQUE"
    )


def test_index_columns_in_wrong_order_count_as_missing(conn: Conn) -> None:
    conn.execute("DROP INDEX outbox_pending_idx")
    conn.execute(
        "CREATE INDEX outbox_pending_idx ON outbox (next_attempt_at, queue)"
        " WHERE acquired_token IS NULL AND NOT key_blocked"
    )
    assert "pending index on (queue, next_attempt_at) is missing" in only(conn)


def test_index_under_another_name_passes(conn: Conn) -> None:
    conn.execute("DROP INDEX outbox_pending_idx")
    conn.execute(
        "CREATE INDEX ix_alembic_made_this ON outbox (queue, next_attempt_at)"
        " WHERE (acquired_token IS NULL) AND NOT key_blocked"
    )
    assert problems(conn) == []


def test_missing_lease_check(conn: Conn) -> None:
    conn.execute("ALTER TABLE outbox DROP CONSTRAINT outbox_lease_ck")
    assert only(conn).startswith(
        "outbox: lease CHECK ((acquired_token IS NULL) = (acquired_at IS NULL)) is missing or wrong"
    )


def test_wrong_lease_check_predicate(conn: Conn) -> None:
    conn.execute("ALTER TABLE outbox DROP CONSTRAINT outbox_lease_ck")
    conn.execute(
        "ALTER TABLE outbox ADD CONSTRAINT outbox_lease_ck"
        " CHECK (acquired_token IS NULL OR acquired_at IS NOT NULL)"
    )
    assert "lease CHECK" in only(conn)
    assert "is missing or wrong" in only(conn)


def test_lease_check_under_a_different_name_passes(conn: Conn) -> None:
    conn.execute("ALTER TABLE outbox RENAME CONSTRAINT outbox_lease_ck TO lease_is_whole")
    assert problems(conn) == []


def test_lease_check_written_the_other_way_round_passes(conn: Conn) -> None:
    conn.execute("ALTER TABLE outbox DROP CONSTRAINT outbox_lease_ck")
    conn.execute(
        "ALTER TABLE outbox ADD CONSTRAINT django_lease"
        " CHECK ((acquired_at IS NULL) = (acquired_token IS NULL))"
    )
    assert problems(conn) == []


def test_extra_user_column_and_index_are_fine(conn: Conn) -> None:
    conn.execute("ALTER TABLE outbox ADD COLUMN tenant text NOT NULL DEFAULT 'acme'")
    conn.execute("CREATE INDEX outbox_tenant_idx ON outbox (tenant)")
    conn.execute("ALTER TABLE outbox_dlq ADD COLUMN note text")
    conn.execute("ALTER TABLE outbox ADD CONSTRAINT tenant_ck CHECK (tenant <> '')")
    assert problems(conn) == []


def test_dlq_missing_while_outbox_is_fine(conn: Conn) -> None:
    conn.execute("DROP TABLE outbox_dlq")
    assert check_schema(conn, NAMES) == [
        Problem("outbox_dlq", "table does not exist; run `outbox-farm migrate`")
    ]
    assert (
        check_schema(conn, TableNames.build("outbox")) == []
    )  # the DLQ is only checked when configured


def test_dlq_column_drift_is_reported_against_the_dlq(conn: Conn) -> None:
    conn.execute("ALTER TABLE outbox_dlq ALTER COLUMN failure_reason TYPE text")
    conn.execute("ALTER TABLE outbox_dlq ALTER COLUMN failed_at DROP DEFAULT")
    found = check_schema(conn, NAMES)
    assert {p.table for p in found} == {"outbox_dlq"}
    assert sorted(p.message for p in found) == [
        "column failed_at has lost its default",
        "column failure_reason is text, expected character varying(64)",
    ]


def test_dlq_index_must_cover_every_row(conn: Conn) -> None:
    conn.execute("DROP INDEX outbox_dlq_queue_failed_idx")
    conn.execute(
        "CREATE INDEX outbox_dlq_queue_failed_idx ON outbox_dlq (queue, failed_at)"
        " WHERE last_exception IS NOT NULL"
    )
    message = only(conn)
    assert message.startswith(
        "outbox_dlq: failure index outbox_dlq_queue_failed_idx on (queue, failed_at) is partial"
    )
    assert "must cover every row" in message


def test_the_dlq_needs_no_lease_check(conn: Conn) -> None:
    lease_checks = conn.execute(
        "SELECT count(*) FROM pg_constraint WHERE conrelid = 'outbox_dlq'::regclass"
        " AND contype = 'c'"
    ).fetchone()
    assert lease_checks == (0,)
    assert problems(conn) == []


def test_several_problems_reported_at_once(conn: Conn) -> None:
    conn.execute("ALTER TABLE outbox DROP COLUMN first_attempt_at")
    conn.execute("ALTER TABLE outbox ALTER COLUMN payload TYPE text")
    conn.execute("DROP INDEX outbox_lease_idx")
    conn.execute("ALTER TABLE outbox DROP CONSTRAINT outbox_lease_ck")
    conn.execute("DROP INDEX outbox_dlq_queue_failed_idx")
    found = problems(conn)
    assert len(found) == 5, found
    expected_fragments = [
        "outbox: column first_attempt_at is missing",
        "outbox: column payload is text, expected bytea",
        "outbox: lease index on (queue, lease_expires_at) is missing",
        "outbox: lease CHECK",
        "outbox_dlq: failure index on (queue, failed_at) is missing",
    ]
    for fragment in expected_fragments:
        assert any(p.startswith(fragment) for p in found), (fragment, found)


def test_check_runs_in_a_transaction_too(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        conn.execute("DROP INDEX outbox_pending_idx")
        assert "pending index" in only(conn)
        conn.rollback()
        assert problems(conn) == []


def test_database_failure_is_a_database_error(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        with pytest.raises(psycopg.errors.DivisionByZero):
            conn.execute("SELECT 1/0")
        with pytest.raises(DatabaseError, match="schema check failed") as info:
            check_schema(conn, TableNames.build("outbox"))  # the transaction is aborted
        assert isinstance(info.value, psycopg.Error)


def test_mixed_case_table_names_are_found(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA app")
        migrate(conn, TableNames.build("app.MyOutbox", "app.MyOutboxDlq"))
        assert check_schema(conn, TableNames.build("app.MyOutbox", "app.MyOutboxDlq")) == []


def test_invalid_timer_index_is_reported(conn: Conn) -> None:
    conn.execute("DROP INDEX outbox_timer_id_uq")
    conn.execute(
        "INSERT INTO outbox (queue, payload, timer_id) VALUES ('q', 'a', 't'), ('q', 'b', 't')"
    )
    with pytest.raises(psycopg.errors.UniqueViolation):
        conn.execute(
            "CREATE UNIQUE INDEX CONCURRENTLY outbox_timer_id_uq ON outbox (queue, timer_id)"
            " WHERE timer_id IS NOT NULL"
        )
    conn.execute("DELETE FROM outbox")
    valid = conn.execute(
        "SELECT indisvalid FROM pg_index WHERE indexrelid = 'outbox_timer_id_uq'::regclass"
    ).fetchone()
    assert valid == (False,)  # the failed build left an INVALID index behind
    # Timer publishes are broken now ...
    with pytest.raises(DatabaseError, match="no unique or exclusion constraint"):
        Farm().publish(conn, b"x", queue="q", timer_id="t2")
    # ... so the check must say so.
    assert any("timer index" in p for p in problems(conn))


def test_missing_queue_controls_table_says_to_migrate(conn: Conn) -> None:
    # A database before 0011: none of the migrations that make or extend the table are there.
    conn.execute("DELETE FROM outbox_farm_migrations WHERE version IN (11, 12, 14)")
    conn.execute("ALTER TABLE outbox DROP COLUMN fair_key")
    conn.execute("DROP TABLE outbox_farm_queues")
    table, fair_key = problems(conn)
    assert table.startswith("outbox_farm_queues: table does not exist (migration 0011")
    assert table.endswith("run `outbox-farm migrate`")
    assert fair_key.startswith("outbox: column fair_key is missing (expected text) (migration 0014")
    assert fair_key.endswith("run `outbox-farm migrate`")
    migrate(conn, NAMES)
    assert check_schema(conn, NAMES) == []


def test_queue_controls_table_dropped_after_its_migration_says_to_repair(conn: Conn) -> None:
    conn.execute("DROP TABLE outbox_farm_queues")
    assert only(conn).endswith("run `outbox-farm migrate --repair` (it makes it again)")
    migrate(conn, NAMES, repair=True)
    assert check_schema(conn, NAMES) == []


def test_missing_queue_limits_columns_are_each_reported(conn: Conn) -> None:
    conn.execute("ALTER TABLE outbox_farm_queues DROP COLUMN max_running, DROP COLUMN tokens")
    found = problems(conn)
    assert len(found) == 2, found
    assert found[0].startswith(
        "outbox_farm_queues: column max_running is missing (expected integer) (migration 0012"
    )
    assert "column tokens is missing" in found[1]
    assert all(p.endswith("`outbox-farm migrate --repair` (it makes it again)") for p in found)


def test_missing_breaker_columns_are_each_reported(conn: Conn) -> None:
    conn.execute(
        "ALTER TABLE outbox_farm_queues DROP COLUMN breaker_open_since, "
        "ALTER COLUMN breaker_failures DROP DEFAULT"
    )
    found = problems(conn)
    assert found == [
        "outbox_farm_queues: column breaker_failures has lost its default (migration 0012: "
        "breakers); run `outbox-farm migrate --repair` (it makes it again)",
        "outbox_farm_queues: column breaker_open_since is missing (expected timestamp with time "
        "zone) (migration 0012: breakers); run `outbox-farm migrate --repair` (it makes it again)",
    ]


def test_missing_priority_column_is_reported_but_start_does_not_refuse(conn: Conn) -> None:
    from outbox_farm.ops.readiness import check_ready
    from outbox_farm.ops.schema_check import missing_columns

    conn.execute("DELETE FROM outbox_farm_migrations WHERE version = 13")
    conn.execute("ALTER TABLE outbox DROP COLUMN priority")  # its index goes with it
    found = only(conn)
    assert found.startswith(
        "outbox: column priority is missing (expected smallint) (migration 0013"
    )
    assert found.endswith("run `outbox-farm migrate`")
    assert missing_columns(conn, NAMES) == []
    check_ready(conn, NAMES, False, logging.getLogger("test"))  # what `start` asks: no refusal
    migrate(conn, NAMES)
    assert check_schema(conn, NAMES) == []


def test_priority_index_dropped_or_drifted_is_reported(conn: Conn) -> None:
    index = NAMES.identifiers()["priority_idx"]
    conn.execute(sql.SQL("DROP INDEX {}").format(index))
    found = only(conn)
    assert found == (
        "outbox: priority index (migration 0013) on (queue, priority, next_attempt_at) is "
        "missing; run `outbox-farm migrate --repair` (it makes it again)"
    )
    conn.execute(
        "CREATE INDEX drifted ON outbox (queue, priority DESC, next_attempt_at) "
        "WHERE acquired_token IS NULL"
    )
    assert "has predicate WHERE acquired_token is null, expected WHERE" in only(conn)
    conn.execute("DROP INDEX drifted")
    migrate(conn, NAMES, repair=True)
    assert check_schema(conn, NAMES) == []
    conn.execute("ALTER TABLE outbox ALTER COLUMN priority DROP NOT NULL")
    assert "column priority should be NOT NULL (migration 0013" in problems(conn)[0]


def test_a_database_at_0013_says_to_migrate_and_start_does_not_refuse(conn: Conn) -> None:
    from outbox_farm.ops.readiness import check_ready
    from outbox_farm.ops.schema_check import missing_columns

    # A database at 0013: migration 0014 neither recorded nor made.
    conn.execute("DELETE FROM outbox_farm_migrations WHERE version = 14")
    conn.execute("ALTER TABLE outbox DROP COLUMN fair_key")  # its index goes with it
    conn.execute("ALTER TABLE outbox_farm_queues DROP COLUMN key_max_running")
    assert problems(conn) == [
        "outbox_farm_queues: column key_max_running is missing (expected integer) (migration "
        "0014: fair keys; until then a limit per fair key is refused); run `outbox-farm migrate`",
        "outbox: column fair_key is missing (expected text) (migration 0014: fair keys; until "
        "then a publish with a fair key is refused); run `outbox-farm migrate`",
    ]
    # Reported as a migration pending, as 0013's priority is: `start` does not refuse it.
    assert missing_columns(conn, NAMES) == []
    check_ready(conn, NAMES, False, logging.getLogger("test"))
    migrate(conn, NAMES)
    assert check_schema(conn, NAMES) == []


def test_per_key_limit_column_dropped_or_drifted_after_0014_is_reported(conn: Conn) -> None:
    conn.execute("ALTER TABLE outbox_farm_queues DROP COLUMN key_max_running")
    assert only(conn) == (
        "outbox_farm_queues: column key_max_running is missing (expected integer) (migration "
        "0014: fair keys; until then a limit per fair key is refused); run `outbox-farm migrate "
        "--repair` (it makes it again)"
    )
    migrate(conn, NAMES, repair=True)
    assert check_schema(conn, NAMES) == []
    conn.execute("ALTER TABLE outbox_farm_queues ALTER COLUMN key_max_running TYPE bigint")
    assert only(conn).startswith(
        "outbox_farm_queues: column key_max_running is bigint, expected integer (migration 0014"
    )


def test_fair_key_column_dropped_or_drifted_after_0014_is_reported(conn: Conn) -> None:
    conn.execute("ALTER TABLE outbox DROP COLUMN fair_key")  # its index goes with it
    assert only(conn) == (
        "outbox: column fair_key is missing (expected text) (migration 0014: fair keys; until "
        "then a publish with a fair key is refused); run `outbox-farm migrate --repair`"
    )
    migrate(conn, NAMES, repair=True)
    assert check_schema(conn, NAMES) == []
    conn.execute("ALTER TABLE outbox ALTER COLUMN fair_key SET NOT NULL")
    assert only(conn) == (
        "outbox: column fair_key should be nullable (migration 0014: fair keys); run "
        "`outbox-farm migrate --repair`"
    )
    conn.execute("ALTER TABLE outbox ALTER COLUMN fair_key DROP NOT NULL")
    conn.execute("ALTER TABLE outbox ALTER COLUMN fair_key TYPE varchar(255)")
    assert only(conn).startswith(
        "outbox: column fair_key is character varying(255), expected text (migration 0014"
    )


def test_fair_key_index_dropped_or_drifted_after_0014_is_reported(conn: Conn) -> None:
    index = NAMES.identifiers()["fair_idx"]
    conn.execute(sql.SQL("DROP INDEX {}").format(index))
    assert only(conn) == (
        "outbox: fair key index (migration 0014) on (queue, fair_key, next_attempt_at) is "
        "missing; run `outbox-farm migrate --repair` (it makes it again)"
    )
    migrate(conn, NAMES, repair=True)
    assert check_schema(conn, NAMES) == []

    conn.execute(sql.SQL("DROP INDEX {}").format(index))
    conn.execute(
        "CREATE INDEX drifted ON outbox (queue, fair_key, next_attempt_at) "
        "WHERE acquired_token IS NULL AND NOT key_blocked"
    )
    assert only(conn) == (
        "outbox: fair key index (migration 0014) drifted on (queue, fair_key, next_attempt_at) "
        "has predicate WHERE acquired_token is null and not key_blocked, expected WHERE "
        f"acquired_token IS NULL AND NOT key_blocked AND fair_key IS NOT NULL; {FIX_HINT}"
    )


def test_fair_key_index_missing_before_0014_is_recorded_says_to_migrate(
    conn: Conn,
) -> None:
    # The column is there, but 0014 never ran: `migrate` makes the index.
    conn.execute("DELETE FROM outbox_farm_migrations WHERE version = 14")
    conn.execute(sql.SQL("DROP INDEX {}").format(NAMES.identifiers()["fair_idx"]))
    assert only(conn) == (
        "outbox: fair key index (migration 0014) on (queue, fair_key, next_attempt_at) is "
        f"missing; {FIX_HINT}"
    )
    migrate(conn, NAMES)
    assert check_schema(conn, NAMES) == []


def test_fair_key_index_missing_on_a_newer_schema_is_a_note_without_advice(conn: Conn) -> None:
    conn.execute(sql.SQL("DROP INDEX {}").format(NAMES.identifiers()["fair_idx"]))
    conn.execute(
        "INSERT INTO outbox_farm_migrations (target, version, name, checksum)"
        " VALUES ('outbox', 99, 'fair_reshaped', 'x')"
    )
    found = assess_schema(conn, NAMES)
    assert found.problems == []
    assert found.notes[1] == (
        "outbox: fair key index (migration 0014) on (queue, fair_key, next_attempt_at) is "
        "missing, as a newer migration may have left it: leave it, and check with the release "
        "that migrated"
    )


def test_a_fleet_table_dropped_after_0015_says_repair(conn: Conn) -> None:
    assert check_schema(conn, NAMES) == []
    conn.execute("DROP TABLE outbox_farm_fleet_leases")
    conn.execute("ALTER TABLE outbox_farm_fleet_members DROP COLUMN expires_at")
    problems = [(p.table, p.message) for p in check_schema(conn, NAMES)]
    repair = "(migration 0015: a fleet's leases); run `outbox-farm migrate --repair`"
    assert problems == [
        (
            "outbox_farm_fleet_members",
            f"column expires_at is missing (expected timestamp with time zone) {repair}",
        ),
        ("outbox_farm_fleet_leases", f"table does not exist {repair}"),
    ]
    migrate(conn, NAMES, repair=True)
    assert check_schema(conn, NAMES) == []
