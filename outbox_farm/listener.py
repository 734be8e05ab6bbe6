"""LISTEN on the farm's channel and wake the fetcher of the queue named in each NOTIFY.

A dedicated autocommit connection (LISTEN cannot share a pooled one). It is health-checked
between waits and reconnected with jittered backoff; while it is down the fetchers still poll,
and after every (re)connect all fetchers are woken once, since NOTIFYs sent meanwhile are lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import psycopg
from psycopg import sql

from .backoff import Backoff

log = logging.getLogger("outbox_farm.listener")


class Listener:
    def __init__(
        self,
        dsn: str,
        channel: str,
        on_notify: Callable[[str], None],
        on_connect: Callable[[], None],
        *,
        health_interval: float = 5.0,
    ) -> None:
        self.dsn = dsn
        self.channel = channel
        self.on_notify = on_notify
        self.on_connect = on_connect
        self.health_interval = health_interval
        self.connected = asyncio.Event()  # set while LISTEN is active; read by tests/health
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="outbox-farm-listener")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        backoff = Backoff(first=0.1, cap=10.0)
        warned = False
        while True:
            try:
                async with await psycopg.AsyncConnection.connect(self.dsn, autocommit=True) as conn:
                    await conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
                    self.connected.set()
                    backoff.reset()
                    if warned:
                        log.info(
                            "LISTEN %s is back; wake-ups are immediate again",
                            self.channel,
                            extra={"event": "listen_restored"},
                        )
                        warned = False
                    self.on_connect()
                    while True:
                        async for note in conn.notifies(timeout=self.health_interval):
                            self.on_notify(note.payload)
                        await conn.execute("SELECT 1")
            except (psycopg.Error, OSError) as exc:
                self.connected.clear()
                delay = backoff.next()
                if not warned:
                    log.warning(
                        "LISTEN %s failed (%s); falling back to polling, reconnecting in the "
                        "background",
                        self.channel,
                        str(exc).strip(),
                        extra={"event": "listen_failed", "channel": self.channel},
                    )
                    warned = True
                await asyncio.sleep(delay)
