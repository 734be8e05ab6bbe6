"""A registered handler and its per-queue delivery policy, validated at registration."""

from __future__ import annotations

import enum
import inspect
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from .breaker import Breaker
from .errors import ConfigurationError
from .message import Message
from .middleware import Middleware, check
from .outcome import Outcome
from .retry import ExponentialBackoff, RetryStrategy, check_seconds

HandlerFunc = Callable[[Message], Awaitable[Any]] | Callable[[Message], Any]
BatchHandlerFunc = Callable[[list[Message]], Awaitable[Any]] | Callable[[list[Message]], Any]
# on_failure(msg, exc, outcome): called after every failed run; may be async.
FailureHook = Callable[[Message, BaseException, Outcome], Awaitable[Any] | Any]

DEFAULT_RETRY = ExponentialBackoff(first=1.0, factor=2.0, cap=300.0, jitter=0.2, max_attempts=10)


class AckPolicy(enum.Enum):
    """What a handler's return and exceptions mean for its row."""

    ACK_ON_SUCCESS = "ack_on_success"  # return: delete; raise: retry per strategy
    REJECT_ON_ERROR = "reject_on_error"  # return: delete; raise: terminal `rejected`
    MANUAL = "manual"  # the handler calls msg.ack()/nack()/reject(); no decision: nack


@dataclass(frozen=True, kw_only=True)
class HandlerSpec:
    """One queue's handler and policy.

    `lease_ttl` is how long a row stays held by a worker that stopped answering. While its
    handler runs, the lease is renewed every `lease_ttl / 3` (the `heartbeat`), so a handler may
    run far longer than `lease_ttl`; without the heartbeat a `timeout` longer than `lease_ttl` is
    refused, since the row would be run again elsewhere while the first run goes on. A claimed
    row starts only while at least half its lease is left (the heartbeat then renews it in
    time); one that waited longer is handed back unrun. `timeout` defaults to 90% of
    `lease_ttl`. `max_deliveries` counts claims, including claims whose process died; a row
    claimed more often goes to the DLQ unrun. `on_failure(msg, exc, outcome)` is called after
    every failed run (for error trackers): one that raised, or a row nacked or rejected with an
    error; what the hook raises is logged and changes nothing.

    With `batch=N` the handler takes a list of up to N rows claimed together: what is waiting,
    and what arrives within `linger` seconds (so a trickle still makes batches, at the cost of
    that much latency). It decides each row with `ack()`, `nack()` or `reject()`; rows it left
    undecided get what its return or exception gives under the policy, as a single row would;
    a call that raised is a failed run of each of its rows, for `on_failure` too. Rows over
    `max_deliveries` are not passed in. `timeout` bounds the whole call; `concurrency` counts
    calls, and the claimed rows the queue may hold grow with the batch. `linger` must be
    shorter than half the lease: the first row of a batch waits that long at most.

    `middleware` is the chain the handler is called through, outermost first (`Farm.handler`
    puts the farm's before the queue's own): see `middleware`.

    `transactional=True`: the (async) handler is called as `handler(msg, conn)`, `conn` a
    connection inside a transaction in which the row is also deleted, lease-guarded, after the
    handler returns: the handler's writes and the row's completion commit together, or neither
    does (a raise, a nack or reject, a lost lease). Not for batch handlers, which settle rows
    one by one.

    `breaker=Breaker(...)`: hold the queue on every farm while its handler keeps failing (or
    raises `DownstreamDown`), probing with one row at a time, instead of spending the rows'
    attempts: see `breaker`.
    """

    queue: str
    func: HandlerFunc | BatchHandlerFunc
    concurrency: int = 32
    max_deliveries: int | None = 25
    retry: RetryStrategy = DEFAULT_RETRY
    ack: AckPolicy = AckPolicy.ACK_ON_SUCCESS
    lease_ttl: float = 60.0
    timeout: float | None = None
    prefetch: int | None = None
    heartbeat: bool = True
    on_failure: FailureHook | None = None
    batch: int | None = None
    linger: float = 0.005
    middleware: tuple[Middleware, ...] = ()
    transactional: bool = False
    breaker: Breaker | None = None

    def __post_init__(self) -> None:
        if not callable(self.func):
            raise ConfigurationError(f"handler for queue {self.queue!r} is not callable")
        if self.transactional and (self.batch is not None or not self.is_async):
            raise ConfigurationError(
                f"queue {self.queue!r}: a transactional handler must be an `async def "
                "handler(msg, conn)` for one row at a time (not a batch handler, not a plain "
                "function): its transaction completes exactly the row it was given"
            )
        for what in ("concurrency", "prefetch", "max_deliveries", "batch"):
            value = getattr(self, what)
            if value is None and what != "concurrency":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"{what} must be a whole number >= 1, got {value!r}")
        if not isinstance(self.retry, RetryStrategy):
            raise ConfigurationError(
                f"retry must have a next_delay(attempt, exc, elapsed) method, got {self.retry!r}"
            )
        if self.breaker is not None and not isinstance(self.breaker, Breaker):
            raise ConfigurationError(f"breaker must be a Breaker, got {self.breaker!r}")
        if not isinstance(self.ack, AckPolicy):
            raise ConfigurationError(f"ack must be an AckPolicy, got {self.ack!r}")
        check_seconds(self.lease_ttl, "lease_ttl", positive=True)
        check_seconds(self.timeout, "timeout", allow_none=True, positive=True)
        check_seconds(self.linger, "linger")
        if self.batch is not None and self.linger >= self.start_margin:
            raise ConfigurationError(
                f"queue {self.queue!r}: linger {self.linger:g}s must be shorter than half the "
                f"lease ({self.start_margin:g}s), or rows would wait out their lease unrun"
            )
        check(self.middleware, f"queue {self.queue!r}:")
        if self.on_failure is not None and not callable(self.on_failure):
            raise ConfigurationError(f"on_failure must be callable, got {self.on_failure!r}")
        if not self.heartbeat and self.effective_timeout > self.lease_ttl:
            raise ConfigurationError(
                f"queue {self.queue!r}: timeout {self.effective_timeout:g}s is longer than "
                f"lease_ttl {self.lease_ttl:g}s with heartbeat=False: the lease would expire "
                "while the handler still runs, and another worker would run the message again. "
                "Turn the heartbeat on, raise lease_ttl, or shorten the timeout"
            )

    @property
    def is_async(self) -> bool:
        func = self.func
        return inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(
            getattr(func, "__call__", None)  # noqa: B004 - async callable objects
        )

    @property
    def effective_timeout(self) -> float:
        return self.timeout if self.timeout is not None else self.lease_ttl * 0.9

    @property
    def heartbeat_interval(self) -> float:
        return self.lease_ttl / 3

    @property
    def start_margin(self) -> float:
        """Lease left that a claimed row needs to be started: enough for the next beat."""
        return self.lease_ttl / 2

    @property
    def capacity(self) -> int:
        """Rows this queue may hold claimed at once: those its executors run (a batch each for
        a batch handler) plus a prefetch buffer, by default as large."""
        running = self.concurrency * (self.batch or 1)
        return running + (self.prefetch if self.prefetch is not None else running)
