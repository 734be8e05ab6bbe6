"""One process's runtime: listener, fetchers, executors and completer over one pool.

Database connections do not grow with concurrency: one pool of at most (queues + 2)
connections serves the claims, the completer and the vacuum loop, plus one LISTEN connection.
A runtime that also refreshes the gauges (one per farm) gets one more, so a long VACUUM never
makes a claim or a flush wait for a connection.
"""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import orjson
import psycopg
from psycopg.types.json import set_json_loads
from psycopg_pool import AsyncConnectionPool

from . import gauges, retention, vacuum
from .completer import Completer
from .dsn import probe, redact
from .errors import ConfigurationError
from .executor import Executors
from .fetcher import Fetcher
from .heartbeat import Heartbeat
from .inflight import Ledger
from .leases import check_worker_id
from .listener import Listener
from .message import Message
from .problems import Problems

if TYPE_CHECKING:
    from .farm import Farm

log = logging.getLogger("outbox_farm.runtime")


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _configure(conn: psycopg.AsyncConnection[Any]) -> None:
    set_json_loads(orjson.loads, conn)


class Runtime:
    """Runs a farm's handlers on the current event loop.

    Options: `queues` (a subset of the farm's queues), `poll_interval` (seconds between polls
    when idle; NOTIFY and known due times wake sooner), `flush_interval` / `flush_size` (the
    completer's batch limits), `graceful_timeout` (how long `stop()` lets handlers finish),
    `listen` (False: poll only), `gauges_interval` (refresh the database-derived gauges every
    so many seconds; one process of a farm does it), `vacuum_interval` (check every so many
    seconds whether the outbox table needs a VACUUM and run it; 0 or None: leave it to
    autovacuum; see `vacuum`), `dlq_retention` (delete DLQ rows older than so many seconds,
    once a minute, one process of a farm; see `retention`), `worker_id` (0 to 2**31-1,
    carried in every lease token this runtime takes, so that a supervisor can free a dead
    worker's rows with `leases.release_worker`).
    """

    def __init__(
        self,
        farm: Farm,
        dsn: str,
        *,
        queues: list[str] | None = None,
        poll_interval: float = 0.5,
        flush_interval: float = 0.01,
        flush_size: int = 1000,
        graceful_timeout: float = 30.0,
        listen: bool = True,
        gauges_interval: float | None = None,
        vacuum_interval: float | None = 10.0,
        dlq_retention: float | None = None,
        worker_id: int | None = None,
    ) -> None:
        if not farm.handlers:
            raise ConfigurationError("the farm has no handlers: register one with @farm.handler")
        unknown = sorted(set(queues or ()) - set(farm.handlers))
        if unknown:
            raise ConfigurationError(f"no handler registered for queues {unknown}")
        self.farm = farm
        self.dsn = dsn
        self.specs = [farm.handlers[q] for q in (queues or farm.handlers)]
        self.poll_interval = poll_interval
        self.flush_interval = flush_interval
        self.flush_size = flush_size
        self.graceful_timeout = graceful_timeout
        self.listen = listen
        self.gauges_interval = gauges_interval
        self.vacuum_interval = vacuum_interval
        self.dlq_retention = dlq_retention if self.farm.names.dlq is not None else None
        self.worker_id = None if worker_id is None else check_worker_id(worker_id)
        self.fetchers: dict[str, Fetcher] = {}
        self.executors: dict[str, Executors] = {}
        self.completer: Completer | None = None
        self.ledgers: dict[str, Ledger] = {}
        self.heartbeats: list[Heartbeat] = []
        self.problems = Problems()
        self.listener: Listener | None = None
        self.pool: AsyncConnectionPool[Any] | None = None
        self._stack = AsyncExitStack()
        self._stopped = asyncio.Event()
        self._deadline = 0.0

    async def start(self) -> None:
        await probe(self.dsn)
        stack = self._stack
        chores = bool(self.gauges_interval) + bool(self.vacuum_interval) + bool(self.dlq_retention)
        # Closed last: everything below writes through it. No check on checkout (it would cost a
        # round trip per statement): every user of the pool retries on a broken connection,
        # and the pool discards connections that come back broken.
        self.pool = AsyncConnectionPool(
            self.dsn,
            min_size=1,
            max_size=len(self.specs) + 1 + max(chores, 1),
            kwargs={"autocommit": True},
            configure=_configure,
            open=False,
            name="outbox-farm",
        )
        await self.pool.open(wait=True, timeout=30)
        stack.push_async_callback(self.pool.close)

        if self.farm.names.dlq is None:
            log.warning(
                "this farm has no DLQ (dlq_table=None): messages that fail for good will be "
                "deleted, with nothing kept of them",
                extra={"event": "no_dlq"},
            )
        if self.gauges_interval:
            queues = [s.queue for s in self.specs]
            task = asyncio.create_task(
                gauges.run(
                    self.pool, self.farm.queries, queues, self.gauges_interval, self.problems
                )
            )
            stack.push_async_callback(_cancel, task)
        if self.vacuum_interval:
            task = asyncio.create_task(
                vacuum.run(self.pool, self.farm.queries, self.vacuum_interval)
            )
            stack.push_async_callback(_cancel, task)
        if self.dlq_retention:
            task = asyncio.create_task(
                retention.run(self.pool, self.farm.queries, self.dlq_retention)
            )
            stack.push_async_callback(_cancel, task)

        self.completer = Completer(
            self.pool,
            self.farm.queries,
            flush_interval=self.flush_interval,
            flush_size=self.flush_size,
            on_retry=self._on_retry,
            ledgers=self.ledgers,
            problems=self.problems,
        )
        self.completer.start()
        # Stopped after the final flush: leases are extended until their outcomes are written.
        stack.push_async_callback(self._stop_heartbeats)
        # Closed after the executors: their last outcomes must reach the final flush.
        stack.push_async_callback(self._close_completer)

        for spec in self.specs:
            inbox: asyncio.Queue[Message | None] = asyncio.Queue()
            fetcher = Fetcher(
                spec,
                self.pool,
                self.farm.queries,
                inbox,
                poll_interval=self.poll_interval,
                worker_id=self.worker_id,
                problems=self.problems,
                on_starved=self.completer.flush_now,
            )
            self.ledgers[spec.queue] = fetcher.ledger
            executors = Executors(spec, inbox, fetcher, self.completer)
            self.fetchers[spec.queue], self.executors[spec.queue] = fetcher, executors
            executors.start()
            stack.push_async_callback(self._stop_executors, executors)
            if spec.heartbeat:
                heartbeat = Heartbeat(
                    spec, fetcher.ledger, self.pool, self.farm.queries, self.problems
                )
                self.heartbeats.append(heartbeat)
                heartbeat.start()

        if self.listen:
            self.listener = Listener(
                self.dsn, self.farm.names.channel, self._on_notify, self._wake_all
            )
            self.listener.start()
            stack.push_async_callback(self.listener.close)

        for fetcher in self.fetchers.values():
            fetcher.start()
        # Stopped first: no new claims once the stop began.
        stack.push_async_callback(self._stop_fetchers)
        log.info(
            "outbox_farm running queues %s on %s",
            ", ".join(s.queue for s in self.specs),
            redact(self.dsn),
            extra={"event": "started"},
        )

    async def stop(self, graceful_timeout: float | None = None) -> None:
        """Graceful stop, in this order: stop claiming; release rows not yet started and let
        running handlers finish until the deadline; final completer flush; close the listener
        and the pool. Safe to call twice."""
        if self._stopped.is_set():
            return
        timeout = self.graceful_timeout if graceful_timeout is None else graceful_timeout
        self._deadline = time.monotonic() + timeout
        try:
            await self._stack.aclose()
        finally:
            self._stopped.set()
            log.info("outbox_farm stopped", extra={"event": "stopped"})

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    @property
    def problem(self) -> str | None:
        """A one-line reason while a permanent database error (a missing privilege, table or
        column) keeps an operation of this runtime failing; None once it succeeds again."""
        return self.problems.current

    # -- wiring --------------------------------------------------------------------------

    def _on_notify(self, queue: str) -> None:
        fetcher = self.fetchers.get(queue)
        if fetcher is not None:
            fetcher.wake()

    def _wake_all(self) -> None:
        for fetcher in self.fetchers.values():
            fetcher.wake()

    def _on_retry(self, queue: str, delay: float) -> None:
        fetcher = self.fetchers.get(queue)
        if fetcher is not None:
            fetcher.note_due(delay)

    async def _stop_fetchers(self) -> None:
        await asyncio.gather(*(f.stop() for f in self.fetchers.values()))

    async def _stop_heartbeats(self) -> None:
        await asyncio.gather(*(h.stop() for h in self.heartbeats))

    async def _stop_executors(self, executors: Executors) -> None:
        await executors.stop(self._deadline)

    async def _close_completer(self) -> None:
        assert self.completer is not None
        await self.completer.close(timeout=max(self._deadline - time.monotonic(), 0) + 10.0)
