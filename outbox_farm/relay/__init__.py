"""Relays: outbox rows published to a broker in confirmed batches.

`farm.relay(queue, to=target)` registers one; the targets (`RabbitMQ`, `NatsJetStream`,
`RedisStream`) need their client library, installed with the matching extra
(`outbox-farm[rabbitmq]`, `[nats]`, `[redis]`), and import it only when made. `base` is the
contract a target implements; `runner` the broker-agnostic handler that settles each row.
"""

from .base import CONFIRMED, Delivery, Envelope, Outcome, Route, Target, TargetUnavailable

__all__ = [
    "CONFIRMED",
    "Delivery",
    "Envelope",
    "NatsJetStream",
    "Outcome",
    "RabbitMQ",
    "RedisStream",
    "Route",
    "Target",
    "TargetUnavailable",
]


def __getattr__(name: str) -> object:
    """The targets, imported on first use: each pulls in its broker's client library."""
    if name == "RabbitMQ":
        from .rabbitmq import RabbitMQ

        return RabbitMQ
    if name == "NatsJetStream":
        from .nats import NatsJetStream

        return NatsJetStream
    if name == "RedisStream":
        from .redis_streams import RedisStream

        return RedisStream
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
