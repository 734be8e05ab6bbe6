"""Executors: `concurrency` tasks per queue that run the handler and hand each row's outcome
to the completer.

This module is the data path: what an executor task does with the rows it takes from the inbox,
one at a time (`_work`) or a batch at a time (`_work_batches`). What happens to a row is decided
by the rulebook (`decision`, pure), which both loops ask through that module, row by row:
whether to run it (`before_run`), and the verdict on its run (`decide`). The machinery under the
loops (the slots, the per-call timeout and its watchdog, cancellation at a stop, a failed
task's rows) is `slots`'; the call path (middleware, a thread per sync handler call) is
`invoke`'s. What a loop sees (a handler's start and run time, each verdict) goes to the
observer (`observe`), which counts and logs it. The outcomes are written by the completer; a
transactional handler's row is deleted in its own transaction (`transactional`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Awaitable
from functools import partial

from .. import decision
from ..decision import QUIET, Verdict
from ..message import Message
from ..outcome import Kind, Outcome
from .inbox import EMPTY
from .invoke import on_failure
from .slots import Slot, Slots
from .supervised import Supervisor

_ACK = Kind.ACK  # read once: an Enum member read off its class costs 0.1 µs (Python 3.11)


class Executors(Slots):
    """The handler tasks of one queue: the loops its slots run."""

    def start(self, supervisor: Supervisor) -> None:
        """One supervised task per slot, and the watchdog. A slot's task that ends with an
        unexpected error is run again (see `supervised`), and its next run first lets go of
        the rows the failed run had in hand (`_abandon`)."""
        queue = self.spec.queue
        for i in range(self.spec.concurrency):
            slot = Slot(i)
            slot.task = supervisor.spawn(
                f"executor {i} of queue {queue}", partial(self._serve, slot)
            )
            self._slots.append(slot)
            self._tasks.append(slot.task)
        self._watchdog = supervisor.spawn(f"timeout watchdog of queue {queue}", self._watch)

    def _serve(self, slot: Slot) -> Awaitable[None]:
        """One run of the slot's task: the rows a failed run left in hand are let go first.
        A plain function returning the loop's coroutine, which the supervisor awaits itself:
        one frame less to resume on every message."""
        self._abandon(slot)
        return self._work(slot) if self.spec.batch is None else self._work_batches(slot)

    async def _work(self, slot: Slot) -> None:
        """One row at a time. The rules are asked of the rulebook as the batch loop asks them
        (`decision.before_run`, then `decision.decide`, whose first step, `completes`, is
        asked here directly: a call less for a plain ack); the bookkeeping is written out here
        rather than through the batch loop's helpers (`_run`, `_settle`): this loop runs once
        per message, and each call or coroutine less counts. Nothing here awaits unless it
        must: the inbox's row is taken without a wait when one is there, the outcome handed
        over without one when the completer has room, so that a handler that does not suspend
        costs no task switch."""
        ledger, spec, observer, inbox, completer = (
            self.ledger,
            self.spec,
            self.observer,
            self.inbox,
            self.completer,
        )
        queue, call, timeout, committed = spec.queue, self._call, self._timeout, self._committed
        hook, monotonic, perf_counter = spec.on_failure, time.monotonic, time.perf_counter
        breaker = self.breaker
        while True:
            msg = inbox.take()
            if msg is EMPTY:
                msg = await inbox.get()
            if msg is None:
                return
            slot.hand = (msg,)
            now = monotonic()
            if self._closing or now > msg.start_by or (breaker and breaker.holds(msg)):
                await self._not_started(msg)
                slot.hand = ()
                continue
            ledger.start(msg.id)
            unrun = decision.before_run(spec, msg)
            if unrun is not None:
                await self._not_run(msg, unrun)
                slot.hand = ()
                continue
            started = msg.claimed_epoch + (now - msg.received_monotonic)
            lag = started - msg.due_epoch
            observer.handler_started(msg, lag if lag > 0.0 else 0.0)
            began = perf_counter()
            slot.deadline = now + timeout
            exc: BaseException | None = None
            try:
                await call(msg)
            except asyncio.CancelledError as error:
                exc = self._cancelled(slot, error, [(msg, started)], began)
            except BaseException as error:  # see `_run`
                exc = error
            slot.deadline = math.inf  # no await since the handler returned: no stray cancel
            if slot.expired:  # the handler swallowed its timeout's cancellation
                self._swallowed(slot)
            # A row gone with its handler's writes is acked, whatever a middleware outside
            # the transaction did afterwards.
            exc = None if committed and msg.id in committed else exc
            duration = perf_counter() - began
            observer.handler_finished(queue, duration)
            if exc is None and breaker is None and decision.completes(spec, msg):
                # `decide`'s first step: a plain ack
                outcome = Outcome(_ACK, msg.id, msg.lease_token, queue, msg.deliveries_count)
                notes = QUIET
            else:
                outcome, notes = await self._decide(msg, exc, started, duration)
            if not ledger.finish(msg.id, msg.lease_token):
                slot.hand = ()  # its lease was lost while it ran: nothing to write
                continue
            observer.decided(msg, outcome)
            if notes:
                observer.noted(msg, notes)
            if committed and self._written(msg):
                slot.hand = ()
                continue
            if not completer.offer(outcome):
                await completer.put(outcome)
            slot.hand = ()
            if hook is not None:
                await on_failure(spec, msg, exc, outcome)

    async def _decide(
        self, msg: Message, exc: BaseException | None, started: float, duration: float
    ) -> Verdict:
        """`decision.decide`, and what the queue's breaker, if it has one, makes of it."""
        verdict = decision.decide(self.spec, msg, exc, started, duration)
        breaker = self.breaker
        if breaker is not None and breaker.concerns(msg, exc):
            return await breaker.settle(msg, exc, *verdict)
        return verdict

    async def _not_started(self, msg: Message) -> None:
        """A row taken from the inbox that is not to be started: released when the stop
        began or the queue's breaker is open (its attempts and delivery as they were), else
        handed back (too little of its lease is left)."""
        if self._closing:
            self.completer.put_nowait(decision.released(msg))
        elif self.breaker is not None and self.breaker.holds(msg):
            await self.completer.put(decision.released(msg))
        else:
            await self._hand_back(msg)

    async def _not_run(self, msg: Message, verdict: Verdict) -> None:
        """A row the rulebook holds back unrun (`decision.before_run`): its verdict handed over."""
        outcome = self._settle(msg, verdict)
        if outcome is not None:
            await self.completer.put(outcome)

    async def _work_batches(self, slot: Slot) -> None:
        """`_work` for a batch handler: one call per batch, the rest per row, written out here
        as in `_work` (a relay runs this loop for every row it sends)."""
        ledger, spec, observer, completer = self.ledger, self.spec, self.observer, self.completer
        breaker = self.breaker
        while True:
            async with self._forming:
                rows = await self._take()
            if rows is None:
                return
            if self._closing:
                for msg in rows:
                    completer.put_nowait(decision.released(msg))
                continue
            slot.hand = rows
            runs: list[tuple[Message, float]] = []  # the rows passed in, and their start
            now = time.monotonic()
            for msg in rows:
                if now > msg.start_by or (breaker and breaker.tripped and breaker.holds(msg)):
                    await self._not_started(msg)
                    continue
                ledger.start(msg.id)
                unrun = decision.before_run(spec, msg)
                if unrun is not None:
                    await self._not_run(msg, unrun)
                    continue
                started = msg.claimed_epoch + (now - msg.received_monotonic)
                lag = started - msg.due_epoch
                observer.handler_started(msg, lag if lag > 0.0 else 0.0)
                runs.append((msg, started))
            if not runs:
                slot.hand = ()
                continue
            began = time.perf_counter()
            exc = await self._run(slot, runs, began)
            duration = time.perf_counter() - began
            observer.handler_finished(spec.queue, duration)
            written: list[tuple[Message, Outcome]] = []
            for msg, started in runs:
                verdict = decision.decide(spec, msg, exc, started, duration)
                if breaker is not None and breaker.concerns(msg, exc):
                    verdict = await breaker.settle(msg, exc, *verdict)
                outcome = self._settle(msg, verdict)
                if outcome is not None:
                    written.append((msg, outcome))
            await completer.put_all([outcome for _, outcome in written])
            slot.hand = ()
            if spec.on_failure is not None:  # after every outcome was handed over
                for msg, outcome in written:
                    await on_failure(self.spec, msg, exc, outcome)

    async def _take(self) -> list[Message] | None:
        """Up to `batch` rows: those waiting, then those arriving within `linger`. None: stop."""
        inbox, size = self.inbox, self.spec.batch or 1
        first = await inbox.get()
        if first is None:
            return None
        rows = [first]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.spec.linger):
                while len(rows) < size:
                    msg = await inbox.get()  # at once while rows are waiting
                    if msg is None:
                        inbox.put_nowait(None)  # the stop's: this task's next take ends it
                        break
                    rows.append(msg)
        return rows

    async def _run(
        self, slot: Slot, runs: list[tuple[Message, float]], began: float
    ) -> BaseException | None:
        """Call the batch handler with the rows of `runs` (each with its start), through its
        middleware, under the slot's deadline (its timeout from now): None when it returned,
        else the exception it ended with (its timeout as HandlerTimeout). A stop's cancellation
        past its deadline hands the rows' outcomes over and propagates (`_cancelled`)."""
        slot.deadline = time.monotonic() + self._timeout
        exc: BaseException | None = None
        try:
            await self._call([msg for msg, _ in runs])
        except asyncio.CancelledError as error:
            exc = self._cancelled(slot, error, runs, began)
        except BaseException as error:
            # KeyboardInterrupt, SystemExit and GeneratorExit too: one message must not take
            # down the worker and every other row it holds; it is retried, then dead-lettered.
            exc = error
        slot.deadline = math.inf  # no await since the handler returned: no stray cancel
        if slot.expired:  # the handler swallowed its timeout's cancellation and returned
            self._swallowed(slot)
        return exc
