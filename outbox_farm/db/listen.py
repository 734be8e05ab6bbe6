"""The LISTEN session: a connection of its own that receives the farm's NOTIFYs."""

from __future__ import annotations

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
    """An open LISTEN session; see `listen()`. Used by one task."""

    def __init__(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self._conn = conn

    async def relay(self, on_notify: Callable[[str], None], timeout: float) -> None:
        """Call `on_notify` with each NOTIFY's payload as it arrives, for `timeout` seconds;
        then prove the session alive with a round trip. Raises `ConnectionLost` when it is
        not: the caller connects again (NOTIFYs sent meanwhile are lost)."""
        with boundary():
            async for note in self._conn.notifies(timeout=timeout):
                on_notify(note.payload)
            await self._conn.execute(load_blocks()["listen_check"])


@asynccontextmanager
async def listen(dsn: str, channel: str) -> AsyncIterator[Listening]:
    """Connect to `dsn` (autocommit) and LISTEN on `channel` for the duration of the block."""
    with boundary():
        async with await psycopg.AsyncConnection.connect(dsn, autocommit=True) as conn:
            await conn.execute(_listen_statement(channel))
            yield Listening(conn)
