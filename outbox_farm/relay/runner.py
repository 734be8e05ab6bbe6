"""The relay runner: the batch handler of a relay queue.

It turns claimed rows into `Envelope`s, has the target publish them as one batch, and settles
each row from its `Delivery`: `ack()` on CONFIRMED only; `nack(error=...)` when the broker
refused it, so the queue's retry strategy, `max_deliveries` and the DLQ apply as to any handler,
with what the broker said as the error. A row nobody answered for (UNCONFIRMED) is held, not
failed (`hold`): the runner drops the connection (a Kafka producer with it), connects anew and
sends it again, waiting a jittered, doubling while between rounds in which nothing was answered,
until the broker confirms or refuses it: a broker that is down, or up but has forgotten the
producer, costs no attempt and no dead letter (only a row the broker keeps failing while it
confirms others spends one). While the broker is unreachable, or answers nothing, the rows stay
in the outbox (leased; the heartbeat renews them) and `outbox_farm_relay_up{target}` and
`problem` (which `/healthz` reports) say so, until the broker confirms again. The hold is the
queue's breaker too (`trip`, see `Farm.relay`): every farm holds the queue but for its probes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

import orjson

from ..message import CONTENT_TYPE, CORRELATION_ID, Message
from ..observe.base import Observer
from .base import BrokerReply, Delivery, Envelope, Target, TargetUnavailable
from .hold import Backoff, Held, Suspects

log = logging.getLogger("outbox_farm.relay")

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


_UNCONFIRMED = BrokerReply.UNCONFIRMED
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
        self.problem: str | None = None  # why the relay delivers nothing, for /healthz
        # Written by the batches of this relay (one event loop), under `_lock` while connecting.
        self._up = False  # connected, as far as the runner knows
        self._generation = 0  # bumped by each connection dropped to be made anew
        self._reported = False  # relay_up was set once: the first connection is behind it
        self._confirms = 0  # rows confirmed, all batches: evidence that the broker works
        self._suspects = Suspects()  # rows judged at fault for no answer (hold.py)
        self._lock = asyncio.Lock()
        self.observer = Observer()  # the runtime's, once it serves this relay's queue
        # The queue's breaker's `trip`, once the runtime serves the queue with one: called when
        # the broker is found out of reach, so every farm holds the queue, not this batch alone.
        self.trip: Callable[[str], Awaitable[None]] | None = None

    def __repr__(self) -> str:
        return f"Relay(to={self.label})"

    async def __call__(self, msgs: list[Message]) -> None:
        msgs, batch = self._envelopes(msgs)
        if not batch:
            return
        since = self._confirms
        generation = await self._connected()
        unanswered = self._settle(msgs, await self._publish(batch))
        if unanswered:
            suspects = self._suspects
            held = Held(len(batch), since, (i for i in unanswered if msgs[i].id in suspects))
            await self._hold(msgs, batch, held, unanswered, generation)

    async def _hold(
        self,
        msgs: Sequence[Message],
        batch: Sequence[Envelope],
        held: Held,
        unanswered: dict[int, Delivery],
        generation: int,
    ) -> None:
        """Send the rows nobody answered for again, over a connection made anew, until each is
        confirmed, refused or judged at fault (`Held`); the relay is reported down while rounds
        get no answer at all, and waits a jittered, doubling while after each of those."""
        rows = held.rows
        anew = False  # the connection was made anew for the round that just ended
        backoff = Backoff()
        while True:
            failed = {rows[i]: delivery for i, delivery in unanswered.items()}
            for row in held.record(rows, list(failed), anew=anew, confirms=self._confirms):
                self._suspects.add(msgs[row].id)
                msgs[row].nack(error=Unconfirmed(f"{self.label}: {failed[row].reason}"))
            if not held.rows:
                return
            anew = bool(failed)
            if len(failed) == len(rows):  # no answer at all: the broker is not there for us
                await self._down(f"no answer from its broker: {next(iter(failed.values())).reason}")
                await backoff.wait()
            else:
                backoff.reset()
            if failed:
                await self._replace(generation)
            generation = await self._connected()
            rows = held.next_round()
            deliveries = await self._publish([batch[i] for i in rows])
            unanswered = self._settle([msgs[i] for i in rows], deliveries)

    async def _publish(self, batch: list[Envelope]) -> list[Delivery]:
        began = time.perf_counter()
        try:
            deliveries = await self.target.publish(batch)
        except TargetUnavailable as exc:
            deliveries = [Delivery(_UNCONFIRMED, str(exc))] * len(batch)
        if len(deliveries) != len(batch):
            raise RuntimeError(
                f"relay target {self.label} returned {len(deliveries)} deliveries for a "
                f"batch of {len(batch)}: a bug in the target"
            )
        self.observer.relay_sent(self.label, len(batch), time.perf_counter() - began)
        return deliveries

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

    def _settle(
        self, msgs: Sequence[Message], deliveries: Sequence[Delivery]
    ) -> dict[int, Delivery]:
        """Ack the confirmed rows and nack the refused ones; return the others (no answer), by
        position, unsettled: whether they are held or spend an attempt is the caller's call."""
        confirmed = BrokerReply.CONFIRMED
        failed: dict[BrokerReply, int] = {}  # by outcome; counted apart, as they are rare
        unanswered: dict[int, Delivery] = {}
        for i, (msg, delivery) in enumerate(zip(msgs, deliveries, strict=True)):
            outcome = delivery.outcome
            if outcome is confirmed:
                msg.ack()
                continue
            failed[outcome] = failed.get(outcome, 0) + 1
            if outcome is _UNCONFIRMED:
                unanswered[i] = delivery
                continue
            why = delivery.reason or outcome.value
            msg.nack(error=_ERRORS[outcome](f"{self.label}: {why}"))
        if acked := len(msgs) - sum(failed.values()):
            self._confirms += acked
            self._delivering()
            self.observer.relay_settled(self.label, confirmed.value, acked)
        for outcome, rows in failed.items():
            self.observer.relay_settled(self.label, outcome.value, rows)
        return unanswered

    async def _connected(self) -> int:
        """Return once the target is connected, with the connection's generation: at once
        while it is; else reconnect with a jittered, doubling backoff, however long that takes
        (the rows wait, leased)."""
        if self._up:
            return self._generation
        async with self._lock:
            backoff = Backoff()
            while not self._up:
                try:
                    await self.target.connect()
                except TargetUnavailable as exc:
                    await self._down(f"cannot reach its broker: {exc}")
                    await backoff.wait()
                    continue
                self._up = True
                if not self._reported:
                    # The first connection: up at once. After an outage the relay is reported
                    # up by its first confirm, not by a connection (a broker that forgot the
                    # producer still answers one).
                    self._delivering()
            return self._generation

    async def _replace(self, generation: int) -> None:
        """Drop the connection of `generation` (a Kafka producer with it), unless another batch
        did already: the next round connects anew."""
        async with self._lock:
            if generation == self._generation:
                self._generation += 1
                self._up = False
                await self.target.close()

    def _delivering(self) -> None:
        """Report the relay up: its first connection, or a confirm after it was down."""
        if self._reported and self.problem is None:
            return
        self._reported, self.problem = True, None
        self.observer.relay_connection(self.label, True)
        log.info(
            "relay to %s delivers", self.label, extra={"event": "relay_up", "target": self.label}
        )

    async def _down(self, why: str) -> None:
        """Report the relay down, and open the queue's breaker: the outage is the broker's."""
        reason = f"relay to {self.label}: {why}"
        if self.problem != reason:
            log.warning(
                "%s; holding its rows and connecting anew",
                reason,
                extra={"event": "relay_down", "target": self.label},
            )
        self._reported, self.problem = True, reason
        self.observer.relay_connection(self.label, False)
        if self.trip is not None:
            await self.trip(reason)

    async def close(self) -> None:
        await self.target.close()
        self._up = False
