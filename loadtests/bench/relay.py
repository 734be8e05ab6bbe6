"""Relay benchmark: end to end, pre-loaded outbox rows relayed by `outbox-farm start --procs 2`
to each broker, against two references measured in the same run.

    python -m loadtests.bench.relay --dsn "host=127.0.0.1 user=postgres dbname=postgres"

Per target (Kafka, RabbitMQ, NATS JetStream, Redis Streams; a broker that does not answer is
skipped and said so; Kafka is a `tansu` broker the bench starts on a free port, from the `calfkit-
mesh` wheel, unless OUTBOX_FARM_BENCH_KAFKA names one): the relay's drain of --rows rows (msg/s:
rows acked per second, every one confirmed by the broker); the broker's ceiling, the same bodies
published by the same client library alone, no database, with the same confirm mode and as many
messages in flight as a relay batch (target: the relay reaches >= 60% of it); and the obvious
relay, a plain handler publishing one message per run and awaiting its confirm: as a first relay is
often written, opening its own connection in each run, at the farm's default concurrency (32)
(target: the relay is >= 10x faster); and, for comparison, on one connection the process's runs
share, at concurrency 32 (on --naive-rows rows) and 1 (one confirm round trip at a time). Each
naive run but the shared one at 32 relays --naive-rows / 5 rows. Beside them, for the reader, the
relay's own target publishing the same envelopes batch by batch with no database and no farm: relay
/ target alone is what the database and the farm cost. Each broker is checked to hold every message
after the relay's run. For Kafka, the other well-kept client (aiokafka) is measured alone too, as
the ceiling was: the measurement the relay's choice of client rests on."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import contextlib
import os
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from loadtests.common import tables
from loadtests.common.harness import note
from loadtests.common.kafkabroker import tansu
from outbox_farm import Farm
from outbox_farm.farm import RELAY_BATCH
from outbox_farm.relay import BrokerReply, Envelope, Target
from outbox_farm.relay.kafka import Kafka
from outbox_farm.relay.nats import NatsJetStream
from outbox_farm.relay.rabbitmq import RabbitMQ
from outbox_farm.relay.redis_streams import RedisStream

from .common import add_dsn, scratch, server
from .farm import drain_run
from .report import print_measures, verdict

CEILING_RATIO = 0.6
NAIVE_FACTOR = 10.0
NAIVE_VARIANTS = (("shared", 32), ("shared", 1), ("per-run", 32))
BODY = b"{}"  # what `preload` writes in every row
DEST = "of_bench"
# What the relay sends with each body (a pre-loaded row has no headers of its own): the
# ceiling sends the same, so the two differ only by the relay and the database.
CONTENT_TYPE = "application/json"
CORRELATION_ID = "0123456789abcdef0123456789abcdef"


def message_id(i: int) -> str:
    return f"outbox:{i}:1764000000000000"


APP = """
import os
from outbox_farm import Farm
from loadtests.bench.relay import make_target
from loadtests.common.tables import DLQ, OUTBOX

farm = Farm(table=OUTBOX, dlq_table=DLQ)
target = make_target(os.environ["RELAY_KIND"], os.environ["RELAY_URL"], os.environ["RELAY_DEST"])
farm.relay("bench", to=target, batch=int(os.environ["RELAY_BATCH"]))
"""


def make_target(kind: str, url: str, dest: str) -> Target:
    """The relay target the bench's farm publishes through, and the target-alone run too."""
    if kind == "rabbitmq":
        return RabbitMQ(url, exchange=dest, routing_key="bench")
    if kind == "nats":
        return NatsJetStream(url, subject=dest + ".bench")
    if kind == "kafka":
        return Kafka(url, topic=dest)
    return RedisStream(url, stream=dest)


async def target_alone(kind: str, url: str, count: int, batch: int) -> None:
    """The relay's own publishing, batch after batch as the relay sends them, with no database
    and no farm: the envelopes a pre-loaded row becomes."""
    target = make_target(kind, url, DEST)
    await target.connect()
    try:
        for start in range(0, count, batch):
            envelopes = [
                Envelope(i, message_id(i), "bench", BODY, {}, CONTENT_TYPE, CORRELATION_ID)
                for i in range(start, min(start + batch, count))
            ]
            deliveries = await target.publish(envelopes)
            if any(d.outcome is not BrokerReply.CONFIRMED for d in deliveries):
                raise SystemExit(f"{kind}: the target alone was refused: {deliveries[0]}")
    finally:
        await target.close()


NAIVE_APP = """
import asyncio
import os
from outbox_farm import Farm
from loadtests.common.tables import DLQ, OUTBOX

farm = Farm(table=OUTBOX, dlq_table=DLQ)
url, dest, kind = os.environ["RELAY_URL"], os.environ["RELAY_DEST"], os.environ["RELAY_KIND"]
per_run = os.environ["RELAY_NAIVE_CONNECTION"] == "per-run"
shared = []


async def connect():
    if kind == "rabbitmq":
        import aio_pika
        conn = await aio_pika.connect(url)
        channel = await conn.channel(publisher_confirms=True)
        return conn, await channel.get_exchange(dest)
    if kind == "nats":
        import nats
        conn = await nats.connect(url)
        return conn, conn.jetstream()
    if kind == "kafka":
        import confluent_kafka
        producer = confluent_kafka.Producer({"bootstrap.servers": url, "acks": "all"})
        return producer, producer
    import redis.asyncio
    conn = redis.asyncio.Redis.from_url(url)
    return conn, conn


async def send(to, msg):
    if kind == "rabbitmq":
        import aio_pika
        await to.publish(aio_pika.Message(msg.body, message_id=str(msg.id)), "bench")
    elif kind == "nats":
        await to.publish(dest + ".bench", msg.body, headers={"Nats-Msg-Id": str(msg.id)})
    elif kind == "kafka":
        def produce():
            to.produce(dest, msg.body, headers=[("message_id", str(msg.id))])
            to.flush(30)
        await asyncio.to_thread(produce)
    else:
        await to.xadd(dest, {"body": msg.body, "message_id": str(msg.id)})


@farm.handler("bench", concurrency=int(os.environ["RELAY_NAIVE_CONCURRENCY"]))
async def relay_one(msg):
    # The obvious way: a plain handler, one message per run, awaiting its confirm; on a
    # connection of its own per run, as a first relay is often written, or on one the
    # process's runs share.
    if per_run:
        conn, to = await connect()
        try:
            await send(to, msg)
        finally:
            if kind == "redis":
                await conn.aclose()
            elif kind != "kafka":  # a confluent-kafka producer has nothing to close
                await conn.close()
        return
    if not shared:
        shared.append(await connect())
    await send(shared[0][1], msg)
"""


@dataclass
class Broker:
    """One target kind: its URL, how to make its destination empty, count what it holds, and
    publish `count` bodies with confirms, `inflight` at a time (the ceiling)."""

    kind: str
    url: str
    reset: Callable[[], Awaitable[None]]
    held: Callable[[], Awaitable[int]]
    ceiling: Callable[[int, int], Coroutine[Any, Any, None]]
    drop: Callable[[], Awaitable[None]]
    other_client: Callable[[int, int], Coroutine[Any, Any, None]] | None = None
    """Kafka: the same ceiling by the client the relay does not use (aiokafka)."""


def rabbitmq(url: str) -> Broker:
    import aio_pika

    async def reset() -> None:
        conn = await aio_pika.connect(url)
        async with conn:
            channel = await conn.channel()
            exchange = await channel.declare_exchange(DEST, aio_pika.ExchangeType.DIRECT)
            queue = await channel.declare_queue(DEST)
            await queue.bind(exchange, "bench")
            await queue.purge()

    async def held() -> int:
        conn = await aio_pika.connect(url)
        async with conn:
            queue = await (await conn.channel()).declare_queue(DEST, passive=True)
            return int(queue.declaration_result.message_count or 0)

    async def ceiling(count: int, inflight: int) -> None:
        conn = await aio_pika.connect(url)
        async with conn:
            channel = await conn.channel(publisher_confirms=True, on_return_raises=True)
            exchange = await channel.get_exchange(DEST)
            for start in range(0, count, inflight):
                await asyncio.gather(
                    *(
                        exchange.publish(
                            aio_pika.Message(
                                BODY,
                                headers={},
                                content_type=CONTENT_TYPE,
                                correlation_id=CORRELATION_ID,
                                message_id=message_id(i),
                                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                            ),
                            "bench",
                            mandatory=True,
                        )
                        for i in range(start, min(start + inflight, count))
                    )
                )

    async def drop() -> None:
        conn = await aio_pika.connect(url)
        async with conn:
            channel = await conn.channel()
            await channel.queue_delete(DEST)
            await channel.exchange_delete(DEST)

    return Broker("rabbitmq", url, reset, held, ceiling, drop)


def nats_jetstream(url: str) -> Broker:
    import nats
    import nats.js.errors

    async def with_js(work: Callable[[Any], Awaitable[Any]]) -> Any:
        nc = await nats.connect(url)
        try:
            return await work(nc.jetstream())
        finally:
            await nc.close()

    async def reset() -> None:
        async def go(js: Any) -> None:
            with contextlib.suppress(nats.js.errors.NotFoundError):  # not there yet
                await js.delete_stream(DEST)
            await js.add_stream(name=DEST, subjects=[DEST + ".>"], duplicate_window=120)

        await with_js(go)

    async def held() -> int:
        async def go(js: Any) -> int:
            return int((await js.stream_info(DEST)).state.messages)

        return int(await with_js(go))

    async def ceiling(count: int, inflight: int) -> None:
        async def go(js: Any) -> None:
            for start in range(0, count, inflight):
                futures = [
                    await js.publish_async(
                        DEST + ".bench",
                        BODY,
                        headers={
                            "Nats-Msg-Id": message_id(i),
                            "Content-Type": CONTENT_TYPE,
                            "Correlation-Id": CORRELATION_ID,
                        },
                    )
                    for i in range(start, min(start + inflight, count))
                ]
                await asyncio.gather(*futures)

        await with_js(go)

    async def drop() -> None:
        async def go(js: Any) -> None:
            await js.delete_stream(DEST)

        await with_js(go)

    return Broker("nats", url, reset, held, ceiling, drop)


def redis_stream(url: str) -> Broker:
    import redis.asyncio

    async def with_client(work: Callable[[Any], Awaitable[Any]]) -> Any:
        client = redis.asyncio.Redis.from_url(url)
        try:
            return await work(client)
        finally:
            await client.aclose()

    async def reset() -> None:
        await with_client(lambda c: c.delete(DEST))

    async def held() -> int:
        return int(await with_client(lambda c: c.xlen(DEST)))

    async def ceiling(count: int, inflight: int) -> None:
        async def go(client: Any) -> None:
            for start in range(0, count, inflight):
                pipe = client.pipeline(transaction=False)
                for i in range(start, min(start + inflight, count)):
                    fields = {
                        "body": BODY,
                        "message_id": message_id(i),
                        "headers": b"{}",
                        "content_type": CONTENT_TYPE,
                        "correlation_id": CORRELATION_ID,
                    }
                    pipe.xadd(DEST, fields)
                await pipe.execute()

        await with_client(go)

    return Broker("redis", url, reset, held, ceiling, reset)


def kafka(url: str) -> Broker:
    import confluent_kafka
    from confluent_kafka.admin import AdminClient, NewTopic

    servers = url or _tansu()

    async def reset() -> None:
        def go() -> None:
            admin = AdminClient({"bootstrap.servers": servers})
            if DEST in admin.list_topics(timeout=10).topics:
                admin.delete_topics([DEST])[DEST].result(30)
            admin.create_topics([NewTopic(DEST, num_partitions=3)])[DEST].result(30)

        await asyncio.to_thread(go)

    async def held() -> int:
        def go() -> int:
            consumer = confluent_kafka.Consumer(
                {"bootstrap.servers": servers, "group.id": "of_bench", "enable.auto.commit": False}
            )
            try:
                consumer.assign(
                    [confluent_kafka.TopicPartition(DEST, p, -2) for p in range(3)]  # beginning
                )
                count = 0
                while batch := consumer.consume(num_messages=10_000, timeout=2.0):
                    count += sum(1 for msg in batch if msg.error() is None)
                return count
            finally:
                consumer.close()

        return await asyncio.to_thread(go)

    return Broker(
        "kafka",
        servers,
        reset,
        held,
        partial(_kafka_ceiling, servers),
        reset,
        partial(_aiokafka_ceiling, servers),
    )


KAFKA_HEADERS = [
    ("content-type", CONTENT_TYPE.encode()),
    ("correlation_id", CORRELATION_ID.encode()),
]


async def _kafka_ceiling(servers: str, count: int, inflight: int) -> None:
    """confluent-kafka alone: `inflight` records produced, then flushed, batch after batch."""
    import confluent_kafka

    def go() -> None:
        producer = confluent_kafka.Producer(
            {"bootstrap.servers": servers, "acks": "all", "enable.idempotence": True}
        )
        failed: list[Any] = []

        def report(error: Any, _msg: Any) -> None:
            if error is not None:
                failed.append(error)

        for start in range(0, count, inflight):
            for i in range(start, min(start + inflight, count)):
                producer.produce(
                    DEST,
                    BODY,
                    headers=[("message_id", message_id(i).encode()), *KAFKA_HEADERS],
                    on_delivery=report,
                )
            producer.flush(60)
        if failed:
            raise SystemExit(f"kafka: the client alone was refused: {failed[0]}")

    await asyncio.to_thread(go)


async def _aiokafka_ceiling(servers: str, count: int, inflight: int) -> None:
    """aiokafka alone, the same records and acks, `inflight` awaited at a time."""
    from aiokafka import AIOKafkaProducer

    producer = AIOKafkaProducer(bootstrap_servers=servers, acks="all")
    await producer.start()
    try:
        for start in range(0, count, inflight):
            sent = [
                await producer.send(
                    DEST, BODY, headers=[("message_id", message_id(i).encode()), *KAFKA_HEADERS]
                )
                for i in range(start, min(start + inflight, count))
            ]
            await asyncio.gather(*sent)
    finally:
        await producer.stop()


def _tansu() -> str:
    """A tansu broker for this run, stopped when the bench exits."""
    stack = contextlib.ExitStack()
    atexit.register(stack.close)
    return stack.enter_context(tansu())


BROKERS: dict[str, tuple[str, Callable[[str], Broker]]] = {
    "kafka": ("OUTBOX_FARM_BENCH_KAFKA", kafka),
    "rabbitmq": ("OUTBOX_FARM_BENCH_AMQP", rabbitmq),
    "nats": ("OUTBOX_FARM_BENCH_NATS", nats_jetstream),
    "redis": ("OUTBOX_FARM_BENCH_REDIS", redis_stream),
}
DEFAULT_URLS = {
    "kafka": "",  # a tansu broker of the bench's own
    "rabbitmq": "amqp://guest:guest@127.0.0.1:5672/",
    "nats": "nats://127.0.0.1:4222",
    "redis": "redis://127.0.0.1:6379/0",
}


def per_second(count: int, work: Coroutine[Any, Any, None]) -> float:
    """Run `work` to its end: `count` over the seconds it took."""
    began = time.perf_counter()
    asyncio.run(work)
    return count / (time.perf_counter() - began)


def measure(broker: Broker, dsn: str, appdir: Path, args: argparse.Namespace) -> dict[str, float]:
    env = {
        "RELAY_URL": broker.url,
        "RELAY_DEST": DEST,
        "RELAY_KIND": broker.kind,
        "RELAY_BATCH": str(args.batch),
    }
    asyncio.run(broker.reset())
    note(f"{broker.kind}: ceiling, {args.rows:,} bodies by the client library alone ...")
    ceiling = per_second(args.rows, broker.ceiling(args.rows, args.batch))
    other = 0.0
    if broker.other_client is not None:
        asyncio.run(broker.reset())
        note(f"{broker.kind}: ceiling of the other client, {args.rows:,} bodies ...")
        other = per_second(args.rows, broker.other_client(args.rows, args.batch))
    asyncio.run(broker.reset())
    note(f"{broker.kind}: the relay's target alone, {args.rows:,} bodies, no database ...")
    alone = per_second(args.rows, target_alone(broker.kind, broker.url, args.rows, args.batch))
    asyncio.run(broker.reset())
    note(f"{broker.kind}: relaying {args.rows:,} rows, --procs 2 ...")
    relay = drain_run(dsn, 2, args.rows, appdir, app="relayapp:farm", env=env)["rate"]
    arrived = asyncio.run(broker.held())
    if arrived < args.rows:
        raise SystemExit(f"{broker.kind}: the broker holds {arrived} of {args.rows} messages")
    asyncio.run(broker.reset())
    naive = {}
    # The default concurrency and one confirm round trip at a time, on a shared connection;
    # and a connection per run at the default concurrency.
    for connection, concurrency in NAIVE_VARIANTS:
        note(
            f"{broker.kind}: one message per run, concurrency {concurrency}, "
            f"{connection} connection, --procs 2 ..."
        )
        run_env = {
            **env,
            "RELAY_NAIVE_CONCURRENCY": str(concurrency),
            "RELAY_NAIVE_CONNECTION": connection,
        }
        rows = (
            args.naive_rows
            if (connection, concurrency) == NAIVE_VARIANTS[0]
            else args.naive_rows // 5
        )
        naive[connection, concurrency] = drain_run(
            dsn, 2, rows, appdir, app="naiveapp:farm", env=run_env
        )
    asyncio.run(broker.drop())
    return {
        "ceiling": ceiling,
        "other_client": other,
        "alone": alone,
        "relay": relay,
        "naive": naive["shared", 32]["rate"],
        "naive1": naive["shared", 1]["rate"],
        "naive_per_run": naive["per-run", 32]["rate"],
    }


def rate(per_second: float) -> str:
    return f"{per_second:,.0f} msg/s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.bench.relay", description=__doc__.split("\n\n")[0]
    )
    add_dsn(parser)
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--naive-rows", type=int, default=5_000)
    parser.add_argument(
        "--batch", type=int, default=RELAY_BATCH, help=f"relay batch (default {RELAY_BATCH:,})"
    )
    parser.add_argument(
        "--targets",
        default="kafka,rabbitmq,nats,redis",
        help="comma-separated (default: all four)",
    )
    args = parser.parse_args(argv)
    results: dict[str, dict[str, float]] = {}
    with (
        server(args.dsn) as admin,
        scratch(admin, Farm(table=tables.OUTBOX, dlq_table=tables.DLQ)) as dsn,
        tempfile.TemporaryDirectory() as folder,
    ):
        appdir = Path(folder)
        (appdir / "relayapp.py").write_text(APP)
        (appdir / "naiveapp.py").write_text(NAIVE_APP)
        for kind in args.targets.split(","):
            variable, make = BROKERS[kind]
            url = os.environ.get(variable, DEFAULT_URLS[kind])
            try:
                broker = make(url)
                asyncio.run(broker.reset())
            except Exception as exc:
                note(f"{kind}: skipped, {url} does not answer ({exc!r}); set {variable}")
                continue
            results[kind] = measure(broker, dsn, appdir, args)
    print()
    rows, ok = [], True
    for kind, r in results.items():
        share, factor = r["relay"] / r["ceiling"], r["relay"] / r["naive_per_run"]
        ok = ok and share >= CEILING_RATIO and factor >= NAIVE_FACTOR
        shared = r["relay"] / r["naive1"], r["relay"] / r["naive"]
        rows += [
            (f"{kind}: client library alone, the ceiling", rate(r["ceiling"]), "-", ""),
            *(
                [(f"{kind}: aiokafka alone (the other client)", rate(r["other_client"]), "-", "")]
                if r["other_client"]
                else []
            ),
            (f"{kind}: the relay's target alone, no database", rate(r["alone"]), "-", ""),
            (f"{kind}: relay, {args.rows:,} rows, --procs 2", rate(r["relay"]), "-", ""),
            (
                f"{kind}:   relay / ceiling",
                f"{share:.2f}",
                f">= {CEILING_RATIO}",
                verdict(share >= CEILING_RATIO),
            ),
            (f"{kind}:   relay / target alone", f"{r['relay'] / r['alone']:.2f}", "-", ""),
            (
                f"{kind}: one per run, own connection, concurrency 32",
                rate(r["naive_per_run"]),
                "-",
                "",
            ),
            (
                f"{kind}:   relay / that",
                f"{factor:.1f}x",
                f">= {NAIVE_FACTOR:g}x",
                verdict(factor >= NAIVE_FACTOR),
            ),
            (f"{kind}: one per run, shared connection, concurrency 1", rate(r["naive1"]), "-", ""),
            (f"{kind}:   relay / that", f"{shared[0]:.1f}x", "-", ""),
            (f"{kind}: one per run, shared connection, concurrency 32", rate(r["naive"]), "-", ""),
            (f"{kind}:   relay / that", f"{shared[1]:.1f}x", "-", ""),
        ]
    print_measures(rows, widths=(58, 14, 8))
    return 0 if ok and results else 1


if __name__ == "__main__":
    sys.exit(main())
