"""The Redis Streams target (redis-py asyncio, `pip install 'outbox-farm[redis]'`).

A batch is one write of XADDs (no MULTI: entries are independent) on a pooled connection,
followed by one reply per entry, in order: an entry id confirms, an error (the key holds another
type, a full memory) refuses. The commands are encoded here rather than by redis-py's pipeline,
whose per-argument encoding cost more than the rest of the relay together; redis-py still owns
the connection (URL, TLS, auth, reply parsing, with hiredis when installed). A connection that
breaks mid-batch keeps the replies read before it: those rows are confirmed, the rest are not.
The client's own retries are off: re-sending a batch after a broken connection would add every
entry again, and the runner must see the outage anyway. The entry's fields: `body`,
`message_id` (stable per row, for consumers' idempotence), `content_type`, `correlation_id`,
and `headers` (JSON).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import orjson
import redis.asyncio
import redis.exceptions
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

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

_CONNECTION_ERRORS = (OSError, redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)


class RedisStream:
    """XADD to `stream`, a template of the envelope's fields (`"events"`,
    `"events.{headers[tenant]}"`) or a callable of it; `maxlen` caps each stream
    approximately (`MAXLEN ~`), None keeps every entry. `confirm_timeout` bounds a batch's
    round trip (and the connect's PING)."""

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
        self._trim = () if maxlen is None else (b"MAXLEN", b"~", b"%d" % maxlen)
        self._client: redis.asyncio.Redis | None = None

    def __repr__(self) -> str:
        return f"RedisStream({redact_url(self.url)})"

    async def connect(self) -> None:
        if self._client is None:
            # No socket timeout: redis-py would arm a timer for every reply of a batch; the
            # batch's own deadline (confirm_timeout) bounds them all at once.
            self._client = redis.asyncio.Redis.from_url(
                self.url, retry=Retry(NoBackoff(), 0), socket_connect_timeout=10
            )
        try:
            async with asyncio.timeout(self.confirm_timeout):
                await self._client.ping()
        except (*_CONNECTION_ERRORS, redis.exceptions.RedisError) as exc:
            raise await self._unavailable(exc) from None

    async def publish(self, batch: Sequence[Envelope]) -> list[Delivery]:
        client = self._client
        if client is None:
            raise TargetUnavailable("not connected")
        routes = route_all(self.stream, batch)
        commands = [
            self._xadd(route, envelope)
            for envelope, route in zip(batch, routes, strict=True)
            if not isinstance(route, Delivery)
        ]
        replies = await self._send(client, commands) if commands else []
        answers = iter(replies)
        return [route if isinstance(route, Delivery) else next(answers) for route in routes]

    async def _send(self, client: redis.asyncio.Redis, commands: list[bytes]) -> list[Delivery]:
        """Write every command at once, then read one reply per command; a connection lost
        on the way leaves the rest UNCONFIRMED (or, when nothing at all is known, reports the
        target unavailable)."""
        pool = client.connection_pool
        try:
            conn: AbstractConnection = await pool.get_connection()  # type: ignore[no-untyped-call]
        except _CONNECTION_ERRORS as exc:
            raise await self._unavailable(exc) from None
        replies: list[Delivery] = []
        try:
            async with asyncio.timeout(self.confirm_timeout):
                await conn.send_packed_command(commands, check_health=False)
                for _ in commands:
                    replies.append(await _reply(conn))
            return replies
        except _CONNECTION_ERRORS as exc:
            await conn.disconnect(nowait=True)
            reason = (
                f"no reply within {self.confirm_timeout:g}s"
                if isinstance(exc, TimeoutError)
                else scrub(f"connection lost while publishing: {exc!r}", self.url)
            )
        finally:
            await pool.release(conn)
        if not replies:
            raise await self._unavailable(reason) from None
        await self.close()
        return replies + [Delivery(BrokerReply.UNCONFIRMED, reason)] * (
            len(commands) - len(replies)
        )

    async def _unavailable(self, why: BaseException | str) -> TargetUnavailable:
        """Drop the client (the next connect makes a new one) and say why Redis is out of reach."""
        await self.close()
        if isinstance(why, BaseException):
            why = scrub(f"{redact_url(self.url)}: {why!r}", self.url)
        return TargetUnavailable(why)

    def _xadd(self, stream: str, envelope: Envelope) -> bytes:
        fields = [
            b"body",
            envelope.body,
            b"message_id",
            envelope.message_id.encode(),
            b"headers",
            orjson.dumps(dict(envelope.headers)),
        ]
        if envelope.content_type:
            fields += (b"content_type", envelope.content_type.encode())
        if envelope.correlation_id:
            fields += (b"correlation_id", envelope.correlation_id.encode())
        return _command((b"XADD", stream.encode(), *self._trim, b"*", *fields))

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            await quietly(client.aclose())


def _command(args: Sequence[bytes]) -> bytes:
    """One command in RESP: an array of bulk strings."""
    out = [b"*%d\r\n" % len(args)]
    for arg in args:
        out += (b"$%d\r\n" % len(arg), arg, b"\r\n")
    return b"".join(out)


async def _reply(conn: AbstractConnection) -> Delivery:
    try:
        await conn.read_response(disable_decoding=True)
    except redis.exceptions.ResponseError as exc:
        return Delivery(BrokerReply.NACKED, f"refused by Redis: {exc}")
    return CONFIRMED
