"""`start --dlq-retention`: the housekeeping worker deletes DLQ rows past the retention."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg
import pytest

from tests.acceptance.test_farm import FARMAPP, farm_process, scalar
from tests.steps import wait_for

pytestmark = pytest.mark.slow


def test_dlq_retention_deletes_only_rows_older_than_it_and_counts_them(
    tmp_path: Path, dsn: str, conn: psycopg.Connection[Any]
) -> None:
    (tmp_path / "farmapp.py").write_text(FARMAPP)
    conn.execute(
        "INSERT INTO outbox_dlq (original_id, queue, payload, deliveries_count, created_at, "
        "failed_at, failure_reason) "
        "SELECT g, 'q', 'x', 1, now(), now() - make_interval(hours => CASE WHEN g <= 1200 "
        "THEN 3 ELSE 1 END), 'rejected' FROM generate_series(1, 1500) AS g"
    )
    with farm_process(tmp_path, dsn, "--dlq-retention", "2h") as farm:
        wait_for(
            lambda: scalar(conn, "SELECT count(*) FROM outbox_dlq") == 300,
            "the 1,200 old DLQ rows deleted",
            30,
            farm,
            every=0.2,
        )
        wait_for(
            lambda: farm.metric("outbox_farm_dlq_purged_total", queue="q") == 1200,
            "dlq_purged_total 1200",
            15,
            farm,
        )
        assert scalar(conn, "SELECT max(original_id) - min(original_id) FROM outbox_dlq") == 299
        code, _ = farm.stop()
    assert code == 0, farm.log_tail()


def test_a_malformed_dlq_retention_is_a_usage_error(tmp_path: Path, dsn: str) -> None:
    (tmp_path / "farmapp.py").write_text(FARMAPP)
    with farm_process(tmp_path, dsn, "--dlq-retention", "thirty days") as farm:
        code = farm.proc.wait(timeout=30)
    assert code == 2
    assert "--dlq-retention" in farm.log()
    assert "not a duration" in farm.log()
