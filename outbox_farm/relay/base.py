"""The contract between the relay runner and a broker target.

A relay is a batch handler whose work is "publish these rows and tell me, per row, what the
broker said". The runner (`runner.Relay`: reconnects, settling each row, metrics, health) knows
no broker; a target only turns `Envelope`s into broker messages and reports one `Delivery` per
envelope. That narrow seam is what lets Kafka, RabbitMQ, NATS JetStream and Redis Streams
share the one rule that keeps rows safe: a row is acked only on `CONFIRMED`.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import string
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol, runtime_checkable

from ..errors import ConfigurationError, OutboxFarmError

_FIELDS = frozenset({"queue", "headers", "message_id", "row_id", "correlation_id", "ordering_key"})


class Envelope(NamedTuple):
    """One outbox row as a broker message (immutable; a tuple, not a frozen dataclass: one is
    built per relayed row, and a frozen dataclass takes four times as long to build).

    `message_id` is stable for the row (the same on every re-send), so a broker's duplicate
    window (JetStream's `Nats-Msg-Id`) or a consumer's idempotence check drops re-sends.
    `headers` holds the row's headers as strings (`traceparent` among them when the row has
    one), without `content-type` and `correlation_id`, which have fields of their own.
    `ordering_key` is the row's (None without one): Kafka's default record key, and a field
    routes may name (`""` there for a row without one).
    """

    row_id: int
    message_id: str
    queue: str
    body: bytes
    headers: Mapping[str, str]
    content_type: str | None
    correlation_id: str | None
    ordering_key: str | None = None


class BrokerReply(enum.Enum):
    CONFIRMED = "confirmed"
    """The broker took responsibility for the message: the row may be acked."""
    NACKED = "nacked"
    """The broker answered no (a nack, a stream that refused the entry, a route that could not
    be resolved): the row's retry strategy runs, then the DLQ, with `reason` as the error."""
    RETURNED = "returned"
    """Unroutable: the broker returned the message (AMQP `mandatory`, no queue bound). As
    NACKED, counted apart: it is a topology problem, not a broker refusal."""
    UNCONFIRMED = "unconfirmed"
    """No answer is known (the connection broke mid-batch, the confirm timed out): the row is
    held and sent again over a new connection, never acked, and costs no attempt unless the
    broker keeps failing it while it confirms others (`hold`). It may have reached the broker;
    its stable message id makes that a duplicate a consumer can drop."""


@dataclass(frozen=True, slots=True)
class Delivery:
    outcome: BrokerReply
    reason: str | None = None
    """What the broker said, for every outcome but CONFIRMED: it becomes the retry's error and,
    should the strategy give up, the DLQ row's `last_exception`."""


CONFIRMED = Delivery(BrokerReply.CONFIRMED)


class TargetUnavailable(OutboxFarmError):
    """The broker could not be reached, or the connection broke before anything of the batch
    was known; the relay reconnects with a jittered backoff, holding its rows meanwhile."""


@runtime_checkable
class Target(Protocol):
    """A broker a relay publishes to. One instance serves one relay queue in one process.

    `label` names the target in metrics (`outbox_farm_relay_*{target=label}`) and logs.
    `connect` is awaited before the first batch and again after `TargetUnavailable`; it raises
    `TargetUnavailable` while the broker is down. `publish` returns exactly one `Delivery` per
    envelope, in order; it raises `TargetUnavailable` only when nothing of the batch is known
    (every row then counts as unconfirmed). `close` is idempotent.

    A target may also set `max_header_bytes`, the most its broker takes in one message's
    headers: the runner rejects a row whose headers weigh more (to the DLQ as `rejected`) before
    publishing, so one oversized row never fails its batch or the connection (64 KiB when the
    target states nothing: within RabbitMQ's default frame, where AMQP headers must fit).
    """

    label: str

    async def connect(self) -> None: ...

    async def publish(self, batch: Sequence[Envelope]) -> list[Delivery]: ...

    async def close(self) -> None: ...


Route = str | Callable[[Envelope], str]
"""Where an envelope goes: a template such as `"{queue}"` or `"audit.{headers[tenant]}"`
(formatted with the envelope's fields), or a callable of the envelope."""


async def quietly(closing: Awaitable[object]) -> None:
    """Await a close of a connection that may be broken already: nothing is left to save."""
    with contextlib.suppress(Exception):
        await closing


def check_route(route: Route, what: str) -> Route:
    """Refuse a route that cannot work at registration, not at the first publish."""
    if callable(route):
        return route
    if not isinstance(route, str) or not route:
        raise ConfigurationError(f"{what} must be a non-empty template or a callable: {route!r}")
    try:
        route.format_map(_Probe())
    except (ValueError, IndexError, KeyError) as exc:
        raise ConfigurationError(f"{what} {route!r} is not a valid template: {exc}") from None
    return route


def resolve(route: Route, envelope: Envelope) -> str:
    """The routing key, subject or stream of one envelope. A template naming a header the row
    lacks raises KeyError: the target reports that row NACKED (retried, then dead-lettered)."""
    if callable(route):
        return str(route(envelope))
    return route.format(
        queue=envelope.queue,
        headers=envelope.headers,
        message_id=envelope.message_id,
        row_id=envelope.row_id,
        correlation_id=envelope.correlation_id,
        ordering_key=envelope.ordering_key or "",
    )


def routed(route: Route, batch: Sequence[Envelope]) -> list[str | Delivery]:
    """Each envelope's destination, or the NACKED delivery of one whose route fails."""
    if batch and isinstance(route, str) and _per_queue(route):
        # Every row of a relay's batch is of its one queue: formatted once, not per row.
        queues = {envelope.queue for envelope in batch}
        if len(queues) == 1:
            return [resolve(route, batch[0])] * len(batch)
    out: list[str | Delivery] = []
    for envelope in batch:
        try:
            out.append(resolve(route, envelope))
        except Exception as exc:
            out.append(Delivery(BrokerReply.NACKED, f"route {route!r} failed: {exc!r}"))
    return out


@functools.lru_cache(maxsize=256)
def _per_queue(template: str) -> bool:
    """The template names no field but `{queue}` (`"orders"`, `"{queue}"`, `"out.{queue}"`):
    it formats alike for every row of one queue."""
    return all(
        field is None or (field == "queue" and "{" not in (spec or ""))
        for _, field, spec, _ in string.Formatter().parse(template)
    )


class _Probe(dict[str, object]):
    """Accepts the envelope's field names, and any key or attribute below them, while a
    template is checked."""

    def __missing__(self, key: str) -> object:
        if key not in _FIELDS:
            raise ValueError(f"unknown field {{{key}}}; use {sorted(_FIELDS)}")
        return _Any()


class _Any(str):
    def __getitem__(self, key: object) -> _Any:
        return self

    def __getattr__(self, name: str) -> _Any:
        return self
