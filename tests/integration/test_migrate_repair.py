"""`migrate` against the catalog: a dropped table gets its migrations again, and `repair`
restores what `check` reports missing, so `check` → `migrate` → `check` ends in "schema OK".

The expected migrations are read from the migrations folder, which grows over time.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from outbox_farm.names import TableNames
from outbox_farm.ops.migrate import migrate, selected
from outbox_farm.ops.schema_check import check_schema

Conn = psycopg.Connection[Any]
NAMES = TableNames.build("outbox", "outbox_dlq")


def labels(target: str) -> list[str]:
    table = NAMES.outbox if target == "outbox" else NAMES.dlq
    return [f"{m.version:04d}_{m.name} on {table}" for m in selected(NAMES) if m.target == target]


def problems(conn: Conn) -> list[str]:
    return [str(p) for p in check_schema(conn, NAMES)]


def recorded(conn: Conn, target: str) -> list[int]:
    rows = conn.execute(
        "SELECT version FROM outbox_farm_migrations WHERE target = %s ORDER BY version", [target]
    ).fetchall()
    return [int(r[0]) for r in rows]


@pytest.mark.parametrize("dropped", ["outbox_dlq", "outbox"])
def test_a_dropped_table_gets_its_migrations_again(conn: Conn, dropped: str) -> None:
    target = "dlq" if dropped == "outbox_dlq" else "outbox"
    before = recorded(conn, dropped)
    assert before
    conn.execute(f"DROP TABLE {dropped}")
    assert f"{dropped}: table does not exist; run `outbox-farm migrate`" in problems(conn)

    said: list[str] = []
    result = migrate(conn, NAMES, progress=said.append)

    assert result.applied == labels(target)
    assert sorted(result.already) == sorted(
        set(labels("outbox") + labels("dlq")) - set(labels(target))
    )
    assert f"{dropped} does not exist although its migrations were recorded" in said[0]
    assert problems(conn) == []
    assert recorded(conn, dropped) == before

    again = migrate(conn, NAMES)
    assert again.applied == []


def test_both_tables_dropped(conn: Conn) -> None:
    conn.execute("DROP TABLE outbox, outbox_dlq")
    result = migrate(conn, NAMES)
    assert sorted(result.applied) == sorted(labels("outbox") + labels("dlq"))
    assert problems(conn) == []


def test_the_rows_of_a_table_that_was_not_dropped_are_kept(conn: Conn) -> None:
    conn.execute("INSERT INTO outbox (queue, payload) VALUES ('q', 'kept')")
    conn.execute("DROP TABLE outbox_dlq")
    migrate(conn, NAMES)
    row = conn.execute("SELECT payload FROM outbox").fetchone()
    assert row == (b"kept",)


def test_repair_brings_back_a_dropped_index(conn: Conn) -> None:
    conn.execute("DROP INDEX outbox_pending_idx")
    conn.execute("ALTER TABLE outbox RESET (vacuum_truncate)")
    broken = problems(conn)
    assert any("pending index" in p for p in broken), broken

    plain = migrate(conn, NAMES)
    assert plain.applied == []
    assert problems(conn) == broken

    said: list[str] = []
    repaired = migrate(conn, NAMES, repair=True, progress=said.append)
    assert repaired.applied == []
    assert sorted(repaired.repaired) == sorted(labels("outbox") + labels("dlq"))
    assert f"repairing {labels('outbox')[0]}" in said
    assert problems(conn) == []
    options = conn.execute(
        "SELECT reloptions FROM pg_class WHERE oid = 'outbox'::regclass"
    ).fetchone()
    assert options is not None
    assert "vacuum_truncate=false" in options[0]


def test_repair_of_an_intact_schema_changes_nothing(conn: Conn) -> None:
    conn.execute("INSERT INTO outbox (queue, payload) VALUES ('q', 'kept')")
    before = conn.execute("SELECT target, version, checksum FROM outbox_farm_migrations").fetchall()
    migrate(conn, NAMES, repair=True)
    after = conn.execute("SELECT target, version, checksum FROM outbox_farm_migrations").fetchall()
    assert sorted(after) == sorted(before)
    assert problems(conn) == []
    assert conn.execute("SELECT count(*) FROM outbox").fetchone() == (1,)
