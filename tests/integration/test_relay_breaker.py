"""A relay's hold is its queue's breaker: a broker that answers nothing opens it (every farm
holds the queue but for its probes, with the reason on /healthz), the first confirm after the
outage closes it, and every row is delivered with its attempts untouched."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg

from outbox_farm import ConstantBackoff, Farm
from tests.integration.test_relay_hold import Forgetful
from tests.steps import eventually, publish


def breaker_row(dsn: str) -> tuple[Any, ...] | None:
    with psycopg.connect(dsn) as conn:
        return conn.execute(
            "SELECT breaker_open_since, breaker_reason FROM outbox_farm_queues"
            " WHERE queue = 'events'"
        ).fetchone()


def test_a_broker_out_of_reach_opens_the_queues_breaker_until_it_confirms(dsn: str) -> None:
    target = Forgetful("forgetful")
    target.forget()
    farm = Farm()
    relay = farm.relay("events", to=target, batch=20, retry=ConstantBackoff(0, max_attempts=1))
    bodies = [b"%d" % i for i in range(60)]

    async def scenario() -> None:
        publish(dsn, bodies, queue="events")
        async with farm.running(dsn, poll_interval=0.05, flush_interval=0.01) as runtime:
            await eventually(lambda: relay.problem, "the relay reported down")
            row = await eventually(
                lambda: (found := breaker_row(dsn)) and found[0] is not None and found,
                "the queue's breaker open in the database",
            )
            assert "no answer from its broker" in row[1]
            await eventually(
                lambda: any("breaker open" in line for line in runtime.warnings),
                "the breaker on /healthz's notes",
            )
            target.remember()
            await eventually(lambda: len(target.received) == 60, "every row, after the outage")
            await eventually(lambda: breaker_row(dsn)[0] is None, "the breaker closed")  # type: ignore[index]
        with psycopg.connect(dsn) as conn:
            left = conn.execute("SELECT count(*) FROM outbox").fetchone()
            dead = conn.execute("SELECT count(*) FROM outbox_dlq").fetchone()
        assert left == (0,)
        assert dead == (0,)

    asyncio.run(scenario())
