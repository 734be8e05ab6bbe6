"""The Redis Streams target (redis-py asyncio, `pip install 'outbox-farm[redis]'`).

A batch is one pipeline of XADDs (no MULTI: entries are independent), sent in one round trip;
each reply is its row's `Delivery`: an entry id confirms, an error (the key holds another type,
a full memory) refuses. The client's own retries are off: re-sending a whole pipeline after a
broken connection would add every entry again, and the runner must see the outage anyway. The
entry's fields: `body`, `message_id` (stable per row, for consumers' idempotence),
`content_type`, `correlation_id`, and `headers` (JSON).
"""

from __future__ import annotations

from collections.abc import Sequence

import orjson
import redis.asyncio
import redis.exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

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

_CONNECTION_ERRORS = (OSError, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


class RedisStream:
    """XADD to `stream`, a template of the envelope's fields (`"events"`,
    `"events.{headers[tenant]}"`) or a callable of it; `maxlen` caps each stream
    approximately (`MAXLEN ~`), None keeps every entry. `confirm_timeout` bounds the
    pipeline's round trip."""

    def __init__(
        self,
        url: str,
        *,
        stream: Route = "{queue}",
        maxlen: int | None = None,
        confirm_timeout: float = 30.0,
        label: str | None = None,
    ) -> None:
        self.url = url
        self.stream = check_route(stream, "stream")
        self.maxlen = maxlen
        self.confirm_timeout = confirm_timeout
        self.label = label or "redis"
        self._client: redis.asyncio.Redis | None = None

    def __repr__(self) -> str:
        return f"RedisStream({redact_url(self.url)})"

    async def connect(self) -> None:
        if self._client is None:
            self._client = redis.asyncio.Redis.from_url(
                self.url,
                retry=Retry(NoBackoff(), 0),
                socket_timeout=self.confirm_timeout,
                socket_connect_timeout=10,
            )
        try:
            await self._client.ping()
        except (*_CONNECTION_ERRORS, redis.exceptions.RedisError) as exc:
            await self.close()
            raise TargetUnavailable(f"{redact_url(self.url)}: {exc!r}") from None

    async def publish(self, batch: Sequence[Envelope]) -> list[Delivery]:
        client = self._client
        if client is None:
            raise TargetUnavailable("not connected")
        routes = route_all(self.stream, batch)
        pipe = client.pipeline(transaction=False)
        sent = []
        for envelope, route in zip(batch, routes, strict=True):
            if isinstance(route, Delivery):
                continue
            fields: dict[str | bytes, bytes | str] = {
                "body": envelope.body,
                "message_id": envelope.message_id,
                "headers": orjson.dumps(dict(envelope.headers)),
            }
            if envelope.content_type:
                fields["content_type"] = envelope.content_type
            if envelope.correlation_id:
                fields["correlation_id"] = envelope.correlation_id
            pipe.xadd(route, fields, maxlen=self.maxlen, approximate=True)  # type: ignore[arg-type]
            sent.append(route)
        try:
            replies = iter(await pipe.execute(raise_on_error=False)) if sent else iter(())
        except _CONNECTION_ERRORS as exc:
            await self.close()
            raise TargetUnavailable(f"connection lost while publishing: {exc!r}") from None
        return [
            route if isinstance(route, Delivery) else _delivery(next(replies)) for route in routes
        ]

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await quietly(client.aclose())


def _delivery(reply: object) -> Delivery:
    if isinstance(reply, _CONNECTION_ERRORS):
        return Delivery(Outcome.UNCONFIRMED, f"no reply: {reply!r}")
    if isinstance(reply, Exception):
        return Delivery(Outcome.NACKED, f"refused by Redis: {reply}")
    return CONFIRMED
