"""The relay runner against a real Postgres, with a scripted target in place of the broker:
each row is acked only on a confirm; refusals follow the retry strategy to the DLQ with what
the broker said; an outage holds the rows (no attempt counted, nothing dead-lettered), reports
itself, and drains in claim order once the broker is back."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import psycopg
import pytest

from outbox_farm import ConfigurationError, ConstantBackoff, Farm
from outbox_farm.relay import CONFIRMED, BrokerReply, Delivery, Envelope, TargetUnavailable
from outbox_farm.testing import adrain, drain
from tests import samples
from tests.steps import eventually, publish


class Scripted:
    """A broker that confirms everything, except what `answers` says for a body, and that is
    down while `down` is set."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.answers: dict[bytes, Delivery] = {}
        self.received: list[Envelope] = []
        self.down = asyncio.Event()
        self.connects = 0
        self.closed = False

    async def connect(self) -> None:
        self.connects += 1
        if self.down.is_set():
            raise TargetUnavailable("connection refused")

    async def publish(self, batch: Sequence[Envelope]) -> list[Delivery]:
        if self.down.is_set():
            raise TargetUnavailable("connection reset")
        self.received.extend(batch)
        return [self.answers.get(e.body, CONFIRMED) for e in batch]

    async def close(self) -> None:
        self.closed = True


def sample(name: str, target: str) -> float:
    return samples.sample(name, target=target)


def test_confirmed_rows_are_acked_and_carry_a_stable_id_and_the_headers(dsn: str) -> None:
    target = Scripted("scripted-ok")
    farm = Farm()
    farm.relay("events", to=target, batch=50)
    with psycopg.connect(dsn) as conn:
        farm.publish(
            conn, b"one", queue="events", headers={"tenant": "t1", "n": 7}, correlation_id="corr-1"
        )
        farm.publish_batch(conn, [b"%d" % i for i in range(120)], queue="events")
    result = drain(farm, dsn)
    assert len(result.acked) == 121
    assert result.left == 0
    first = target.received[0]
    assert first.body == b"one"
    assert first.headers == {"tenant": "t1", "n": "7"}
    assert first.correlation_id == "corr-1"
    assert first.content_type == "application/octet-stream"
    assert first.message_id.startswith(f"outbox:{first.row_id}:")
    assert [e.body for e in target.received[1:]] == [b"%d" % i for i in range(120)]  # in order
    assert sample("outbox_farm_relay_confirmed_total", "scripted-ok") == 121
    assert sample("outbox_farm_relay_up", "scripted-ok") == 1
    assert target.closed  # the runtime's stop closed the connection


def test_refusals_follow_the_retry_strategy_to_the_dlq_with_the_brokers_words(dsn: str) -> None:
    target = Scripted("scripted-refuse")
    target.answers[b"nacked"] = Delivery(BrokerReply.NACKED, "nacked by the broker: queue full")
    target.answers[b"returned"] = Delivery(
        BrokerReply.RETURNED, "returned unroutable: 312 NO_ROUTE"
    )
    farm = Farm()
    farm.relay("events", to=target, retry=ConstantBackoff(1, max_attempts=2))
    publish(dsn, [b"ok", b"nacked", b"returned"], queue="events")
    result = drain(farm, dsn, within=10)
    assert len(result.acked) == 1
    assert len(result.retried) == 2  # two rows: a retry each, then the DLQ (2 attempts)
    with psycopg.connect(dsn) as conn:
        dlq = dict(
            conn.execute(
                "SELECT convert_from(payload, 'UTF8'), last_exception FROM outbox_dlq"
            ).fetchall()
        )
    assert set(dlq) == {"nacked", "returned"}
    assert "BrokerRefused('scripted-refuse: nacked by the broker: queue full')" in dlq["nacked"]
    assert "Unroutable('scripted-refuse: returned unroutable: 312 NO_ROUTE')" in dlq["returned"]
    assert sample("outbox_farm_relay_nacked_total", "scripted-refuse") == 2
    assert sample("outbox_farm_relay_returned_total", "scripted-refuse") == 2


def test_an_unconfirmed_row_is_never_acked(dsn: str) -> None:
    target = Scripted("scripted-unconfirmed")
    target.answers[b"lost"] = Delivery(BrokerReply.UNCONFIRMED, "connection lost mid-batch")
    farm = Farm()
    farm.relay("events", to=target, retry=ConstantBackoff(1, max_attempts=3))
    publish(dsn, [b"lost", b"fine"], queue="events")
    result = drain(farm, dsn, within=1.5)
    assert [r.message.body for r in result.acked] == [b"fine"]
    assert {r.message.body for r in result.retried} == {b"lost"}
    assert "Unconfirmed" in repr(result.retried[0].error)
    assert target.connects >= 2  # an unconfirmed row makes the next batch check the connection


def test_an_outage_holds_the_rows_reports_itself_and_drains_after(dsn: str) -> None:
    target = Scripted("scripted-outage")
    target.down.set()
    farm = Farm()
    relay = farm.relay("events", to=target, batch=10, retry=ConstantBackoff(0, max_attempts=1))
    publish(dsn, 25, queue="events", ordering_key=None)

    async def scenario() -> None:
        run = asyncio.create_task(adrain(farm, dsn, timeout=30))
        await eventually(lambda: target.connects >= 3, "three refused connects")
        assert relay.problem is not None
        assert "cannot reach its broker: connection refused" in relay.problem
        assert sample("outbox_farm_relay_up", "scripted-outage") == 0
        with psycopg.connect(dsn) as conn:
            held = conn.execute(
                "SELECT count(*), max(attempts_count) FROM outbox WHERE acquired_token IS NOT NULL"
            ).fetchone()
        assert held == (20, 0)  # a batch and its prefetch held, no attempt counted; no more
        target.down.clear()
        result = await run
        assert len(result.acked) == 25
        assert result.dead_lettered == []

    asyncio.run(scenario())
    assert [e.body for e in target.received] == [b"%d" % i for i in range(25)]  # claim order
    assert relay.problem is None
    assert sample("outbox_farm_relay_up", "scripted-outage") == 1


def test_a_relay_needs_a_target() -> None:
    farm = Farm()
    with pytest.raises(ConfigurationError, match="to= must be a relay target"):
        farm.relay("events", to="amqp://localhost")  # type: ignore[arg-type]
