"""The Farm: one outbox table, its handlers, and the producer calls for it."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from .breaker import Breaker
from .errors import ConfigurationError
from .handler import DEFAULT_RETRY, AckPolicy, FailureHook, HandlerSpec
from .middleware import Middleware, check
from .names import TableNames
from .producer import Producer
from .queries import Queries
from .retry import RetryStrategy
from .settings import RuntimeSettings

if TYPE_CHECKING:
    from .observe import Observer
    from .relay.base import Target
    from .relay.runner import Relay
    from .storage import Store
    from .worker.runtime import Runtime

F = TypeVar("F", bound=Callable[..., Any])

# A relay's default batch. Measured with 50,000 rows and `--procs 2`, 2,000 beat 500 by 0%
# (RabbitMQ, bound by its client), 25% (NATS) and 25% (Redis); 4,000 beat 2,000 by 0%
# (RabbitMQ), 27% (NATS), 25% (Redis) and 31% (Kafka): each row's share of the claim, of the
# round trips and of the wait for the broker's confirms shrinks.
RELAY_BATCH = 4000


RELAY_BREAKER = Breaker(failures=5, probe_every=5.0)
"""A relay queue's breaker unless given: opened by its first batch that finds the broker out of
reach; probing as often as the relay's own hold connects anew at most (every 5 s)."""


class Farm:
    """Configuration shared by producers and workers.

    Producers only need the table names (`publish`, `apublish`, ...); workers also need the
    handlers registered with `@farm.handler(queue)`. The DSN is not part of the farm: it comes
    from the CLI or the environment, or is passed to `running()`.

    Messages that fail for good are kept in `dlq_table` (`outbox_dlq`, which `outbox-farm
    migrate` creates); `dlq_table=None` deletes them instead, and the runtime says so when it
    starts. `on_failure(msg, exc, outcome)` is called after every failed handler run of every
    queue whose handler has no hook of its own (for error trackers such as Sentry); it may be
    async, runs on the event loop after the outcome was decided, and cannot change it.
    `middleware` wraps the handler of every queue, outside each handler's own: see `middleware`.
    `tracing=True` adds OpenTelemetry spans and `traceparent` propagation (`observe.tracing`).
    """

    def __init__(
        self,
        table: str = "outbox",
        dlq_table: str | None = "outbox_dlq",
        *,
        notify: bool = True,
        on_failure: FailureHook | None = None,
        middleware: Sequence[Middleware] = (),
        tracing: bool = False,
    ) -> None:
        self.names = TableNames.build(table, dlq_table)
        self.queries = Queries(self.names)
        # The farm has a producer rather than being one: the producer knows nothing of handlers,
        # and an application that only publishes can use `Producer` alone. Its calls are the
        # farm's own, so that `farm.publish(conn, body, queue=...)` reads as it should.
        self.producer = producer = Producer(self.queries, notify=notify, trace=tracing)
        self.publish = producer.publish
        self.apublish = producer.apublish
        self.publish_batch = producer.publish_batch
        self.apublish_batch = producer.apublish_batch
        self.cancel_timer = producer.cancel_timer
        self.acancel_timer = producer.acancel_timer
        if on_failure is not None and not callable(on_failure):
            raise ConfigurationError(f"on_failure must be callable, got {on_failure!r}")
        self.on_failure = on_failure
        self.middleware = check(middleware, "the farm's")
        # Observers every runtime of this farm reports to, besides metrics and logs.
        self.observers: list[Observer] = []
        if tracing:
            from .observe.tracing import Tracing

            tracer = Tracing(dlq=self.names.dlq is not None)
            self.middleware = (tracer, *self.middleware)  # outermost: its span covers the rest
            self.observers.append(tracer)
        self.handlers: dict[str, HandlerSpec] = {}

    def handler(
        self,
        queue: str,
        *,
        concurrency: int = 32,
        max_deliveries: int | None = 25,
        retry: RetryStrategy = DEFAULT_RETRY,
        ack: AckPolicy | str = AckPolicy.ACK_ON_SUCCESS,
        lease_ttl: float = 60.0,
        timeout: float | None = None,
        prefetch: int | None = None,
        heartbeat: bool = True,
        on_failure: FailureHook | None = None,
        batch: int | None = None,
        linger: float = 0.005,
        middleware: Sequence[Middleware] = (),
        transactional: bool = False,
        breaker: Breaker | None = None,
    ) -> Callable[[F], F]:
        """Register the decorated function (async or plain) as the handler of `queue`.

        See `HandlerSpec` for the options; `on_failure` replaces the farm's hook for this queue.
        `batch=N` makes it a batch handler, called with a list of up to N messages: an option
        rather than a decorator of its own, since every other option means the same for both.
        `transactional=True` passes `(msg, conn)` and completes the row in that transaction.
        """
        if not isinstance(queue, str) or not queue or len(queue) > 255:
            raise ConfigurationError(f"queue must be a non-empty string of <= 255 chars: {queue!r}")
        if queue in self.handlers:
            raise ConfigurationError(f"queue {queue!r} already has a handler")
        try:
            policy = AckPolicy(ack)
        except ValueError:
            choices = ", ".join(p.value for p in AckPolicy)
            raise ConfigurationError(f"ack must be one of {choices}; got {ack!r}") from None

        chain = (*self.middleware, *check(middleware, f"queue {queue!r}:"))

        def register(func: F) -> F:
            self.handlers[queue] = HandlerSpec(
                queue=queue,
                func=func,
                concurrency=concurrency,
                max_deliveries=max_deliveries,
                retry=retry,
                ack=policy,
                lease_ttl=lease_ttl,
                timeout=timeout,
                prefetch=prefetch,
                heartbeat=heartbeat,
                on_failure=on_failure if on_failure is not None else self.on_failure,
                batch=batch,
                linger=linger,
                middleware=chain,
                breaker=breaker,
                transactional=transactional,
            )
            return func

        return register

    def relay(
        self,
        queue: str,
        *,
        to: Target,
        batch: int = RELAY_BATCH,
        concurrency: int = 1,
        max_deliveries: int | None = None,
        retry: RetryStrategy = DEFAULT_RETRY,
        lease_ttl: float = 60.0,
        prefetch: int | None = None,
        linger: float = 0.005,
        on_failure: FailureHook | None = None,
        breaker: Breaker | None = RELAY_BREAKER,
    ) -> Relay:
        """Relay the rows of `queue` to a broker: `to` is a target (`RabbitMQ`, `NatsJetStream`,
        `RedisStream` from `outbox_farm.relay`, or your own `relay.Target`).

        Up to `batch` claimed rows are published together (4,000 by default: fewer claims
        and round trips per row; lower it for large bodies, since a process holds up to twice
        that many rows) and each is acked only once the broker confirmed it; a refusal is a
        failed run of that row (its `retry` strategy, then the DLQ with what the broker said).
        While the broker cannot be reached, or answers nothing (a restarted broker that forgot
        the producer), the relay holds its rows (leased, renewed), connects anew and sends them
        again; nothing is acked and nothing dead-lettered for it. `concurrency=1` publishes
        one batch at a time, in claim order; more batches in flight are faster and give up that
        order. No
        `max_deliveries` by default: an outage's re-claims (a restarted process) must not
        dead-letter rows the broker never refused.

        The hold is the queue's breaker (`Breaker`, see `breaker`): the first batch that finds
        the broker unreachable, or unanswering, opens it, so every process of every host stops
        claiming the queue beyond one probe row per `probe_every`, instead of each claiming
        batches to hold; the first confirm after the outage closes it. `breaker=None` keeps the
        hold within each batch.
        """
        from .relay.base import Target
        from .relay.runner import RELAY_TIMEOUT, Relay

        if not isinstance(to, Target):
            raise ConfigurationError(
                f"relay {queue!r}: to= must be a relay target (connect, publish, close, label), "
                f"got {to!r}"
            )
        runner = Relay(to, str(self.names.outbox))
        self.handler(
            queue,
            concurrency=concurrency,
            max_deliveries=max_deliveries,
            retry=retry,
            lease_ttl=lease_ttl,
            timeout=RELAY_TIMEOUT,
            prefetch=prefetch,
            on_failure=on_failure,
            batch=batch,
            linger=linger,
            breaker=breaker,
        )(runner)
        return runner

    @asynccontextmanager
    async def running(
        self,
        dsn: str | None = None,
        settings: RuntimeSettings | None = None,
        *,
        observers: Iterable[Observer] = (),
        store: Store | None = None,
        **options: Any,
    ) -> AsyncIterator[Runtime]:
        """Run every handler of this farm in the current event loop until the block exits.

        For embedding in an asyncio application (a web app's lifespan). Leaving the block is a
        graceful stop. `settings`, or its fields given one by one as keywords (`poll_interval=`,
        `queues=`, ...): see `RuntimeSettings`. `observers`: `outbox_farm.Observer`s told of
        every claim, handler run, verdict and write, after the metrics and logs.

        `store`: run over it instead of the database at `dsn` (the test kit's `MemoryStore`):
        the data path only, with no pools, chores or listener.
        """
        from .ops.readiness import refuse_older_schema
        from .worker.runtime import Runtime

        if store is None:
            if not dsn:
                raise ConfigurationError("Farm.running needs a dsn (or a store to run over)")
            await asyncio.to_thread(refuse_older_schema, dsn, self.queries.names)
        if options:
            settings = dataclasses.replace(settings or RuntimeSettings(), **options)
        runtime = Runtime(
            list(self.handlers.values()),
            self.queries,
            dsn or "",
            settings,
            [*self.observers, *observers],
            store=store,
        )
        await runtime.start()
        try:
            yield runtime
        finally:
            await runtime.stop()
