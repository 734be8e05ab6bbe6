"""The NATS JetStream target (nats-py, `pip install 'outbox-farm[nats]'`).

A batch goes out as JetStream publishes all in flight at once, each with a reply inbox of its
own on one subscription, and each awaited for its ack. Every message carries `Nats-Msg-Id` =
the row's stable message id, so a re-send within the stream's duplicate window is dropped by
the server (its ack says `duplicate`: still a confirm, the stream holds the message).

The acks are read here rather than through nats-py's `publish_async`, whose reply handler
raises the stream's error instead of handing it to the waiting future (nats-py 2.16): a refused
message would look like a lost one, be retried forever and never reach the DLQ with its reason.
The client's reconnecting is off: a dropped connection must reach the relay runner, which
reports it and reconnects.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

import nats
import nats.errors
import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg

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

MSG_ID = "Nats-Msg-Id"
NO_RESPONDERS = "503"


class NatsJetStream:
    """Publish to JetStream on `subject`, a template of the envelope's fields (`"{queue}"`,
    `"audit.{headers[tenant]}"`) or a callable of it; a stream must listen on the subject.

    `confirm_timeout`: seconds a batch waits for its acks before the rest count as unconfirmed
    (held and sent again; the duplicate window makes the re-send harmless).
    """

    def __init__(
        self,
        url: str,
        *,
        subject: Route = "{queue}",
        confirm_timeout: float = 30.0,
        label: str | None = None,
    ) -> None:
        self.url = url
        self.subject = check_route(subject, "subject")
        self.confirm_timeout = confirm_timeout
        self.label = label or "nats"
        self._nc: Client | None = None
        self._inbox = ""
        self._tokens = itertools.count()
        self._waiting: dict[str, asyncio.Future[Delivery]] = {}

    def __repr__(self) -> str:
        return f"NatsJetStream({redact_url(self.url)})"

    async def connect(self) -> None:
        if self._nc is not None and self._nc.is_connected:
            return
        await self.close()
        try:
            nc = await nats.connect(
                self.url,
                allow_reconnect=False,
                connect_timeout=10,
                error_cb=_ignore,  # the runner reports; nats-py would log each error itself
            )
            self._inbox = nc.new_inbox() + "."
            await nc.subscribe(self._inbox + "*", cb=self._acked)
        except (OSError, nats.errors.Error, TimeoutError) as exc:
            raise TargetUnavailable(scrub(f"{redact_url(self.url)}: {exc!r}", self.url)) from None
        self._nc = nc

    async def publish(self, batch: Sequence[Envelope]) -> list[Delivery]:
        nc = self._nc
        if nc is None or not nc.is_connected:
            raise TargetUnavailable("not connected")
        loop = asyncio.get_running_loop()
        routes = route_all(self.subject, batch)
        results: list[Delivery | asyncio.Future[Delivery]] = []
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
                reply = f"{self._inbox}{next(self._tokens)}"
                self._waiting[reply] = future = loop.create_future()
                results.append(future)
                await nc.publish(route, envelope.body, reply=reply, headers=headers)
        except (OSError, nats.errors.Error) as exc:
            # The rest of the batch never left; the acks of what did may never come.
            reason = scrub(f"connection lost while publishing: {exc!r}", self.url)
            results.extend(
                [Delivery(BrokerReply.UNCONFIRMED, reason)] * (len(batch) - len(results))
            )
        futures = [r for r in results if isinstance(r, asyncio.Future)]
        if futures:
            await asyncio.wait(futures, timeout=self.confirm_timeout)
        lost = Delivery(BrokerReply.UNCONFIRMED, f"no ack within {self.confirm_timeout:g}s")
        out = []
        for result in results:
            if isinstance(result, asyncio.Future):
                if not result.done():
                    result.cancel()
                result = result.result() if not result.cancelled() else lost
            out.append(result)
        for reply in [k for k, f in self._waiting.items() if f.done()]:
            del self._waiting[reply]
        return out

    async def _acked(self, msg: Msg) -> None:
        """The stream's answer to one publish: an ack, an error, or no stream at all."""
        future = self._waiting.pop(msg.subject, None)
        if future is None or future.done():
            return
        if msg.headers and msg.headers.get("Status") == NO_RESPONDERS:
            future.set_result(
                Delivery(BrokerReply.NACKED, "no JetStream stream listens on the subject")
            )
            return
        try:
            answer = orjson.loads(msg.data)
        except orjson.JSONDecodeError:
            future.set_result(
                Delivery(BrokerReply.UNCONFIRMED, f"unreadable ack {msg.data[:200]!r}")
            )
            return
        error = answer.get("error") if isinstance(answer, dict) else None
        if error:
            future.set_result(
                Delivery(
                    BrokerReply.NACKED,
                    f"refused by the stream: {error.get('description')} "
                    f"(code {error.get('code')}, err_code {error.get('err_code')})",
                )
            )
        else:
            future.set_result(CONFIRMED)

    async def close(self) -> None:
        nc, self._nc = self._nc, None
        for future in self._waiting.values():
            future.cancel()
        self._waiting.clear()
        if nc is not None and not nc.is_closed:
            await quietly(nc.close())


async def _ignore(exc: Exception) -> None:
    return None
