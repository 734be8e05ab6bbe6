"""The storage layer of the schema tools, the operator tools and the producer, on a real server:
typed rows from its reads, driver errors translated once into outbox_farm errors that say what
to do, and publishing on the caller's connection inside the caller's transaction."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from datetime import datetime
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from outbox_farm.db.connect import connect
from outbox_farm.db.dlq import DlqMatch, DlqRecord, DlqRow, Summary, list_rows, read_row, summarize
from outbox_farm.db.operator import DeadCounts, DoctorProbes, Plan, ServerFacts, StatsReader
from outbox_farm.db.privileges import table_access
from outbox_farm.db.publish import Due, NewBatch, NewRow, Publisher
from outbox_farm.db.schema import LiveIndex, migration_lock, missing_tables, read_table
from outbox_farm.errors import (
    ConnectionLost,
    DatabaseError,
    MigrationError,
    PrivilegeError,
    SchemaError,
)
from outbox_farm.names import QualifiedName, TableNames
from outbox_farm.queries import Queries

NAMES = TableNames.build("outbox", "outbox_dlq")
Conn = psycopg.Connection[Any]
NOW = Due(None, 0.0)


def dead(conn: Conn, queue: str, reason: str, age: str = "0 seconds") -> int:
    row = conn.execute(
        "INSERT INTO outbox_dlq (original_id, queue, payload, headers, deliveries_count, "
        "created_at, failed_at, failure_reason, last_exception) VALUES (7, %s, 'body', "
        """'{"content-type": "text/plain"}', 2, now(), now() - %s::interval, %s, """
        "'KeyError(1)\nTraceback') RETURNING id",
        [queue, age, reason],
    ).fetchone()
    assert row is not None
    return int(row[0])


# --- typed rows -----------------------------------------------------------------------------


def test_dlq_reads_are_typed_rows(conn: Conn) -> None:
    first = dead(conn, "orders", "rejected", "2 hours")
    second = dead(conn, "orders", "retry_terminal")
    dead(conn, "mail", "rejected")

    (newest,) = list_rows(conn, NAMES, DlqMatch(queue="orders", reason="retry_terminal"), 10)
    assert isinstance(newest, DlqRow)
    assert (newest.id, newest.original_id, newest.queue, newest.reason) == (
        second,
        7,
        "orders",
        "retry_terminal",
    )
    assert (newest.deliveries_count, newest.payload_bytes) == (2, 4)
    assert newest.headers == {"content-type": "text/plain"}
    assert newest.exception == "KeyError(1)"
    assert isinstance(newest.failed_at, datetime)

    record = read_row(conn, NAMES, first)
    assert isinstance(record, DlqRecord)
    assert (record.payload, record.last_exception, record.timer_id) == (
        b"body",
        "KeyError(1)\nTraceback",
        None,
    )
    assert read_row(conn, NAMES, 10**9) is None

    summary = summarize(conn, NAMES, DlqMatch(queue="orders"))
    assert isinstance(summary, Summary)
    assert [(line.queue, line.reason, line.rows) for line in summary.lines] == [
        ("orders", "rejected", 1),
        ("orders", "retry_terminal", 1),
    ]
    assert summary.upto == second


def test_stats_reads_are_typed_rows(conn: Conn) -> None:
    conn.execute("INSERT INTO outbox (queue, payload) VALUES ('q', 'a'), ('q', 'b')")
    dead(conn, "q", "rejected", "2 hours")
    dead(conn, "gone", "max_deliveries")
    reader = StatsReader(conn, NAMES)
    assert reader.queues() == ["gone", "q"]
    assert reader.count_outbox("ready", "q", cap=10) == 2
    assert reader.count_outbox("ready", "q", cap=1) == 1  # capped
    plan = reader.plan_outbox("ready", "q", cap=10)
    assert isinstance(plan, Plan)
    assert plan.cost > 0
    assert plan.rows >= 1
    (counts,) = reader.newest_dead("q", cap=10)
    assert counts == DeadCounts("rejected", 0, 1, 1, counts.oldest_age)
    assert 7100 < counts.oldest_age < 7300
    assert reader.oldest_ready("nothing here") == 0.0


def test_doctor_probes_are_typed_rows(conn: Conn) -> None:
    probes = DoctorProbes(conn, NAMES)
    facts = probes.server()
    assert isinstance(facts, ServerFacts)
    assert facts.version_num >= 120000
    assert isinstance(facts.track_counts, bool)
    assert 0.0 <= facts.notify_queue_usage < 1.0
    health = probes.table_health(NAMES.outbox)
    assert health is not None
    assert health.size > 0
    assert health.autovacuum_off is False
    assert probes.table_health(QualifiedName(None, "no_such_table")) is None
    assert probes.oldest_ready_by_queue() == {}


def test_schema_reads_are_typed_rows(conn: Conn) -> None:
    live = read_table(conn, NAMES.outbox)
    assert live is not None
    assert live.columns["payload"].type == "bytea"
    assert live.columns["id"].has_default
    assert not live.columns["timer_id"].not_null
    pending = [index for index in live.indexes if index.name == "outbox_pending_idx"]
    assert pending == [
        LiveIndex(
            "outbox_pending_idx",
            ("queue", "next_attempt_at"),
            False,
            False,
            "((acquired_token IS NULL) AND (NOT key_blocked))",
        )
    ]
    assert len(live.checks) == 4  # lease, counters, values (0006), blocked rows (0008)
    assert read_table(conn, QualifiedName(None, "no_such_table")) is None
    assert missing_tables(conn, NAMES) == []
    conn.execute("DROP TABLE outbox_dlq")
    assert missing_tables(conn, NAMES) == [NAMES.dlq]


def test_privileges_are_a_typed_row(conn: Conn) -> None:
    access = table_access(conn, NAMES.outbox)
    assert access is not None
    assert (access.select, access.insert, access.update, access.delete) == (True,) * 4
    assert access.sequence == QualifiedName("public", "outbox_id_seq")
    assert access.sequence_usage
    assert table_access(conn, QualifiedName(None, "no_such_table")) is None


# --- error translation ----------------------------------------------------------------------


def test_a_missing_table_names_it_and_says_what_to_run(empty_dsn: str) -> None:
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        calls: list[tuple[str, Callable[[], object]]] = [
            ("DLQ table outbox_dlq", lambda: list_rows(conn, NAMES, DlqMatch(), 10)),
            ("outbox table outbox", lambda: StatsReader(conn, NAMES).count_outbox("ready", "q", 9)),
            (
                "outbox table outbox",
                lambda: Publisher(Queries(NAMES)).insert(
                    conn, NewRow("q", b"x", "{}", NOW), notify=False
                ),
            ),
        ]
        for table, call in calls:
            with pytest.raises(SchemaError) as info:
                call()
            assert f"{table} does not exist: run `outbox-farm migrate`" in str(info.value)
            assert isinstance(info.value.__cause__, psycopg.errors.UndefinedTable)


def test_other_failures_say_what_failed(conn: Conn) -> None:
    conn.execute("ALTER TABLE outbox_dlq RENAME COLUMN failure_reason TO why")
    with pytest.raises(SchemaError, match=r"^DLQ statement failed: column d\.failure_reason"):
        list_rows(conn, NAMES, DlqMatch(), 10)
    conn.execute("ALTER TABLE outbox_dlq RENAME COLUMN why TO failure_reason")
    conn.execute(
        "CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
        "RAISE EXCEPTION 'no more rows'; END $$"
    )
    conn.execute(
        "CREATE TRIGGER refuse BEFORE INSERT ON outbox FOR EACH ROW EXECUTE FUNCTION refuse()"
    )
    with pytest.raises(DatabaseError, match=r"^outbox write failed: no more rows") as info:
        Publisher(Queries(NAMES)).insert(conn, NewRow("q", b"x", "{}", NOW), notify=True)
    assert type(info.value) is DatabaseError
    with (
        pytest.raises(MigrationError, match=r"^migration failed: division by zero"),
        migration_lock(conn) as ledger,
    ):
        ledger.apply("SELECT 1/0", None)
    assert conn.autocommit is True  # handed back as it came


@pytest.fixture
def stranger(server_dsn: str, dsn: str) -> Iterator[str]:
    """A DSN for a fresh LOGIN role with no privileges on the test database's tables."""
    role = f"outbox_farm_s_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(server_dsn, autocommit=True) as admin:
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)))
    params = conninfo_to_dict(dsn)
    params["user"] = role
    params.pop("password", None)
    try:
        yield make_conninfo(**params)
    finally:
        with psycopg.connect(server_dsn, autocommit=True) as admin:
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


def test_a_missing_privilege_points_at_check(stranger: str) -> None:
    with psycopg.connect(stranger, autocommit=True) as conn:
        calls: list[Callable[[], object]] = [
            lambda: list_rows(conn, NAMES, DlqMatch(), 10),
            lambda: StatsReader(conn, NAMES).queues(),
            lambda: Publisher(Queries(NAMES)).insert_batch(
                conn, NewBatch("q", [b"x"], ["{}"], NOW), notify=True
            ),
        ]
        for call in calls:
            with pytest.raises(PrivilegeError) as info:
                call()
            assert "permission denied for table" in str(info.value)
            assert "`outbox-farm check` prints the GRANT" in str(info.value)
            assert isinstance(info.value, DatabaseError)
            assert isinstance(info.value, psycopg.Error)


def test_a_bad_dsn_is_a_connect_error_without_the_password(dsn: str) -> None:
    params = conninfo_to_dict(dsn)
    params.update(port="1", password="hunter2", host="127.0.0.1")
    with pytest.raises(ConnectionLost) as info:
        connect(make_conninfo(**params))
    message = str(info.value)
    assert message.startswith("cannot connect to ")
    assert "hunter2" not in message
    assert "password=***" in message
    assert "Check --dsn / OUTBOX_FARM_DSN" in message


# --- publishing on the caller's connection --------------------------------------------------


def test_publish_shares_the_callers_transaction(dsn: str, conn: Conn) -> None:
    publisher = Publisher(Queries(NAMES))
    conn.execute("LISTEN outbox_outbox")
    with psycopg.connect(dsn) as producer:
        row_id = publisher.insert(producer, NewRow("q", b"x", "{}", NOW), notify=True)
        ids = publisher.insert_batch(
            producer, NewBatch("q", [b"y", b"z"], ["{}", "{}"], NOW), notify=True
        )
        assert isinstance(row_id, int)
        assert len(ids) == 2
        assert producer.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS
        producer.rollback()
        assert list(conn.notifies(timeout=0.3)) == []
        assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (0,)

        kept = publisher.insert(producer, NewRow("q", b"kept", "{}", NOW), notify=True)
        timer = NewRow("q", b"t", "{}", Due(None, 60.0), timer_id="t1")
        assert publisher.insert(producer, timer, notify=True) is not None
        assert publisher.insert(producer, timer, notify=True) is None  # the live timer is kept
        producer.commit()
    assert [(n.channel, n.payload) for n in conn.notifies(timeout=1)] == [("outbox_outbox", "q")]
    rows = conn.execute("SELECT id, payload FROM outbox ORDER BY id").fetchall()
    assert [(kept, b"kept")] == rows[:1]
    assert len(rows) == 2
