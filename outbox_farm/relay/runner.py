"""The relay runner: the batch handler of a relay queue.

It turns claimed rows into `Envelope`s, has the target publish them as one batch, and settles
each row from its `Delivery`: `ack()` on CONFIRMED only; `nack(error=...)` otherwise, so the
queue's retry strategy, `max_deliveries` and the DLQ apply as to any handler, with what the
broker said as the error. While the broker is unreachable the runner holds its batch (the
heartbeat keeps the leases) and reconnects with a jittered backoff; the rows stay in the outbox,
in claim order, and nothing is acked. `outbox_farm_relay_up{target}` and `problem` (which
`/healthz` reports) say so meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Sequence

import orjson

from ..message import CONTENT_TYPE, CORRELATION_ID, Message
from ..observe.base import Observer
from .base import BrokerReply, Delivery, Envelope, Target, TargetUnavailable

log = logging.getLogger("outbox_farm.relay")

RECONNECT_FIRST = 0.2  # seconds before the first reconnect; doubled up to RECONNECT_CAP
RECONNECT_CAP = 15.0
# A relay call's timeout: it waits out a broker outage holding its rows (the heartbeat renews
# their leases), so only a day without a broker abandons a batch; each publish is bounded by
# its target's own confirm timeout.
RELAY_TIMEOUT = 24 * 3600.0
MAX_HEADER_BYTES = 64 * 1024  # headers of one message, unless the target states its own limit


class BrokerRefused(Exception):
    """The broker refused the message (a nack, a rejected entry, an unresolvable route)."""


class Unroutable(BrokerRefused):
    """The broker returned the message: no queue is bound for its routing key."""


class Unconfirmed(Exception):
    """No confirm arrived (the connection broke mid-batch, or the confirm timed out): the row
    is published again; the broker may see it twice, with the same message id."""


_ERRORS: dict[BrokerReply, type[Exception]] = {
    BrokerReply.NACKED: BrokerRefused,
    BrokerReply.RETURNED: Unroutable,
    BrokerReply.UNCONFIRMED: Unconfirmed,
}


def message_id(table: str, msg: Message) -> str:
    """Stable for the row across re-sends and processes; distinct across tables and across a
    table recreated with its ids starting over (the creation time is part of it)."""
    return f"{table}:{msg.id}:{int(msg.created_at.timestamp() * 1_000_000)}"


class Unpublishable(Exception):
    """The row cannot become a broker message (a header value that cannot be encoded, headers
    larger than the target takes): it is dead-lettered as `rejected`, as no retry can help."""


def header_bytes(envelope: Envelope) -> int:
    """What the envelope's headers weigh on the wire, roughly: every key and value as UTF-8,
    the content type, correlation id and message id included (brokers send them as headers)."""
    size = len(envelope.message_id) + len((envelope.content_type or "").encode())
    size += len((envelope.correlation_id or "").encode())
    for key, value in envelope.headers.items():
        size += len(key.encode()) + len(value.encode())
    return size


def envelope(table: str, msg: Message) -> Envelope:
    row = msg.headers
    headers = (
        {
            key: value if isinstance(value, str) else orjson.dumps(value).decode()
            for key, value in row.items()
            if key not in (CONTENT_TYPE, CORRELATION_ID)
        }
        if row
        else {}
    )
    return Envelope(
        msg.id,
        message_id(table, msg),
        msg.queue,
        msg.body,
        headers,
        msg.content_type,
        msg.correlation_id,
        msg.ordering_key,
    )


class Relay:
    """The handler `Farm.relay` registers: called with a batch of claimed rows of its queue."""

    def __init__(self, target: Target, table: str, *, max_header_bytes: int | None = None) -> None:
        self.target = target
        self.table = table
        # The target's own limit when it states one (`max_header_bytes`), else RabbitMQ's: its
        # content header frame, where the headers travel, must fit in one frame (128 KiB by
        # default); a larger one makes the broker close the connection, failing the batch.
        stated = getattr(target, "max_header_bytes", None)
        self.max_header_bytes: int = max_header_bytes or stated or MAX_HEADER_BYTES
        self.label = target.label
        self.problem: str | None = None  # why the broker is unreachable, for /healthz
        self._up = False
        self._lock = asyncio.Lock()
        self.observer = Observer()  # the runtime's, once it serves this relay's queue

    def __repr__(self) -> str:
        return f"Relay(to={self.label})"

    async def __call__(self, msgs: list[Message]) -> None:
        msgs, batch = self._envelopes(msgs)
        if not batch:
            return
        await self._connected()
        began = time.perf_counter()
        try:
            deliveries = await self.target.publish(batch)
        except TargetUnavailable as exc:
            self._down(exc)
            deliveries = [Delivery(BrokerReply.UNCONFIRMED, str(exc))] * len(batch)
        if len(deliveries) != len(batch):
            raise RuntimeError(
                f"relay target {self.label} returned {len(deliveries)} deliveries for a "
                f"batch of {len(batch)}: a bug in the target"
            )
        self.observer.relay_sent(self.label, len(batch), time.perf_counter() - began)
        self._settle(msgs, deliveries)

    def _envelopes(self, msgs: list[Message]) -> tuple[list[Message], list[Envelope]]:
        """The rows that can be published, and their envelopes, in order. A row that cannot
        (`Unpublishable`) is rejected on its own, before anything is sent: one outcome per row,
        never one bad row failing its whole batch (or the connection, for RabbitMQ)."""
        ready: list[Message] = []
        batch: list[Envelope] = []
        limit = self.max_header_bytes
        for msg in msgs:
            try:
                built = envelope(self.table, msg)
            except Exception as exc:
                msg.reject(Unpublishable(f"row {msg.id} cannot become a message: {exc!r}"))
                continue
            size = header_bytes(built)
            if size > limit:
                msg.reject(
                    Unpublishable(
                        f"row {msg.id}: its headers take {size} bytes, more than the "
                        f"{limit} {self.label} is given (max_header_bytes)"
                    )
                )
                continue
            ready.append(msg)
            batch.append(built)
        return ready, batch

    def _settle(self, msgs: Sequence[Message], deliveries: Sequence[Delivery]) -> None:
        confirmed = BrokerReply.CONFIRMED
        failed: dict[BrokerReply, int] = {}  # by outcome; counted apart, as they are rare
        for msg, delivery in zip(msgs, deliveries, strict=True):
            outcome = delivery.outcome
            if outcome is confirmed:
                msg.ack()
                continue
            failed[outcome] = failed.get(outcome, 0) + 1
            msg.nack(error=_ERRORS[outcome](f"{self.label}: {delivery.reason or outcome.value}"))
        if BrokerReply.UNCONFIRMED in failed:
            self._up = False  # maybe a broken connection: the next batch checks it first
        if acked := len(msgs) - sum(failed.values()):
            self.observer.relay_settled(self.label, confirmed.value, acked)
        for outcome, rows in failed.items():
            self.observer.relay_settled(self.label, outcome.value, rows)

    async def _connected(self) -> None:
        """Return once the target is connected: at once while it is; else reconnect with a
        jittered, doubling backoff, however long that takes (the rows wait, leased)."""
        if self._up:
            return
        async with self._lock:
            delay = RECONNECT_FIRST
            while not self._up:
                try:
                    await self.target.connect()
                except TargetUnavailable as exc:
                    self._down(exc)
                    await asyncio.sleep(delay * random.uniform(0.5, 1.0))
                    delay = min(delay * 2, RECONNECT_CAP)
                    continue
                self._up, self.problem = True, None
                self.observer.relay_connection(self.label, True)
                log.info(
                    "relay to %s connected",
                    self.label,
                    extra={"event": "relay_up", "target": self.label},
                )

    def _down(self, exc: BaseException) -> None:
        reason = f"relay to {self.label} cannot reach its broker: {exc}"
        if self._up or self.problem != reason:
            log.warning(
                "%s; holding its rows and reconnecting",
                reason,
                extra={"event": "relay_down", "target": self.label},
            )
        self._up, self.problem = False, reason
        self.observer.relay_connection(self.label, False)

    async def close(self) -> None:
        await self.target.close()
        self._up = False
