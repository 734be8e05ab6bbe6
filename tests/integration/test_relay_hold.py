"""The relay's hold against a real Postgres, with scripted brokers: a broker that answers
nothing (up, but it forgot the producer) costs no attempt and no dead letter, is reported down
until it confirms again, and gets its rows from a connection made anew; a row the broker never
answers for while it confirms others walks to the DLQ under its retry strategy, alone or in a
batch it breaks, and the rows beside it are delivered."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import psycopg
import pytest

from outbox_farm import ConstantBackoff, Farm
from outbox_farm.relay import CONFIRMED, BrokerReply, Delivery, Envelope
from outbox_farm.testing import adrain, drain
from tests import samples
from tests.steps import eventually, publish

NO_ANSWER = Delivery(BrokerReply.UNCONFIRMED, "no delivery report")


class Forgetful:
    """A broker that, once `forget()` is called, answers nothing on the connection it has (an
    idempotent producer it no longer knows), nor on new ones until `remember()`; connecting
    works throughout, as a Kafka metadata request does."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.received: list[bytes] = []
        self.connection = 0  # the current connection's number; 0: none
        self.answers_from = 1  # the first connection the broker answers on
        self.connects = 0
        self.answering = True
        # While set and not yet opened, a round it answers waits for it: the test publishes its
        # next rows before the first ones are acked, so the drain never finds the table empty.
        self.gate: asyncio.Event | None = None

    def forget(self) -> None:
        self.answering = False
        self.answers_from = 1 << 30

    def remember(self) -> None:
        """Answer again, on connections made from now on only."""
        self.answering = True
        self.answers_from = self.connection + 1

    async def connect(self) -> None:
        if not self.connection:
            self.connects += 1
            self.connection = self.connects

    async def publish(self, batch: Sequence[Envelope]) -> list[Delivery]:
        if self.connection < self.answers_from:
            return [NO_ANSWER] * len(batch)
        self.received += [e.body for e in batch]
        if self.gate is not None:
            await self.gate.wait()
        return [CONFIRMED] * len(batch)

    async def close(self) -> None:
        self.connection = 0


class Breaking:
    """A broker that answers nothing for any round holding a `poison` row (it closes the
    connection for it), and confirms every other round."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.received: list[bytes] = []
        self.rounds = 0

    async def connect(self) -> None:
        return None

    async def publish(self, batch: Sequence[Envelope]) -> list[Delivery]:
        self.rounds += 1
        if any(e.body == b"poison" for e in batch):
            return [NO_ANSWER] * len(batch)
        self.received += [e.body for e in batch]
        return [CONFIRMED] * len(batch)

    async def close(self) -> None:
        return None


def held_attempts(dsn: str) -> tuple[int, int]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT count(*), coalesce(max(attempts_count), 0) FROM outbox"
            " WHERE acquired_token IS NOT NULL"
        ).fetchone()
    assert row is not None
    return row[0], row[1]


def test_a_broker_that_forgot_the_producer_holds_rows_and_reports_down(
    dsn: str, caplog: pytest.LogCaptureFixture
) -> None:
    target = Forgetful("forgetful")
    farm = Farm()
    relay = farm.relay("events", to=target, batch=20, retry=ConstantBackoff(0, max_attempts=1))
    bodies = [b"%d" % i for i in range(50)]

    async def scenario() -> None:
        publish(dsn, bodies[:10], queue="events")
        target.gate = asyncio.Event()
        run = asyncio.create_task(adrain(farm, dsn, timeout=60))
        await eventually(lambda: len(target.received) == 10, "the first rows received")
        assert samples.sample("outbox_farm_relay_up", target="forgetful") == 1
        target.forget()
        publish(dsn, bodies[10:], queue="events")
        target.gate.set()  # the first rows confirmed, with the next ones already waiting
        await eventually(lambda: relay.problem, "the relay reported down")
        assert "no answer from its broker: no delivery report" in (relay.problem or "")
        assert samples.sample("outbox_farm_relay_up", target="forgetful") == 0
        await eventually(lambda: target.connects >= 3, "connections made anew")
        held, attempts = held_attempts(dsn)
        assert held > 0
        assert attempts == 0  # held: no attempt spent on the broker's amnesia
        assert relay.problem  # still down: connecting is not delivering
        target.remember()
        result = await run
        assert result.dead_lettered == []
        assert result.retried == []
        assert len(result.acked) == 50

    caplog.set_level(logging.INFO, logger="outbox_farm.relay")
    asyncio.run(scenario())
    assert sorted(target.received, key=int) == bodies
    assert relay.problem is None
    assert samples.sample("outbox_farm_relay_up", target="forgetful") == 1
    events = [getattr(r, "event", None) for r in caplog.records]
    # One line per change of state, however many connections were made anew meanwhile.
    assert events.count("relay_up") == 2  # the first connection, the first confirm after
    assert events.count("relay_down") == 1
    assert target.connects >= 3


def test_a_row_that_breaks_its_batch_walks_to_the_dlq_and_the_others_arrive(dsn: str) -> None:
    target = Breaking("breaking")
    farm = Farm()
    farm.relay("events", to=target, batch=40, retry=ConstantBackoff(0, max_attempts=2))
    bodies = [b"%d" % i for i in range(30)]
    publish(dsn, [*bodies[:12], b"poison", *bodies[12:]], queue="events")
    result = drain(farm, dsn, timeout=60)
    assert sorted(target.received, key=int) == bodies  # each once, none held back
    assert [r.message.body for r in result.dead_lettered] == [b"poison"]
    assert "Unconfirmed('breaking: no delivery report')" in repr(result.dead_lettered[0].error)
    assert len(result.acked) == 30
    assert {r.message.body for r in result.retried} == {b"poison"}  # the others spent nothing
