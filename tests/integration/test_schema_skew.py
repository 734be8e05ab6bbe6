"""Code and schema one release apart, in either order (DESIGN.md §9, invariant 18).

This release's producer on a schema without migration 0008, its `start` on a schema older than
it needs, its `check` on a schema a newer release migrated. The previous release's own code on
this schema, and the switch from one to the other under load, are in
tests/acceptance/test_upgrade.py.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import psycopg
import pytest

from outbox_farm import Farm
from outbox_farm.db import publish as publish_module
from outbox_farm.db.schema import MigrationRecord, migration_lock
from outbox_farm.errors import SchemaError
from outbox_farm.names import TableNames
from outbox_farm.ops.migrate import migrate, selected
from outbox_farm.ops.readiness import check_ready, schema_report
from outbox_farm.ops.schema_check import FIX_HINT, assess_schema, check_schema

Conn = psycopg.Connection[Any]
NAMES = TableNames.build("outbox", "outbox_dlq")
BEFORE_KEY_BLOCKED = 7  # the last migration before 0008 added `key_blocked`
WINDOW_PLUS_ONE = 9  # rows of one key: the ninth has a whole window (8) before it
LOG = logging.getLogger("tests.schema_skew")


def migrate_to(dsn: str, last: int) -> None:
    """The schema as a release whose newest migration is `last` leaves it, records and all."""
    with psycopg.connect(dsn) as conn, migration_lock(conn) as ledger:
        for m in selected(NAMES):
            if m.version <= last:
                target = str(NAMES.outbox if m.target == "outbox" else NAMES.dlq)
                record = MigrationRecord(target, m.version, m.name, m.checksum)
                ledger.apply(m.statement(NAMES), record)


def marked_by_key(conn: Conn) -> dict[str, int]:
    rows = conn.execute(
        "SELECT ordering_key, count(*) FILTER (WHERE key_blocked) FROM outbox"
        " WHERE ordering_key IS NOT NULL GROUP BY ordering_key"
    ).fetchall()
    return {key: int(count) for key, count in rows}


def test_every_publish_call_works_on_a_schema_without_key_blocked(empty_dsn: str) -> None:
    migrate_to(empty_dsn, BEFORE_KEY_BLOCKED)
    farm = Farm("outbox", "outbox_dlq")
    with psycopg.connect(empty_dsn) as conn:
        with conn.transaction():
            conn.execute("CREATE TABLE orders (id int)")  # the application's own write
            assert farm.publish(conn, {"n": 1}, queue="q") is not None
            assert farm.publish(conn, {"n": 2}, queue="q", ordering_key="k") is not None
            assert farm.publish(conn, {"n": 3}, queue="q", timer_id="t") is not None
            extended = farm.publish(
                conn, {"n": 4}, queue="q", timer_id="t", on_timer_conflict="extend"
            )
            assert extended is not None
            ids = farm.publish_batch(conn, list(range(10)), queue="q", ordering_key="k")
            assert len(ids) == 10
        rows = conn.execute("SELECT count(*), count(ordering_key) FROM outbox").fetchone()
        assert rows == (13, 11)
        assert conn.execute("SELECT to_regclass('orders') IS NOT NULL").fetchone() == (True,)


def test_async_publish_calls_work_on_a_schema_without_key_blocked(empty_dsn: str) -> None:
    migrate_to(empty_dsn, BEFORE_KEY_BLOCKED)
    farm = Farm("outbox", "outbox_dlq")

    async def publish() -> list[int]:
        async with await psycopg.AsyncConnection.connect(empty_dsn) as aconn:
            async with aconn.transaction():
                one = await farm.apublish(aconn, b"x", queue="q", ordering_key="k")
                many = await farm.apublish_batch(aconn, [b"y"] * 9, queue="q", ordering_key="k")
            assert one is not None
            return [one, *many]

    ids = asyncio.run(publish())
    with psycopg.connect(empty_dsn) as conn:
        found = conn.execute("SELECT id FROM outbox ORDER BY id").fetchall()
    assert [row[0] for row in found] == ids


def test_a_connection_marks_rows_once_it_finds_the_migration(
    empty_dsn: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    migrate_to(empty_dsn, BEFORE_KEY_BLOCKED)
    farm = Farm("outbox", "outbox_dlq")
    with (
        psycopg.connect(empty_dsn, autocommit=True) as kept,
        psycopg.connect(empty_dsn, autocommit=True) as looks_again,
    ):
        farm.publish(kept, b"before", queue="q")  # found no column: keeps that for RECHECK
        monkeypatch.setattr(publish_module, "RECHECK", 0.0)
        farm.publish(looks_again, b"before", queue="q")  # found no column: looks again next time
        with psycopg.connect(empty_dsn) as admin:
            migrate(admin, NAMES)
        farm.publish_batch(kept, [b"r"] * WINDOW_PLUS_ONE, queue="q", ordering_key="kept")
        farm.publish_batch(looks_again, [b"r"] * WINDOW_PLUS_ONE, queue="q", ordering_key="again")
        with psycopg.connect(empty_dsn, autocommit=True) as fresh:
            farm.publish_batch(fresh, [b"r"] * WINDOW_PLUS_ONE, queue="q", ordering_key="fresh")
            # The connection that asked once still writes the older rows (accepted, unmarked);
            # one that asks again, and a new one, mark the row behind a whole window.
            assert marked_by_key(fresh) == {"kept": 0, "again": 1, "fresh": 1}


def test_start_refuses_a_schema_older_than_it_needs_in_one_line(empty_dsn: str) -> None:
    migrate_to(empty_dsn, BEFORE_KEY_BLOCKED)
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        with pytest.raises(SchemaError) as refused:
            check_ready(conn, NAMES, False, LOG)
        message = str(refused.value)
        assert "\n" not in message
        assert "outbox.key_blocked" in message
        assert "run `outbox-farm migrate`" in message
        # The positive control: `start --migrate` migrates, then starts.
        check_ready(conn, NAMES, True, LOG)
        check_ready(conn, NAMES, False, LOG)


def test_an_embedded_runtime_refuses_a_schema_older_than_it_needs(empty_dsn: str) -> None:
    """`Farm.running` has no `start` to look first: it refuses as `start` does, and runs once
    the schema is migrated."""
    migrate_to(empty_dsn, BEFORE_KEY_BLOCKED)
    farm = Farm("outbox", "outbox_dlq")

    @farm.handler("q")
    async def handle(msg: object) -> None:
        pass

    async def run() -> None:
        async with farm.running(empty_dsn, poll_interval=0.1):
            pass

    with pytest.raises(SchemaError, match=r"outbox\.key_blocked.*outbox-farm migrate"):
        asyncio.run(run())
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        migrate(conn, NAMES)
    asyncio.run(run())  # the positive control


def test_check_on_a_newer_schema_notes_its_shapes_instead_of_advising_to_undo_them(
    conn: Conn,
) -> None:
    # What a newer release's migration might do: rebuild the pending index another way.
    conn.execute("DROP INDEX outbox_pending_idx")
    conn.execute(
        "CREATE INDEX outbox_pending_idx ON outbox (queue, next_attempt_at)"
        " WHERE acquired_token IS NULL AND NOT key_blocked AND attempts_count < 1000"
    )
    # The control: without a record of a newer migration, that is drift to repair.
    drift = check_schema(conn, NAMES)
    assert [p.message.endswith(FIX_HINT) for p in drift] == [True]
    assert "pending index" in drift[0].message

    conn.execute(
        "INSERT INTO outbox_farm_migrations (target, version, name, checksum)"
        " VALUES ('outbox', 99, 'pending_reshaped', 'x')"
    )
    found = assess_schema(conn, NAMES)
    assert found.problems == []
    assert found.notes[0].startswith(
        "the schema is newer than this release (migration 0099_pending_reshaped on outbox;"
    )
    assert "pending index" in found.notes[1]
    assert not any("recreate" in note or "drop it" in note for note in found.notes)
    report = schema_report(conn, NAMES)
    assert report.problems == []
    assert report.notes[:2] == found.notes

    # A newer schema still has every column this release needs: a missing one is a problem.
    conn.execute("ALTER TABLE outbox_dlq DROP COLUMN timer_id")
    assert [str(p) for p in check_schema(conn, NAMES)] == [
        "outbox_dlq: column timer_id is missing (expected character varying(255))"
    ]
