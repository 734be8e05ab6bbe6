"""The slots of one queue's executors, and the machinery under the loops of `executor`.

A slot is one executor task: the deadline of the handler it runs and the rows in its hand.
Around the slots: the watchdog that cancels a handler past its timeout, what a cancelled call
ended with, what becomes of the rows a failed task had in hand, the stop (unstarted rows
released, running handlers given until the deadline), and the bookkeeping every row ends with
(its verdict observed and handed to the completer, unless its lease was lost meanwhile). What a
task does with the rows it takes, one at a time or a batch at a time, is `executor`'s.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time

from .. import decision
from ..decision import Verdict
from ..handler import HandlerSpec
from ..message import Message
from ..observe import Observer
from ..outcome import Outcome
from .breaker import QueueBreaker
from .completer import Completer
from .inbox import Inbox
from .inflight import Ledger
from .invoke import call_path, timed_out
from .transactional import Complete, InTransaction

log = logging.getLogger("outbox_farm.executor")


class Slot:
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


class Slots:
    """The executor slots of one queue, and what their loops share.

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
        self.breaker: QueueBreaker | None = None  # the queue's, when it has one (`runtime`)
        self._timeout = spec.effective_timeout
        self._slots: list[Slot] = []
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

    def close(self) -> None:
        """The stop began: rows taken from the inbox from now on are released, not run."""
        self._closing = True

    def _abandon(self, slot: Slot) -> None:
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

    def _cancelled(
        self,
        slot: Slot,
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
    def _swallowed(slot: Slot) -> None:
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
