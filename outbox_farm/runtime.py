"""One process's runtime: listener, fetchers, executors and completer over one pool.

Database connections do not grow with concurrency: one pool of at most (queues + 2)
connections serves the claims, the completer and the vacuum loop, plus one LISTEN connection.
A runtime that also refreshes the gauges (one per farm) gets one more, so a long VACUUM never
makes a claim or a flush wait for a connection. Transactional handlers are the exception, by
their nature: each one running holds a connection for its transaction, from a second pool of
(the sum of those queues' `concurrency`) connections.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Sequence
from contextlib import AsyncExitStack
from functools import partial

from . import gauges, observe, retention, vacuum
from .completer import Completer
from .db import transactions
from .db.pool import Pool, open_pool, probe
from .dsn import redact
from .errors import ConfigurationError
from .executor import Complete, Executors
from .fetcher import Fetcher
from .handler import HandlerSpec
from .heartbeat import Heartbeat
from .inflight import Ledger
from .listener import Listener
from .message import Message
from .observe import Observer
from .problems import Problems
from .queries import Queries
from .relay.runner import Relay
from .settings import RuntimeSettings

log = logging.getLogger("outbox_farm.runtime")


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class Runtime:
    """Runs handlers on the current event loop: `specs` (one per queue), over the tables of
    `queries`, against `dsn`, as `settings` say (see `RuntimeSettings`). What happens is
    reported to the metrics and log observers, and to the user's `observers` after them."""

    def __init__(
        self,
        specs: Sequence[HandlerSpec],
        queries: Queries,
        dsn: str,
        settings: RuntimeSettings | None = None,
        observers: Iterable[Observer] = (),
    ) -> None:
        settings = settings or RuntimeSettings()
        if not specs:
            raise ConfigurationError("the farm has no handlers: register one with @farm.handler")
        by_queue = {spec.queue: spec for spec in specs}
        unknown = sorted(set(settings.queues or ()) - set(by_queue))
        if unknown:
            raise ConfigurationError(f"no handler registered for queues {unknown}")
        self.queries = queries
        self.names = queries.names
        self.dsn = dsn
        self.settings = settings
        self.specs = [by_queue[q] for q in (settings.queues or by_queue)]
        # No DLQ: nothing to prune.
        self.dlq_retention = settings.dlq_retention if self.names.dlq is not None else None
        self.worker_id = settings.worker_id
        self.fetchers: dict[str, Fetcher] = {}
        self.executors: dict[str, Executors] = {}
        self.completer: Completer | None = None
        self.ledgers: dict[str, Ledger] = {}
        self.heartbeats: list[Heartbeat] = []
        self.relays: list[Relay] = []
        self.problems = Problems()
        self.observer = observe.observers(observers)
        self.listener: Listener | None = None
        self.pool: Pool | None = None
        self._stack = AsyncExitStack()
        self._stopped = asyncio.Event()
        self._deadline = 0.0

    async def start(self) -> None:
        await probe(self.dsn)
        stack = self._stack
        chores = (
            bool(self.settings.gauges_interval)
            + bool(self.settings.vacuum_interval)
            + bool(self.dlq_retention)
        )
        # Closed last: everything below writes through it.
        self.pool = await open_pool(self.dsn, max_size=len(self.specs) + 1 + max(chores, 1))
        stack.push_async_callback(self.pool.close)
        complete = await self._transactions_pool()

        if self.names.dlq is None:
            log.warning(
                "this farm has no DLQ (dlq_table=None): messages that fail for good will be "
                "deleted, with nothing kept of them",
                extra={"event": "no_dlq"},
            )
        if self.settings.gauges_interval:
            queues = [s.queue for s in self.specs]
            task = asyncio.create_task(
                gauges.run(
                    self.pool, self.queries, queues, self.settings.gauges_interval, self.problems
                )
            )
            stack.push_async_callback(_cancel, task)
        if self.settings.vacuum_interval:
            task = asyncio.create_task(
                vacuum.run(self.pool, self.queries, self.settings.vacuum_interval)
            )
            stack.push_async_callback(_cancel, task)
        if self.dlq_retention:
            task = asyncio.create_task(retention.run(self.pool, self.queries, self.dlq_retention))
            stack.push_async_callback(_cancel, task)

        self.completer = Completer(
            self.pool,
            self.queries,
            flush_interval=self.settings.flush_interval,
            flush_size=self.settings.flush_size,
            on_retry=self._on_retry,
            ledgers=self.ledgers,
            problems=self.problems,
            observer=self.observer,
        )
        self.completer.start()
        # Stopped after the final flush: leases are extended until their outcomes are written.
        stack.push_async_callback(self._stop_heartbeats)
        # Closed after the executors: their last outcomes must reach the final flush.
        stack.push_async_callback(self._close_completer)

        self.observer.serving([spec.queue for spec in self.specs])
        for spec in self.specs:
            inbox: asyncio.Queue[Message | None] = asyncio.Queue()
            fetcher = Fetcher(
                spec,
                self.pool,
                self.queries,
                inbox,
                self.observer,
                poll_interval=self.settings.poll_interval,
                worker_id=self.worker_id,
                problems=self.problems,
                on_starved=self.completer.flush_now,
            )
            self.ledgers[spec.queue] = fetcher.ledger
            executors = Executors(
                spec, inbox, fetcher, self.completer, self.observer, complete=complete
            )
            self.fetchers[spec.queue], self.executors[spec.queue] = fetcher, executors
            if isinstance(spec.func, Relay):  # its broker connection closes after the last batch
                self.relays.append(spec.func)
                stack.push_async_callback(spec.func.close)
            executors.start()
            stack.push_async_callback(self._stop_executors, executors)
            if spec.heartbeat:
                heartbeat = Heartbeat(spec, fetcher.ledger, self.pool, self.queries, self.problems)
                self.heartbeats.append(heartbeat)
                heartbeat.start()

        if self.settings.listen:
            self.listener = Listener(self.dsn, self.names.channel, self._on_notify, self._wake_all)
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

    async def _transactions_pool(self) -> Complete | None:
        """A pool of its own for transactional handlers, one connection per handler that may
        run at once, so their transactions never queue behind claims and outcome writes (nor
        hold those up); None when no queue is transactional."""
        size = sum(spec.concurrency for spec in self.specs if spec.transactional)
        if not size:
            return None
        pool = await open_pool(self.dsn, max_size=size)
        self._stack.push_async_callback(pool.close)
        return partial(transactions.run_completing, pool, self.queries)

    async def stop(self, graceful_timeout: float | None = None) -> None:
        """Graceful stop, in this order: stop claiming; release rows not yet started and let
        running handlers finish until the deadline; final completer flush; close the listener
        and the pool. Safe to call twice."""
        if self._stopped.is_set():
            return
        timeout = self.settings.graceful_timeout if graceful_timeout is None else graceful_timeout
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
        column) keeps an operation of this runtime failing, or a relay cannot reach its broker;
        None once that passes."""
        return self.problems.current or next((r.problem for r in self.relays if r.problem), None)

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
