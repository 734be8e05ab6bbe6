"""Relays: outbox rows published to a broker in confirmed batches.

`farm.relay(queue, to=target)` registers one; the targets (`Kafka`, `RabbitMQ`,
`NatsJetStream`, `RedisStream`) need their client library, installed with the matching extra
(`outbox-farm[kafka]`, `[rabbitmq]`, `[nats]`, `[redis]`), and import it only when made. `base`
is the contract a target implements; `runner` the broker-agnostic handler that settles each row.
"""

import importlib

from .base import CONFIRMED, BrokerReply, Delivery, Envelope, Route, Target, TargetUnavailable

__all__ = [
    "CONFIRMED",
    "BrokerReply",
    "Delivery",
    "Envelope",
    "Kafka",
    "NatsJetStream",
    "RabbitMQ",
    "RedisStream",
    "Route",
    "Target",
    "TargetUnavailable",
]


_TARGETS = {
    "Kafka": "kafka",
    "RabbitMQ": "rabbitmq",
    "NatsJetStream": "nats",
    "RedisStream": "redis_streams",
}


def __getattr__(name: str) -> object:
    """The targets, imported on first use: each pulls in its broker's client library."""
    if name not in _TARGETS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_TARGETS[name]}"), name)
