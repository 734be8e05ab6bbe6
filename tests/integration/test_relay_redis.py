"""The Redis Streams relay against the real server: pipelined XADDs, a refusal (the key holds
another type), connections killed from the server side (`CLIENT KILL`) and an outage through a
proxy; every committed row becomes an entry at least once, and twice only after a lost reply."""

from __future__ import annotations

import asyncio
import uuid
from collections import Counter
from typing import Any

import orjson
import psycopg
import pytest
from brokers import REDIS, Proxy, relayed, require

from outbox_farm import ConstantBackoff, Farm
from outbox_farm.relay import RedisStream
from outbox_farm.relay.base import BrokerReply, Envelope, TargetUnavailable
from outbox_farm.testing import adrain
from tests import samples
from tests.steps import eventually, publish

redis_asyncio = pytest.importorskip("redis.asyncio")


@pytest.fixture
def url() -> str:
    return require(REDIS)


async def entries(client: Any, key: str) -> list[dict[bytes, bytes]]:
    return [fields for _, fields in await client.xrange(key)]


def test_rows_become_entries_in_order_with_their_ids(dsn: str, url: str) -> None:
    async def scenario() -> None:
        key = f"of_test_{uuid.uuid4().hex[:8]}"
        client = redis_asyncio.Redis.from_url(url)
        try:
            farm = Farm()
            farm.relay("events", to=RedisStream(url, stream=key, maxlen=100_000), batch=200)
            with psycopg.connect(dsn) as conn:
                farm.publish(conn, {"a": 1}, queue="events", headers={"tenant": "t"})
            publish(dsn, 999, queue="events")
            result = await adrain(farm, dsn)
            assert len(result.acked) == 1000
            got = await entries(client, key)
            assert [e[b"body"] for e in got[1:]] == [b"%d" % i for i in range(999)]
            first = got[0]
            assert first[b"body"] == b'{"a":1}'
            assert first[b"message_id"].startswith(b"outbox:")
            assert first[b"content_type"] == b"application/json"
            assert first[b"correlation_id"]
            assert orjson.loads(first[b"headers"]) == {"tenant": "t"}
        finally:
            await client.delete(key)
            await client.aclose()

    asyncio.run(scenario())


def test_a_key_of_another_type_refuses_to_the_dlq(dsn: str, url: str) -> None:
    async def scenario() -> None:
        key = f"of_test_{uuid.uuid4().hex[:8]}"
        client = redis_asyncio.Redis.from_url(url)
        await client.set(key, "not a stream")
        try:
            farm = Farm()
            farm.relay(
                "events",
                to=RedisStream(url, stream=key),
                retry=ConstantBackoff(0.1, max_attempts=2),
            )
            publish(dsn, 1, queue="events")
            result = await adrain(farm, dsn, within=1)
            [dead] = result.dead_lettered
            assert "refused by Redis" in str(dead.error)
            assert "WRONGTYPE" in str(dead.error)
        finally:
            await client.delete(key)
            await client.aclose()

    asyncio.run(scenario())


def test_killed_connections_lose_nothing(dsn: str, url: str) -> None:
    async def scenario() -> None:
        key = f"of_test_{uuid.uuid4().hex[:8]}"
        admin = redis_asyncio.Redis.from_url(url)
        name = f"relay-{uuid.uuid4().hex[:6]}"
        try:
            farm = Farm()
            farm.relay(
                "events",
                to=RedisStream(f"{url}?client_name={name}", stream=key),
                batch=100,
            )
            publish(dsn, 10_000, queue="events")
            drained = asyncio.create_task(adrain(farm, dsn, within=60, timeout=60))
            kills = 0
            for _ in range(5):
                await relayed(dsn, 500)
                for client in await admin.client_list():
                    if client.get("name") == name:
                        await admin.client_kill_filter(_id=client["id"])
                        kills += 1
            result = await drained
            assert kills >= 1
            assert len({r.message.id for r in result.acked}) == 10_000
            assert result.left == 0
            assert result.dead_lettered == []
            ids = Counter(e[b"message_id"] for e in await entries(admin, key))
            assert len(ids) == 10_000  # every row at least once
            doubled = sum(n - 1 for n in ids.values())
            unconfirmed = samples.sample("outbox_farm_relay_unconfirmed_total", target="redis")
            assert doubled <= unconfirmed  # a second entry only after a lost reply
            assert result.retried == []  # held through the kills, sent again: no attempt spent
        finally:
            await admin.delete(key)
            await admin.aclose()

    asyncio.run(scenario())


def test_an_outage_holds_rows_until_redis_is_back(dsn: str, url: str) -> None:
    async def scenario() -> None:
        key = f"of_test_{uuid.uuid4().hex[:8]}"
        admin = redis_asyncio.Redis.from_url(url)
        proxy = Proxy(url)
        try:
            farm = Farm()
            relay = farm.relay("events", to=RedisStream(proxy.url, stream=key))
            publish(dsn, 300, queue="events")
            drained = asyncio.create_task(adrain(farm, dsn, timeout=60))
            problem = await eventually(lambda: relay.problem, "its first attempts to fail")
            assert "cannot reach its broker" in problem
            assert await admin.xlen(key) == 0
            await proxy.restore()
            result = await drained
            assert len(result.acked) == 300
            assert await admin.xlen(key) == 300
        finally:
            await proxy.cut()
            await admin.delete(key)
            await admin.aclose()

    asyncio.run(scenario())


def test_a_connection_lost_mid_batch_confirms_only_the_replies_read(url: str) -> None:
    async def scenario() -> None:
        key = f"of_test_{uuid.uuid4().hex[:8]}"
        admin = redis_asyncio.Redis.from_url(url)
        proxy = Proxy(url)
        target = RedisStream(proxy.url, stream=key)
        batch = [Envelope(i, f"m{i}", "events", b"%d" % i, {}, None, None) for i in range(10)]
        try:
            await proxy.restore()
            await target.connect()
            proxy.cut_after_lines(3 * 2)  # an XADD's reply is two lines: "$<length>", the id
            deliveries = await target.publish(batch)
            outcomes = [d.outcome for d in deliveries]
            assert outcomes == [BrokerReply.CONFIRMED] * 3 + [BrokerReply.UNCONFIRMED] * 7
            assert "connection lost while publishing" in str(deliveries[3].reason)
            held = {fields[b"message_id"] for fields in await entries(admin, key)}
            assert {b"m0", b"m1", b"m2"} <= held
            with pytest.raises(TargetUnavailable):  # the proxy refuses until restored
                await target.connect()
            await proxy.restore()
            await target.connect()
            assert {d.outcome for d in await target.publish(batch[3:])} == {BrokerReply.CONFIRMED}
            held = {fields[b"message_id"] for fields in await entries(admin, key)}
            assert held == {b"m%d" % i for i in range(10)}
        finally:
            await target.close()
            await proxy.cut()
            await admin.delete(key)
            await admin.aclose()

    asyncio.run(scenario())
