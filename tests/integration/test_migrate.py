"""Migrations against a real database: idempotent, concurrency-safe, any table names."""

from __future__ import annotations

import threading
from typing import Any

import psycopg
import pytest

from outbox_farm.errors import MigrationError
from outbox_farm.names import TableNames
from outbox_farm.ops.migrate import MigrateResult, ddl, migrate
from outbox_farm.ops.schema_check import check_schema

DEFAULT = TableNames.build("outbox", "outbox_dlq")


def regclass(conn: psycopg.Connection[Any], name: str) -> str | None:
    row = conn.execute("SELECT to_regclass(%s)::text", [name]).fetchone()
    assert row is not None
    return row[0]  # type: ignore[no-any-return]


def records(conn: psycopg.Connection[Any]) -> list[tuple[str, int, str]]:
    return conn.execute(
        "SELECT target, version, name FROM outbox_farm_migrations ORDER BY target, version"
    ).fetchall()


def test_migrate_creates_both_tables(empty_dsn: str) -> None:
    lines: list[str] = []
    with psycopg.connect(empty_dsn) as conn:
        result = migrate(conn, DEFAULT, progress=lines.append)
        # The connection is handed back as it came: not autocommit, idle.
        assert conn.autocommit is False
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        assert result.applied == [
            "0001_outbox on outbox",
            "0002_dlq on outbox_dlq",
            "0003_vacuum_truncate on outbox",
            "0004_lease_expiry on outbox",
            "0005_ordering_key on outbox",
            "0006_row_values_check on outbox",
            "0007_dlq_filter_indexes on outbox_dlq",
            "0008_key_blocked on outbox",
            "0009_dlq_cause on outbox_dlq",
            "0010_farm_code on outbox",
            "0011_queue_control on outbox",
            "0012_queue_limits on outbox",
            "0013_priority on outbox",
            "0014_fair_key on outbox",
            "0015_fleet on outbox",
        ]
        assert result.already == []
        assert lines == [
            "applying 0001_outbox on outbox",
            "applying 0002_dlq on outbox_dlq",
            "applying 0003_vacuum_truncate on outbox",
            "applying 0004_lease_expiry on outbox",
            "applying 0005_ordering_key on outbox",
            "applying 0006_row_values_check on outbox",
            "applying 0007_dlq_filter_indexes on outbox_dlq",
            "applying 0008_key_blocked on outbox",
            "applying 0009_dlq_cause on outbox_dlq",
            "applying 0010_farm_code on outbox",
            "applying 0011_queue_control on outbox",
            "applying 0012_queue_limits on outbox",
            "applying 0013_priority on outbox",
            "applying 0014_fair_key on outbox",
            "applying 0015_fleet on outbox",
        ]
        assert regclass(conn, "outbox") == "outbox"
        assert regclass(conn, "outbox_dlq") == "outbox_dlq"
        assert records(conn) == [
            ("outbox", 1, "outbox"),
            ("outbox", 3, "vacuum_truncate"),
            ("outbox", 4, "lease_expiry"),
            ("outbox", 5, "ordering_key"),
            ("outbox", 6, "row_values_check"),
            ("outbox", 8, "key_blocked"),
            ("outbox", 10, "farm_code"),
            ("outbox", 11, "queue_control"),
            ("outbox", 12, "queue_limits"),
            ("outbox", 13, "priority"),
            ("outbox", 14, "fair_key"),
            ("outbox", 15, "fleet"),
            ("outbox_dlq", 2, "dlq"),
            ("outbox_dlq", 7, "dlq_filter_indexes"),
            ("outbox_dlq", 9, "dlq_cause"),
        ]
        assert check_schema(conn, DEFAULT) == []


def test_second_run_applies_nothing(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn) as conn:
        migrate(conn, DEFAULT)
        lines: list[str] = []
        again = migrate(conn, DEFAULT, progress=lines.append)
        assert again.applied == []
        assert again.already == [
            "0001_outbox on outbox",
            "0002_dlq on outbox_dlq",
            "0003_vacuum_truncate on outbox",
            "0004_lease_expiry on outbox",
            "0005_ordering_key on outbox",
            "0006_row_values_check on outbox",
            "0007_dlq_filter_indexes on outbox_dlq",
            "0008_key_blocked on outbox",
            "0009_dlq_cause on outbox_dlq",
            "0010_farm_code on outbox",
            "0011_queue_control on outbox",
            "0012_queue_limits on outbox",
            "0013_priority on outbox",
            "0014_fair_key on outbox",
            "0015_fleet on outbox",
        ]
        assert lines == []
        assert len(records(conn)) == 15


def test_migrate_refuses_a_connection_inside_a_transaction(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn) as conn:
        conn.execute("SELECT 1")  # opens a transaction (not autocommit)
        with pytest.raises(MigrationError, match="not inside a transaction"):
            migrate(conn, DEFAULT)
        conn.rollback()
        assert regclass(conn, "outbox") is None


def test_concurrent_migrate_on_a_fresh_database(empty_dsn: str) -> None:
    barrier = threading.Barrier(2, timeout=10)
    results: list[MigrateResult] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            with psycopg.connect(empty_dsn) as conn:
                barrier.wait()
                results.append(migrate(conn, DEFAULT))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert errors == []
    assert len(results) == 2
    applied = sorted(label for r in results for label in r.applied)
    already = sorted(label for r in results for label in r.already)
    # Each migration ran exactly once; the other run found it done.
    assert applied == [
        "0001_outbox on outbox",
        "0002_dlq on outbox_dlq",
        "0003_vacuum_truncate on outbox",
        "0004_lease_expiry on outbox",
        "0005_ordering_key on outbox",
        "0006_row_values_check on outbox",
        "0007_dlq_filter_indexes on outbox_dlq",
        "0008_key_blocked on outbox",
        "0009_dlq_cause on outbox_dlq",
        "0010_farm_code on outbox",
        "0011_queue_control on outbox",
        "0012_queue_limits on outbox",
        "0013_priority on outbox",
        "0014_fair_key on outbox",
        "0015_fleet on outbox",
    ]
    assert already == applied
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        assert records(conn) == [
            ("outbox", 1, "outbox"),
            ("outbox", 3, "vacuum_truncate"),
            ("outbox", 4, "lease_expiry"),
            ("outbox", 5, "ordering_key"),
            ("outbox", 6, "row_values_check"),
            ("outbox", 8, "key_blocked"),
            ("outbox", 10, "farm_code"),
            ("outbox", 11, "queue_control"),
            ("outbox", 12, "queue_limits"),
            ("outbox", 13, "priority"),
            ("outbox", 14, "fair_key"),
            ("outbox", 15, "fleet"),
            ("outbox_dlq", 2, "dlq"),
            ("outbox_dlq", 7, "dlq_filter_indexes"),
            ("outbox_dlq", 9, "dlq_cause"),
        ]
        tables = conn.execute(
            "SELECT relname FROM pg_class WHERE relkind = 'r' AND relname LIKE 'outbox%%'"
            " ORDER BY relname"
        ).fetchall()
        assert tables == [
            ("outbox",),
            ("outbox_dlq",),
            ("outbox_dlq_causes",),
            ("outbox_farm_code",),
            ("outbox_farm_fleet_leases",),
            ("outbox_farm_fleet_members",),
            ("outbox_farm_migrations",),
            ("outbox_farm_queues",),
        ]
        assert check_schema(conn, DEFAULT) == []


def test_renamed_tables(empty_dsn: str) -> None:
    names = TableNames.build("jobs", "jobs_dead")
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        result = migrate(conn, names)
        assert result.applied == [
            "0001_outbox on jobs",
            "0002_dlq on jobs_dead",
            "0003_vacuum_truncate on jobs",
            "0004_lease_expiry on jobs",
            "0005_ordering_key on jobs",
            "0006_row_values_check on jobs",
            "0007_dlq_filter_indexes on jobs_dead",
            "0008_key_blocked on jobs",
            "0009_dlq_cause on jobs_dead",
            "0010_farm_code on jobs",
            "0011_queue_control on jobs",
            "0012_queue_limits on jobs",
            "0013_priority on jobs",
            "0014_fair_key on jobs",
            "0015_fleet on jobs",
        ]
        assert regclass(conn, "jobs") == "jobs"
        assert regclass(conn, "jobs_dead") == "jobs_dead"
        assert regclass(conn, "outbox") is None
        indexes = {
            row[0]
            for row in conn.execute(
                "SELECT indexname FROM pg_indexes WHERE tablename IN ('jobs', 'jobs_dead')"
            )
        }
        assert {
            "jobs_pending_idx",
            "jobs_lease_idx",
            "jobs_timer_id_uq",
            "jobs_order_idx",
            "jobs_blocked_idx",
            "jobs_fair_idx",
            "jobs_dead_queue_failed_idx",
            "jobs_dead_reason_idx",
            "jobs_dead_queue_reason_idx",
            "jobs_dead_cause_idx",
        } <= indexes
        assert check_schema(conn, TableNames.build("jobs", "jobs_dead")) == []
        # Both sets of tables can live in one database, each with its own records.
        migrate(conn, DEFAULT)
        assert [r[0] for r in records(conn)] == [
            *["jobs"] * 12,
            *["jobs_dead"] * 3,
            *["outbox"] * 12,
            *["outbox_dlq"] * 3,
        ]


def test_schema_qualified_tables(empty_dsn: str) -> None:
    names = TableNames.build("app.jobs", "app.jobs_dlq")
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA app")
        result = migrate(conn, names)
        assert result.applied == [
            "0001_outbox on app.jobs",
            "0002_dlq on app.jobs_dlq",
            "0003_vacuum_truncate on app.jobs",
            "0004_lease_expiry on app.jobs",
            "0005_ordering_key on app.jobs",
            "0006_row_values_check on app.jobs",
            "0007_dlq_filter_indexes on app.jobs_dlq",
            "0008_key_blocked on app.jobs",
            "0009_dlq_cause on app.jobs_dlq",
            "0010_farm_code on app.jobs",
            "0011_queue_control on app.jobs",
            "0012_queue_limits on app.jobs",
            "0013_priority on app.jobs",
            "0014_fair_key on app.jobs",
            "0015_fleet on app.jobs",
        ]
        assert regclass(conn, "app.jobs") == "app.jobs"
        assert regclass(conn, "app.jobs_dlq") == "app.jobs_dlq"
        assert regclass(conn, "jobs") is None  # nothing leaked into public
        schemas = {
            row[0]
            for row in conn.execute(
                "SELECT schemaname FROM pg_indexes WHERE indexname LIKE 'jobs%%'"
            )
        }
        assert schemas == {"app"}
        assert check_schema(conn, TableNames.build("app.jobs", "app.jobs_dlq")) == []
        assert migrate(conn, names).applied == []


def test_no_dlq_creates_only_the_outbox(empty_dsn: str) -> None:
    names = TableNames.build("outbox", None)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        result = migrate(conn, names)
        assert result.applied == [
            "0001_outbox on outbox",
            "0003_vacuum_truncate on outbox",
            "0004_lease_expiry on outbox",
            "0005_ordering_key on outbox",
            "0006_row_values_check on outbox",
            "0008_key_blocked on outbox",
            "0010_farm_code on outbox",
            "0011_queue_control on outbox",
            "0012_queue_limits on outbox",
            "0013_priority on outbox",
            "0014_fair_key on outbox",
            "0015_fleet on outbox",
        ]
        assert regclass(conn, "outbox") == "outbox"
        assert regclass(conn, "outbox_dlq") is None
        assert records(conn) == [
            ("outbox", 1, "outbox"),
            ("outbox", 3, "vacuum_truncate"),
            ("outbox", 4, "lease_expiry"),
            ("outbox", 5, "ordering_key"),
            ("outbox", 6, "row_values_check"),
            ("outbox", 8, "key_blocked"),
            ("outbox", 10, "farm_code"),
            ("outbox", 11, "queue_control"),
            ("outbox", 12, "queue_limits"),
            ("outbox", 13, "priority"),
            ("outbox", 14, "fair_key"),
            ("outbox", 15, "fleet"),
        ]
        assert check_schema(conn, TableNames.build("outbox")) == []
        # Adding the DLQ later applies only its migration.
        assert migrate(conn, DEFAULT).applied == [
            "0002_dlq on outbox_dlq",
            "0007_dlq_filter_indexes on outbox_dlq",
            "0009_dlq_cause on outbox_dlq",
        ]


@pytest.mark.parametrize(
    ("table", "dlq"), [("outbox", "outbox_dlq"), ("outbox", None), ("app.jobs", "app.dead")]
)
def test_ddl_applied_by_hand_passes_the_check(empty_dsn: str, table: str, dlq: str | None) -> None:
    text = ddl(TableNames.build(table, dlq))
    assert "CREATE TABLE IF NOT EXISTS" in text
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA app")
        conn.execute(text)
        assert check_schema(conn, TableNames.build(table, dlq)) == []
        if dlq is None:
            assert regclass(conn, "outbox_dlq") is None
        # DDL leaves no bookkeeping; migrate then adopts the tables without error.
        assert regclass(conn, "outbox_farm_migrations") is None
        result = migrate(conn, TableNames.build(table, dlq))
        assert len(result.applied) == (12 if dlq is None else 15)
        assert check_schema(conn, TableNames.build(table, dlq)) == []


def test_outbox_has_autovacuum_reloptions(conn: psycopg.Connection[Any]) -> None:
    row = conn.execute("SELECT reloptions FROM pg_class WHERE oid = 'outbox'::regclass").fetchone()
    assert row is not None
    options = dict(opt.split("=", 1) for opt in row[0])
    assert options == {
        "fillfactor": "80",
        "autovacuum_vacuum_scale_factor": "0.0",
        "autovacuum_vacuum_threshold": "1000",
        "autovacuum_vacuum_insert_scale_factor": "0.0",
        "autovacuum_vacuum_insert_threshold": "10000",
        "autovacuum_analyze_scale_factor": "0.0",
        "autovacuum_analyze_threshold": "5000",
        "autovacuum_vacuum_cost_delay": "0",
        "vacuum_truncate": "false",
    }
    dlq = conn.execute(
        "SELECT reloptions FROM pg_class WHERE oid = 'outbox_dlq'::regclass"
    ).fetchone()
    assert dlq == (None,)  # the DLQ is append-only; default autovacuum is right for it
