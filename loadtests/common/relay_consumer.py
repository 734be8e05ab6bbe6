"""The far side of the load test's relay mode: a consumer that records every message the relay
published, so the checker can tell whether each committed row reached the broker.

    python -m loadtests.common.relay_consumer --amqp URL --exchange X --queue Q --dsn DSN
    python -m loadtests.common.relay_consumer --kafka SERVERS --exchange PREFIX --bind ok --dsn DSN

It declares a durable queue bound to the exchange for every routing key the load test expects
to arrive (`--bind`, the relayed queues that must succeed), consumes with manual acks, and
writes one `loadtest_ledger` row per delivery (`outcome` 'success', the routing key as the
queue) before acking it: a message is acked to RabbitMQ only once its ledger row committed, so
the ledger holds every message the broker took, at least once. A repeated delivery is a
repeated ledger row, which the checker counts as a duplicate that must be explained.

SIGTERM ends it after the queue is empty and nothing arrived for a second (at most `--linger`
seconds); it deletes its queue and exchange and prints one JSON line: received, distinct.

With `--kafka`, it creates one topic `PREFIX.<key>` (3 partitions) per `--bind` key, reads each
from its start, and writes the ledger rows (the key as the queue) in batches; Kafka keeps what
it delivered, so there is nothing to ack. SIGTERM ends it once nothing arrived for a second.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import time
from typing import Any

import aio_pika
import aiormq.exceptions
import orjson
import psycopg
from aio_pika.abc import AbstractIncomingMessage

LEDGER = "INSERT INTO loadtest_ledger (msg_id, queue, outcome, pid) VALUES (%s, %s, 'success', %s)"
FLUSH_EVERY = 0.1  # seconds between ledger writes
QUIET = 1.0  # seconds without a delivery that, with an empty queue, mean "all arrived"


class Recorder:
    """Collects deliveries and writes them to the ledger in batches, acking after the commit."""

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self.conn = conn
        self.pending: list[AbstractIncomingMessage] = []
        self.received = 0
        self.ids: set[str] = set()
        self.last_delivery = time.monotonic()

    async def take(self, message: AbstractIncomingMessage) -> None:
        self.pending.append(message)
        self.last_delivery = time.monotonic()

    async def flush(self) -> None:
        batch, self.pending = self.pending, []
        if not batch:
            return
        rows = []
        for message in batch:
            msg_id = str(orjson.loads(message.body)["id"])
            rows.append((msg_id, message.routing_key or "", os.getpid()))
            self.ids.add(msg_id)
        async with self.conn.transaction(), self.conn.cursor() as cur:
            await cur.executemany(LEDGER, rows)
        await batch[-1].ack(multiple=True)
        self.received += len(batch)


async def consume(args: argparse.Namespace) -> dict[str, int]:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    connection = await aio_pika.connect(args.amqp, timeout=10)
    async with (
        connection,
        await psycopg.AsyncConnection.connect(args.dsn, autocommit=True) as conn,
    ):
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=2_000)
        exchange = await channel.declare_exchange(
            args.exchange, aio_pika.ExchangeType.DIRECT, durable=True
        )
        queue = await channel.declare_queue(args.queue, durable=True)
        for key in args.bind:
            await queue.bind(exchange, routing_key=key)
        recorder = Recorder(conn)
        tag = await queue.consume(recorder.take)
        print("ready", flush=True)  # the load test starts the farm after this line
        while not stop.is_set():
            await recorder.flush()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), FLUSH_EVERY)
        deadline = time.monotonic() + args.linger
        while time.monotonic() < deadline:
            await recorder.flush()
            waiting = (await channel.declare_queue(args.queue, passive=True)).declaration_result
            quiet = time.monotonic() - recorder.last_delivery >= QUIET
            if quiet and not waiting.message_count and not recorder.pending:
                break
            await asyncio.sleep(FLUSH_EVERY)
        await queue.cancel(tag)
        await recorder.flush()
        with contextlib.suppress(Exception):
            await queue.delete(if_unused=False, if_empty=False)
            await exchange.delete()
        return {"received": recorder.received, "distinct": len(recorder.ids)}


def consume_kafka(args: argparse.Namespace) -> dict[str, int]:
    """The Kafka side: topics made, read from their start, every record in the ledger."""
    import confluent_kafka
    from confluent_kafka.admin import AdminClient, NewTopic

    stopping: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, lambda *_: stopping.append(True))
    topics = {f"{args.exchange}.{key}": key for key in args.bind}
    admin = AdminClient({"bootstrap.servers": args.kafka})
    for future in admin.create_topics([NewTopic(t, num_partitions=3) for t in topics]).values():
        future.result(30)
    consumer = confluent_kafka.Consumer(
        {"bootstrap.servers": args.kafka, "group.id": args.exchange, "enable.auto.commit": False}
    )
    consumer.assign(
        [
            confluent_kafka.TopicPartition(topic, p, confluent_kafka.OFFSET_BEGINNING)
            for topic in topics
            for p in range(3)
        ]
    )
    received, ids = 0, set()
    last = time.monotonic()
    deadline: float | None = None
    print("ready", flush=True)
    with psycopg.connect(args.dsn, autocommit=True) as conn:
        while True:
            batch = [m for m in consumer.consume(2_000, FLUSH_EVERY) if m.error() is None]
            if batch:
                last = time.monotonic()
                rows = []
                for msg in batch:
                    msg_id = str(orjson.loads(msg.value())["id"])
                    rows.append((msg_id, topics[msg.topic()], os.getpid()))
                    ids.add(msg_id)
                with conn.transaction(), conn.cursor() as cur:
                    cur.executemany(LEDGER, rows)
                received += len(batch)
            if stopping and deadline is None:
                deadline = time.monotonic() + args.linger
            if deadline is not None and (
                time.monotonic() - last >= QUIET or time.monotonic() > deadline
            ):
                break
    consumer.close()
    with contextlib.suppress(Exception):
        for future in admin.delete_topics(list(topics)).values():
            future.result(30)
    return {"received": received, "distinct": len(ids)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    broker = parser.add_mutually_exclusive_group(required=True)
    broker.add_argument("--amqp", help="RabbitMQ's URL")
    broker.add_argument("--kafka", help="Kafka's bootstrap servers")
    parser.add_argument("--exchange", required=True, help="the exchange the relay publishes to")
    parser.add_argument("--queue", help="RabbitMQ: the queue to declare, bind and consume")
    parser.add_argument("--bind", action="append", default=[], help="a routing key to bind")
    parser.add_argument("--dsn", required=True, help="the load test's database (the ledger)")
    parser.add_argument("--linger", type=float, default=60.0, help="seconds to empty the queue")
    args = parser.parse_args(argv)
    try:
        summary = consume_kafka(args) if args.kafka else asyncio.run(consume(args))
    except (OSError, aiormq.exceptions.AMQPError, psycopg.Error) as exc:
        # One line for the load test to show: the broker or the database could not be used.
        print(f"relay consumer: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 2
    print(orjson.dumps(summary).decode(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
