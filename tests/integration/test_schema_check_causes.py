"""check_schema against drift of migration 0009's objects (dead letters grouped by cause):
each dropped or disabled one is reported with the command that makes it again, and that
command leaves the schema clean and the counts true."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from outbox_farm.admin import DlqFilter
from outbox_farm.admin.dlq import dlq_causes
from outbox_farm.names import TableNames
from outbox_farm.ops.migrate import migrate
from outbox_farm.ops.schema_check import check_schema
from tests.integration.test_admin_dlq import dead

Conn = psycopg.Connection[Any]
NAMES = TableNames.build("outbox", "outbox_dlq")
REPAIR = "; run `outbox-farm migrate --repair` (it makes them again and recounts)"
DRIFT = "missing or disabled (migration 0009), so the counts drift from the rows"


def problems(conn: Conn) -> list[str]:
    return [str(p) for p in check_schema(conn, NAMES)]


@pytest.mark.parametrize(
    ("drift", "reported"),
    [
        (
            "DROP TRIGGER outbox_farm_causes_insert ON outbox_dlq",
            [f"the cause counts' trigger outbox_farm_causes_insert is {DRIFT}"],
        ),
        (
            "ALTER TABLE outbox_dlq DISABLE TRIGGER outbox_farm_causes_delete",
            [f"the cause counts' trigger outbox_farm_causes_delete is {DRIFT}"],
        ),
        (
            "DROP FUNCTION outbox_dlq_causes_count() CASCADE",  # and its four triggers
            [
                "the cause counts' triggers outbox_farm_causes_delete, outbox_farm_causes_insert, "
                f"outbox_farm_causes_truncate, outbox_farm_causes_update are {DRIFT}"
            ],
        ),
        (
            "DROP TABLE outbox_dlq_causes",
            [
                "the cause counts table outbox_dlq_causes (every write to the DLQ fails "
                "meanwhile) is missing (migration 0009)"
            ],
        ),
        (
            "DROP INDEX outbox_dlq_cause_idx",
            ["the index on outbox_dlq_cause(last_exception) is missing (migration 0009)"],
        ),
        (
            "DROP FUNCTION outbox_dlq_cause(text) CASCADE",  # and the index on it
            [
                "the cause function outbox_dlq_cause(text) (every write to the DLQ fails "
                "meanwhile) is missing (migration 0009)",
                "the index on outbox_dlq_cause(last_exception) is missing (migration 0009)",
            ],
        ),
    ],
)
def test_a_dropped_cause_object_is_drift_that_repair_mends(
    conn: Conn, drift: str, reported: list[str]
) -> None:
    dead(conn, exception="KeyError('sku')")
    assert problems(conn) == []  # positive control: the migrated schema is clean
    conn.execute(drift)
    assert problems(conn) == [f"outbox_dlq: {message}{REPAIR}" for message in reported]
    if "fails meanwhile" in reported[0]:
        with pytest.raises(psycopg.ProgrammingError, match="does not exist"):  # as it says
            dead(conn, exception="KeyError('sku')")
        dead_letters = 1
    else:
        dead(conn, exception="KeyError('sku')")  # uncounted, or counted, meanwhile
        dead_letters = 2
    migrate(conn, NAMES, repair=True)
    assert problems(conn) == []
    assert [(g.cause, g.rows) for g in dlq_causes(conn, NAMES, DlqFilter())] == [
        ("KeyError('sku')", dead_letters)
    ]


def test_a_dlq_never_migrated_to_0009_says_to_migrate(conn: Conn) -> None:
    conn.execute("DROP FUNCTION outbox_dlq_causes_count() CASCADE")
    conn.execute("DROP FUNCTION outbox_dlq_cause(text) CASCADE")
    conn.execute("DROP TABLE outbox_dlq_causes")
    conn.execute("DELETE FROM outbox_farm_migrations WHERE version = 9")
    assert problems(conn) == [
        "outbox_dlq: dead letters by cause are not set up (migration 0009: the cause function, "
        "the counts table, its triggers and the index on the cause); run `outbox-farm migrate`"
    ]
    assert migrate(conn, NAMES).applied == ["0009_dlq_cause on outbox_dlq"]
    assert problems(conn) == []


def test_the_objects_are_looked_up_in_the_dlq_s_schema(empty_dsn: str) -> None:
    """A function or table of the same name in another schema on the path stands in for none."""
    names = TableNames.build("app.jobs", "app.jobs_dlq")
    with psycopg.connect(empty_dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA app")
        migrate(conn, names)
        assert check_schema(conn, names) == []
        conn.execute("CREATE TABLE public.jobs_dlq_causes (LIKE app.jobs_dlq_causes)")
        conn.execute("DROP TABLE app.jobs_dlq_causes")
        assert [p.message for p in check_schema(conn, names)] == [
            "the cause counts table jobs_dlq_causes (every write to the DLQ fails meanwhile) "
            f"is missing (migration 0009){REPAIR}"
        ]
