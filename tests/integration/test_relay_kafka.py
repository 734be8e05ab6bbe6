"""The Kafka relay against a real Kafka-protocol broker (tansu, started by the test): confirmed
batches with their headers, keys to partitions in publish order, refusals to the DLQ with the
broker's words, a topic that does not exist, and connections cut mid-batch through a proxy:
every committed row reaches the topic, acked only after its delivery report, and twice only
after a lost report."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from brokers import Proxy, relayed, tansu
from brokers import kafka_records as records

from loadtests.common.harness import free_port
from loadtests.common.restartable import Broker
from outbox_farm import ConstantBackoff, Farm
from outbox_farm.errors import ConfigurationError
from outbox_farm.relay import CONFIRMED, BrokerReply, Envelope, Kafka, TargetUnavailable
from outbox_farm.testing import adrain
from tests import samples
from tests.steps import publish

kafka = pytest.importorskip("confluent_kafka")
admin = pytest.importorskip("confluent_kafka.admin")


@pytest.fixture(scope="module")
def servers() -> Iterator[str]:
    with tansu() as address:
        yield address


def new_topic(servers: str, partitions: int = 1) -> str:
    name = f"of_test_{uuid.uuid4().hex[:8]}"
    client = admin.AdminClient({"bootstrap.servers": servers})
    futures = client.create_topics([admin.NewTopic(name, num_partitions=partitions)])
    futures[name].result(timeout=30)
    return name


def test_rows_reach_the_topic_with_their_headers(dsn: str, servers: str) -> None:
    topic = new_topic(servers)

    async def scenario() -> None:
        farm = Farm()
        farm.relay("events", to=Kafka(servers, topic=topic), batch=200)
        with psycopg.connect(dsn) as conn:
            farm.publish(conn, {"a": 1}, queue="events", headers={"tenant": "t", "n": 7})
        publish(dsn, 999, queue="events")
        result = await adrain(farm, dsn)
        assert len(result.acked) == 1000

    asyncio.run(scenario())
    got = records(servers, topic, 1000)
    assert [m.value() for m in got[1:]] == [b"%d" % i for i in range(999)]
    first = got[0]
    assert first.value() == b'{"a":1}'
    assert first.key() is None  # no ordering key, no record key
    headers = dict(first.headers())
    assert headers["message_id"].startswith(b"outbox:")
    assert headers["content-type"] == b"application/json"
    assert headers["correlation_id"]
    assert headers["tenant"] == b"t"
    assert headers["n"] == b"7"
    assert len({dict(m.headers())["message_id"] for m in got}) == 1000


def test_rows_of_one_key_land_on_one_partition_in_publish_order(dsn: str, servers: str) -> None:
    topic = new_topic(servers, partitions=3)
    keys = [f"customer-{k}" for k in range(12)]

    async def scenario() -> None:
        farm = Farm()
        farm.relay("events", to=Kafka(servers, topic=topic), batch=50, concurrency=4)
        with psycopg.connect(dsn) as conn:
            for i in range(600):
                farm.publish(conn, b"%d" % i, queue="events", ordering_key=keys[i % len(keys)])
        result = await adrain(farm, dsn, timeout=120)
        assert len(result.acked) == 600

    asyncio.run(scenario())
    got = records(servers, topic, 600)
    partitions: dict[bytes, set[int]] = defaultdict(set)
    order: dict[bytes, list[int]] = defaultdict(list)
    for msg in got:
        partitions[msg.key()].add(msg.partition())
        order[msg.key()].append(int(msg.value()))
    assert set(partitions) == {k.encode() for k in keys}
    assert all(len(p) == 1 for p in partitions.values())  # one key, one partition
    assert len(set().union(*partitions.values())) > 1  # and the keys spread over several
    for key, seen in order.items():
        assert seen == sorted(seen), f"{key!r} out of publish order: {seen}"
        assert len(seen) == 50


def test_a_key_template_and_a_callable_key(servers: str) -> None:
    topic = new_topic(servers)

    async def scenario() -> None:
        for key, want in (
            ("{headers[tenant]}", b"acme"),
            (lambda e: e.message_id.encode(), b"m1"),
            (None, None),
        ):
            target = Kafka(servers, topic=topic, key=key)
            await target.connect()
            batch = [Envelope(1, "m1", "q", b"x", {"tenant": "acme"}, None, None, "ok")]
            assert await target.publish(batch) == [CONFIRMED]
            await target.close()
            got = records(servers, topic, 1)
            assert got[-1].key() == want

    asyncio.run(scenario())


def test_an_oversized_record_goes_to_the_dlq_with_the_brokers_words(dsn: str, servers: str) -> None:
    topic = new_topic(servers)

    async def scenario() -> None:
        farm = Farm(dlq_table="outbox_dlq")
        farm.relay(
            "events", to=Kafka(servers, topic=topic), retry=ConstantBackoff(0.1, max_attempts=2)
        )
        with psycopg.connect(dsn) as conn:
            farm.publish(conn, b"small", queue="events")
            farm.publish(conn, b"x" * 2_000_000, queue="events")
        result = await adrain(farm, dsn, within=1)
        assert [r.message.body for r in result.acked] == [b"small"]
        [dead] = result.dead_lettered
        assert "Message size too large" in str(dead.error)
        assert "MSG_SIZE_TOO_LARGE" in str(dead.error)

    asyncio.run(scenario())


def test_a_topic_that_does_not_exist_is_retried_then_dead_lettered(dsn: str, servers: str) -> None:
    """Auto-creation off: RETURNED, so the row's retry strategy runs (time to create the topic)
    and the DLQ then keeps it with the broker's words, while other topics' rows flow."""
    topic = new_topic(servers)

    async def scenario() -> None:
        farm = Farm(dlq_table="outbox_dlq")
        target = Kafka(
            servers,
            topic=lambda e: e.headers.get("topic", topic),
            config={"allow.auto.create.topics": False, "topic.metadata.propagation.max.ms": 1000},
        )
        relay = farm.relay("events", to=target, retry=ConstantBackoff(0.1, max_attempts=2))
        with psycopg.connect(dsn) as conn:
            farm.publish(conn, b"lost", queue="events", headers={"topic": "of_test_nowhere"})
            farm.publish(conn, b"fine", queue="events")
        result = await adrain(farm, dsn, within=5, timeout=60)
        assert [r.message.body for r in result.acked] == [b"fine"]
        [dead] = result.dead_lettered
        assert "no such topic" in str(dead.error)
        assert "UNKNOWN_TOPIC" in str(dead.error)
        assert "Unroutable" in repr(dead.error)
        assert relay.problem is None  # a row's route, not an outage

    asyncio.run(scenario())
    assert (
        "of_test_nowhere"
        not in kafka.admin.AdminClient({"bootstrap.servers": servers})
        .list_topics(timeout=10)
        .topics
    )


ROWS = 20_000
EXTRA = 500  # rows published while the proxy is cut


def test_cut_connections_lose_nothing_and_ack_only_reported_rows(dsn: str, tmp_path: Any) -> None:
    """Every connection goes through a proxy that is cut three times mid-stream, first for long
    enough that librdkafka gives up on the broker: the relay reports itself down then up, every
    row is in the topic, none acked without its report (acked ⊆ delivered), and a row is there
    twice only after a report was lost (an unconfirmed retry)."""
    listen = free_port()
    proxy = Proxy(f"kafka://127.0.0.1:{listen}")
    bootstrap = f"127.0.0.1:{proxy.port}"

    async def scenario() -> None:
        topic = await asyncio.to_thread(new_topic, bootstrap, 2)
        farm = Farm()
        relay = farm.relay(
            "events",
            to=Kafka(
                bootstrap, topic=topic, confirm_timeout=10, config={"reconnect.backoff.max.ms": 200}
            ),
            batch=100,
        )
        publish(dsn, ROWS, queue="events")
        drained = asyncio.create_task(adrain(farm, dsn, within=60, timeout=120))
        await relayed(dsn, ROWS // 10)
        ups: list[bool] = []
        for hold in (3.0, 0.3, 0.3):
            await proxy.cut()
            # Rows to relay while it is cut, however fast the rows before went out.
            await asyncio.to_thread(publish, dsn, EXTRA, queue="events")
            # The cut is held this long on purpose (the first time long enough for librdkafka
            # to give up on the broker), the relay's health sampled meanwhile.
            deadline = time.monotonic() + hold
            while time.monotonic() < deadline:
                ups.append(relay.problem is None)
                await asyncio.sleep(0.05)
            await proxy.restore()
            await relayed(dsn, EXTRA // 5)  # flowing again before the next cut
        result = await drained
        total = ROWS + 3 * EXTRA
        retried = Counter(repr(r.error)[:80] for r in result.retried)
        why = f"{len(result.acked)} acked, left {result.left}, retried {retried.most_common(4)}"
        assert len({r.message.id for r in result.acked}) == total, why
        assert result.left == 0
        assert result.dead_lettered == []
        assert False in ups, why  # reported down during the long cut ...
        assert relay.problem is None  # ... and up after
        got = await asyncio.to_thread(records, bootstrap, topic, total)
        ids = Counter(dict(m.headers())["message_id"] for m in got)
        assert len(ids) == total  # every row at least once
        doubled = sum(n - 1 for n in ids.values())
        unconfirmed = samples.sample("outbox_farm_relay_unconfirmed_total", target="kafka")
        assert doubled <= unconfirmed  # a second record only after a lost report
        assert result.retried == []  # held through the cuts, sent again: no attempt spent
        assert proxy.connections >= 2

    async def proxied() -> None:
        async with proxy.running():
            await scenario()

    with tansu(advertised_port=proxy.port, port=listen):
        asyncio.run(proxied())


def test_an_unreachable_broker_is_reported_and_waited_out(servers: str) -> None:
    async def scenario() -> None:
        target = Kafka(
            f"127.0.0.1:{free_port()}", config={"socket.connection.setup.timeout.ms": 1000}
        )
        with pytest.raises(TargetUnavailable, match=r"127\.0\.0\.1"):
            await target.connect()
        batch = [Envelope(1, "m", "q", b"x", {}, None, None)]
        await target.close()
        with pytest.raises(TargetUnavailable, match="not connected"):
            await target.publish(batch)

    asyncio.run(scenario())


def test_the_idempotent_producer_can_be_turned_off(servers: str) -> None:
    topic = new_topic(servers)

    async def scenario() -> None:
        for idempotent in (True, False):
            target = Kafka(servers, topic=topic, idempotent=idempotent)
            assert target.config["enable.idempotence"] is idempotent
            await target.connect()
            batch = [Envelope(i, f"m{i}", "q", b"x", {}, None, None) for i in range(3)]
            assert await target.publish(batch) == [CONFIRMED] * 3
            await target.close()

    asyncio.run(scenario())
    assert len(records(servers, topic, 6)) == 6


def test_bad_settings_are_refused_with_what_to_fix() -> None:
    with pytest.raises(ConfigurationError, match="non-empty"):
        Kafka("")
    with pytest.raises(ConfigurationError, match="not a valid template"):
        Kafka("127.0.0.1:9092", topic="{queue")
    with pytest.raises(ConfigurationError, match="unknown field"):
        Kafka("127.0.0.1:9092", key="{tenant}")

    async def scenario() -> None:
        target = Kafka("127.0.0.1:9092", config={"no.such.setting": 1})
        with pytest.raises(ConfigurationError, match=r"no\.such\.setting"):
            await target.connect()

    asyncio.run(scenario())


def test_a_failing_route_refuses_only_its_row(servers: str) -> None:
    topic = new_topic(servers)

    async def scenario() -> None:
        target = Kafka(servers, topic=topic, key="{headers[tenant]}")
        await target.connect()
        batch = [
            Envelope(1, "m1", "q", b"x", {"tenant": "a"}, None, None),
            Envelope(2, "m2", "q", b"y", {}, None, None),
        ]
        first, second = await target.publish(batch)
        assert first == CONFIRMED
        assert second.outcome is BrokerReply.NACKED
        assert "tenant" in str(second.reason)
        await target.close()

    asyncio.run(scenario())


def test_a_full_local_queue_is_waited_out(servers: str) -> None:
    """librdkafka's queue holds 5 records; a batch of 60 goes out as reports free room."""
    topic = new_topic(servers)

    async def scenario() -> None:
        target = Kafka(servers, topic=topic, config={"queue.buffering.max.messages": 5})
        await target.connect()
        batch = [Envelope(i, f"m{i}", "q", b"%d" % i, {}, None, None) for i in range(60)]
        assert await target.publish(batch) == [CONFIRMED] * 60
        await target.close()

    asyncio.run(scenario())
    assert sorted(int(m.value()) for m in records(servers, topic, 60)) == list(range(60))


def test_a_producer_the_restarted_broker_forgot_is_found_stuck_and_made_anew(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tansu restarted forgets the idempotent producer; librdkafka then retries its records
    until `confirm_timeout` (it bumps the producer's epoch again and again). With librdkafka's
    word that every broker went down ignored (a restart too quick for it, say), the batch is
    found stuck after `stall_timeout`, unconfirmed, and a new producer delivers it."""
    private = Broker("kafka", tmp_path)
    private.start()
    try:
        private.prepare()
        target = Kafka(private.url, topic=private.name, confirm_timeout=60, stall_timeout=2)
        monkeypatch.setattr(target, "_error", lambda error: None)
        batch = [Envelope(i, f"m{i}", "events", b"%d" % i, {}, None, None) for i in range(20)]

        async def scenario() -> None:
            await target.connect()
            assert {d.outcome for d in await target.publish(batch[:10])} == {CONFIRMED.outcome}
            await asyncio.to_thread(private.restart)
            await asyncio.to_thread(private.prepare)
            began = time.monotonic()
            stuck = await target.publish(batch[10:])
            assert time.monotonic() - began < 30  # not confirm_timeout's 60 s
            assert {d.outcome for d in stuck} == {BrokerReply.UNCONFIRMED}
            assert "no delivery report for 2s" in str(stuck[0].reason)
            await target.close()
            await target.connect()  # a new producer, with an id the broker gave it
            again = await target.publish(batch[10:])
            assert {d.outcome for d in again} == {CONFIRMED.outcome}
            await target.close()

        asyncio.run(scenario())
        assert {f"m{i}" for i in range(10, 20)} <= private.arrived()
    finally:
        private.kill()
