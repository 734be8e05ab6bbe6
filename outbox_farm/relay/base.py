"""The contract between the relay runner and a broker target.

A relay is a batch handler whose work is "publish these rows and tell me, per row, what the broker
said". The runner (claiming, settling each row, metrics, reconnects) is broker-agnostic; a target
only turns `Envelope`s into broker messages and reports one `Delivery` per envelope. Keeping that
seam narrow is what lets RabbitMQ, NATS JetStream, Redis Streams (and later Kafka) share every
rule that keeps rows safe: a row is acked only on `CONFIRMED`, whatever else happened.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from ..errors import ConfigurationError, OutboxFarmError


@dataclass(frozen=True, slots=True)
class Envelope:
    """One outbox row as a broker message.

    `message_id` is stable for the row (the same on every re-send), so a broker's duplicate
    window (JetStream's `Nats-Msg-Id`) or a consumer's idempotence check can drop re-sends.
    `headers` holds the row's headers as strings, `traceparent` included when the row has one.
    """

    row_id: int
    message_id: str
    queue: str
    body: bytes
    headers: Mapping[str, str]
    content_type: str | None
    correlation_id: str | None


class Outcome(enum.Enum):
    CONFIRMED = "confirmed"
    """The broker took responsibility for the message: the row may be acked."""
    REFUSED = "refused"
    """The broker answered no (nack, unroutable return, stream rejection): the row's retry
    strategy runs, then the DLQ, with `reason` as the error."""
    UNCONFIRMED = "unconfirmed"
    """No answer is known (connection lost mid-batch, confirm timeout): the row is retried, never
    acked. It may have reached the broker; the stable message id makes that harmless."""


@dataclass(frozen=True, slots=True)
class Delivery:
    outcome: Outcome
    reason: str | None = None
    """What the broker said, for REFUSED and UNCONFIRMED: it becomes the retry's error and,
    should the strategy give up, the DLQ row's `last_exception`."""


CONFIRMED = Delivery(Outcome.CONFIRMED)


class TargetUnavailable(OutboxFarmError):
    """The broker could not be reached or the connection broke; the relay reconnects with
    backoff and leaves the rows in the outbox meanwhile."""


@runtime_checkable
class Target(Protocol):
    """A broker a relay publishes to. One instance serves one relay queue in one process.

    `label` names the target in metrics (`outbox_farm_relay_*{target=label}`) and logs. `connect`
    is awaited before the first batch and again after `TargetUnavailable`; it raises
    `TargetUnavailable` when the broker is down. `publish` returns exactly one `Delivery` per
    envelope, in order; it raises `TargetUnavailable` only when nothing of the batch can be known
    (every row then counts as unconfirmed). `close` is idempotent.
    """

    label: str

    async def connect(self) -> None: ...

    async def publish(self, batch: Sequence[Envelope]) -> list[Delivery]: ...

    async def close(self) -> None: ...


Route = str | Callable[[Envelope], str]
"""Where an envelope goes: a template such as `"{queue}"` or `"audit.{headers[tenant]}"`
(formatted with the envelope's fields), or a callable of the envelope."""


def check_route(route: Route, what: str) -> Route:
    """Refuse a route that cannot work at registration, not at the first publish."""
    if callable(route):
        return route
    if not isinstance(route, str) or not route:
        raise ConfigurationError(f"{what} must be a non-empty template or a callable: {route!r}")
    try:
        route.format_map(_Probe())
    except (ValueError, IndexError) as exc:
        raise ConfigurationError(f"{what} {route!r} is not a valid template: {exc}") from None
    return route


def resolve(route: Route, envelope: Envelope) -> str:
    """The routing key, subject or stream of one envelope. A template naming a header the row
    lacks raises KeyError: the runner treats it as the row's own failure (retry, then DLQ)."""
    if callable(route):
        return str(route(envelope))
    return route.format(
        queue=envelope.queue,
        headers=envelope.headers,
        message_id=envelope.message_id,
        row_id=envelope.row_id,
        correlation_id=envelope.correlation_id,
    )


class _Probe(dict[str, object]):
    """Accepts any field name while a template is checked for syntax."""

    def __missing__(self, key: str) -> object:
        if key not in {"queue", "headers", "message_id", "row_id", "correlation_id"}:
            raise ValueError(f"unknown field {{{key}}}")
        return _Any()


class _Any(str):
    def __getitem__(self, key: object) -> _Any:
        return self

    def __getattr__(self, name: str) -> _Any:
        return self
