"""The RabbitMQ relay against the real broker: confirms, nacks, returns, a connection the
server closes (`rabbitmqctl close_all_connections`) and an outage through a proxy; every
committed row reaches the queue at least once, none is acked without its confirm."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import uuid
from typing import Any

import psycopg
import pytest
from brokers import AMQP, Proxy, relayed, require

from outbox_farm import ConstantBackoff, Farm
from outbox_farm.relay import RabbitMQ
from outbox_farm.relay.runner import message_id
from outbox_farm.testing import adrain
from tests import samples
from tests.steps import eventually, publish

aio_pika = pytest.importorskip("aio_pika")


async def topology(url: str, **queue_args: Any) -> tuple[Any, Any, str]:
    """A fresh direct exchange with one queue bound to routing key `events`."""
    name = f"of_test_{uuid.uuid4().hex[:8]}"
    conn = await aio_pika.connect(url)
    channel = await conn.channel()
    exchange = await channel.declare_exchange(name, aio_pika.ExchangeType.DIRECT, auto_delete=True)
    queue = await channel.declare_queue(name, auto_delete=True, arguments=queue_args or None)
    await queue.bind(exchange, "events")
    return conn, queue, name


async def let_go(conn: Any) -> None:
    """Close a connection the server has closed already: the client's close then fails with
    the server's reason, or with a future the server's close cancelled (not this task's own
    cancellation, which still ends the test)."""
    try:
        await conn.close()
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            raise
    except (aio_pika.exceptions.AMQPError, ConnectionError):
        pass


async def consumed(queue: Any, expected: int, timeout: float = 20.0) -> list[Any]:
    got: list[Any] = []
    async with asyncio.timeout(timeout), queue.iterator() as messages:
        async for message in messages:
            await message.ack()
            got.append(message)
            if len(got) >= expected:
                break
    return got


def dlq(dsn: str) -> list[tuple[str, str]]:
    with psycopg.connect(dsn) as conn:
        rows = conn.execute("SELECT failure_reason, last_exception FROM outbox_dlq").fetchall()
    return [(str(a), str(b)) for a, b in rows]


@pytest.fixture
def amqp() -> str:
    return require(AMQP)


async def _relayed(dsn: str, url: str, count: int, **queue_args: Any) -> tuple[Any, list[Any]]:
    conn, queue, name = await topology(url, **queue_args)
    try:
        farm = Farm()
        farm.relay("events", to=RabbitMQ(url, exchange=name, routing_key="{queue}"), batch=200)
        publish(dsn, [{"n": i} for i in range(count)], queue="events")
        result = await adrain(farm, dsn)
        return result, await consumed(queue, count)
    finally:
        await conn.close()


def test_every_row_is_confirmed_and_arrives_in_order_with_its_ids(dsn: str, amqp: str) -> None:
    result, messages = asyncio.run(_relayed(dsn, amqp, 1000))
    assert len(result.acked) == 1000
    assert result.left == 0
    assert [m.body for m in messages] == [b'{"n":%d}' % i for i in range(1000)]
    first, row = messages[0], min((r.message for r in result.acked), key=lambda m: m.id)
    assert first.message_id == message_id("outbox", row)  # stable: outbox:<id>:<created µs>
    assert first.message_id.startswith(f"outbox:{row.id}:")
    assert first.content_type == "application/json"
    assert first.correlation_id
    assert first.delivery_mode == aio_pika.DeliveryMode.PERSISTENT
    assert len({m.message_id for m in messages}) == 1000


def test_unroutable_and_nacked_rows_go_to_the_dlq_with_what_the_broker_said(
    dsn: str, amqp: str
) -> None:
    async def scenario() -> None:
        # A queue that holds one message and nacks the rest (x-overflow: reject-publish).
        conn, _queue, name = await topology(
            amqp, **{"x-max-length": 1, "x-overflow": "reject-publish"}
        )
        try:
            farm = Farm()
            farm.relay(
                "events",
                to=RabbitMQ(amqp, exchange=name, routing_key="{headers[route]}"),
                retry=ConstantBackoff(0.1, max_attempts=2),
            )
            with psycopg.connect(dsn) as pg:
                farm.publish(pg, b"kept", queue="events", headers={"route": "events"})
                farm.publish(pg, b"over", queue="events", headers={"route": "events"})
                farm.publish(pg, b"lost", queue="events", headers={"route": "nowhere"})
                farm.publish(pg, b"no-route-header", queue="events")
            result = await adrain(farm, dsn, within=1)
            assert [r.message.body for r in result.acked] == [b"kept"]
            assert len(result.dead_lettered) == 3
        finally:
            await conn.close()

    asyncio.run(scenario())
    reasons = sorted(text.split("\n")[0] for _, text in dlq(dsn))
    assert any("BrokerRefused" in r and "nacked by the broker" in r for r in reasons)
    assert any("Unroutable" in r and "312 NO_ROUTE" in r and "'nowhere'" in r for r in reasons)
    assert any("route '{headers[route]}' failed" in r and "KeyError" in r for r in reasons)


@pytest.mark.skipif(shutil.which("rabbitmqctl") is None, reason="rabbitmqctl is not installed")
def test_connections_closed_by_the_server_lose_nothing(dsn: str, amqp: str) -> None:
    async def scenario() -> None:
        conn, queue, name = await topology(amqp)
        try:
            farm = Farm()
            farm.relay("events", to=RabbitMQ(amqp, exchange=name), batch=100)
            publish(dsn, [{"n": i} for i in range(10_000)], queue="events")
            # within: the unconfirmed rows' retries (a second or so later) run too.
            drained = asyncio.create_task(adrain(farm, dsn, within=60, timeout=60))
            for _ in range(3):
                await relayed(dsn, 500)
                await asyncio.to_thread(
                    subprocess.run,
                    ["rabbitmqctl", "close_all_connections", "relay test: server-side close"],
                    capture_output=True,
                    check=True,
                )
            result = await drained
            # Our consumer's connection was closed too: read what arrived on a new one.
            await let_go(conn)
            conn = await aio_pika.connect(amqp)
            channel = await conn.channel()
            queue = await channel.get_queue(name, ensure=True)
            bodies: list[bytes] = []
            while (message := await queue.get(fail=False, no_ack=True)) is not None:
                bodies.append(message.body)
            assert {b'{"n":%d}' % i for i in range(10_000)} <= set(bodies)  # each at least once
            assert len({r.message.id for r in result.acked}) == 10_000
            assert result.left == 0
            assert result.dead_lettered == []
            # The closes cut batches short: those rows were held and went again, no attempt spent.
            assert samples.sample("outbox_farm_relay_unconfirmed_total", target=f"rabbitmq:{name}")
            assert result.retried == []
        finally:
            await conn.close()

    asyncio.run(scenario())


def test_an_outage_holds_rows_and_the_backlog_drains_when_the_broker_returns(
    dsn: str, amqp: str
) -> None:
    async def scenario() -> None:
        conn, queue, name = await topology(amqp)
        proxy = Proxy(amqp)
        try:
            farm = Farm()
            relay = farm.relay("events", to=RabbitMQ(proxy.url, exchange=name), batch=100)
            publish(dsn, [{"n": i} for i in range(500)], queue="events")
            drained = asyncio.create_task(adrain(farm, dsn, timeout=60))  # no proxy: down
            problem = await eventually(lambda: relay.problem, "its first attempts to fail")
            assert "cannot reach its broker" in problem
            assert not drained.done()
            await proxy.restore()
            result = await drained
            assert len(result.acked) == 500
            assert relay.problem is None
            assert len(await consumed(queue, 500)) == 500
        finally:
            await proxy.cut()
            await conn.close()

    asyncio.run(scenario())
