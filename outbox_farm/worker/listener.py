"""LISTEN on the farm's channel and wake the fetcher of the queue named in each NOTIFY.

A dedicated autocommit connection (LISTEN cannot share a pooled one). It is health-checked
between waits and reconnected with jittered backoff; while it is down the fetchers still poll,
and after every (re)connect all fetchers are woken once, since NOTIFYs sent meanwhile are lost.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from ..backoff import Backoff
from ..db.listen import listen
from ..errors import DatabaseError
from .supervised import Policy, Supervisor

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

    def start(self, supervisor: Supervisor) -> None:
        """Restarted for ever if it fails: fetchers poll meanwhile (see `supervised`)."""
        self._task = supervisor.spawn("listener", self._run, Policy.RESTART)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    @property
    def alive(self) -> bool:
        """Its loop runs (connected or reconnecting): started, and not closed."""
        return self._task is not None and not self._task.done()

    async def _run(self) -> None:
        backoff = Backoff(first=0.1, cap=10.0)
        warned = False
        while True:
            try:
                async with listen(self.dsn, self.channel) as session:
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
                        await session.relay(self.on_notify, self.health_interval)
            except BaseException as exc:
                self.connected.clear()
                if not isinstance(exc, DatabaseError):
                    raise  # a stop, or a bug: the supervisor's
                delay = backoff.next()
                if not warned:
                    log.warning(
                        "LISTEN %s failed (%s); falling back to polling, reconnecting in the "
                        "background",
                        self.channel,
                        exc,
                        extra={"event": "listen_failed", "channel": self.channel},
                    )
                    warned = True
                await asyncio.sleep(delay)
