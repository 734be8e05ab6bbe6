"""The NATS JetStream target (nats-py, `pip install 'outbox-farm[nats]'`).

A batch goes out as JetStream async publishes, all in flight at once, each awaited for its
`PubAck`. Every message carries `Nats-Msg-Id` = the row's stable message id, so a re-send
within the stream's duplicate window is dropped by the server (the ack then says `duplicate`,
which is still a confirm: the stream holds the message). The client's own reconnecting is off:
a dropped connection must reach the relay runner, which reports it and reconnects.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.js import JetStreamContext

from ..dsn import redact_url
from .base import (
    CONFIRMED,
    Delivery,
    Envelope,
    Outcome,
    Route,
    TargetUnavailable,
    check_route,
    quietly,
)
from .base import routed as route_all

MSG_ID = "Nats-Msg-Id"


class NatsJetStream:
    """Publish to JetStream on `subject`, a template of the envelope's fields (`"{queue}"`,
    `"audit.{headers[tenant]}"`) or a callable of it; a stream must listen on the subject.

    `confirm_timeout`: seconds a batch waits for its acks before the rest count as unconfirmed
    (retried; the duplicate window makes the re-send harmless). `max_pending`: async publishes
    in flight per connection, at least the relay's batch size.
    """

    def __init__(
        self,
        url: str,
        *,
        subject: Route = "{queue}",
        confirm_timeout: float = 30.0,
        max_pending: int = 4000,
        label: str | None = None,
    ) -> None:
        self.url = url
        self.subject = check_route(subject, "subject")
        self.confirm_timeout = confirm_timeout
        self.max_pending = max_pending
        self.label = label or "nats"
        self._nc: Client | None = None
        self._js: JetStreamContext | None = None

    def __repr__(self) -> str:
        return f"NatsJetStream({redact_url(self.url)})"

    async def connect(self) -> None:
        if self._nc is not None and self._nc.is_connected:
            return
        await self.close()
        try:
            self._nc = await nats.connect(
                self.url,
                allow_reconnect=False,
                connect_timeout=10,
                error_cb=_ignore,  # the runner reports; nats-py would log each error itself
            )
        except (OSError, nats.errors.Error, TimeoutError) as exc:
            raise TargetUnavailable(f"{redact_url(self.url)}: {exc!r}") from None
        self._js = self._nc.jetstream(publish_async_max_pending=self.max_pending)

    async def publish(self, batch: Sequence[Envelope]) -> list[Delivery]:
        js, nc = self._js, self._nc
        if js is None or nc is None or not nc.is_connected:
            raise TargetUnavailable("not connected")
        routes = route_all(self.subject, batch)
        results: list[Delivery | asyncio.Future[Any]] = []
        try:
            for envelope, route in zip(batch, routes, strict=True):
                if isinstance(route, Delivery):
                    results.append(route)
                    continue
                headers = {**envelope.headers, MSG_ID: envelope.message_id}
                if envelope.content_type:
                    headers["Content-Type"] = envelope.content_type
                if envelope.correlation_id:
                    headers["Correlation-Id"] = envelope.correlation_id
                results.append(await js.publish_async(route, envelope.body, headers=headers))
        except (OSError, nats.errors.Error) as exc:
            # The rest of the batch never left: unconfirmed, as are the sent ones' acks.
            reason = f"connection lost while publishing: {exc!r}"
            results.extend([Delivery(Outcome.UNCONFIRMED, reason)] * (len(batch) - len(results)))
        futures = [r for r in results if isinstance(r, asyncio.Future)]
        if futures:
            _, pending = await asyncio.wait(futures, timeout=self.confirm_timeout)
            for future in pending:
                future.cancel()
        return [
            r if isinstance(r, Delivery) else _delivery(r, self.confirm_timeout) for r in results
        ]

    async def close(self) -> None:
        nc, self._nc, self._js = self._nc, None, None
        if nc is not None and not nc.is_closed:
            await quietly(nc.close())


async def _ignore(exc: Exception) -> None:
    return None


def _delivery(future: asyncio.Future[Any], timeout: float) -> Delivery:
    if future.cancelled():
        return Delivery(Outcome.UNCONFIRMED, f"no ack within {timeout:g}s")
    exc = future.exception()
    if exc is None:
        return CONFIRMED
    if isinstance(exc, nats.js.errors.NoStreamResponseError):
        return Delivery(Outcome.NACKED, "no JetStream stream listens on the subject")
    if isinstance(exc, nats.js.errors.APIError):
        return Delivery(Outcome.NACKED, f"refused by the stream: {exc}")
    return Delivery(Outcome.UNCONFIRMED, f"no ack: {exc!r}")
