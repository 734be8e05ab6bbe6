"""Executors: `concurrency` tasks per queue that run the handler and hand each row's outcome
to the completer.

This module is the machinery: the tasks, batching, the per-call timeout, a thread per sync
handler call, cancellation at a stop. What happens to a row is decided by the rulebook
(`decision`, pure), which both loops ask through that module, row by row: whether to run it
(`before_run`), and the verdict on its run (`decide`). What it sees (a handler's start and run
time, each verdict) goes to the observer (`observe`), which counts and logs it. The outcomes are
written by the completer; a transactional handler's row is deleted in its own transaction
(`transactional`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Awaitable
from functools import partial

from .. import decision
from ..decision import QUIET, Verdict
from ..handler import HandlerSpec
from ..message import Message
from ..observe import Observer
from ..outcome import Kind, Outcome
from .completer import Completer
from .inbox import EMPTY, Inbox
from .inflight import Ledger
from .invoke import call_path, on_failure, timed_out
from .supervised import Supervisor
from .transactional import Complete, InTransaction

log = logging.getLogger("outbox_farm.executor")
_ACK = Kind.ACK  # read once: an Enum member read off its class costs 0.1 µs (Python 3.11)


class _Slot:
    """One executor task, the deadline of the handler it runs (inf while idle), and the rows
    in its hand (taken from the inbox, outcome not yet handed over).

    Written by its executor task; read, and `expired` set, by the queue's watchdog; `hand` read
    by the task's next run when an unexpected error ended this one.
    """

    __slots__ = ("deadline", "expired", "hand", "index", "task")

    def __init__(self, index: int) -> None:
        self.index = index
        self.deadline = math.inf
        self.expired = False
        self.hand: tuple[Message, ...] | list[Message] = ()
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
        inbox: Inbox[Message | None],
        ledger: Ledger,
        completer: Completer,
        observer: Observer,
        complete: Complete | None = None,
    ) -> None:
        self.spec = spec
        self.observer = observer
        self.inbox = inbox
        self.completer = completer
        self.ledger = ledger
        self._timeout = spec.effective_timeout
        self._slots: list[_Slot] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._watchdog: asyncio.Task[None] | None = None
        # Held by the batch executor forming a batch: rows arriving while it lingers join its
        # batch instead of waking an idle executor into a batch of one.
        self._forming = asyncio.Lock()
        # The handler through its middleware; a sync one in a thread per call; a transactional
        # one inside its transaction (the middleware around it, a tracing span say, sees the
        # whole transaction).
        self._transaction: InTransaction | None = None
        if spec.transactional:
            if complete is None:
                raise ValueError(f"queue {spec.queue!r} is transactional: pass `complete`")
            self._transaction = InTransaction(spec, ledger, observer, complete)
        self._call = call_path(spec, self._transaction)
        # Rows a transactional handler completed itself (the same set; empty for other queues).
        self._committed: set[int] = self._transaction.committed if self._transaction else set()
        self._closing = False  # set when the stop begins: no handler starts after that

    def start(self, supervisor: Supervisor) -> None:
        """One supervised task per slot, and the watchdog. A slot's task that ends with an
        unexpected error is run again (see `supervised`), and its next run first lets go of
        the rows the failed run had in hand (`_abandon`)."""
        queue = self.spec.queue
        for i in range(self.spec.concurrency):
            slot = _Slot(i)
            slot.task = supervisor.spawn(
                f"executor {i} of queue {queue}", partial(self._serve, slot)
            )
            self._slots.append(slot)
            self._tasks.append(slot.task)
        self._watchdog = supervisor.spawn(f"timeout watchdog of queue {queue}", self._watch)

    def close(self) -> None:
        """The stop began: rows taken from the inbox from now on are released, not run."""
        self._closing = True

    def _serve(self, slot: _Slot) -> Awaitable[None]:
        """One run of the slot's task: the rows a failed run left in hand are let go first.
        A plain function returning the loop's coroutine, which the supervisor awaits itself:
        one frame less to resume on every message."""
        self._abandon(slot)
        return self._work(slot) if self.spec.batch is None else self._work_batches(slot)

    def _abandon(self, slot: _Slot) -> None:
        """Free the slots of rows an unexpected error left in `slot`'s hand, unwritten: what
        became of them is unknown (the handler may have run), so neither an ack nor a release
        (which would take back the delivery, and let a row that keeps breaking this loop escape
        `max_deliveries`) is right. Their leases run out and they are delivered again, counted."""
        hand, slot.hand = slot.hand, ()
        slot.deadline, slot.expired = math.inf, False
        for msg in hand:
            self.ledger.settle(msg.id, msg.lease_token)
        if hand:
            log.warning(
                "executor %d of queue %s failed with rows %s in hand; they are delivered again "
                "when their leases expire",
                slot.index,
                self.spec.queue,
                [msg.id for msg in hand],
                extra={"event": "rows_abandoned", "queue": self.spec.queue},
            )

    async def _watch(self) -> None:
        period = min(1.0, max(self._timeout / 10, 0.005))
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
        self.close()
        while not self.inbox.empty():
            msg = self.inbox.get_nowait()
            if msg is not None:
                self.completer.put_nowait(decision.released(msg))
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
                "(their rows are retried, unless the handler decided them)",
                len(running),
                self.spec.queue,
                extra={"event": "stop_deadline", "queue": self.spec.queue},
            )
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    async def _work(self, slot: _Slot) -> None:
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
        while True:
            msg = inbox.take()
            if msg is EMPTY:
                msg = await inbox.get()
            if msg is None:
                return
            slot.hand = (msg,)
            now = monotonic()
            if self._closing or now > msg.start_by:
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
            if committed and msg.id in committed:
                exc = None  # the row is gone with its handler's writes: acked, whatever
                # a middleware outside the transaction did afterwards
            duration = perf_counter() - began
            observer.handler_finished(queue, duration)
            outcome, notes = (
                (Outcome(_ACK, msg.id, msg.lease_token, queue, msg.deliveries_count), QUIET)
                if exc is None and decision.completes(spec, msg)  # `decide`'s first step
                else decision.decide(spec, msg, exc, started, duration)
            )
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

    async def _not_started(self, msg: Message) -> None:
        """A row taken from the inbox that is not to be started: released when the stop
        began, else handed back (too little of its lease is left)."""
        if self._closing:
            self.completer.put_nowait(decision.released(msg))
        else:
            await self._hand_back(msg)

    async def _not_run(self, msg: Message, verdict: Verdict) -> None:
        """A row the rulebook holds back unrun (`decision.before_run`): its verdict handed over."""
        outcome = self._settle(msg, verdict)
        if outcome is not None:
            await self.completer.put(outcome)

    async def _work_batches(self, slot: _Slot) -> None:
        """`_work` for a batch handler: one call per batch, the rest per row, written out here
        as in `_work` (a relay runs this loop for every row it sends)."""
        ledger, spec, observer, completer = self.ledger, self.spec, self.observer, self.completer
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
                if now > msg.start_by:
                    await self._hand_back(msg)
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
                outcome = self._settle(msg, decision.decide(spec, msg, exc, started, duration))
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
        self, slot: _Slot, runs: list[tuple[Message, float]], began: float
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

    def _cancelled(
        self,
        slot: _Slot,
        error: asyncio.CancelledError,
        runs: list[tuple[Message, float]],
        began: float,
    ) -> BaseException:
        """What a handler's run that ended cancelled ended with: its own CancelledError when
        nobody cancelled it, its timeout when the watchdog did. A stop's cancellation (past
        its deadline) is raised again, once the outcomes of `runs` (the rows the call was
        running, each with its start; the call began at `began`) are handed over."""
        task = asyncio.current_task()
        assert task is not None
        if not task.cancelling():
            return error  # raised by the handler itself: nobody cancelled this run
        if not slot.expired:
            self._interrupted(runs, began)
            raise error
        slot.expired = False
        task.uncancel()
        return timed_out(self.spec)

    @staticmethod
    def _swallowed(slot: _Slot) -> None:
        """The handler returned although the watchdog cancelled it (it swallowed the
        cancellation): the cancel request is taken back, so the task's next await is not hit."""
        slot.expired = False
        asyncio.current_task().uncancel()  # type: ignore[union-attr]

    def _interrupted(self, runs: list[tuple[Message, float]], began: float) -> None:
        """A stop cancelled the call at its deadline: the rows' outcomes, handed over without
        waiting (this task is being cancelled)."""
        duration = time.perf_counter() - began
        for msg, started in runs:
            if msg.id in self._committed:  # cancelled after its transaction committed
                verdict = decision.decide(self.spec, msg, None, started, duration)
            else:
                verdict = decision.interrupted(self.spec, msg, started, duration)
            outcome = self._settle(msg, verdict)
            if outcome is not None and not (self._committed and self._written(msg)):
                self.completer.put_nowait(outcome)

    def _written(self, msg: Message) -> bool:
        """The row's transaction already deleted it: nothing more to write."""
        return self._transaction is not None and self._transaction.written(msg)

    def _settle(self, msg: Message, verdict: Verdict) -> Outcome | None:
        """A verdict's outcome to write, observed; None when the heartbeat found the row's lease
        lost while it ran (it reported that, and nothing of this run is written)."""
        outcome, notes = verdict
        if not self.ledger.finish(msg.id, msg.lease_token):
            return None
        self.observer.decided(msg, outcome)
        if notes:
            self.observer.noted(msg, notes)
        return outcome

    async def _hand_back(self, msg: Message) -> None:
        """Too little of this row's lease is left to start it (it waited behind slower
        handlers): another runner may take it over any moment, or already has."""
        outcome, notes = decision.expired(self.spec, msg)
        self.observer.decided(msg, outcome)
        self.observer.noted(msg, notes)
        await self.completer.put(outcome)
