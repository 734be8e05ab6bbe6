"""Private brokers that a test or a chaos scenario may SIGKILL and start again on the same
port: tansu (Kafka), RabbitMQ (a node of its own), NATS JetStream and Redis. Never the shared
servers: other suites publish to those.

Each `Broker` makes its destination (`prepare`, again after a restart: a memory-only broker
forgets it), builds the relay target a farm publishes with (`target`, also from the
environment `env()` sets, for a farm started as a process: `loadtests.common.restartapp`), and
reads back the message ids that arrived (`arrived`). `Load` publishes to the relayed queue
meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg

from loadtests.common import kafkabroker
from loadtests.common.harness import free_port, listening
from loadtests.common.waits import wait_until
from outbox_farm import Farm
from outbox_farm.relay import Kafka, NatsJetStream, RabbitMQ, RedisStream, Target

KINDS = ("kafka", "rabbitmq", "nats", "redis")
START_TIMEOUT = 180.0  # a RabbitMQ node's first boot takes 40 s on a busy 2-core machine
# The server's own script: the one on the PATH may switch to the rabbitmq user, who cannot
# write the node's temporary directory.
RABBITMQ_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"
SUBJECT = "restart.events"  # NATS: the stream listens on `restart.>`


class Broker:
    """A broker process of `kind` on a free loopback port; `start()` again after `kill()`
    serves the same port (and, but for tansu's and Redis's memory, the same data)."""

    def __init__(self, kind: str, work: Path) -> None:
        if kind not in KINDS:
            raise ValueError(f"no private broker of kind {kind!r}; choose from {KINDS}")
        self.kind = kind
        self.work = work
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.name = "relay_restart"  # the topic, stream or queue
        self._seen: set[str] = set()  # RabbitMQ: what was taken off the queue so far
        self.url = {
            "kafka": f"127.0.0.1:{self.port}",
            "rabbitmq": f"amqp://guest:guest@127.0.0.1:{self.port}/",
            "nats": f"nats://127.0.0.1:{self.port}",
            "redis": f"redis://127.0.0.1:{self.port}/0",
        }[kind]

    def _command(self) -> tuple[list[str], dict[str, str]]:
        port, work = str(self.port), str(self.work)
        if self.kind == "kafka":
            address = f"tcp://127.0.0.1:{port}"
            command = [str(kafkabroker.binary()), "broker", "--storage-engine", "memory://tansu/"]
            return [*command, "--listener-url", address, "--advertised-listener-url", address], {}
        if self.kind == "redis":
            return ["redis-server", "--port", port, "--save", "", "--appendonly", "no"], {}
        if self.kind == "nats":
            return ["nats-server", "-a", "127.0.0.1", "-p", port, "-js", "-sd", work], {}
        env = {
            "HOME": work,  # its Erlang cookie
            "RABBITMQ_NODENAME": f"of_restart_{port}@localhost",
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": port,
            "RABBITMQ_DIST_PORT": str(free_port()),
            "RABBITMQ_MNESIA_BASE": f"{work}/mnesia",
            "RABBITMQ_LOG_BASE": f"{work}/log",
            "RABBITMQ_ENABLED_PLUGINS_FILE": f"{work}/plugins",
            "RABBITMQ_CONFIG_FILE": f"{work}/none",
        }
        return [RABBITMQ_SERVER if Path(RABBITMQ_SERVER).exists() else "rabbitmq-server"], env

    def start(self) -> None:
        command, env = self._command()
        if shutil.which(command[0]) is None and not Path(command[0]).exists():
            raise FileNotFoundError(f"{command[0]} is not installed: no private {self.kind}")
        with (self.work / f"{self.kind}.log").open("ab") as log:
            self.proc = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                start_new_session=True,  # killed with everything it started
            )  # fmt: skip
        port = self.port
        if not wait_until(lambda: listening(port), START_TIMEOUT, every=0.1, watch=self.proc):
            tail = (self.work / f"{self.kind}.log").read_text(errors="replace")[-1500:]
            self.kill()
            raise RuntimeError(f"private {self.kind} did not start on {self.port}:\n{tail}")

    def kill(self) -> None:
        """SIGKILL the broker and whatever it started (RabbitMQ's Erlang VM)."""
        proc, self.proc = self.proc, None
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def restart(self) -> None:
        self.kill()
        self.start()

    # -- the destination ---------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        """What `loadtests.common.restartapp` needs to relay here."""
        return {"RESTART_KIND": self.kind, "RESTART_URL": self.url, "RESTART_NAME": self.name}

    def target(self) -> Target:
        return target(self.kind, self.url, self.name)

    def prepare(self, timeout: float = 60.0) -> None:
        """Make the destination (if the broker forgot it); retried while the broker warms up."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                asyncio.run(self._prepare())
                return
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    async def _prepare(self) -> None:
        if self.kind == "kafka":
            from confluent_kafka.admin import AdminClient, NewTopic

            client = AdminClient({"bootstrap.servers": self.url})
            if self.name not in client.list_topics(timeout=10).topics:
                futures = client.create_topics([NewTopic(self.name, num_partitions=2)])
                await asyncio.to_thread(futures[self.name].result, 30)
        elif self.kind == "rabbitmq":
            import aio_pika

            async with await aio_pika.connect(self.url, timeout=10) as connection:
                channel = await connection.channel()
                await channel.declare_queue(self.name, durable=True)
        elif self.kind == "nats":
            import nats

            nc = await nats.connect(self.url, connect_timeout=5, allow_reconnect=False)
            try:
                js = nc.jetstream()
                await js.add_stream(name=self.name, subjects=["restart.>"])
            finally:
                await nc.close()

    def arrived(self) -> set[str]:
        """The message ids the destination holds (RabbitMQ: that it held so far)."""
        return asyncio.run(self._arrived())

    async def _arrived(self) -> set[str]:
        if self.kind == "kafka":
            return await asyncio.to_thread(self._kafka_ids)
        if self.kind == "redis":
            import redis.asyncio

            client = redis.asyncio.Redis.from_url(self.url)
            try:
                entries = await client.xrange(self.name)
            finally:
                await client.aclose()
            return {fields[b"message_id"].decode() for _, fields in entries}
        if self.kind == "nats":
            return await self._nats_ids()
        return await self._rabbitmq_ids()

    def _kafka_ids(self) -> set[str]:
        """Every record of the topic, read from the beginning: up to each partition's high
        watermark, then on until a fetch comes back empty. tansu's watermark can lag the
        records it serves (152 for a partition holding offsets 0-199, two producers writing),
        so a reader that stopped there would miss the last records, the same ones at every
        look, and a test waiting for them would wait in vain."""
        import confluent_kafka

        consumer = confluent_kafka.Consumer(
            {"bootstrap.servers": self.url, "group.id": "restart", "enable.auto.commit": False}
        )
        try:
            meta = consumer.list_topics(self.name, timeout=10).topics[self.name]
            offsets = confluent_kafka.OFFSET_BEGINNING
            partitions = [
                confluent_kafka.TopicPartition(self.name, p, offsets) for p in meta.partitions
            ]
            ends = {
                p: consumer.get_watermark_offsets(t, timeout=10)[1]
                for p, t in enumerate(partitions)
            }
            consumer.assign(partitions)
            ids: set[str] = set()
            read = dict.fromkeys(ends, 0)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                batch = consumer.consume(num_messages=1000, timeout=0.5)
                if not batch and all(read[p] >= ends[p] for p in ends):
                    break
                for msg in batch:
                    if msg.error() is None:
                        ids.add(dict(msg.headers() or [])["message_id"].decode())
                        read[msg.partition()] = msg.offset() + 1
            return ids
        finally:
            consumer.close()

    async def _nats_ids(self) -> set[str]:
        import nats

        nc = await nats.connect(self.url, connect_timeout=5, allow_reconnect=False)
        try:
            js = nc.jetstream()
            state = (await js.stream_info(self.name)).state
            ids: set[str] = set()
            if not state.messages:
                return ids
            for seq in range(state.first_seq, state.last_seq + 1):
                msg = await js.get_msg(self.name, seq)
                ids.add((msg.headers or {})["Nats-Msg-Id"])
            return ids
        finally:
            await nc.close()

    async def _rabbitmq_ids(self) -> set[str]:
        """Take what the queue holds now, by a consumer (a `get` per message would make the
        reading, not the relay, the slow part); unacked deliveries go back to the queue."""
        import aio_pika

        async with await aio_pika.connect(self.url, timeout=10) as connection:
            channel = await connection.channel()
            await channel.set_qos(prefetch_count=1000)
            queue = await channel.declare_queue(self.name, durable=True)
            ready = queue.declaration_result.message_count or 0
            taken = asyncio.Event()
            count = 0

            async def take(message: aio_pika.abc.AbstractIncomingMessage) -> None:
                nonlocal count
                self._seen.add(str(message.message_id))
                await message.ack()
                count += 1
                if count >= ready:
                    taken.set()

            if ready:
                tag = await queue.consume(take)
                await asyncio.wait_for(taken.wait(), 60)
                await queue.cancel(tag)
        return set(self._seen)


def target(kind: str, url: str, name: str) -> Target:
    """The relay target to a private broker: short timeouts, so a test sees it recover soon."""
    if kind == "kafka":
        return Kafka(url, topic=name, confirm_timeout=20, config={"reconnect.backoff.max.ms": 500})
    if kind == "rabbitmq":
        return RabbitMQ(url, routing_key=name, confirm_timeout=10)
    if kind == "nats":
        return NatsJetStream(url, subject=SUBJECT, confirm_timeout=10)
    return RedisStream(url, stream=name, confirm_timeout=10)


@contextlib.contextmanager
def broker(kind: str) -> Iterator[Broker]:
    """A started private broker of `kind` and its destination, for the block."""
    work = Path(tempfile.mkdtemp(prefix=f"outbox-farm-{kind}-"))
    private = Broker(kind, work)
    try:
        private.start()
        private.prepare()
        yield private
    finally:
        private.kill()
        shutil.rmtree(work, ignore_errors=True)


def row_ids(message_ids: set[str]) -> set[int]:
    """The outbox row ids of relayed message ids (`table:id:created`)."""
    return {int(message_id.split(":")[1]) for message_id in message_ids}


class Load:
    """Publishes `per_tick` rows to queue `events` every 50 ms, in a thread, from `with` until
    its end; `ids` are the rows' ids, in order."""

    def __init__(self, dsn: str, per_tick: int = 5) -> None:
        self.dsn = dsn
        self.per_tick = per_tick
        self.ids: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        producer = Farm()
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self._stop.wait(0.05):
                self.ids += producer.publish_batch(conn, [b"load"] * self.per_tick, queue="events")


def publish(dsn: str, count: int) -> list[int]:
    """`count` rows to queue `events`, at once; their ids."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        return Farm().publish_batch(conn, [b"row"] * count, queue="events")
