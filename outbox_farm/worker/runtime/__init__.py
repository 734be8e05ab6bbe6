"""One process's runtime: listener, fetchers, executors and completer over one pool.

Database connections do not grow with concurrency: one pool of at most (queues + 2)
connections serves the claims, the completer and the vacuum loop, plus one LISTEN connection.
A runtime that also refreshes the gauges (one per farm) gets one more, so a long VACUUM never
makes a claim or a flush wait for a connection. Transactional handlers are the exception, by
their nature: each one running holds a connection for its transaction, from a second pool of
(the sum of those queues' `concurrency`) connections.

The data path (fetchers, executors, completer, heartbeats) speaks only the storage port
(`outbox_farm.storage`): given a store of its own (an in-memory one, say), the runtime runs
that path over it, with no pool, listener or chores.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from functools import partial

from ... import observe
from ...chores import gauges, retention, vacuum
from ...chores.farm_code import CodeWatch
from ...db import transactions
from ...db.pool import Pool, open_pool, probe
from ...db.store import PostgresStore
from ...dsn import redact
from ...errors import ConfigurationError
from ...handler import HandlerSpec
from ...message import Message
from ...observe import Observer
from ...problems import Problems
from ...queries import Queries
from ...relay.runner import Relay
from ...settings import RuntimeSettings
from ...storage import Notifier, QueueControl, Store, is_control
from ..breaker import QueueBreaker
from ..breaker import describe as describe_tripped
from ..completer import Completer
from ..control import ControlWatch, describe
from ..executor import Executors
from ..fetcher import Fetcher
from ..heartbeat import Heartbeat
from ..inbox import Inbox
from ..listener import Listener
from ..supervised import Policy, Supervisor
from ..transactional import Complete
from .stop_steps import CANCEL_GRACE, cancel, step

log = logging.getLogger("outbox_farm.runtime")
RELAY_CLOSE = 1.0  # seconds the relays get to close their broker connections past the deadline
FLUSH_OVERTIME = 3.0  # seconds the final flush may run past the deadline while the database answers
# The longest a graceful stop runs past its deadline, its overruns one after the other: the
# drain (2 grace periods), the relays (RELAY_CLOSE and a grace), the final flush, the loops (2)
# and the pools (3).
PAST_DEADLINE = RELAY_CLOSE + FLUSH_OVERTIME + 8 * CANCEL_GRACE


class Runtime:
    """Runs handlers on the current event loop: `specs` (one per queue), over the tables of
    `queries`, against `dsn`, as `settings` say (see `RuntimeSettings`). What happens is
    reported to the metrics and log observers, and to the user's `observers` after them.

    `code_note` says, when asked, what is wrong with the code this process runs (its arbiter's
    last reload failed), for the report of its code (see `chores.farm_code`).

    `store`: the rows are claimed from and written to it rather than through a pool opened on
    `dsn`; then no listener, chore or code report runs (a `storage.Notifier` store wakes the
    fetchers instead of NOTIFY), and a transactional handler, which needs Postgres
    transactions, is refused.

    Every long-running task runs under `supervisor` (see `outbox_farm.worker.supervised`). When one
    of them keeps failing the runtime is broken: `fatal` is set and `fatal_reason` says why;
    whoever runs the runtime then stops it (a worker process exits non-zero so the arbiter
    replaces it).
    """

    def __init__(
        self,
        specs: Sequence[HandlerSpec],
        queries: Queries,
        dsn: str,
        settings: RuntimeSettings | None = None,
        observers: Iterable[Observer] = (),
        code_note: Callable[[], str | None] = lambda: None,
        store: Store | None = None,
    ) -> None:
        settings = settings or RuntimeSettings()
        if not specs:
            raise ConfigurationError("the farm has no handlers: register one with @farm.handler")
        by_queue = {spec.queue: spec for spec in specs}
        unknown = sorted(set(settings.queues or ()) - set(by_queue))
        if unknown:
            raise ConfigurationError(f"no handler registered for queues {unknown}")
        transactional = sorted(s.queue for s in specs if s.transactional)
        if store is not None and transactional:
            raise ConfigurationError(
                f"queues {transactional} have transactional handlers, which run in a Postgres "
                "transaction: they cannot run over a store other than Postgres"
            )
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
        self.controls: ControlWatch | None = None  # from `start` on
        self.store = store
        self.heartbeats: list[Heartbeat] = []
        self.relays: list[Relay] = []
        self.problems = Problems()
        self.code_watch: CodeWatch | None = None  # from `start` on
        self._code_note = code_note
        self.observer = observe.observers(observers)
        self.listener: Listener | None = None
        self.pool: Pool | None = None
        self.fatal = asyncio.Event()  # set once a component failed too often (see supervised)
        self.fatal_reason: str | None = None
        self.supervisor = Supervisor(self._broken)
        self._pools: list[Pool] = []  # closed last, all of them
        self._chores: list[asyncio.Task[None]] = []
        self._code_task: asyncio.Task[None] | None = None  # the code watch's loop
        self._unsubscribe: Callable[[], None] | None = None  # from a Notifier store
        self._stopping = False

    async def start(self) -> None:
        """Open the pools and start every component; the stop undoes whatever of this ran
        (see `stop`), so a start that failed midway is cleaned up by `stop` too."""
        complete: Complete | None = None
        if self.store is None:
            self.store, complete = await self._open()
        store = self.store
        if not store.has_dlq:
            log.warning(
                "this farm has no DLQ (dlq_table=None): messages that fail for good will be "
                "deleted, with nothing kept of them",
                extra={"event": "no_dlq"},
            )
        completer = self.completer = Completer(
            store,
            flush_interval=self.settings.flush_interval,
            flush_size=self.settings.flush_size,
            problems=self.problems,
            observer=self.observer,
        )
        for spec in self.specs:
            inbox: Inbox[Message | None] = Inbox()
            fetcher = Fetcher(
                spec,
                store,
                inbox,
                self.observer,
                completer,
                poll_interval=self.settings.poll_interval,
                worker_id=self.worker_id,
                problems=self.problems,
            )
            self.fetchers[spec.queue] = fetcher
            executors = self.executors[spec.queue] = Executors(
                spec, inbox, fetcher.ledger, completer, self.observer, complete=complete
            )
            breaker = None
            if spec.breaker is not None:
                breaker = QueueBreaker(spec.queue, spec.breaker, store)
                fetcher.breaker = executors.breaker = breaker
                breaker.wake = fetcher.wake
            if isinstance(spec.func, Relay):
                spec.func.observer = self.observer
                spec.func.trip = breaker.trip if breaker is not None else None
                self.relays.append(spec.func)
            if spec.heartbeat:
                self.heartbeats.append(Heartbeat(spec, fetcher.ledger, store, self.problems))
        completer.connect(self.fetchers)
        self.controls = ControlWatch(store, self.fetchers)
        await self.controls.load()  # before any claim: a queue paused now is never claimed

        completer.start(self.supervisor)
        self.observer.serving([spec.queue for spec in self.specs])
        for executors in self.executors.values():
            executors.start(self.supervisor)
        for heartbeat in self.heartbeats:
            heartbeat.start(self.supervisor)
        if self.pool is not None and self.settings.listen:
            self.listener = Listener(self.dsn, self.names.channel, self._on_notify, self._wake_all)
            self.listener.start(self.supervisor)
        if isinstance(store, Notifier):
            self._unsubscribe = store.subscribe(self._on_notify)
        self.controls.start(self.supervisor)
        for fetcher in self.fetchers.values():
            fetcher.start(self.supervisor)
        log.info(
            "outbox_farm running queues %s on %s",
            ", ".join(s.queue for s in self.specs),
            redact(self.dsn) if self.pool is not None else type(store).__name__,
            extra={"event": "started"},
        )

    async def _open(self) -> tuple[PostgresStore, Complete | None]:
        """The pools on `dsn`, the store over them, the chores: what a runtime given no store
        of its own runs on; and how its transactional handlers complete, if it has any."""
        await probe(self.dsn)
        chores = (
            bool(self.settings.gauges_interval)
            + bool(self.settings.vacuum_interval)
            + bool(self.dlq_retention)
        )
        self.pool = await open_pool(
            self.dsn, max_size=len(self.specs) + 1 + max(chores, 1), farm=True
        )
        self._pools.append(self.pool)
        complete = await self._transactions_pool()
        self._start_chores(self.pool)
        return PostgresStore(self.pool, self.queries), complete

    def _start_chores(self, pool: Pool) -> None:
        """The housekeeping loops; restarted for ever if they fail (see `supervised`)."""
        spawn = self.supervisor.spawn
        # Every process reports its code; the housekeeper also compares (`farm_code`).
        compare = bool(self.settings.gauges_interval)
        self.code_watch = CodeWatch(
            pool, self.queries, self.specs, compare=compare, note=self._code_note
        )
        self._code_task = spawn("code report", self.code_watch.run, Policy.RESTART)
        if self.settings.gauges_interval:
            queues = [s.queue for s in self.specs]
            run = partial(
                gauges.run, pool, self.queries, queues, self.settings.gauges_interval, self.problems
            )
            self._chores.append(spawn("gauges", run, Policy.RESTART))
        if self.settings.vacuum_interval:
            run = partial(vacuum.run, pool, self.queries, self.settings.vacuum_interval)
            self._chores.append(spawn("vacuum", run, Policy.RESTART))
        if self.dlq_retention:
            run = partial(retention.run, pool, self.queries, self.dlq_retention)
            self._chores.append(spawn("DLQ retention", run, Policy.RESTART))

    async def _transactions_pool(self) -> Complete | None:
        """A pool of its own for transactional handlers, one connection per handler that may
        run at once, so their transactions never queue behind claims and outcome writes (nor
        hold those up); None when no queue is transactional."""
        size = sum(spec.concurrency for spec in self.specs if spec.transactional)
        if not size:
            return None
        pool = await open_pool(self.dsn, max_size=size)
        self._pools.append(pool)
        return partial(transactions.run_completing, pool, self.queries)

    async def stop(self, graceful_timeout: float | None = None) -> None:
        """Graceful stop, written once, in this order:

        1. no handler starts any more, in any queue, and no fetcher claims again (a claim
           already sent may finish until the deadline, so its rows are known);
        2. every queue at once: rows not yet started are released (their leases cleared, so
           another process takes them at once), running handlers finish until the deadline;
        3. relays close their broker connections (no batch runs any more);
        4. the completer's final flush, until the deadline, and past it only while the
           database answers (see `Completer.close`);
        5. lease heartbeats stop: they extended the running rows' leases until their
           outcomes were written;
        6. the listener and the chores (gauges, vacuum, retention; the report of this process's
           code is withdrawn);
        7. the pools: everything above wrote through them.

        Nothing here waits on the database for long past the deadline: a step still running
        when its time is up (a claim, a write or a connection attempt that an unreachable
        database never answers) is cancelled, and left behind if it does not end within
        `CANCEL_GRACE`; what it would have written comes back when its rows' leases expire.
        `PAST_DEADLINE` bounds the whole overrun. A step that fails is logged and the next
        one still runs. Safe to call twice (the second call returns at once), and after a
        start that failed midway.
        """
        if self._stopping:
            return
        self._stopping = True
        timeout = self.settings.graceful_timeout if graceful_timeout is None else graceful_timeout
        deadline = time.monotonic() + timeout
        for executors in self.executors.values():
            executors.close()
        await step("stop claiming", deadline, *(f.stop() for f in self.fetchers.values()))
        # The executors cancel their handlers at the deadline themselves; this bounds how long
        # a cancelled handler may take to end.
        drained = deadline + CANCEL_GRACE
        await step("drain", drained, *(e.stop(deadline) for e in self.executors.values()))
        relays_by = max(deadline, time.monotonic()) + RELAY_CLOSE
        await step("close relays", relays_by, *(relay.close() for relay in self.relays))
        if self.completer is not None:
            flush = self.completer.close(deadline, overtime=FLUSH_OVERTIME)
            await step("final flush", None, flush)
        # Cancelled, these loops end at once, unless a statement or connection attempt of
        # theirs waits on a database that does not answer: the second cancellation ends that.
        if self._unsubscribe is not None:
            self._unsubscribe()
        loops: list[Awaitable[None]] = [h.stop() for h in self.heartbeats]
        loops += [self.controls.close()] if self.controls is not None else []
        if self.listener is not None:
            loops.append(self.listener.close())
        loops += [cancel(task) for task in self._chores]
        if self.code_watch is not None and self._code_task is not None:
            loops.append(self.code_watch.forget(self._code_task))
        await step("stop loops", time.monotonic() + CANCEL_GRACE, *loops)
        # A pool's close waits for its connection attempts no longer than its timeout.
        closes = (pool.close(timeout=CANCEL_GRACE) for pool in self._pools)
        await step("close pools", time.monotonic() + 2 * CANCEL_GRACE, *closes)
        self.observer.stopped()
        log.info("outbox_farm stopped", extra={"event": "stopped"})

    @property
    def problem(self) -> str | None:
        """A one-line reason while something keeps this runtime from working as it should, the
        gravest first: it is broken (`fatal_reason`); a component failed and is restarting; a
        permanent database error (a missing privilege, table or column) keeps an operation
        failing (a queue's claims among them: its stall is that error); a queue is stalled; a
        relay cannot reach its broker. None once all that passes."""
        if self.fatal_reason is not None:
            return f"worker broken: {self.fatal_reason}"
        return (
            self.supervisor.problem
            or self.problems.current
            or next((f.stall.reason for f in self.fetchers.values() if f.stall.reason), None)
            or next((r.problem for r in self.relays if r.problem), None)
        )

    @property
    def paused(self) -> dict[str, QueueControl]:
        """The queues of this runtime an operator has paused, as it last read them."""
        return dict(self.controls.paused) if self.controls is not None else {}

    @property
    def warnings(self) -> list[str]:
        """What degrades the farm without stopping it, one line each: farms on the database
        that run different code for a queue (see `chores.farm_code`); paused queues; queues
        whose breaker is open."""
        code = self.code_watch.warnings if self.code_watch is not None else []
        tripped = [
            describe_tripped(queue, fetcher.breaker.tripped)
            for queue, fetcher in self.fetchers.items()
            if fetcher.breaker is not None and fetcher.breaker.tripped is not None
        ]
        return code + [describe(control) for control in self.paused.values()] + tripped

    def _broken(self, reason: str) -> None:
        """A component failed too often (the supervisor's verdict): the runtime is broken."""
        if self.fatal_reason is None:
            self.fatal_reason = reason
        self.fatal.set()

    # -- wiring --------------------------------------------------------------------------

    def _on_notify(self, queue: str) -> None:
        fetcher = self.fetchers.get(queue)
        if fetcher is not None:
            fetcher.wake()
        elif is_control(queue) and self.controls is not None:
            self.controls.changed()

    def _wake_all(self) -> None:
        if self.controls is not None:
            self.controls.changed()
        for fetcher in self.fetchers.values():
            fetcher.wake()
