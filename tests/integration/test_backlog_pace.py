"""The backlog gauge's count is paced by its own cost (`gauges.Pace`): a count that took
seconds, as one over a backlog of ten million rows does, is not run again at the next refresh
but after twenty times its duration, so counting never keeps the database busy; a cheap count
runs at every refresh."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg
from prometheus_client import REGISTRY
from psycopg_pool import AsyncConnectionPool

from outbox_farm import Farm
from outbox_farm.chores import gauges
from outbox_farm.metrics import metrics
from outbox_farm.prefork.arbiter import GAUGES_INTERVAL
from outbox_farm.problems import Problems
from tests.steps import publish

metrics()  # register the collectors before the first sample is read

FARM = Farm(table="outbox", dlq_table="outbox_dlq")


def refresh(dsn: str, pace: gauges.Pace) -> None:
    async def once() -> None:
        pool = AsyncConnectionPool(dsn, kwargs={"autocommit": True}, open=False)
        async with pool:
            await gauges.refresh(pool, FARM.queries, ["paced"], Problems(), pace=pace)

    asyncio.run(once())


def backlog() -> float | None:
    return REGISTRY.get_sample_value("outbox_farm_backlog", {"queue": "paced"})


def test_a_count_that_took_long_waits_twenty_times_as_long(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    publish(conn, 3, queue="paced")
    pace = gauges.Pace()
    refresh(dsn, pace)  # never counted: counts
    assert backlog() == 3
    publish(conn, 2, queue="paced")
    now = time.monotonic()
    pace.ran(now - 1.0, now)  # as if the last count had taken a second, just now
    refresh(dsn, pace)
    assert backlog() == 3, "a count that took 1 s ran again within 20 s of it"
    pace.ran(now - 21.0, now - 20.0)  # that second-long count was 21 s ago
    refresh(dsn, pace)
    assert backlog() == 5


def test_a_cheap_count_does_not_delay_the_next_refresh(
    dsn: str, conn: psycopg.Connection[Any]
) -> None:
    pace = gauges.Pace()
    publish(conn, 100, queue="paced")
    refresh(dsn, pace)
    assert backlog() == 100
    # Milliseconds to count: the farm's next refresh, GAUGES_INTERVAL later, counts again.
    assert pace.ready(time.monotonic() + GAUGES_INTERVAL)


def test_pace_allows_a_count_after_pause_times_its_duration() -> None:
    pace = gauges.Pace(pause=20.0)
    assert pace.ready(0.0)
    pace.ran(100.0, 102.0)
    assert not pace.ready(139.9)
    assert pace.ready(140.0)
