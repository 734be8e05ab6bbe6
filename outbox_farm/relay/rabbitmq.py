"""The RabbitMQ target (aio-pika, `pip install 'outbox-farm[rabbitmq]'`).

A batch is published on one channel with publisher confirms, every message in flight at once,
`mandatory` so that an unroutable message comes back (`basic.return`) instead of vanishing:
each message's confirm, nack or return is its row's `Delivery`. The connection is a plain one,
not aio-pika's robust kind: reconnecting is the relay runner's job, and a robust connection
would hide from it exactly the outage it must report.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import aio_pika
import aiormq.exceptions
from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractExchange

from ..dsn import redact_url, scrub
from .base import (
    CONFIRMED,
    BrokerReply,
    Delivery,
    Envelope,
    Route,
    TargetUnavailable,
    check_route,
    quietly,
)
from .base import routed as route_all

_CONNECTION_ERRORS = (
    ConnectionError,
    OSError,
    aiormq.exceptions.AMQPConnectionError,
    aiormq.exceptions.ChannelClosed,
    aiormq.exceptions.ChannelInvalidStateError,
    asyncio.CancelledError,
)


class RabbitMQ:
    """Publish to `exchange` (the default exchange when "") with `routing_key`, a template of
    the envelope's fields (`"{queue}"`, `"orders.{headers[tenant]}"`) or a callable of it.

    `confirm_timeout`: seconds a batch waits for its confirms before the rest count as
    unconfirmed (held and sent again). Messages are persistent and carry `message_id`,
    `correlation_id`, `content_type` and the row's headers. The exchange must exist: the relay
    checks it when it connects and reports a missing one as the reason it cannot publish.
    """

    def __init__(
        self,
        url: str,
        *,
        exchange: str = "",
        routing_key: Route = "{queue}",
        confirm_timeout: float = 30.0,
        label: str | None = None,
    ) -> None:
        self.url = url
        self.exchange_name = exchange
        self.routing_key = check_route(routing_key, "routing_key")
        self.confirm_timeout = confirm_timeout
        self.label = label or f"rabbitmq:{exchange or '(default)'}"
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None
        self._exchange: AbstractExchange | None = None

    def __repr__(self) -> str:
        return f"RabbitMQ({redact_url(self.url)}, exchange={self.exchange_name!r})"

    async def connect(self) -> None:
        if self._channel is not None and not self._channel.is_closed:
            return
        await self.close()
        try:
            self._connection = await aio_pika.connect(self.url, timeout=10)
            if self.exchange_name:
                # A passive declare: a missing exchange closes the channel it ran on.
                async with self._connection.channel(publisher_confirms=False) as check:
                    await check.get_exchange(self.exchange_name, ensure=True)
            self._channel = await self._connection.channel(
                publisher_confirms=True, on_return_raises=True
            )
            self._exchange = (
                await self._channel.get_exchange(self.exchange_name, ensure=False)
                if self.exchange_name
                else self._channel.default_exchange
            )
        except aiormq.exceptions.ChannelNotFoundEntity:
            await self.close()
            raise TargetUnavailable(
                f"exchange {self.exchange_name!r} does not exist on {redact_url(self.url)}: "
                "declare it (the relay never declares topology)"
            ) from None
        except (*_CONNECTION_ERRORS, TimeoutError, aiormq.exceptions.AMQPError) as exc:
            await self.close()
            raise TargetUnavailable(scrub(f"{redact_url(self.url)}: {exc!r}", self.url)) from None

    async def publish(self, batch: Sequence[Envelope]) -> list[Delivery]:
        exchange = self._exchange
        if exchange is None or self._channel is None or self._channel.is_closed:
            raise TargetUnavailable("not connected")
        routes = route_all(self.routing_key, batch)
        sends: list[Any] = []
        for envelope, route in zip(batch, routes, strict=True):
            if isinstance(route, Delivery):
                sends.append(_known(route))
                continue
            message = aio_pika.Message(
                envelope.body,
                headers=dict(envelope.headers),
                content_type=envelope.content_type,
                correlation_id=envelope.correlation_id,
                message_id=envelope.message_id,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
            )
            sends.append(exchange.publish(message, route, mandatory=True))
        try:
            async with asyncio.timeout(self.confirm_timeout):
                results = await asyncio.gather(*sends, return_exceptions=True)
        except TimeoutError:
            raise TargetUnavailable(
                f"no confirms within {self.confirm_timeout:g}s for a batch of {len(batch)}"
            ) from None
        return [_delivery(result) for result in results]

    async def close(self) -> None:
        connection, self._connection = self._connection, None
        self._channel = self._exchange = None
        if connection is not None and not connection.is_closed:
            await quietly(connection.close())


async def _known(delivery: Delivery) -> Delivery:
    return delivery


def _delivery(result: object) -> Delivery:
    """One message's confirm, as a `Delivery`."""
    if isinstance(result, Delivery):
        return result
    if isinstance(result, aiormq.exceptions.PublishError):
        returned = result.message.delivery if result.message is not None else None
        code, text, key = (
            getattr(returned, f, "?") for f in ("reply_code", "reply_text", "routing_key")
        )
        return Delivery(
            BrokerReply.RETURNED, f"returned unroutable: {code} {text} (routing key {key!r})"
        )
    if isinstance(result, aiormq.exceptions.DeliveryError):
        return Delivery(BrokerReply.NACKED, f"nacked by the broker: {result.frame!r}")
    if isinstance(result, BaseException):
        return Delivery(BrokerReply.UNCONFIRMED, f"no confirm: {result!r}")
    return CONFIRMED
