"""The Kafka target (confluent-kafka, the librdkafka client; `pip install 'outbox-farm[kafka]'`).

confluent-kafka rather than aiokafka: batch by batch, as the relay sends (the benchmark's
ceiling: the same records, acks from every in-sync replica, one relay batch in flight), the two
publish alike on the same broker, within the run-to-run noise; streaming records without a wait
per batch librdkafka made several times aiokafka's rate; and its idempotent producer works where
aiokafka's was refused (the benchmarks page has the numbers).

A batch is handed to librdkafka's queue at once (`produce` never waits on the network) with
`acks=all`; librdkafka batches, retries what is retriable and reconnects by itself, within
`confirm_timeout` (its `message.timeout.ms`). Each message's delivery report, served by a poller
thread of the target's own, is its row's `Delivery`:
- delivered: CONFIRMED, the only outcome that acks a row;
- the topic does not exist (auto-creation off): RETURNED, as an unroutable AMQP message: a
  topology problem of that row's route, so the retry strategy gives an operator time to create
  the topic and the DLQ then keeps the row with the broker's words, while rows for other topics
  keep flowing (holding the whole relay would stall every topic for one bad route);
- refused (message too large, not authorised, an invalid record): NACKED with the broker's words;
- no report known (timed out, purged because every broker went down, a fatal producer error, the
  idempotent producer's state lost by the broker, no report at all for `stall_timeout`):
  UNCONFIRMED, so the runner holds the row and sends it again, with the same `message_id`
  header, by a producer made anew (a restarted broker that forgot the producer's id answers
  its records with nothing librdkafka gives up on before `confirm_timeout`).
When librdkafka says every broker is down, the target purges what it holds (the reports come at
once, as purged, instead of after `confirm_timeout`) and drops the producer, and the runner's
reconnect asks the cluster for its metadata until it answers: the runner holds its rows and
reports the outage meanwhile. The producer is made anew because a broker that comes back may
have lost the producers' state: tansu then hands a known producer id to a new producer, and the
old one's records would pass for the new one's duplicates, acked and never stored. (librdkafka
may say so once more just after a reconnect: that costs a re-send, never a row.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any, cast

from confluent_kafka import KafkaError, KafkaException, Producer

from ..dsn import scrub
from ..errors import ConfigurationError
from .base import (
    BrokerReply,
    Delivery,
    Envelope,
    Route,
    TargetUnavailable,
    check_route,
    resolve,
)
from .base import routed as route_all
from .kafka_reports import Reports, fatal, refused, words

log = logging.getLogger("outbox_farm.relay.kafka")

ORDERING_KEY = "{ordering_key}"
"""The default record key: the row's ordering key, or no key for a row without one."""

MESSAGE_ID = "message_id"  # the record headers the target adds to the row's own
CORRELATION_ID = "correlation_id"
CONTENT_TYPE = "content-type"

CONNECT_SECONDS = 10.0  # a first connection's wait for the cluster's metadata
DOWN_PROBE_SECONDS = 1.0  # a reconnect's, once librdkafka said every broker is down
POLL_SECONDS = 0.1  # the poller thread's longest wait in librdkafka between two stop checks
QUEUE_FULL_WAIT = 0.005  # seconds between tries while librdkafka's local queue is full

Key = str | Callable[[Envelope], str | bytes | None] | None


class Kafka:
    """Publish to `topic`, a template of the envelope's fields (`"orders.{queue}"`,
    `"audit.{headers[tenant]}"`) or a callable of it, with the record key `key`: a template
    (default: the row's ordering key, or no key when the row has none), a callable of the
    envelope returning str, bytes or None, or None for no key. Rows of one key land on one
    partition, in publish order across the whole farm (the ordering key already runs them one at
    a time).

    `servers`: the bootstrap list, `"broker1:9092,broker2:9092"`. `idempotent`: librdkafka's
    idempotent producer (on by default; turn it off for a broker that refuses InitProducerId).
    `confirm_timeout`: seconds librdkafka may spend delivering one record (its retries
    included) before the row counts as unconfirmed and is sent again. `stall_timeout`: seconds
    a batch may go without a single delivery report before the producer counts as stuck (a
    broker that restarted and forgot the idempotent producer's id leaves librdkafka retrying
    until `confirm_timeout`): the records are purged and sent again by a producer made anew.
    Ten seconds by default, so that a healthy producer waiting out a short pause (a partition
    changing leader) is not replaced and its records sent twice; raise it for a cluster whose
    acknowledgements may take longer. `config`: any other
    librdkafka setting (security, compression, `allow.auto.create.topics`, ...); the target's own
    settings (`bootstrap.servers`, `acks`, `enable.idempotence`, `message.timeout.ms`) win.
    Records carry the row's headers, `message_id` (stable per row), `correlation_id` and
    `content-type`.
    """

    def __init__(
        self,
        servers: str,
        *,
        topic: Route = "{queue}",
        key: Key = ORDERING_KEY,
        idempotent: bool = True,
        confirm_timeout: float = 30.0,
        stall_timeout: float = 10.0,
        config: Mapping[str, Any] | None = None,
        label: str | None = None,
    ) -> None:
        if not isinstance(servers, str) or not servers.strip():
            raise ConfigurationError(
                f"Kafka servers must be a non-empty 'host:port[,host:port...]' list: {servers!r}"
            )
        timeouts = {"confirm_timeout": confirm_timeout, "stall_timeout": stall_timeout}
        for name, seconds in timeouts.items():
            if seconds <= 0:
                raise ConfigurationError(f"{name} must be positive: {seconds!r}")
        self.servers = servers
        self.topic = check_route(topic, "topic")
        self.key: Key = key if key is None or callable(key) else check_route(key, "key")
        self.idempotent = idempotent
        self.confirm_timeout = confirm_timeout
        self.stall_timeout = min(stall_timeout, confirm_timeout)
        self.config = {
            **(config or {}),
            "bootstrap.servers": servers,
            "acks": "all",
            "enable.idempotence": idempotent,
            "message.timeout.ms": int(confirm_timeout * 1000),
            "logger": _LibrdkafkaLog(),
        }
        self.label = label or "kafka"
        self._producer: Producer | None = None
        self._poller: threading.Thread | None = None
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._down: str | None = None  # why librdkafka gave up on every broker, until reconnected
        self._broken = False  # lost (fatal, brokers down, stuck): made anew at the next connect

    def __repr__(self) -> str:
        return f"Kafka({self.servers!r})"

    # -- connection --------------------------------------------------------------------------

    async def connect(self) -> None:
        """Make the producer (once, or again after a fatal error) and check that the cluster
        answers a metadata request: TargetUnavailable, with librdkafka's words, while it does
        not."""
        loop = asyncio.get_running_loop()
        if self._broken:
            await self.close()
        if self._producer is None:
            self._loop = loop
            self._stop.clear()
            try:
                self._producer = Producer({**self.config, "error_cb": self._error})
            except KafkaException as exc:
                raise ConfigurationError(f"{self.label}: {words(exc)}") from None
            self._poller = threading.Thread(
                target=self._poll, args=(self._producer,), name="outbox-farm-kafka", daemon=True
            )
            self._poller.start()
        producer = self._producer
        # librdkafka waits for a broker to come up: long enough for a first connection, short
        # while it has said that every broker is down, so that the outage is reported at once.
        timeout = DOWN_PROBE_SECONDS if self._down else CONNECT_SECONDS
        try:
            await loop.run_in_executor(None, partial(producer.list_topics, timeout=timeout))
        except KafkaException as exc:
            raise TargetUnavailable(scrub(f"{self.servers}: {words(exc)}", self.servers)) from None
        self._down = None

    def _poll(self, producer: Producer) -> None:
        """The poller thread: serve librdkafka's delivery reports and errors until closed. A
        fatal error that `poll` raises (an idempotent producer out of sequence with a broker
        that forgot it) is handled as the error callback's, and polling goes on: the records'
        reports, failed, come after it."""
        while not self._stop.is_set():
            try:
                producer.poll(POLL_SECONDS)
            except KafkaException as exc:
                error = exc.args[0] if exc.args else None
                if isinstance(error, KafkaError):
                    self._error(error)
                self._stop.wait(POLL_SECONDS)

    def _error(self, error: KafkaError) -> None:
        """librdkafka's error callback (poller thread). Every broker down, or a fatal error:
        purge what the producer holds so each pending row learns it is unconfirmed now, and
        make the producer anew before it sends again: a broker that comes back may have lost
        the producer's state and hand its id to another producer (tansu does), whose records
        would then pass for this one's duplicates. Other errors (one connection dropped)
        librdkafka handles itself."""
        code = error.code()
        if code != KafkaError._ALL_BROKERS_DOWN and not error.fatal():
            return
        self._down = words(error)
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._purge)

    def _purge(self) -> None:
        """Drop what the producer holds (the poller serves the purged reports at once), and
        the producer itself at the next connect."""
        if self._producer is not None:
            self._producer.purge()
            self._broken = True

    # -- publishing --------------------------------------------------------------------------

    async def publish(self, batch: Sequence[Envelope]) -> list[Delivery]:
        producer = self._producer
        if producer is None:
            raise TargetUnavailable("not connected")
        if self._broken:  # the runner connects anew, which makes a new producer
            raise TargetUnavailable(f"the producer is lost ({self._down or 'a fatal error'})")
        topics = route_all(self.topic, batch)
        keys = self._keys(batch)
        reports = Reports(asyncio.get_running_loop(), len(batch))
        report, produce = reports.report, producer.produce
        settled = 0  # known without a report: refused before librdkafka took it
        # Written out, not a call per row: this loop runs for every message the relay sends.
        for i, envelope in enumerate(batch):
            topic, key = topics[i], keys[i]
            if isinstance(topic, Delivery) or isinstance(key, Delivery):  # route or key failed
                reports.known(i, topic if isinstance(topic, Delivery) else cast(Delivery, key))
                settled += 1
                continue
            headers = _headers(envelope)
            while True:
                try:
                    produce(
                        topic, envelope.body, key, headers=headers, on_delivery=partial(report, i)
                    )
                    break
                except BufferError:  # librdkafka's queue is full: the poller drains it
                    await asyncio.sleep(QUEUE_FULL_WAIT)
                except (KafkaException, TypeError, ValueError) as exc:
                    # librdkafka's own checks (too large, a topic it knows is missing) answer
                    # at once, with the codes a delivery report would carry; a fatal error
                    # there leaves a producer that can send nothing more.
                    reports.known(i, refused(exc))
                    self._broken = self._broken or fatal(exc)
                    settled += 1
                    break
        if not await reports.wait(settled, self.confirm_timeout + 5, self.stall_timeout):
            # No report at all for stall_timeout: librdkafka is stuck on something the broker
            # lost (it bumps the epoch of a producer id the broker forgot, again and again,
            # until confirm_timeout). A producer made anew gets an id the broker knows.
            self._broken = True
            producer.purge()
            return reports.deliveries(
                f"no delivery report for {self.stall_timeout:g}s (the broker may have forgotten "
                "the producer): sent again by a new one"
            )
        self._broken = self._broken or reports.state_lost
        return reports.deliveries()

    def _keys(self, batch: Sequence[Envelope]) -> list[str | bytes | Delivery | None]:
        """Each envelope's record key, or the NACKED delivery of one whose key fails."""
        key = self.key
        if key is None:
            return [None] * len(batch)
        if key == ORDERING_KEY:
            return [envelope.ordering_key for envelope in batch]
        out: list[str | bytes | Delivery | None] = []
        for envelope in batch:
            try:
                out.append(key(envelope) if callable(key) else resolve(key, envelope))
            except Exception as exc:
                out.append(Delivery(BrokerReply.NACKED, f"key {key!r} failed: {exc!r}"))
        return out

    # -- closing -----------------------------------------------------------------------------

    async def close(self) -> None:
        """Drop the producer. What it still holds is purged, and those records' reports are
        served before the poller stops: a batch still waiting learns they are unconfirmed."""
        producer, self._producer = self._producer, None
        poller, self._poller = self._poller, None
        self._broken = False
        if producer is None:
            return
        producer.purge()
        self._stop.set()
        if poller is not None:
            await asyncio.get_running_loop().run_in_executor(None, poller.join)
        with contextlib.suppress(KafkaException):  # a fatal error, raised again: nothing to save
            producer.poll(0)


def _headers(envelope: Envelope) -> list[tuple[str, str | bytes | None]]:
    """A record's headers: the row's, then `message_id`, `correlation_id`, `content-type`."""
    headers: list[tuple[str, str | bytes | None]] = list(envelope.headers.items())
    headers.append((MESSAGE_ID, envelope.message_id))
    if envelope.correlation_id:
        headers.append((CORRELATION_ID, envelope.correlation_id))
    if envelope.content_type:
        headers.append((CONTENT_TYPE, envelope.content_type))
    return headers


class _LibrdkafkaLog:
    """Where librdkafka's log lines go, instead of stderr: DEBUG records of this module's
    logger. librdkafka logs every failed reconnect at its error level; the runner reports an
    outage itself, once, with its reason, and `/healthz` tells while it lasts."""

    def log(self, level: int, msg: str, *args: object) -> None:
        log.debug(msg, *args)
