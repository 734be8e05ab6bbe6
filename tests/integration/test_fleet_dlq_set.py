"""`dlq purge --database all` as `bulk_set.run_over` runs it, on three real databases: one
failing after its first batch was committed does not stop the next, the summary names it, and
the exit status is 1; what the failing one had done stays done."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest

from outbox_farm.admin import DlqFilter, Done, dlq_purge
from outbox_farm.cli.bulk import Bulk, Progress
from outbox_farm.cli.bulk_set import run_over
from outbox_farm.db.connect import Connection
from outbox_farm.errors import DatabaseError
from outbox_farm.names import TableNames
from outbox_farm.testing.databases import Templates
from tests.integration.test_admin_dlq import dead

NAMES = TableNames.build("outbox", "outbox_dlq")


@pytest.fixture
def three(outbox_templates: Templates) -> Iterator[dict[str, str]]:
    """Three migrated databases by name, two dead-lettered rows in each."""
    with contextlib.ExitStack() as stack:
        databases = {
            f"tenant_{i}": stack.enter_context(outbox_templates.database(NAMES)) for i in range(3)
        }
        for url in databases.values():
            with psycopg.connect(url, autocommit=True) as conn:
                dead(conn)
                dead(conn)
        yield databases


def dlq_rows(url: str) -> Any:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM outbox_dlq").fetchone()
    assert row is not None
    return row[0]


def test_a_database_failing_mid_way_does_not_stop_the_others(
    three: dict[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    failing = psycopg.conninfo.conninfo_to_dict(three["tenant_1"])["dbname"]

    def work(conn: Connection, upto: int, step: Progress) -> Done:
        def progress(rows: int) -> None:
            step(rows)
            if conn.info.dbname == failing:
                raise DatabaseError("the server went away")

        return dlq_purge(conn, NAMES, DlqFilter(), batch=1, upto=upto, progress=progress)

    bulk = Bulk(
        ask="Delete",
        doing="purging",
        past="purged",
        target="from outbox_dlq",
        plan=lambda rows: f"delete {rows} row(s) from outbox_dlq, in batches of 1",
        work=work,
    )
    with pytest.raises(SystemExit) as ended:
        run_over(bulk, three, NAMES, DlqFilter(), dry_run=False, yes=True, as_json=False)
    assert ended.value.code == 1
    out, err = capsys.readouterr()
    assert out.strip() == ("purged 4 row(s) from outbox_dlq in 2 database(s); 1 failed (tenant_1)")
    assert "  tenant_1: FAILED: the server went away" in err
    assert "  tenant_2: purged 2 row(s) in 2 batch(es)" in err
    # Its first batch was committed before the failure; the others purged everything.
    assert [dlq_rows(three[n]) for n in sorted(three)] == [0, 1, 0]
