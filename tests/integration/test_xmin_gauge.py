"""The xmin horizon gauge: a transaction holding a snapshot open is measured and named, and the
gauge falls back to 0 once it ends."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import psycopg
import pytest
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from outbox_farm import Farm
from outbox_farm.chores import gauges
from outbox_farm.metrics import metrics
from outbox_farm.problems import Problems

metrics()  # register the collectors before the first sample is read


def refresh(dsn: str, watch: gauges.XminWatch) -> None:
    async def once() -> None:
        pool = AsyncConnectionPool(dsn, kwargs={"autocommit": True}, open=False)
        async with pool:
            await gauges.refresh(pool, Farm().queries, ["q"], Problems(), watch)

    asyncio.run(once())


def horizon() -> float | None:
    return REGISTRY.get_sample_value("outbox_farm_xmin_horizon_age_seconds")


def test_a_held_snapshot_is_measured_named_in_a_warning_and_cleared(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    watch = gauges.XminWatch(warn_after=0.5)
    with psycopg.connect(dsn, application_name="report-job") as holder:
        holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM outbox")  # takes the snapshot
        holder.execute("SELECT pg_sleep(1)")  # the snapshot ages a second: what is measured
        pid = holder.info.backend_pid
        with caplog.at_level(logging.WARNING, logger="outbox_farm.gauges"):
            refresh(dsn, watch)
            refresh(dsn, watch)  # within the minute: no second warning
        age = horizon()
        assert age is not None
        assert age >= 1.0
        held = [r for r in caplog.records if getattr(r, "event", None) == "xmin_held"]
        assert len(held) == 1
        assert f"pid {pid}" in held[0].getMessage()
        assert "report-job" in held[0].getMessage()
        holder.rollback()
    refresh(dsn, watch)
    assert horizon() == 0.0


def test_a_short_snapshot_sets_the_gauge_without_a_warning(
    dsn: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture
) -> None:
    conn.execute("SELECT 1")  # an open transaction, held only for this refresh
    with caplog.at_level(logging.WARNING, logger="outbox_farm.gauges"):
        refresh(dsn, gauges.XminWatch())
    assert not [r for r in caplog.records if getattr(r, "event", None) == "xmin_held"]
    age = horizon()
    assert age is not None
    assert 0.0 <= age < 60
