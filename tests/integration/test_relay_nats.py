"""The NATS JetStream relay against the real server: acks, the duplicate window, refusals, a
connection dropped mid-run; every committed row reaches the stream, and, thanks to Nats-Msg-Id,
exactly once however often the relay re-sends."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import psycopg
import pytest
from brokers import NATS, Proxy, relayed, require

from outbox_farm import ConstantBackoff, Farm
from outbox_farm.relay import CONFIRMED, Envelope, NatsJetStream, TargetUnavailable
from outbox_farm.testing import adrain
from tests.steps import publish

nats = pytest.importorskip("nats")


@asynccontextmanager
async def stream(url: str, **config: Any) -> AsyncIterator[tuple[Any, str]]:
    """A fresh stream on subjects `<name>.>`, deleted after; yields the JetStream context and
    the subject prefix."""
    name = f"of_test_{uuid.uuid4().hex[:8]}"
    nc = await nats.connect(url)
    js = nc.jetstream()
    await js.add_stream(name=name, subjects=[f"{name}.>"], duplicate_window=120, **config)
    try:
        yield js, name
    finally:
        await js.delete_stream(name)
        await nc.close()


async def bodies(js: Any, name: str) -> list[tuple[bytes, dict[str, str]]]:
    info = await js.stream_info(name)
    out = []
    for seq in range(1, info.state.messages + 1):
        msg = await js.get_msg(name, seq)
        out.append((msg.data, dict(msg.headers or {})))
    return out


@pytest.fixture
def url() -> str:
    return require(NATS)


def test_rows_reach_the_stream_in_order_with_their_ids(dsn: str, url: str) -> None:
    async def scenario() -> None:
        async with stream(url) as (js, name):
            farm = Farm()
            farm.relay("events", to=NatsJetStream(url, subject=f"{name}.{{queue}}"), batch=200)
            publish(dsn, 1000, queue="events")
            result = await adrain(farm, dsn)
            assert len(result.acked) == 1000
            got = await bodies(js, name)
            assert [b for b, _ in got] == [b"%d" % i for i in range(1000)]
            headers = got[0][1]
            assert headers["Nats-Msg-Id"].startswith("outbox:")
            assert headers["Content-Type"] == "application/octet-stream"
            assert headers["Correlation-Id"]

    asyncio.run(scenario())


def test_a_resend_within_the_duplicate_window_is_confirmed_and_dropped(url: str) -> None:
    async def scenario() -> None:
        async with stream(url) as (js, name):
            target = NatsJetStream(url, subject=f"{name}.x")
            await target.connect()
            batch = [Envelope(1, "outbox:1:1", "q", b"once", {}, None, None)]
            assert await target.publish(batch) == [CONFIRMED]
            assert await target.publish(batch) == [CONFIRMED]  # PubAck(duplicate=True)
            assert len(await bodies(js, name)) == 1
            await target.close()

    asyncio.run(scenario())


def test_refusals_go_to_the_dlq_with_the_streams_words(dsn: str, url: str) -> None:
    async def scenario() -> None:
        async with stream(url, max_msgs=1, discard="new") as (_js, name):
            farm = Farm()

            def subject(envelope: Envelope) -> str:  # a row without `to`: no stream has it
                return f"{name}.{envelope.headers['to']}" if "to" in envelope.headers else "void"

            farm.relay(
                "events",
                to=NatsJetStream(url, subject=subject),
                retry=ConstantBackoff(0.1, max_attempts=2),
            )
            with psycopg.connect(dsn) as conn:
                farm.publish(conn, b"first", queue="events", headers={"to": "a"})
                farm.publish(conn, b"full", queue="events", headers={"to": "a"})
                farm.publish(conn, b"nowhere", queue="events")
            result = await adrain(farm, dsn, within=1)
            assert [r.message.body for r in result.acked] == [b"first"]
            assert {r.message.body for r in result.dead_lettered} == {b"full", b"nowhere"}
            errors = {r.message.body: str(r.error) for r in result.dead_lettered}
            assert "refused by the stream" in errors[b"full"]
            assert "maximum messages exceeded" in errors[b"full"]
            assert "no JetStream stream listens" in errors[b"nowhere"]

    asyncio.run(scenario())


def test_a_dropped_connection_loses_nothing_and_duplicates_nothing(dsn: str, url: str) -> None:
    async def scenario() -> None:
        async with stream(url) as (js, name), Proxy(url).running() as proxy:
            farm = Farm()
            relay = farm.relay(
                "events",
                to=NatsJetStream(proxy.url, subject=f"{name}.e", confirm_timeout=2),
                batch=100,
            )
            publish(dsn, 5000, queue="events")
            drained = asyncio.create_task(adrain(farm, dsn, within=60, timeout=60))
            for _ in range(3):
                await relayed(dsn, 200)
                await proxy.cut()
                await asyncio.sleep(0.3)  # the outage lasts this long, on purpose
                await proxy.restore()
            result = await drained
            assert len({r.message.id for r in result.acked}) == 5000
            assert result.left == 0
            assert result.dead_lettered == []
            got = [b for b, _ in await bodies(js, name)]
            assert sorted(got) == sorted(b"%d" % i for i in range(5000))  # exactly once
            assert proxy.connections >= 2
            assert relay.problem is None

    asyncio.run(scenario())


def test_publishing_without_a_connection_says_so(url: str) -> None:
    async def scenario() -> None:
        target = NatsJetStream(url)
        batch = [Envelope(1, "m", "q", b"x", {}, None, None)]
        with pytest.raises(TargetUnavailable, match="not connected"):
            await target.publish(batch)
        await target.connect()
        await target.close()
        with pytest.raises(TargetUnavailable, match="not connected"):
            await target.publish(batch)

    asyncio.run(scenario())
