"""A reload that fails is visible: /healthz, a gauge, and the log say that the running code is
not the code on disk, until a reload succeeds.

Real `outbox-farm start` subprocesses with the fault-injection app of `test_worker_faults`.
"""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import psycopg
import pytest

from outbox_farm.admin.doctor import Check, Status, doctor
from outbox_farm.names import TableNames
from tests.acceptance.test_farm import farm_process, ledger_stats
from tests.acceptance.test_worker_faults import (
    _new_workers,
    _versions,
    fault_dir,
    ledger,
    write_app,
)
from tests.steps import publish, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.one_server]
__all__ = ["fault_dir", "ledger"]  # fixtures, used by name


def code_warnings(dsn: str) -> list[Check]:
    """What `doctor` finds wrong with the farms' code."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        checks = doctor(conn, TableNames.build("outbox", "outbox_dlq"))
    return [c for c in checks if c.name == "farm code" and c.status is Status.WARN]


def test_a_failed_reload_degrades_healthz_until_a_reload_succeeds(
    fault_dir: Path, dsn: str, ledger: psycopg.Connection[Any]
) -> None:
    conn = ledger
    with farm_process(fault_dir, dsn, app="faultapp:farm") as farm:
        wait_for(lambda: farm.healthy(2), "2 healthy workers", 30, farm)
        assert "degraded" not in farm.health()[1]  # type: ignore[index]
        assert farm.metric("outbox_farm_reload_failed") == 0
        old = farm.children()
        (fault_dir / "faultapp.py").write_text("import nowhere  # the half-deployed code\n")
        farm.proc.send_signal(signal.SIGHUP)

        def degraded() -> list[str] | None:
            got = farm.health()
            return got[1].get("degraded") if got is not None else None

        notes = wait_for(degraded, "/healthz degraded", 30, farm)
        assert farm.health()[0] == 200  # type: ignore[index]  # the old workers still serve
        assert len(notes) == 1, notes
        assert "the running code is not the code on disk" in notes[0]
        assert "No module named 'nowhere'" in notes[0]
        assert farm.metric("outbox_farm_reload_failed") == 1
        assert farm.children() == old
        (found,) = wait_for(lambda: code_warnings(dsn), "doctor's warning", 30, farm)
        assert found.detail.startswith("the running code is not the code on disk")
        assert "No module named 'nowhere'" in found.detail
        ids = publish(conn, 10, queue="q")
        wait_for(lambda: ledger_stats(conn)[1] == 10, "rows handled by old workers", 30, farm)
        assert _versions(conn, ids) == {"v1"}

        write_app(fault_dir, "fixed")
        farm.proc.send_signal(signal.SIGHUP)
        wait_for(lambda: _new_workers(farm, old), "2 new workers after the fix", 30, farm)
        wait_for(lambda: degraded() is None, "/healthz no longer degraded", 30, farm)
        assert farm.metric("outbox_farm_reload_failed") == 0
        wait_for(lambda: not code_warnings(dsn), "doctor finds nothing wrong again", 30, farm)
        ids = publish(conn, 10, queue="q")
        wait_for(lambda: ledger_stats(conn)[1] == 20, "rows handled by new workers", 30, farm)
        assert _versions(conn, ids) == {"fixed"}
        code, _ = farm.stop()
    assert code == 0, farm.log_tail()


def test_another_farm_running_other_code_for_a_queue_degrades_healthz(
    fault_dir: Path, dsn: str, ledger: psycopg.Connection[Any]
) -> None:
    conn = ledger
    with farm_process(fault_dir, dsn, app="faultapp:farm") as farm:
        wait_for(lambda: farm.healthy(2), "2 healthy workers", 30, farm)
        ours = wait_for(
            lambda: conn.execute(
                "SELECT DISTINCT fingerprint FROM outbox_farm_code WHERE queue = 'q'"
            ).fetchall(),
            "the farm's report of its code",
            30,
            farm,
        )
        assert len(ours) == 1, ours
        # Another farm, on other code for queue q since long before the grace period.
        conn.execute(
            "INSERT INTO outbox_farm_code (target, queue, worker, fingerprint, since, expires_at) "
            "VALUES ('outbox', 'q', 'elsewhere pid 9', 'other', now(), now() + interval '1 hour')"
        )
        conn.execute("UPDATE outbox_farm_code SET since = now() - interval '1 hour'")

        def degraded() -> list[str] | None:
            got = farm.health()
            return got[1].get("degraded") if got is not None else None

        notes = wait_for(degraded, "/healthz degraded", 60, farm)
        assert farm.health()[0] == 200  # type: ignore[index]  # rows are still delivered
        assert len(notes) == 1, notes
        assert notes[0].startswith("queue q: the farms on this database run different code")
        assert "other in 1 process(es) (elsewhere pid 9)" in notes[0]

        conn.execute("DELETE FROM outbox_farm_code WHERE worker = 'elsewhere pid 9'")
        wait_for(lambda: degraded() is None, "/healthz no longer degraded", 60, farm)
        assert farm.log().count("event=code_disagrees") == 1, farm.log_tail()
        code, _ = farm.stop()
    assert code == 0, farm.log_tail()
