"""Executors: `concurrency` tasks per queue that run the handler and decide each row's fate.

The decision (ack, retry after a delay, terminal with a reason) is made here and handed to the
completer; nothing in this module writes to the database. A handler's exception is kept for
the retry strategy and, cut to 8 KiB, for the DLQ.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import math
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

from .completer import Completer
from .errors import DeadLetter, Retry
from .fetcher import Fetcher
from .handler import AckPolicy, HandlerSpec
from .message import Decision, Message
from .metrics import metrics
from .outcome import Kind, Outcome, Reason, describe_exception

log = logging.getLogger("outbox_farm.executor")


class HandlerTimeout(TimeoutError):
    """The handler ran past its per-message timeout and was abandoned."""


class NoDecision(RuntimeError):
    """A manual-ack handler returned without calling ack(), nack() or reject()."""


def _utc(epoch: float) -> datetime:
    return datetime.fromtimestamp(epoch, UTC)


def _valid_delay(value: object, msg: Message) -> float | None:
    """A handler's Retry(delay): seconds >= 0, or None (use the strategy) with a warning."""
    if value is None:
        return None
    try:
        delay = float(value.total_seconds() if isinstance(value, timedelta) else value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        delay = math.nan
    if math.isfinite(delay) and delay >= 0:
        return delay
    log.warning(
        "Retry(delay=%r) from the handler of queue %s is not seconds >= 0; using the "
        "retry strategy instead (row %s)",
        value,
        msg.queue,
        msg.id,
        extra={"event": "bad_retry_delay", "row_id": msg.id, "queue": msg.queue},
    )
    return None


async def _in_thread(func: Callable[[Message], Any], msg: Message) -> Any:
    """Run a sync handler in a thread of its own.

    Not a shared pool: a hung handler that timed out keeps its thread, and in a pool it would
    hold a slot that later messages then wait for (and time out in, without ever running). The
    executor tasks already bound how many run at once; an abandoned thread holds no slot.

    The handler's exception travels as a value and is raised here: an exception set on the
    future would be thrown into the awaiting coroutine, and a thrown GeneratorExit closes it
    instead of reaching its `except`.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[tuple[BaseException | None, Any]] = loop.create_future()

    def settle(error: BaseException | None, result: object) -> None:
        if not future.done():
            future.set_result((error, result))

    def target() -> None:
        try:
            result, error = func(msg), None
        except BaseException as caught:
            result, error = None, caught
        with contextlib.suppress(RuntimeError):  # the loop closed: this run was abandoned
            loop.call_soon_threadsafe(settle, error, result)

    threading.Thread(target=target, daemon=True, name=f"outbox-farm-{msg.queue}").start()
    error, result = await future
    if error is not None:
        raise error
    return result


class _Slot:
    """One executor task and the deadline of the handler it runs (inf while idle).

    Written by its executor task; read, and `expired` set, by the queue's watchdog.
    """

    __slots__ = ("deadline", "expired", "task")

    def __init__(self) -> None:
        self.deadline = math.inf
        self.expired = False
        self.task: asyncio.Task[None] | None = None


class Executors:
    """The handler tasks of one queue.

    Per-message timeouts are enforced by one watchdog task per queue that cancels overdue
    handlers, checking ten times per timeout (at most once a second): far cheaper than a timer
    per message, and precise enough for timeouts that default to most of a minute.
    """

    def __init__(
        self,
        spec: HandlerSpec,
        inbox: asyncio.Queue[Message | None],
        fetcher: Fetcher,
        completer: Completer,
    ) -> None:
        self.spec = spec
        self.inbox = inbox
        self.fetcher = fetcher
        self.completer = completer
        self.ledger = fetcher.ledger
        self.is_async = spec.is_async
        self._slots: list[_Slot] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._watchdog: asyncio.Task[None] | None = None
        self._m = m = metrics()
        self._handler_seconds = m.handler_seconds.labels(spec.queue)
        self._lag = m.delivery_lag.labels(spec.queue)
        self._expired = m.lease_lost.labels(spec.queue, "start")

    def start(self) -> None:
        for i in range(self.spec.concurrency):
            slot = _Slot()
            slot.task = asyncio.create_task(
                self._work(slot), name=f"outbox-farm-exec-{self.spec.queue}-{i}"
            )
            self._slots.append(slot)
            self._tasks.append(slot.task)
        self._watchdog = asyncio.create_task(self._watch(), name="outbox-farm-watchdog")

    async def _watch(self) -> None:
        period = min(1.0, max(self.spec.effective_timeout / 10, 0.005))
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for slot in self._slots:
                if slot.deadline < now and not slot.expired and slot.task is not None:
                    slot.expired = True
                    slot.task.cancel()

    async def stop(self, deadline: float) -> None:
        """Release unstarted rows, let running handlers finish until `deadline` (monotonic).

        Call after the fetcher stopped, so nothing new reaches the inbox.
        """
        while not self.inbox.empty():
            msg = self.inbox.get_nowait()
            if msg is not None:
                self.completer.put_nowait(self._outcome(msg, Kind.RELEASE))
        for _ in self._tasks:
            self.inbox.put_nowait(None)
        try:
            await self._finish(deadline)
        finally:
            if self._watchdog is not None:
                self._watchdog.cancel()
                await asyncio.gather(self._watchdog, return_exceptions=True)

    async def _finish(self, deadline: float) -> None:
        if not self._tasks:
            return
        _, running = await asyncio.wait(self._tasks, timeout=max(deadline - time.monotonic(), 0))
        if running:
            log.warning(
                "%d handlers of queue %s still running at the stop deadline; cancelling them "
                "(their rows are retried)",
                len(running),
                self.spec.queue,
                extra={"event": "stop_deadline", "queue": self.spec.queue},
            )
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _work(self, slot: _Slot) -> None:
        ledger = self.ledger
        while True:
            msg = await self.inbox.get()
            if msg is None:
                return
            if time.monotonic() > msg.start_by:
                await self._hand_back(msg)
                continue
            ledger.start(msg.id)
            outcome, exc = await self._deliver(msg, slot)
            if not ledger.finish(msg.id, msg.lease_token):
                continue  # its lease was lost while it ran (the heartbeat counted it)
            if outcome.kind is Kind.TERMINAL:
                self._m.terminal.labels(msg.queue, str(outcome.reason)).inc()
            await self.completer.put(outcome)
            if exc is not None and self.spec.on_failure is not None:
                await self._on_failure(msg, exc, outcome)

    async def _hand_back(self, msg: Message) -> None:
        """Too little of this row's lease is left to start it (it waited behind slower
        handlers): another runner may take it over any moment, or already has."""
        self._expired.inc()
        log.warning(
            "lease lost: row %s of queue %s waited for an executor until less than half its "
            "lease was left (lease_ttl=%gs); handing it back unrun (lower prefetch or raise "
            "lease_ttl if this recurs)",
            msg.id,
            msg.queue,
            self.spec.lease_ttl,
            extra={
                "event": "lease_lost",
                "phase": "start",
                "row_id": msg.id,
                "queue": msg.queue,
                "deliveries_count": msg.deliveries_count,
            },
        )
        await self.completer.put(self._outcome(msg, Kind.EXPIRE))

    async def _on_failure(self, msg: Message, exc: BaseException, outcome: Outcome) -> None:
        """The user's hook, after the outcome was handed over: it cannot change it."""
        hook = self.spec.on_failure
        assert hook is not None
        try:
            result = hook(msg, exc, outcome)
            if inspect.isawaitable(result):
                await result
        except asyncio.CancelledError:
            raise
        except BaseException:
            log.exception(
                "on_failure hook %r raised for row %s of queue %s; the outcome (%s) stands",
                hook,
                msg.id,
                msg.queue,
                outcome.kind.value,
                extra={"event": "hook_failed", "row_id": msg.id, "queue": msg.queue},
            )

    def _outcome(self, msg: Message, kind: Kind, **fields: Any) -> Outcome:
        return Outcome(kind, msg.id, msg.lease_token, msg.queue, msg.deliveries_count, **fields)

    async def _deliver(self, msg: Message, slot: _Slot) -> tuple[Outcome, BaseException | None]:
        """Run the handler; its outcome, and its exception if it failed."""
        spec = self.spec
        if spec.max_deliveries is not None and msg.deliveries_count > spec.max_deliveries:
            log.error(
                "row %s of queue %s was claimed %d times (max_deliveries=%d); giving up "
                "without running the handler",
                msg.id,
                msg.queue,
                msg.deliveries_count,
                spec.max_deliveries,
                extra={
                    "event": "terminal",
                    "reason": "max_deliveries",
                    "row_id": msg.id,
                    "queue": msg.queue,
                },
            )
            return self._outcome(msg, Kind.TERMINAL, reason=Reason.MAX_DELIVERIES), None
        # Seconds since the epoch on the database clock: the claim's now() plus local time since.
        started = msg.claimed_epoch + (time.monotonic() - msg.received_monotonic)
        self._lag.observe(max(started - msg.due_epoch, 0.0))
        began = time.perf_counter()
        slot.deadline = time.monotonic() + spec.effective_timeout
        exc: BaseException | None = None
        try:
            if self.is_async:
                await spec.func(msg)
            else:
                await _in_thread(spec.func, msg)
        except asyncio.CancelledError as error:
            if not asyncio.current_task().cancelling():  # type: ignore[union-attr]
                exc = error  # raised by the handler itself: nobody cancelled this run
            elif not slot.expired:
                # A stop past its deadline: the row is tried again at once.
                if self.ledger.finish(msg.id, msg.lease_token):
                    self.completer.put_nowait(
                        self._outcome(
                            msg, Kind.RETRY, delay=0.0, ran=True, started_at=_utc(started)
                        )
                    )
                raise
            else:
                slot.expired = False
                asyncio.current_task().uncancel()  # type: ignore[union-attr]
                exc = HandlerTimeout(
                    f"handler of queue {msg.queue!r} exceeded its timeout of "
                    f"{spec.effective_timeout:g}s"
                )
        except BaseException as error:
            # KeyboardInterrupt, SystemExit and GeneratorExit too: one message must not take
            # down the worker and every other row it holds; it is retried, then dead-lettered.
            exc = error
        slot.deadline = math.inf  # no await since the handler returned: no stray cancel
        if slot.expired:  # the handler swallowed its timeout's cancellation and returned
            slot.expired = False
            asyncio.current_task().uncancel()  # type: ignore[union-attr]
        duration = time.perf_counter() - began
        self._handler_seconds.observe(duration)
        return self._decide(msg, exc, started, duration), exc

    def _decide(
        self, msg: Message, exc: BaseException | None, started: float, duration: float
    ) -> Outcome:
        spec = self.spec
        decision = msg.decision
        if decision is Decision.ACK:
            return self._outcome(msg, Kind.ACK)
        if decision is Decision.REJECT:
            return self._terminal(msg, Reason.REJECTED, exc)
        if decision is Decision.NACK:
            delay = msg.nack_delay
        elif exc is None:
            if spec.ack is not AckPolicy.MANUAL:
                return self._outcome(msg, Kind.ACK)
            exc = NoDecision(
                f"manual-ack handler of queue {msg.queue!r} returned without "
                "ack(), nack() or reject(); retrying"
            )
            log.warning("%s (row %s)", exc, msg.id, extra={"event": "no_decision"})
            delay = None
        elif isinstance(exc, DeadLetter):
            return self._terminal(msg, Reason.REJECTED, exc)
        elif isinstance(exc, Retry):
            delay = _valid_delay(exc.delay, msg)
        elif spec.ack is AckPolicy.REJECT_ON_ERROR:
            return self._terminal(msg, Reason.REJECTED, exc)
        else:
            delay = None
        if delay is None:
            delay = self._strategy_delay(msg, exc or NoDecision(), started, duration)
            if delay is None:
                return self._terminal(msg, Reason.RETRY_TERMINAL, exc)
        if exc is not None:
            log.warning(
                "handler of queue %s failed on row %s (attempt %d); retrying in %.3gs: %s",
                msg.queue,
                msg.id,
                msg.attempts_count + 1,
                delay,
                describe_exception(exc),
                extra={"event": "retry", "row_id": msg.id, "queue": msg.queue},
            )
        return self._outcome(msg, Kind.RETRY, delay=delay, ran=True, started_at=_utc(started))

    def _strategy_delay(
        self, msg: Message, exc: BaseException, started: float, duration: float
    ) -> float | None:
        attempt = msg.attempts_count + 1
        first = msg.first_attempt_at.timestamp() if msg.first_attempt_at else started
        elapsed = started - first + duration
        try:
            delay = self.spec.retry.next_delay(attempt, exc, elapsed)
            if delay is None:
                return None
            delay = float(delay)
            if not math.isfinite(delay) or delay < 0:
                raise ValueError(f"next_delay returned {delay!r}; expected seconds >= 0")
            return delay
        except Exception as strategy_error:
            log.error(
                "retry strategy %r failed for row %s of queue %s (%r); treating the failure "
                "as terminal",
                self.spec.retry,
                msg.id,
                msg.queue,
                strategy_error,
                extra={"event": "strategy_failed", "row_id": msg.id, "queue": msg.queue},
            )
            return None

    def _terminal(self, msg: Message, reason: Reason, exc: BaseException | None) -> Outcome:
        text = describe_exception(exc)
        log.error(
            "row %s of queue %s failed for good (%s): %s",
            msg.id,
            msg.queue,
            reason,
            text,
            extra={
                "event": "terminal",
                "reason": str(reason),
                "row_id": msg.id,
                "queue": msg.queue,
            },
        )
        return self._outcome(msg, Kind.TERMINAL, reason=reason, last_exception=text)
