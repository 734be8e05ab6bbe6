"""The LISTEN session: a connection of its own that receives the farm's NOTIFYs.

Between health checks the session is read by a reader callback on its socket, not by the
driver's `notifies()`: that generator arms a wait (a future, a timer, the reader added and
removed again) and builds a `Notify` for every notification, about 40 µs of the event loop's
time per NOTIFY, which at thousands of messages a second is a tenth of the farm's CPU per
message; and the fetcher a NOTIFY wakes ran only after that re-arming. The callback reads what
arrived (`consume_input`) and hands each payload on at once. The driver's own connection
machinery still runs every statement (the LISTEN, the health check), with the callback's
reader removed meanwhile; a NOTIFY it reads then reaches the same callback through its notify
handler.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from functools import cache
from typing import Any

import psycopg
from psycopg import sql

from ..queries import load_blocks
from .boundary import boundary


@cache
def _listen_statement(channel: str) -> str:
    return sql.SQL(load_blocks()["listen"]).format(channel=sql.Identifier(channel)).as_string(None)


class Listening:
    """An open LISTEN session; see `listen()`. Used by one task.

    A payload that arrives while no `relay` runs (read by the driver along with a statement's
    result) is kept for the next one, so none is dropped between two relays."""

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self._conn = conn
        self._encoding = conn.info.encoding
        self._on_notify: Callable[[str], None] | None = None
        self._kept: list[str] = []
        conn.add_notify_handler(self._handled)

    def _handled(self, note: psycopg.Notify) -> None:
        """The driver's notify handler: a NOTIFY it read with a statement's result."""
        if self._on_notify is None:
            self._kept.append(note.payload)
        else:
            self._on_notify(note.payload)

    async def relay(self, on_notify: Callable[[str], None], timeout: float) -> None:
        """Call `on_notify` with each NOTIFY's payload as it arrives, for `timeout` seconds;
        then prove the session alive with a round trip. Raises `ConnectionLost` when it is
        not, or as soon as the session's socket says so: the caller connects again (NOTIFYs
        sent meanwhile are lost). An error `on_notify` raises ends the relay with it."""
        self._on_notify = on_notify
        try:
            with boundary():
                kept, self._kept = self._kept, []
                for payload in kept:
                    on_notify(payload)
                async with self._conn.lock:
                    await self._read(on_notify, timeout)
                await self._conn.execute(load_blocks()["listen_check"])
        finally:
            self._on_notify = None

    async def _read(self, on_notify: Callable[[str], None], timeout: float) -> None:
        """Hand on each NOTIFY from the socket's reader callback for `timeout` seconds, or
        until reading fails (raised here). The callback runs once first: bytes the driver
        read along with the last statement's result but did not parse wait in its buffer,
        and the socket would not say readable for them."""
        pgconn, encoding = self._conn.pgconn, self._encoding
        loop = asyncio.get_running_loop()
        failed: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            try:
                pgconn.consume_input()
                while (note := pgconn.notifies()) is not None:
                    on_notify(note.extra.decode(encoding))
            except Exception as exc:  # the session or the callback: the relay's to raise
                loop.remove_reader(fd)
                if not failed.done():
                    failed.set_exception(exc)

        fd = pgconn.socket
        loop.add_reader(fd, readable)
        try:
            readable()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await failed
        finally:
            loop.remove_reader(fd)
            # Retrieved whatever ends the wait: a stop that came first leaves it unraised.
            error = failed.exception() if failed.done() and not failed.cancelled() else None
        if error is not None:
            raise error  # it came in the same round as the end of the wait


@asynccontextmanager
async def listen(dsn: str, channel: str) -> AsyncIterator[Listening]:
    """Connect to `dsn` (autocommit) and LISTEN on `channel` for the duration of the block."""
    with boundary():
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            session = Listening(conn)
            await conn.execute(_listen_statement(channel))
            yield session
